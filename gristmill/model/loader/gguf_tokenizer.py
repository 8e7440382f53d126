"""A GGUF file's tokenizer as HF tokenizer files: what transformers 5 writes for
`AutoTokenizer.from_pretrained(dir, gguf_file=name).save_pretrained(out_dir)`
(tokenizer.json, tokenizer_config.json, chat_template.jinja where the file has a
template), from the metadata gristmill.gguf_file has already read.

A Gemma vocabulary (sentencepiece pieces without merges, as the bundled model's) is
written here with the tokenizers library and json alone: the Rust tokenizer that
GemmaTokenizer builds, the tokens transformers adds to it in the order it adds them, and
tokenizer_config.json as its save_pretrained writes it. That is ~2 s of a conversion where
transformers took ~10 (its import, the tokenizer class built twice, a deep copy of the
262k-token Rust tokenizer); tests/model/test_loader.py checks the files byte for byte
against transformers'. Other vocabularies, and Gemma files this does not cover, go
through transformers' own GGUF builders and tokenizer classes. Imports no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

# transformers' GGUF_TOKENIZER_MAPPING (transformers.integrations.gguf), kept here so that
# the Gemma path imports no transformers; tests/model/test_loader.py checks it is the same.
GGUF_TOKENIZER_MAPPING = {
    "tokenizer": {
        "ggml.model": "tokenizer_type",
        "ggml.pre": "pre_tokenizer_type",
        "ggml.tokens": "tokens",
        "ggml.scores": "scores",
        "ggml.token_type": "token_type",
        "ggml.merges": "merges",
        "ggml.precompiled_charsmap": "precompiled_charsmap",
        "ggml.bos_token_id": "bos_token_id",
        "ggml.eos_token_id": "eos_token_id",
        "ggml.unknown_token_id": "unk_token_id",
        "ggml.padding_token_id": "pad_token_id",
        "ggml.add_space_prefix": "add_prefix_space",
    },
    "tokenizer_config": {
        "chat_template": "chat_template",
        "ggml.add_bos_token": "add_bos_token",
        "ggml.add_eos_token": "add_eos_token",
    },
}

# The GGUF pre-tokenizers (tokenizer.ggml.pre) whose BPE takes a word that is a token as
# it is, before any merge: llama.cpp's (src/llama-vocab.cpp), as these models' own
# tokenizer.json say (Llama 3's "ignore_merges": true). Merged, some words come out as
# other tokens: Llama 3 splits " Việt" in three where its tokenizer and llama.cpp give one.
IGNORE_MERGES_PRE_TOKENIZERS = frozenset({
    "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano",
    "youtu", "glm4", "glm5", "tekken", "granite-embed-multi-97m"})

# The GGUF architectures whose sentencepiece vocabulary transformers builds with its
# gemma_tokenizer (GGUF_SENTENCEPIECE_BUILDERS; checked in tests/model/test_loader.py).
GEMMA_ARCHITECTURES = ("gemma", "gemma2", "gemma3")


def convert_gguf_tokenizer(metadata: dict, model_type: str, out_dir: Path, gguf_path: Path | None = None) -> None:
    """Write the HF tokenizer files of a GGUF file into `out_dir`.

    `metadata` is `GGUFFile.fields` of the file. The settings are transformers' (its GGUF
    key mapping); a Gemma vocabulary is written by `write_gemma_tokenizer`, any other
    (or a Gemma one it declines) by transformers' backend builder and the tokenizer class
    AutoTokenizer picks for the model type. The saved files are the same either way.
    """
    tokenizer_dict, tokenizer_config = gguf_tokenizer_settings(metadata)
    architecture = metadata["general.architecture"]
    if (architecture in GEMMA_ARCHITECTURES and tokenizer_dict.get("tokenizer_type") == "llama"
            and TOKENIZER_CLASSES.get(model_type, (None, None))[1] == "GemmaTokenizer"
            and write_gemma_tokenizer(tokenizer_dict, tokenizer_config, out_dir)):
        return
    try:
        from transformers.integrations.gguf import convert_gguf_tokenizer as build_backend
    except ImportError:  # another transformers layout: let it read the file itself (slower)
        if gguf_path is None:
            raise
        from transformers import AutoTokenizer
        AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(str(out_dir))
        return
    backend, extra_kwargs = build_backend(architecture, _with_derived_merges(architecture, tokenizer_dict))
    if tokenizer_dict.get("pre_tokenizer_type") in IGNORE_MERGES_PRE_TOKENIZERS:
        backend.model.ignore_merges = True  # (transformers' builder leaves it off)
    # is_local / local_files_only: what from_pretrained passes and save_pretrained writes
    # into tokenizer_config.json; given here too so the saved files are the same.
    tokenizer = _tokenizer_class(model_type)(
        tokenizer_object=backend, is_local=True, local_files_only=False,
        **tokenizer_config, **extra_kwargs)
    tokenizer.save_pretrained(str(out_dir))


# GemmaTokenizer's own special tokens, in the order transformers adds them (bos, eos, unk,
# pad, mask); and the GGUF token types of control tokens and user-defined ones.
_GEMMA_SPECIAL_TOKENS = {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>",
                         "pad_token": "<pad>", "mask_token": "<mask>"}
_CONTROL, _USER_DEFINED = 3, 4
_VERY_LARGE_INTEGER = int(1e30)  # transformers' model_max_length when none is given


def write_gemma_tokenizer(tokenizer_dict: dict, tokenizer_config: dict, out_dir: Path) -> bool:
    """Write the tokenizer files transformers writes for a Gemma GGUF vocabulary
    (`gguf_tokenizer_settings`' two dicts), with the tokenizers library; False, having
    written nothing, where the file names no token for one of its special tokens, a
    special or control token is not in the vocabulary (transformers would then add new
    ids), the file lists merges, or `derive_merges` declines the vocabulary."""
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    tokens = tokenizer_dict["tokens"]
    token_types = tokenizer_dict.get("token_type") or ()
    named = {key: tokenizer_config.get(key) for key in ("bos_token", "eos_token", "unk_token", "pad_token")}
    named["mask_token"] = _GEMMA_SPECIAL_TOKENS["mask_token"]  # (a GGUF names none)
    # As transformers' gemma_tokenizer: runs of spaces spelled as "\u2581"s, ranked by their
    # place in the file.
    respelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {token: index for index, token in enumerate(respelled)}
    control = [t for t, kind in zip(tokens, token_types) if kind == _CONTROL]
    user_defined = [t for t, kind in zip(tokens, token_types) if kind == _USER_DEFINED and t in vocab]
    if ("merges" in tokenizer_dict or None in named.values()
            or not all(t in vocab for t in (*_GEMMA_SPECIAL_TOKENS.values(), *named.values(), *control))):
        return False
    merges = derive_merges(vocab, {token: -index for index, token in enumerate(respelled)})
    if merges is None:
        return False
    # GemmaTokenizer.__init__'s backend.
    tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token="<unk>", dropout=None,
                              byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                           decoders.Fuse()])
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    # The added tokens, as transformers adds them and in its order (the same text added
    # again replaces the earlier entry): GemmaTokenizer's own special tokens, the file's
    # control tokens (special) and user-defined ones (not special), then the file's named
    # special tokens that are not added yet.
    tokenizer.add_tokens([AddedToken(t, special=True) for t in _GEMMA_SPECIAL_TOKENS.values()])
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    tokenizer.add_tokens([AddedToken(t, special=True) for t in dict.fromkeys(named.values()) if t not in added])
    tokenizer.post_processor = _bos_eos_template(tokenizer, named["bos_token"], named["eos_token"],
                                                 tokenizer_config.get("add_bos_token", False),
                                                 tokenizer_config.get("add_eos_token", False))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    # save_pretrained's tokenizer_config.json: the init arguments but add_bos/eos_token and
    # the chat template (written beside it), the special tokens, the class.
    config = {**named, "backend": "tokenizers", "is_local": True, "local_files_only": False,
              "model_max_length": _VERY_LARGE_INTEGER, "tokenizer_class": "GemmaTokenizer"}
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
    if isinstance(tokenizer_config.get("chat_template"), str):
        (out_dir / "chat_template.jinja").write_text(tokenizer_config["chat_template"], encoding="utf-8")
    return True


def _bos_eos_template(tokenizer, bos: str, eos: str, add_bos: bool, add_eos: bool):
    """transformers' `TokenizersBackend.update_post_processor`: BOS and EOS around each sequence."""
    from tokenizers import processors

    single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
    special_tokens = [(token, tokenizer.token_to_id(token)) for token, added in ((bos, add_bos), (eos, add_eos))
                      if added]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special_tokens)


