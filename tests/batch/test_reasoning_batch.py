"""Batch rows on a reasoning model (a tiny Qwen3 whose chat template opens `<think>` in
the prompt unless `enable_thinking` is false): chat rows get a `reasoning` column and
`generated_text` holding only the answer; `chat_template_kwargs` from the processor, a
row, and `gristmill batch --chat-template-kwargs`, a row's own merged over the job's."""

from __future__ import annotations

import json

import pytest

from gristmill import EngineConfig
from gristmill.batch import ERROR_COLUMN, EngineProcessorConfig, build_processor
from gristmill.batch.openai_batch import batch_request_row
from gristmill.tokenizer import render_chat
from tests.batch.inprocess import batch_main
from tests.chat.reasoning_models import TEMPLATES, cache_dir, tiny_reasoning_model

MESSAGES = [{"role": "user", "content": "What is 2+2?"}]
CLOSE = 504  # </think> in the tiny model's vocabulary (checked below)
#: Makes greedy decoding write </think> eleven tokens in (then again and again).
PARAMS = {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "logit_bias": {CLOSE: 14}}
OFF = {"enable_thinking": False}


class Template:
    """The tiny model's chat template, rendered as the engine does (its tokenizer's)."""

    chat_template = TEMPLATES["qwen3_opened"]

    def apply_chat_template(self, messages, **kwargs):
        from transformers.utils.chat_template_utils import render_jinja_template
        [text], _ = render_jinja_template([messages], chat_template=self.chat_template, **kwargs)
        return text


@pytest.fixture(scope="module")
def engine():
    return EngineConfig(model=tiny_reasoning_model("qwen3_opened"), device="cpu", cache_dir=cache_dir(),
                        quantization=None)


def prompt_row(**template_kwargs) -> dict:
    """The chat as a prompt row (its output unsplit): the rendered text."""
    return {"prompt": render_chat(Template(), MESSAGES, template_kwargs=template_kwargs or None),
            "sampling_params": PARAMS}


def test_chat_rows_get_the_reasoning_apart(engine):
    processor = build_processor(EngineProcessorConfig(engine=engine, sampling_params=PARAMS,
                                                      chat_template_kwargs={"unused": 1}))
    rows = processor([{"messages": MESSAGES}, {"messages": MESSAGES, "chat_template_kwargs": OFF},
                      prompt_row(), prompt_row(**OFF)])
    thinking, off, raw, raw_off = rows
    assert raw["prompt"].endswith("<think>\n") and raw["generated_tokens"].count(CLOSE) >= 1
    before, marker, after = raw["generated_text"].partition("</think>")
    assert marker and before.strip() and after
    assert thinking["reasoning"] == before.strip() and thinking["generated_text"] == after.lstrip()
    assert thinking["generated_tokens"] == raw["generated_tokens"]
    # a row's own enable_thinking: the template closed the reasoning, all is the answer
    assert off["reasoning"] is None and off["generated_text"] == raw_off["generated_text"]
    assert "reasoning" not in raw and "reasoning" not in raw_off  # (prompt rows are not chats)


def test_the_cli_merges_a_rows_template_kwargs_over_the_flags(engine, tmp_path):
    rows = [{"messages": MESSAGES, "sampling_params": PARAMS},
            {"messages": MESSAGES, "sampling_params": PARAMS, "chat_template_kwargs": {"enable_thinking": True}},
            {**prompt_row(**OFF)}, {**prompt_row()}]
    source, out = tmp_path / "rows.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    ran = batch_main(source, "-o", out, "--model", engine.model, "--device", "cpu", "--cache-dir", engine.cache_dir,
                     "--quantization", "none", "--chat-template-kwargs", json.dumps(OFF))
    assert ran.returncode == 0, ran.stderr
    off, thinking, raw_off, raw = [json.loads(line) for line in out.read_text().splitlines()]
    assert off["reasoning"] is None and off["generated_text"] == raw_off["generated_text"]
    before, _, after = raw["generated_text"].partition("</think>")
    assert thinking["reasoning"] == before.strip() and thinking["generated_text"] == after.lstrip()


def test_bad_chat_template_kwargs_are_refused(engine, tmp_path):
    source = tmp_path / "rows.jsonl"
    source.write_text(json.dumps({"messages": MESSAGES}) + "\n")
    ran = batch_main(source, "-o", tmp_path / "out.jsonl", "--chat-template-kwargs", "[1]")
    assert ran.returncode == 1 and "--chat-template-kwargs must be a JSON object" in ran.stderr


def test_a_chat_rows_constraint_applies_after_its_reasoning(engine):
    constrained = {"max_tokens": 24, "temperature": 0, "max_reasoning_tokens": 3,
                   "structured_output": {"choice": ["yes", "no"]}}
    processor = build_processor(EngineProcessorConfig(engine=engine, should_continue_on_error=True))
    chat, plain = processor([{"messages": MESSAGES, "sampling_params": constrained},
                             {"prompt": "2+2=", "sampling_params": constrained}])
    assert chat["generated_tokens"][3] == CLOSE  # three reasoning tokens, then the forced </think>
    assert chat["reasoning"] and chat["generated_text"] in ("yes", "no") and not chat[ERROR_COLUMN]
    assert plain[ERROR_COLUMN].startswith("RequestError: max_reasoning_tokens limits the reasoning of a chat")


def test_an_openai_batch_body_takes_max_reasoning_tokens():
    line = {"custom_id": "a", "url": "/v1/chat/completions",
            "body": {"messages": MESSAGES, "max_reasoning_tokens": 4}}
    assert batch_request_row(line)["sampling_params"]["max_reasoning_tokens"] == 4
