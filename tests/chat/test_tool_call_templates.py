"""Tool calls through the engine on tiny random-weight models with chat templates in the
formats of Llama 3.1 (JSON calls, `"parameters"`) and Gemma 3 (no call syntax of its own:
its template does not render tools, and gristmill reads its calls as pythonic ones,
`[f(a=1)]`, the format Google's Gemma 3 function-calling guide asks for in the prompt):
`tool_choice="required"` and a named function give calls whose arguments validate in
every one of 200 outputs; under "auto" every call the model writes validates."""

from __future__ import annotations

import jsonschema
import pytest

from gristmill.chat.tool_calls import choose_tool_parser
from gristmill.chat.tool_choice import tool_request
from gristmill.sampling import SamplingParams
from tests.chat.tools import SCHEMAS, TOOLS

MESSAGES = [{"role": "user", "content": "Weather in Rome?"}]

# Llama 3.1's JSON tool calling, as its template words it (headers as text: the tiny
# vocabulary has no header tokens).
LLAMA31 = (
    "{% for m in messages %}{{ m['role'] }}:\n"
    "{% if loop.last and tools %}Given the following functions, please respond with a JSON for a function call "
    "with its proper arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function "
    "name, \"parameters\": dictionary of argument name and its value}. Do not use variables.\n\n"
    "{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}{% endif %}{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:\n{% endif %}")
# Gemma 3's: turns only; tools are not rendered.
GEMMA3 = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
          "else m['role'] }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
          "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
MODELS = {"llama3.1": ("llama", "gpt2", {"chat_template": LLAMA31, "control": ("<|python_tag|>",)}, None),
          "gemma3": ("gemma3", "llama", {"chat_template": GEMMA3, "user_defined": ("<|python_start|>",)},
                     "pythonic")}
#: The token that starts a call, under "auto" (biased so that the random model writes calls).
TRIGGERS = {"llama3.1": "<|python_tag|>", "gemma3": "<|python_start|>"}


@pytest.fixture(scope="module", params=sorted(MODELS))
def llm(request, tmp_path_factory):
    from gristmill.llm import LLM
    from tests.model.test_loader import write_tiny_gguf

    arch, vocab, variant, parser = MODELS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    path = write_tiny_gguf(root / "tiny.gguf", arch, vocab, {**variant, "context_length": 1024})
    engine = LLM(str(path), cache_dir=str(root / "cache"), quantization="none", tool_call_parser=parser)
    engine.trigger = TRIGGERS[request.param]
    yield engine
    del engine  # (an in-process engine: nothing to stop)


def outputs(llm, choice, n: int, seed: int, parallel=None, logit_bias=None):
    parser = choose_tool_parser(llm.client.config.tool_call_parser, llm.tokenizer.chat_template)
    tools = tool_request(TOOLS, choice, parallel, parser)
    prompt = llm.tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    params = SamplingParams(n=n, seed=seed, temperature=1.0, max_tokens=160, structured_output=tools.constraint(),
                            logit_bias=logit_bias)
    [out] = llm.generate([prompt], params, use_tqdm=False)
    assert choice == "auto" or all(o.finish_reason == "stop" for o in out.outputs)
    return parser, [o.text for o in out.outputs]


def validate(calls, names=tuple(SCHEMAS)) -> None:
    for call in calls:
        assert call.name in names
        jsonschema.validate(call.arguments, SCHEMAS[call.name])


def test_forced_calls_validate_in_every_one_of_200_outputs(llm):
    # (one call each: with parallel calls a random model may add calls until max_tokens cuts the list)
    parser, texts = outputs(llm, "required", 100, seed=1, parallel=False)
    named, named_texts = outputs(llm, {"type": "function", "function": {"name": "get_time"}}, 100, seed=2,
                                 parallel=False)
    for text in texts:
        parsed = parser.parse(text)
        assert parsed.calls and not parsed.error and not parsed.content.strip(), text
        validate(parsed.calls)
    for text in named_texts:
        parsed = named.parse(text)
        assert len(parsed.calls) == 1 and not parsed.error, text
        validate(parsed.calls, ("get_time",))
    assert parser.name == ("pythonic" if llm.tokenizer.chat_template == GEMMA3 else "llama3_json")


def test_auto_calls_validate_whenever_one_is_written(llm):
    [trigger] = llm.tokenizer.encode(llm.trigger, add_special_tokens=False)
    parser, texts = outputs(llm, "auto", 50, seed=3, logit_bias={trigger: 100.0})
    calls = [call for text in texts for call in parser.parse(text).calls]
    assert len(calls) >= 50  # (the bias starts a call again after each one)
    validate(calls)