_GGUF_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                        "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def gguf_tokenizer_settings(metadata: dict) -> tuple[dict, dict]:
    """`(tokenizer_dict, tokenizer_config)` from GGUF metadata, as transformers'
    `get_gguf_tokenizer` makes them: GGUF "tokenizer.*" keys renamed by its
    GGUF_TOKENIZER_MAPPING, arrays of numbers as lists, special tokens by id."""
    tokenizer_dict, tokenizer_config = (
        {name: _plain(metadata[f"tokenizer.{key}"]) for key, name in GGUF_TOKENIZER_MAPPING[group].items()
         if f"tokenizer.{key}" in metadata}
        for group in ("tokenizer", "tokenizer_config"))
    tokenizer_type = tokenizer_dict.get("tokenizer_type")
    if tokenizer_type == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary unless told not to
        tokenizer_config.setdefault("add_bos_token", True)
    elif tokenizer_type == "gemma4":  # its chat template writes <bos> itself
        tokenizer_config["add_bos_token"] = False
    tokens = tokenizer_dict["tokens"]
    for name, key in _GGUF_SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise ValueError(f"GGUF tokenizer.ggml.{key} {token_id} is not a token id "
                             f"(the vocabulary has {len(tokens)} tokens)")
        tokenizer_config[name] = tokens[token_id] if token_id is not None else None
    return tokenizer_dict, tokenizer_config


