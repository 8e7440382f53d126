"""The tools the tool-call tests send (chat's `{"type": "function", "function": {...}}`
shape): small schemas, as a tiny model's vocabulary spells JSON nearly a byte a token."""

from __future__ import annotations

MESSAGES = [{"role": "user", "content": "Hi"}]
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "hot": {"type": "boolean"}},
           "required": ["city", "hot"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
#: Each tool's parameters schema, by function name.
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
