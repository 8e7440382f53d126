"""`gristmill generate` and `gristmill --help` as a user runs them: the real command line,
run in this process (`cli.main`, tests/batch/inprocess.py) with the exit status, stdout
and stderr a shell would see, without a new interpreter for each."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import typing

import pytest

from gristmill.cli import build_parser, generate_rows
from gristmill.config import EngineConfig, field_doc
from gristmill.engine_flags import engine_config, engine_options
from gristmill.errors import RequestError
from tests.batch.inprocess import run_main

ENGINE_FIELDS = dataclasses.fields(EngineConfig)


def run_cli(*args, env=None):
    return run_main(*args, env=env)


def engine_flag(name: str) -> str:
    # `generate` already has a sampling --seed, so EngineConfig.seed is --engine-seed.
    return "--engine-seed" if name == "seed" else "--" + name.replace("_", "-")


def flag_args_and_value(config_field) -> tuple[list[str], object]:
    """Command-line arguments setting the field to a value of its type (`X | None` -> X),
    and the value the flag must parse back. A bool field is a --x / --no-x switch."""
    annotation = typing.get_type_hints(EngineConfig)[config_field.name]
    base = next(t for t in typing.get_args(annotation) or (annotation,) if t is not type(None))
    flag = engine_flag(config_field.name)
    if base is bool:
        return ["--no-" + flag[2:]], False
    value = {int: 7, float: 2.5, str: "some-value"}[base]
    return [flag, str(value)], value


def test_help_lists_generate():
    result = run_cli("--help")
    assert result.returncode == 0
    assert "generate" in result.stdout


def generate_file(tmp_path, rows: list[dict], max_tokens: int):
    """`gristmill generate` over `rows` as a JSONL file: (result, output rows)."""
    source = tmp_path / "in.jsonl"
    source.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    target = tmp_path / "out.jsonl"
    result = run_cli("generate", "--input", str(source), "--output", str(target),
                     "--max-tokens", str(max_tokens), "--device", "cpu")
    assert result.returncode == 0, result.stderr
    return result, [json.loads(line) for line in target.read_text().splitlines()]


def test_generate_jsonl_keeps_row_order_and_reports_bad_rows(tmp_path):
    rows = [{"id": "a", "prompt": "The capital of France is"},
            {"id": "b", "prompt": ""},
            {"id": "c", "messages": [{"role": "user", "content": "Hi"}]}]
    result, out = generate_file(tmp_path, rows, max_tokens=6)
    assert [r["id"] for r in out] == ["a", "b", "c"]
    assert out[0]["error"] == "" and out[0]["num_generated_tokens"] == 6 and out[0]["text"]
    assert out[1]["finish_reason"] == "error" and out[1]["error"].startswith("RequestError: prompt is empty")
    assert out[2]["error"] == "" and out[2]["messages"] == rows[2]["messages"]
    assert "3 prompts, 2 ok, 1 failed" in result.stderr


@pytest.mark.parametrize("content,expected", [("not json\n", "not valid JSON"), ('{"text": "x"}\n', "'prompt'")])
def test_generate_rejects_malformed_input_with_the_line(tmp_path, content, expected):
    source = tmp_path / "in.jsonl"
    source.write_text(content)
    result = run_cli("generate", "--input", str(source))
    assert result.returncode != 0
    assert f"{source}:1" in result.stderr and expected in result.stderr


def test_generate_turns_rows_with_invalid_prompts_into_error_rows(tmp_path):
    token_ids = [2, 818, 5279, 529, 7001, 563]
    rows = [{"id": 0, "prompt": 5},  # first: it once made the whole file one token-id prompt
            {"id": 1, "prompt": "The capital of France is"},
            {"id": 2, "prompt": token_ids},
            {"id": 3, "prompt": None},
            {"id": 4, "prompt": {"text": "Hi"}},
            {"id": 5, "prompt": [1, "a"]},
            {"id": 6, "messages": {"role": "user", "content": "Hi"}},
            {"id": 7, "messages": [{"role": "user", "content": "Hi"}]},
            {"id": 8, "prompt": "def fib(n):"}]
    result, out = generate_file(tmp_path, rows, max_tokens=4)
    assert [{key: r[key] for key in row} for r, row in zip(out, rows)] == rows and len(out) == len(rows)
    bad = {0: "'prompt' must be a string or a list of token ids", 3: "'prompt' must be",
           4: "'prompt' must be", 5: "'prompt' must be", 6: "'messages' must be a list"}
    for row in out:
        if row["id"] in bad:
            assert row["finish_reason"] == "error" and row["text"] == "" and row["num_generated_tokens"] == 0
            assert row["error"].startswith("RequestError: " + bad[row["id"]]), row
        else:
            assert row["error"] == "" and row["text"] and row["num_generated_tokens"] == 4, row
    assert out[2]["num_prompt_tokens"] == len(token_ids)
    assert "9 prompts, 4 ok, 5 failed" in result.stderr


def test_rows_whose_prompts_are_all_ints_stay_separate_error_rows(default_llm):
    from gristmill import SamplingParams

    # Sent together, [5, 6] would read as one token-id prompt and a dict as one conversation.
    rows = [{"prompt": 5}, {"prompt": 6}, {"messages": {"role": "user", "content": "Hi"}},
            {"messages": [{"role": "user", "content": "Hi"}]}]
    outs = generate_rows(default_llm, rows, SamplingParams(max_tokens=2))
    assert [out.finish_reason for out in outs[:3]] == ["error"] * 3
    assert outs[0].error == ("RequestError: 'prompt' must be a string or a list of token ids (integers), "
                             "got a number: 5; write text as a JSON string")
    assert outs[3].error is None and len(outs[3].token_ids) == 2


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_help_documents_a_flag_for_every_engine_config_field(command):
    # Wide enough that argparse does not wrap (and hyphen-split) the help text.
    result = run_cli(command, "--help", env={**os.environ, "COLUMNS": "1000"})
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    for config_field in ENGINE_FIELDS:
        doc = " ".join(field_doc(config_field).split())
        # `--flag VALUE doc`, or `--flag, --no-flag doc` for a bool field.
        entry = re.escape(engine_flag(config_field.name)) + r",? \S+ " + re.escape(
            f"{doc} (default: {config_field.default})")
        assert re.search(entry, text), f"{command} --help: no {engine_flag(config_field.name)} with its doc"


def test_generate_keeps_seed_for_sampling_and_engine_seed_for_the_engine():
    args = build_parser().parse_args(["generate", "x", "--seed", "3", "--engine-seed", "9"])
    assert args.seed == 3
    assert engine_config(args).seed == 9
    help_text = " ".join(run_cli("generate", "--help", env={**os.environ, "COLUMNS": "1000"}).stdout.split())
    assert re.search(r"--engine-seed \S+ [^-]*EngineConfig\.seed[^-]*--seed", help_text), help_text


@pytest.mark.parametrize("command", [["generate", "x"], ["serve"]])
def test_engine_options_hold_exactly_the_flags_given(command):
    parser = build_parser()
    assert engine_options(parser.parse_args(command)) == {}
    for config_field in ENGINE_FIELDS:
        flag_args, value = flag_args_and_value(config_field)
        args = parser.parse_args([*command, *flag_args])
        assert engine_options(args) == {config_field.name: value}


def test_given_flags_reach_the_config_and_unset_ones_keep_its_defaults():
    args = build_parser().parse_args(["serve", "--block-size", "32", "--step-timeout-s", "5",
                                      "--max-waiting-requests", "4", "--max-num-seqs", "8"])
    config = engine_config(args)
    given = dict(block_size=32, step_timeout_s=5.0, max_waiting_requests=4, max_num_seqs=8)
    assert config == dataclasses.replace(EngineConfig(), **given)


@pytest.mark.parametrize("command", [["generate", "x"], ["serve"]])
def test_no_enable_prefix_caching_turns_prefix_caching_off(command):
    parser = build_parser()
    assert engine_config(parser.parse_args(command)).enable_prefix_caching is True
    assert engine_config(parser.parse_args([*command, "--no-enable-prefix-caching"])).enable_prefix_caching is False
    assert engine_config(parser.parse_args([*command, "--enable-prefix-caching"])).enable_prefix_caching is True


@pytest.mark.parametrize("command", [["generate", "x"], ["serve"]])
def test_a_bad_engine_value_exits_with_the_config_message(command):
    with pytest.raises(RequestError) as expected:
        EngineConfig(block_size=3)
    result = run_cli(*command, "--block-size", "3", "--device", "cpu")
    assert result.returncode != 0
    assert str(expected.value) in result.stderr and "--block-size" in result.stderr
    assert "Traceback" not in result.stderr