def _plain(value):
    """A metadata value as transformers' GGUF reader gives it: arrays as lists."""
    return value.tolist() if hasattr(value, "tolist") else value


# The tokenizer class AutoTokenizer picks for each supported model type (module, class),
# named here: looking it up in transformers' TOKENIZER_MAPPING imports its config classes,
# and those import torch (seconds of a conversion). tests/model/test_loader.py checks these
# against TOKENIZER_MAPPING.
TOKENIZER_CLASSES = {
    "gemma3_text": ("transformers.models.gemma.tokenization_gemma", "GemmaTokenizer"),
    "llama": ("transformers.tokenization_utils_tokenizers", "TokenizersBackend"),
    "qwen2": ("transformers.models.qwen2.tokenization_qwen2", "Qwen2Tokenizer"),
    "qwen3": ("transformers.models.qwen2.tokenization_qwen2", "Qwen2Tokenizer"),
}


def _tokenizer_class(model_type: str):
    """The tokenizer class AutoTokenizer uses for a model type with no tokenizer files."""
    import importlib

    if model_type in TOKENIZER_CLASSES:
        module, name = TOKENIZER_CLASSES[model_type]
        return getattr(importlib.import_module(module), name)
    from transformers import TokenizersBackend
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    return TOKENIZER_MAPPING.get(CONFIG_MAPPING[model_type], None) or TokenizersBackend


def _with_derived_merges(architecture: str, tokenizer_dict: dict) -> dict:
    """`tokenizer_dict`, for a sentencepiece vocabulary without merges (Gemma's, Llama 2's),
    with the merges transformers' GGUF builders would derive from it
    (`generate_merges`, which takes seconds of Python for 262k tokens), derived by
    `derive_merges` instead. Where the builder is not one this knows, or a piece holds a
    space (merges are given as "left right"), the dict is left for transformers to derive."""
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping

    if "merges" in tokenizer_dict or tokenizer_dict.get("tokenizer_type") != "llama":
        return tokenizer_dict
    builder = getattr(mapping, "GGUF_SENTENCEPIECE_BUILDERS", {}).get(architecture)
    tokens = tokenizer_dict["tokens"]
    if builder is not None and builder is getattr(mapping, "gemma_tokenizer", None):
        # gemma_tokenizer: runs of spaces spelled as "\u2581"s, ranked by their place in the file.
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = {token: -index for index, token in enumerate(tokens)}
    elif builder is None or builder is getattr(mapping, "phi3_tokenizer", None):
        if "scores" not in tokenizer_dict:
            return tokenizer_dict
        scores = dict(zip(tokens, tokenizer_dict["scores"]))
    else:
        return tokenizer_dict
    merges = derive_merges({token: index for index, token in enumerate(tokens)}, scores)
    if merges is None:
        return tokenizer_dict
    return {**tokenizer_dict, "merges": [f"{left} {right}" for left, right in merges]}


