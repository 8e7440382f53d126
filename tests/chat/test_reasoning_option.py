"""EngineConfig.reasoning_parser and `--reasoning-parser` on the commands that start an
engine: a known name, "none", or None (from the chat template); an unknown name is refused
with the known ones before any model loads."""

from __future__ import annotations

import pytest

from gristmill import EngineConfig, RequestError
from gristmill.chat.reasoning import choose_reasoning_parser
from gristmill.cli import build_parser
from gristmill.engine_flags import engine_config
from tests.chat.reasoning_models import TEMPLATES

COMMANDS = {"serve": ["serve"], "batch": ["batch", "rows.jsonl", "-o", "out.jsonl"], "generate": ["generate", "Hi"]}


def test_an_unknown_reasoning_parser_is_refused_with_the_known_ones():
    with pytest.raises(RequestError, match=r"unknown reasoning parser 'qwen'; the known ones are deepseek_r1, qwen3") \
            as caught:
        EngineConfig(reasoning_parser="qwen")
    assert caught.value.param == "reasoning_parser"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_takes_the_reasoning_parser_flag(command):
    args = build_parser().parse_args([*COMMANDS[command], "--reasoning-parser", "deepseek_r1"])
    assert engine_config(args).reasoning_parser == "deepseek_r1"
    assert engine_config(build_parser().parse_args(COMMANDS[command])).reasoning_parser is None
    bad = build_parser().parse_args([*COMMANDS[command], "--reasoning-parser", "r1"])
    with pytest.raises(SystemExit, match=r"unknown reasoning parser 'r1'.*\(flag: --reasoning-parser\)"):
        engine_config(bad)


@pytest.mark.parametrize("setting, template, chosen", [
    (None, TEMPLATES["qwen3"], "qwen3"),
    (None, TEMPLATES["qwen3_opened"], "qwen3"),
    (None, TEMPLATES["r1"], "deepseek_r1"),
    (None, "{{ messages[0]['content'] }}", None),
    (None, None, None),
    ("none", TEMPLATES["qwen3"], None),
    ("deepseek_r1", TEMPLATES["qwen3"], "deepseek_r1"),
    ("qwen3", None, "qwen3"),
])
def test_the_parser_is_the_one_named_else_the_chat_templates(setting, template, chosen):
    parser = choose_reasoning_parser(setting, template)
    assert (parser.name if parser is not None else None) == chosen


def test_an_unknown_tool_call_parser_is_refused_with_the_known_ones_on_every_command():
    with pytest.raises(RequestError, match=r"unknown tool-call parser 'hermez'; the known ones are hermes, json, "
                                           r"llama3_json, pythonic") as caught:
        EngineConfig(tool_call_parser="hermez")
    assert caught.value.param == "tool_call_parser"
    assert EngineConfig(tool_call_parser="none").tool_call_parser == "none"
    for command in COMMANDS.values():
        assert engine_config(build_parser().parse_args([*command, "--tool-call-parser", "pythonic"])) \
            .tool_call_parser == "pythonic"
        bad = build_parser().parse_args([*command, "--tool-call-parser", "bogus"])
        with pytest.raises(SystemExit, match=r"unknown tool-call parser 'bogus'.*\(flag: --tool-call-parser\)"):
            engine_config(bad)
