"""Tiny random-weight Qwen3 models whose vocabulary has `<think>` and `</think>` (added
tokens, not special, as in Qwen3's), with a reasoning model's chat template: Qwen3's
hybrid one ("qwen3": `enable_thinking=False` writes an empty `<think>\\n\\n</think>\\n\\n`),
the same opening the reasoning in the prompt when thinking is on ("qwen3_opened"), or
DeepSeek-R1's, which always opens it ("r1").
Each is written once per test run.

A random model does not write `</think>` on its own: a test biases it (`logit_bias`) until
greedy decoding writes it a few tokens in, and checks that it did."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import cache
from pathlib import Path

from tests.model.test_loader import write_tiny_gguf

_TURNS = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}")
_THINKING_OFF = "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
_HERMES_TOOLS = "".join(line.strip() for line in r"""
{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}
\n</tools><|im_end|>\n{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}
{%- for c in m.tool_calls %}<tool_call>\n{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
\n</tool_call>{% endfor %}<|im_end|>\n
{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n
{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}
{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}
""".splitlines()).replace("\\n", "\n")
TEMPLATES = {
    # Qwen3's hybrid models: the model writes <think> itself; thinking off closes it empty.
    "qwen3": _TURNS + _THINKING_OFF + "{% endif %}{% endif %}",
    # The same switch, but the prompt opens the reasoning when it is on (Qwen3's 2507 ones).
    "qwen3_opened": _TURNS + _THINKING_OFF + "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}",
    # DeepSeek-R1's: the prompt always opens it.
    "r1": _TURNS + "{{ '<think>\\n' }}{% endif %}",
    # No reasoning; tools as Qwen's templates write them (`<tool_call>` blocks, `<tool_response>`).
    "hermes_tools": _HERMES_TOOLS,
}


@cache
def _root() -> Path:
    root = Path(tempfile.mkdtemp(prefix="gristmill-reasoning-"))
    atexit.register(shutil.rmtree, root, True)
    return root


@cache
def tiny_reasoning_model(template: str = "qwen3", control: tuple[str, ...] = ()) -> str:
    """The path of a tiny Qwen3 GGUF file with the chat template TEMPLATES[template];
    `control`: more special tokens of its vocabulary (`<tool_call>`, as some Qwen ones have)."""
    path = _root() / "-".join((template, *control)) / "tiny-qwen3.gguf"
    write_tiny_gguf(path, "qwen3", "gpt2", {"chat_template": TEMPLATES[template], "context_length": 1024,
                                            "user_defined": ("<think>", "</think>"), "control": control})
    return str(path)


def cache_dir() -> str:
    return str(_root() / "cache")


def token_id(tokenizer, text: str) -> int:
    [token] = tokenizer.encode(text, add_special_tokens=False)
    return token