def derive_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]] | None:
    """The merges of a vocabulary, as transformers' `generate_merges(vocab, scores)` gives
    them: every split of a token into two tokens, best first by (the token's score, left
    length, right length), ties in token order and then by (left id, right id).

    generate_merges slices every token at every place and looks both halves up, in Python
    (1.2M lookups for Gemma's 262k tokens: seconds). Here numpy does it: the prefix hashes
    (polynomial, mod 2^64) of every token give every split's two halves' hashes, looked
    up among the tokens' own hashes; a hit counts only where the two halves' text is the
    token's, so a hash collision cannot add a merge. None (the caller then lets
    transformers derive them) where `scores` is not over the same tokens in the same
    order, two tokens' hashes collide (a split could then miss its half), a score is not
    a number, or a piece holds a space (merges are passed as "left right")."""
    import numpy as np

    tokens = list(vocab)
    if list(scores) != tokens:
        return None
    try:
        token_scores = np.array(list(scores.values()), dtype=np.float64)
    except (TypeError, ValueError):
        return None
    if np.isnan(token_scores).any() or not tokens:
        return None
    n = len(tokens)
    ids = np.fromiter(vocab.values(), dtype=np.int64, count=n)
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=n)
    # Every character (its code point + 1) of every token, one after another; per character
    # its token and its place in it.
    chars = np.frombuffer("".join(tokens).encode("utf-32-le"), dtype=np.uint32).astype(np.uint64) + 1
    token_of = np.repeat(np.arange(n), lengths)
    starts = np.cumsum(lengths) - lengths
    place = np.arange(len(chars)) - starts[token_of]
    by_place = np.argsort(place, kind="stable")
    place_ends = np.cumsum(np.bincount(place, minlength=1))
    base = np.uint64(0x100000001B3)
    powers = base ** np.arange(int(lengths.max()) + 1, dtype=np.uint64)
    prefix = chars.copy()  # prefix[k]: the hash of its token's characters up to and including k
    whole = np.zeros(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for c in range(1, len(place_ends)):
            at = by_place[place_ends[c - 1]:place_ends[c]]
            prefix[at] = prefix[at - 1] * base + chars[at]
        whole[lengths > 0] = prefix[(starts + lengths - 1)[lengths > 0]]
        order = np.argsort(whole, kind="stable")
        sorted_hashes = whole[order]
        if (sorted_hashes[1:] == sorted_hashes[:-1]).any():
            return None
        # Every split: after character k, which is not its token's last; token by token,
        # left to right. i: the left half's length.
        k = np.flatnonzero(place < lengths[token_of] - 1)
        t, i = token_of[k], place[k] + 1
        left_hash = prefix[k]
        right_hash = whole[t] - left_hash * powers[lengths[t] - i]

    def lookup(hashes):
        at = np.minimum(np.searchsorted(sorted_hashes, hashes), n - 1)
        return sorted_hashes[at] == hashes, order[at]

    found, left = lookup(left_hash)
    hit = np.flatnonzero(found & (lengths[left] == i))
    t, i, left, right_hash = t[hit], i[hit], left[hit], right_hash[hit]
    found, right = lookup(right_hash)
    hit = found & (lengths[right] == lengths[t] - i)
    t, i, left, right = t[hit], i[hit], left[hit], right[hit]
    names = np.array(tokens, dtype=object)
    # The text must match too (a hash collision is not a token).
    same = np.fromiter(map(str.__eq__, names[left] + names[right], names[t]), dtype=bool, count=len(t))
    t, i, left, right = t[same], i[same], left[same], right[same]
    has_space = np.fromiter((" " in token for token in tokens), dtype=bool, count=n)
    if has_space[left].any() or has_space[right].any():
        return None
    # Descending by (score, left length, right length); ties as generate_merges's stable
    # sorts leave them: token order (and then by (left id, right id), which never decides:
    # a token and a left length are one split). lexsort: last key first.
    ranked = np.lexsort((t, -(lengths[t] - i), -i, -token_scores[t]))
    return list(zip(names[left[ranked]].tolist(), names[right[ranked]].tolist()))
