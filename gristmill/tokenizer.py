"""Tokenizers and chat templates (HF tokenizers through transformers, imported when used).

Used by the client side of an engine (tokenizing, detokenizing, chat templates); imports
no torch itself. A GGUF file's tokenizer is converted by gristmill.model.loader.gguf_tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

# Gemma's turn format, for Gemma checkpoints that ship no chat template (the base 270M).
# Gemma's turns are only user and model: as Google's function-calling guide has it, an
# assistant's tool calls are written in the model turn as a pythonic list,
# `[get_weather(city="Paris", hot=True)]` (what the `pythonic` parser reads), and tool
# results go in a user turn, each in a ```tool_output block (results in a row share it).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- if not loop_messages -%}"
    "{{ raise_exception('a system message must be followed by a user message') }}"
    "{%- endif -%}"
    "{%- set ns = namespace(turns=0) -%}"
    "{%- for message in loop_messages -%}"
    "{%- set result = message['role'] == 'tool' -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else ('user' if result else message['role']) -%}"
    "{%- if not (result and loop.previtem is defined and loop.previtem['role'] == 'tool') -%}"
    "{%- if (role == 'user') != (ns.turns % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if ns.turns == 0 else '') }}"
    "{%- set ns.turns = ns.turns + 1 -%}"
    "{%- endif -%}"
    "{%- if result -%}"
    "{{ '```tool_output\n' + message['content'] | trim + '\n```' }}"
    "{%- else -%}"
    "{{ message['content'] | trim }}"
    "{%- endif -%}"
    "{%- if message.tool_calls -%}"
    "{{ '\n' if message['content'] | trim else '' }}["
    "{%- for call in message.tool_calls -%}"
    "{{ ', ' if not loop.first else '' }}{{ call['function']['name'] }}("
    "{%- for key, value in call['function']['arguments'].items() -%}"
    "{{ ', ' if not loop.first else '' }}{{ key }}="
    "{%- if value is sameas true -%}True{%- elif value is sameas false -%}False"
    "{%- elif value is none -%}None{%- else -%}{{ value | tojson }}{%- endif -%}"
    "{%- endfor -%})"
    "{%- endfor -%}]"
    "{%- endif -%}"
    "{%- if result and loop.nextitem is defined and loop.nextitem['role'] == 'tool' -%}"
    "{{ '\n' }}"
    "{%- else -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

# Tokens that end a chat turn in the supported families; a request stops at them.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>")


def load_tokenizer(model_dir: Path, model_type: str, cache: Path | None = None):
    """The model's HF tokenizer. With `cache` (a directory), a copy is kept there, keyed
    by the tokenizer files and the library versions: transformers takes ~3 s to build a
    262k-token tokenizer from its files; the copy loads in about one (`_load_cached`)."""
    tokenizer = _load_cached(model_dir, cache)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        _save_cached(tokenizer, model_dir, cache)
    if not tokenizer.chat_template and model_type.startswith("gemma"):
        tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    return tokenizer


def _cache_path(model_dir: Path, cache: Path | None) -> Path | None:
    """The kept copy of the tokenizer of `model_dir` in `cache`."""
    if cache is None:
        return None
    import importlib.metadata

    # The files as they really are (a symlinked copy of a model shares its tokenizer).
    files = sorted((f.name, f.resolve()) for f in model_dir.iterdir()
                   if f.is_file() and not f.name.endswith((".safetensors", ".bin")))
    parts = ["v2", importlib.metadata.version("transformers"), importlib.metadata.version("tokenizers")]
    parts += [f"{name}:{path}:{path.stat().st_size}:{path.stat().st_mtime_ns}" for name, path in files]
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]
    return cache / "tokenizers" / f"{key}.pickle"


def _load_cached(model_dir: Path, cache: Path | None):
    """The kept tokenizer: its class's Python state as it was, and its Rust tokenizer
    rebuilt from what `_rust_parts` kept."""
    path = _cache_path(model_dir, cache)
    if path is None or not path.exists():
        return None
    try:
        kind, state, rust = pickle.loads(path.read_bytes())  # noqa: S301 - our own cache, as trusted as its kernels
        tokenizer = kind.__new__(kind)
        tokenizer.__dict__.update(state)
        tokenizer._tokenizer = _rust_tokenizer(rust)
        return tokenizer
    except Exception as exc:  # noqa: BLE001 - a damaged or stale copy: load from the files
        logger.warning("ignoring unreadable cached tokenizer %s (%s)", path, exc)
        return None


def _save_cached(tokenizer, model_dir: Path, cache: Path | None) -> None:
    """Keep the tokenizer: its Python state (the tokenizer classes pickle their plain
    __dict__) and its Rust tokenizer (`_rust_parts`), in one pickle."""
    from tokenizers import Tokenizer

    path = _cache_path(model_dir, cache)
    if path is None or not isinstance(getattr(tokenizer, "_tokenizer", None), Tokenizer):
        return  # (a tokenizer without a Rust one is left as it is)
    state = {k: v for k, v in tokenizer.__dict__.items() if k != "_tokenizer"}
    try:
        rust = _rust_parts(tokenizer._tokenizer, state)
        _write_atomically(path, pickle.dumps((type(tokenizer), state, rust), protocol=pickle.HIGHEST_PROTOCOL))
    except Exception as exc:  # noqa: BLE001 - a cache that cannot be written only costs time
        logger.warning("could not cache the tokenizer in %s (%s)", path.parent, exc)


# What a BPE model takes besides its vocabulary and merges, as tokenizer.json names them.
_BPE_OPTIONS = ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk",
                "byte_fallback", "ignore_merges")


def _rust_parts(rust, state: dict) -> tuple:
    """What `_rust_tokenizer` rebuilds the Rust tokenizer `rust` from. For a BPE model:
    its JSON without the vocabulary, the merges and the added tokens, and those three as
    Python objects (the vocabulary and merges shared with the class's `state` where it
    holds the same ones, so the pickle keeps them once): tokenizers builds a BPE model from
    Python objects in half the time it takes to parse them from JSON (~1 s of a 262k
    vocabulary, holding the GIL), and the pickle reads them back in less. Otherwise, or
    where that does not rebuild the same tokenizer, its whole JSON."""
    import json

    text = rust.to_str()
    config = json.loads(text)
    model = config.get("model") or {}
    if model.get("type") != "BPE" or set(model) - {"type", "vocab", "merges", *_BPE_OPTIONS}:
        return ("json", text)
    vocab = model["vocab"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    vocab = state["_vocab"] if state.get("_vocab") == vocab else vocab
    merges = state["_merges"] if state.get("_merges") == merges else merges
    skeleton = json.dumps({**config, "added_tokens": [], "model": {**model, "vocab": {}, "merges": []}})
    options = {name: model[name] for name in _BPE_OPTIONS if model.get(name) is not None}
    parts = ("bpe", skeleton, vocab, merges, options, config["added_tokens"])
    try:
        same = _rust_tokenizer(parts).to_str() == text
    except Exception:  # noqa: BLE001 - whatever does not rebuild is kept whole
        same = False
    return parts if same else ("json", text)


def _rust_tokenizer(parts: tuple):
    """The Rust tokenizer `_rust_parts` kept: added tokens as its JSON loader adds them, in
    id order (the special ones with add_special_tokens), a run of either in one call."""
    import itertools

    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import BPE

    if parts[0] == "json":
        return Tokenizer.from_str(parts[1])
    _, skeleton, vocab, merges, options, added = parts
    rust = Tokenizer.from_str(skeleton)
    rust.model = BPE(vocab=vocab, merges=merges, **options)
    for special, run in itertools.groupby(added, key=lambda token: token["special"]):
        tokens = [AddedToken(t["content"], single_word=t["single_word"], lstrip=t["lstrip"], rstrip=t["rstrip"],
                             normalized=t["normalized"], special=special) for t in run]
        (rust.add_special_tokens if special else rust.add_tokens)(tokens)
    return rust


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict | None = None,
                chat_template: str | None = None, tools: list[dict] | None = None) -> str:
    """A conversation rendered with the tokenizer's chat template (or `chat_template`, a
    Jinja text); RequestError when the messages are malformed or the template rejects
    them. `continue_final_message`: the last message (the assistant's) is left open for
    the model to continue; `template_kwargs`: more variables for the template; `tools`:
    OpenAI tool entries, which the template writes as it writes them (an assistant
    message's `tool_calls` and a `tool` message's `tool_call_id` reach it too)."""
    from gristmill.errors import RequestError

    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise RequestError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts",
                           param="messages")
    if continue_final_message and (add_generation_prompt or messages[-1]["role"] != "assistant"):
        raise RequestError("continue_final_message continues the last message, which must be the assistant's, "
                           "and needs add_generation_prompt false", param="continue_final_message")
    bad_roles = [m["role"] for m in messages if not isinstance(m["role"], str) or not m["role"]]
    if bad_roles:
        raise RequestError(f"each message's role must be a non-empty string such as 'system', 'user' or "
                           f"'assistant', got {bad_roles[0]!r}", param="messages")
    # OpenAI's developer messages are its newer name for system messages; templates know only those.
    flat = [{"role": "system" if m["role"] == "developer" else m["role"], "content": _text_content(m["content"]),
             **_tool_fields(m)} for m in messages]
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise RequestError(f"chat_template_kwargs must be a dict, got {type(template_kwargs).__name__}",
                           param="chat_template_kwargs")
    kwargs = dict(template_kwargs or {})
    reserved = sorted(set(kwargs) & {"conversation", "messages", "tokenize", "add_generation_prompt",
                                     "continue_final_message", "chat_template", "tools", "documents"})
    if reserved:
        raise RequestError(f"chat_template_kwargs may not set {reserved}", param="chat_template_kwargs")
    if continue_final_message:
        kwargs["continue_final_message"] = True
    if chat_template is not None:
        if not isinstance(chat_template, str) or not chat_template.strip():
            raise RequestError("chat_template must be a Jinja template text", param="chat_template")
        kwargs["chat_template"] = chat_template
    try:
        if tools:
            kwargs["tools"] = tools
        return tokenizer.apply_chat_template(flat, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **kwargs)
    except Exception as exc:  # the template raises on e.g. roles out of order
        template = chat_template or tokenizer.chat_template or ""
        hint = ("; this model's chat template has no 'tool' role (Gemma's has only user and model turns): "
                "send the tool's result in a user message, or give a chat template that renders tool messages"
                if any(m["role"] == "tool" for m in flat) and "'tool'" not in template and '"tool"' not in template
                else "")
        raise RequestError(f"the chat template rejected these messages: {exc}{hint}", param="messages") from exc


def _tool_fields(message: dict) -> dict:
    """A message's tool fields as chat templates read them: `tool_call_id` and `name` (a
    tool result), `tool_calls` (an assistant's) with each call's arguments as an object,
    where OpenAI sends them as JSON text (Qwen's and Llama's templates dump them again)."""
    from gristmill.errors import RequestError

    fields = {key: message[key] for key in ("tool_call_id", "name") if message.get(key) is not None}
    calls = message.get("tool_calls")
    if not calls:
        return fields
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                              and isinstance(c["function"].get("name"), str) for c in calls):
        raise RequestError("an assistant message's tool_calls must be a list of {\"id\": ..., \"type\": \"function\", "
                           "\"function\": {\"name\": ..., \"arguments\": JSON text}}", param="messages")
    fields["tool_calls"] = []
    for call in calls:
        arguments = call["function"].get("arguments") or {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise RequestError(f"the arguments of tool call {call.get('id')!r} are not valid JSON: "
                                   f"{arguments[:80]!r}", param="messages") from None
        fields["tool_calls"].append({**call, "type": "function",
                                     "function": {"name": call["function"]["name"], "arguments": arguments}})
    return fields


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
        texts = [p.get("text") for p in content]
        if not all(isinstance(text, str) for text in texts):
            bad = next(text for text in texts if not isinstance(text, str))
            raise RequestError(f"a text content part's text must be a string, got {bad!r:.80}", param="messages")
        return "".join(texts)
    raise RequestError("message content must be a string or a list of text parts", param="messages")


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def token_bytes(tokenizer, token_id: int, text: str | None = None) -> bytes:
    """A token's own bytes (OpenAI's logprobs `bytes`), also where it is part of a
    character and decodes alone to U+FFFD: a byte-fallback piece `<0xF0>` is that byte,
    a SentencePiece piece its text with "▁" as a space, a byte-level BPE piece (GPT-2's
    alphabet) the bytes its characters stand for; any other token, its text in UTF-8.
    `text`: the token decoded alone, when the caller has it."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str) and (match := _BYTE_PIECE.fullmatch(piece)):
        return bytes([int(match.group(1), 16)])
    if isinstance(piece, str) and "\u2581" in piece and token_id not in tokenizer.all_special_ids:
        return piece.replace("\u2581", " ").encode()  # a SentencePiece piece: decoding it alone may drop its space
    text = tokenizer.decode([token_id]) if text is None else text
    if "\ufffd" in text and isinstance(piece, str) and piece and all(c in _BYTE_LEVEL for c in piece):
        return bytes(_BYTE_LEVEL[c] for c in piece)
    return text.encode()


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's stand-ins for bytes: printable Latin-1 bytes stand for themselves,
    the others (controls, space, ...) in order for the characters from U+0100 on."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_LEVEL = _byte_level_alphabet()


def eos_token_ids(tokenizer, model_dir: Path, config: dict) -> frozenset[int]:
    """Every id that ends generation: the config's (`config`: config.json as read, its
    text half's too for a multimodal wrapper), generation_config's, the tokenizer's, and
    the family's end-of-turn token."""
    ids: set[int] = set()

    def add(value):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))

    add(config.get("eos_token_id"))
    add((config.get("text_config") or {}).get("eos_token_id"))
    gen_config = model_dir / "generation_config.json"
    if gen_config.exists():
        add(json.loads(gen_config.read_text()).get("eos_token_id"))
    add(tokenizer.eos_token_id)
    # A token's id where the tokenizer has it (the Rust tokenizer's lookup: get_vocab would
    # build a dict of the whole vocabulary, half a second of 262k tokens).
    backend = getattr(tokenizer, "backend_tokenizer", None)
    token_id = backend.token_to_id if backend is not None else tokenizer.get_vocab().get
    for token in END_OF_TURN_TOKENS:
        add(token_id(token))
    return frozenset(ids)
