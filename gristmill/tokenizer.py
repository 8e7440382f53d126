"""Tokenizers and chat templates (HF tokenizers through transformers, imported when used).

Used by the client side of an engine (tokenizing, detokenizing, chat templates) and by
the GGUF converter; imports no torch itself.
"""

from __future__ import annotations

import json
from pathlib import Path

# Gemma's turn format, for Gemma checkpoints that ship no chat template (the base 270M).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

# Tokens that end a chat turn in the supported families; a request stops at them.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>")


def load_tokenizer(model_dir: Path, model_type: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    if not tokenizer.chat_template and model_type.startswith("gemma"):
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    return tokenizer


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """A conversation rendered with the tokenizer's chat template; RequestError when the
    messages are malformed or the template rejects them."""
    from gristmill.errors import RequestError

    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise RequestError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts",
                           param="messages")
    flat = [{"role": m["role"], "content": _text_content(m["content"])} for m in messages]
    try:
        return tokenizer.apply_chat_template(flat, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # the template raises on e.g. roles out of order
        raise RequestError(f"the chat template rejected these messages: {exc}", param="messages") from exc


def _text_content(content) -> str:
    """Message content as text: a string, or the text parts of a list of content parts."""
    from gristmill.errors import RequestError

    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" for p in content):
            raise RequestError("only text content parts are supported", param="messages")
        return "".join(str(p.get("text", "")) for p in content)
    raise RequestError("message content must be a string or a list of text parts", param="messages")


def eos_token_ids(tokenizer, model_dir: Path, config) -> frozenset[int]:
    """Every id that ends generation: the config's, generation_config's, the tokenizer's,
    and the family's end-of-turn token."""
    ids: set[int] = set()

    def add(value):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(config, "eos_token_id", None))
    gen_config = model_dir / "generation_config.json"
    if gen_config.exists():
        add(json.loads(gen_config.read_text()).get("eos_token_id"))
    add(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    for token in END_OF_TURN_TOKENS:
        add(vocab.get(token))
    return frozenset(ids)


def convert_gguf_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Build an HF tokenizer from a GGUF file's vocabulary and save it into `out_dir`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
