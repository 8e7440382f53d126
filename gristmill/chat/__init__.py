"""What a chat model's output means: reasoning parsers (`reasoning`) split the reasoning
from the answer, tool-call parsers (`tool_calls`) find the calls in the answer; both work
on a whole output or on a stream of deltas, and both are pure Python (no torch, no
tokenizer). Used by LLM.chat, the server and batch alike."""
