"""`gristmill generate` and `gristmill --help` as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "gristmill.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_help_lists_generate():
    result = run_cli("--help")
    assert result.returncode == 0
    assert "generate" in result.stdout


def test_generate_jsonl_keeps_row_order_and_reports_bad_rows(tmp_path):
    source = tmp_path / "in.jsonl"
    rows = [{"id": "a", "prompt": "The capital of France is"},
            {"id": "b", "prompt": ""},
            {"id": "c", "messages": [{"role": "user", "content": "Hi"}]}]
    source.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    target = tmp_path / "out.jsonl"
    result = run_cli("generate", "--input", str(source), "--output", str(target),
                     "--max-tokens", "6", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    out = [json.loads(line) for line in target.read_text().splitlines()]
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
