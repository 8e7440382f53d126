"""Loader pieces that need no network and no real model file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gristmill.model.loader import _unpermute_rotary, convert_gguf, resolve_model

TEXT = Path(__file__).parent.parent / "data" / "public_domain_english.txt"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute` of q_proj / k_proj."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("n_head, head_dim, cols", [(4, 16, 64), (2, 8, 24), (8, 64, 32), (1, 4, 3)])
def test_unpermute_rotary_inverts_llama_cpp_permute(n_head, head_dim, cols):
    rng = np.random.default_rng(n_head * 1000 + head_dim)
    w = rng.standard_normal((n_head * head_dim, cols)).astype(np.float32)
    permuted = _llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)  # the permutation really moves rows
    restored = _unpermute_rotary(permuted, n_head)
    np.testing.assert_array_equal(restored, w)
    assert restored.flags["C_CONTIGUOUS"]


def test_unpermute_rotary_inverts_llama_cpp_permute_of_bias():
    # 1-D tensors (a q/k bias) go through the same permutation.
    b = np.arange(4 * 16, dtype=np.float32)
    np.testing.assert_array_equal(_unpermute_rotary(_llama_cpp_permute(b, 4), 4), b)


def test_unpermute_rotary_splits_interleaved_halves():
    # One head of dim 8: llama.cpp rows are (x0, y0, x1, y1, ...) pairs; HF wants (x..., y...).
    interleaved = np.array([0, 4, 1, 5, 2, 6, 3, 7], dtype=np.float32)[:, None]
    np.testing.assert_array_equal(_unpermute_rotary(interleaved, 1)[:, 0], np.arange(8))


def test_resolve_model_missing_path_says_what_to_pass(tmp_path):
    missing = tmp_path / "nonexistent"
    with pytest.raises(FileNotFoundError) as info:
        resolve_model(str(missing))
    message = str(info.value)
    assert str(missing) in message
    assert "HF model directory" in message and ".gguf" in message


def test_resolve_model_nonexistent_root():
    with pytest.raises(FileNotFoundError, match=r"pass an HF model directory or a \.gguf"):
        resolve_model("/nonexistent")


def test_resolve_model_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))


def test_resolve_model_accepts_hf_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


# -- GGUF conversion of tiny models of each supported family --------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 2, 1, 32, 128
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _trained_bpe(byte_level: bool) -> tuple[list[str], list[str]]:
    """(tokens by id, merges) of a small BPE trained on the test text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    if byte_level:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=500, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train([str(TEXT)], trainer)
    model = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens, merges


def _add_byte_level_vocab(writer, arch: str, variant: dict | None = None) -> int:
    """A gpt2-style vocabulary (Qwen, Llama 3): byte-level tokens, merges, control tokens;
    `variant` may give its "chat_template", its "user_defined" tokens (not special) and
    more "control" tokens (special, after the usual three)."""
    variant = variant or {}
    tokens, merges = _trained_bpe(byte_level=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *variant.get("control", ())]
    user_defined = list(variant.get("user_defined", ("<think>",)))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe" if arch == "llama" else "qwen2")
    writer.add_token_list(tokens + specials + user_defined)
    writer.add_token_types([1] * len(tokens) + [3] * len(specials) + [4] * len(user_defined))
    writer.add_token_merges(merges)
    writer.add_eos_token_id(len(tokens) + 2)
    writer.add_pad_token_id(len(tokens))
    if arch == "llama":
        writer.add_bos_token_id(len(tokens) + 1)
        writer.add_add_bos_token(True)
    else:
        writer.add_add_bos_token(False)
    writer.add_chat_template(variant.get("chat_template", CHAT_TEMPLATE))
    return len(tokens) + len(specials) + len(user_defined)


# Gemma vocabularies that differ from the usual one where the converter's own Gemma path
# must do what transformers does, or leave the file to transformers (see GEMMA_VARIANTS).
GEMMA_VARIANTS = {
    "usual": {},
    "chat template, EOS added, no BOS": {"chat_template": CHAT_TEMPLATE, "add_eos": True, "add_bos": False},
    "BOS a plain piece, user-defined tokens": {"bos": "\u2581the", "user_defined": ("<b>", "[multimodal]")},
    "no pad token": {"pad": None},
    "no <mask> in the vocabulary": {"drop": "<mask>"},
    "a control token of spaces": {"control": "  "},
}


def _add_sentencepiece_vocab(writer, arch: str, variant: dict | None = None) -> int:
    """A sentencepiece-style vocabulary (Llama 2, Gemma): byte tokens, scored pieces, no
    merges; a Gemma one as `variant` (a GEMMA_VARIANTS value) says."""
    variant = variant or {}
    pieces, _ = _trained_bpe(byte_level=False)
    if arch == "gemma3":
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>",
                    *variant.get("user_defined", ())]
        special_types = [3, 3, 3, 2, 4, 3, 3] + [4] * len(variant.get("user_defined", ()))
        if "drop" in variant:
            del special_types[specials.index(variant["drop"])]
            specials.remove(variant["drop"])
        pieces = ["\n", "  ", "   "] + pieces
    else:
        specials, special_types = ["<unk>", "<s>", "</s>"], [2, 3, 3]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = specials + byte_tokens + pieces
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    types = special_types + [6] * 256 + [1] * len(pieces)
    if "control" in variant:
        types[tokens.index(variant["control"])] = 3
    writer.add_token_types(types)
    writer.add_token_scores([0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))])
    ids = {t: i for i, t in enumerate(tokens)}
    writer.add_bos_token_id(ids[variant.get("bos", "<bos>") if arch == "gemma3" else "<s>"])
    writer.add_eos_token_id(ids["<eos>" if arch == "gemma3" else "</s>"])
    writer.add_unk_token_id(ids["<unk>"])
    if arch == "gemma3":
        if variant.get("pad", "<pad>") is not None:
            writer.add_pad_token_id(ids["<pad>"])
        writer.add_add_bos_token(variant.get("add_bos", True))
        if "add_eos" in variant:
            writer.add_add_eos_token(variant["add_eos"])
        if "chat_template" in variant:
            writer.add_chat_template(variant["chat_template"])
    return len(tokens)


def _layer_tensors(arch: str) -> dict[str, tuple[int, ...]]:
    shapes = {"attn_q.weight": (HEADS * HEAD_DIM, HIDDEN), "attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
              "ffn_gate.weight": (FFN, HIDDEN), "ffn_up.weight": (FFN, HIDDEN), "ffn_down.weight": (HIDDEN, FFN),
              "attn_norm.weight": (HIDDEN,), "ffn_norm.weight": (HIDDEN,)}
    if arch == "qwen2":
        shapes.update({"attn_q.bias": (HEADS * HEAD_DIM,), "attn_k.bias": (KV_HEADS * HEAD_DIM,),
                       "attn_v.bias": (KV_HEADS * HEAD_DIM,)})
    if arch in ("qwen3", "gemma3"):
        shapes.update({"attn_q_norm.weight": (HEAD_DIM,), "attn_k_norm.weight": (HEAD_DIM,)})
    if arch == "gemma3":
        shapes.update({"post_attention_norm.weight": (HIDDEN,), "post_ffw_norm.weight": (HIDDEN,)})
    return shapes


def write_tiny_gguf(path: Path, arch: str, vocab: str, variant: dict | None = None) -> Path:
    """A one-layer `arch` model with a `vocab` ("gpt2" or "llama") vocabulary (as `variant`
    says: see _add_byte_level_vocab, GEMMA_VARIANTS; its "context_length", 256 unless it
    says); the token embedding is Q8_0, the output F16, the rest F32."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length((variant or {}).get("context_length", 256))
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(1)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if arch != "llama":
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
    if arch == "gemma3":
        writer.add_sliding_window(128)
    if vocab == "gpt2":
        n_vocab = _add_byte_level_vocab(writer, arch, variant)
    else:
        n_vocab = _add_sentencepiece_vocab(writer, arch, variant)
    rng = np.random.default_rng(len(arch))
    embedding = rng.standard_normal((n_vocab, HIDDEN)).astype(np.float32)
    writer.add_tensor("token_embd.weight", gguf.quantize(embedding, gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", rng.standard_normal(HIDDEN).astype(np.float32))
    if arch != "gemma3":
        writer.add_tensor("output.weight", rng.standard_normal((n_vocab, HIDDEN)).astype(np.float16))
    for name, shape in _layer_tensors(arch).items():
        writer.add_tensor(f"blk.0.{name}", rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


FAMILIES = [("llama", "llama"), ("llama", "gpt2"), ("qwen2", "gpt2"), ("qwen3", "gpt2"), ("gemma3", "llama")]


@pytest.mark.parametrize("arch, vocab", FAMILIES)
def test_convert_gguf_tokenizer_is_what_transformers_builds(tmp_path, arch, vocab):
    """The tokenizer files convert_gguf writes from its own parse of the file are the ones
    transformers writes when it reads the file itself."""
    from transformers import AutoTokenizer

    path = write_tiny_gguf(tmp_path / "src" / "tiny.gguf", arch, vocab)
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(path, out)
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if (arch, vocab) == ("llama", "gpt2"):  # llama-bpe: Llama 3's BPE ignores merges, as llama.cpp's does
        reference.backend_tokenizer.model.ignore_merges = True
    reference.save_pretrained(str(tmp_path / "ref"))
    _assert_same_tokenizer_files(out, tmp_path / "ref")


def _assert_same_tokenizer_files(out: Path, reference: Path) -> None:
    """Every tokenizer file of a conversion (all but config.json and the weights) is the
    reference's, byte for byte, and there are no others."""
    written = sorted(f.name for f in out.iterdir() if f.name != "config.json" and f.suffix != ".safetensors")
    assert written == sorted(f.name for f in reference.iterdir())
    for name in written:
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name


@pytest.mark.parametrize("variant", GEMMA_VARIANTS)
def test_gemma_tokenizer_written_directly_is_what_transformers_writes(tmp_path, monkeypatch, variant):
    """The tokenizer files of a Gemma vocabulary, written without transformers where the
    converter can (the usual files) and by transformers where it declines, are the ones
    transformers writes when it reads the file itself."""
    from transformers import AutoTokenizer

    from gristmill.model.loader import gguf_tokenizer
    from gristmill.gguf_file import GGUFFile

    path = write_tiny_gguf(tmp_path / "src" / "tiny.gguf", "gemma3", "llama", GEMMA_VARIANTS[variant])
    written = []
    direct = gguf_tokenizer.write_gemma_tokenizer
    monkeypatch.setattr(gguf_tokenizer, "write_gemma_tokenizer",
                        lambda *args: written.append(direct(*args)) or written[-1])
    out = tmp_path / "out"
    out.mkdir()
    gguf_tokenizer.convert_gguf_tokenizer(GGUFFile(path).fields, "gemma3_text", out, path)
    assert written == [variant not in ("no pad token", "no <mask> in the vocabulary", "a control token of spaces")]
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(str(tmp_path / "ref"))
    _assert_same_tokenizer_files(out, tmp_path / "ref")


def test_gguf_tokenizer_mapping_is_transformers():
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING
    from transformers.integrations.gguf import gguf_tokenizer_mapping as mapping

    from gristmill.model.loader import gguf_tokenizer

    assert gguf_tokenizer.GGUF_TOKENIZER_MAPPING == GGUF_TOKENIZER_MAPPING
    builders = mapping.GGUF_SENTENCEPIECE_BUILDERS
    gemma = {arch for arch, builder in builders.items() if builder is mapping.gemma_tokenizer}
    assert set(gguf_tokenizer.GEMMA_ARCHITECTURES) == gemma


@pytest.mark.parametrize("arch, vocab", FAMILIES)
def test_convert_gguf_config_and_weights(tmp_path, arch, vocab):
    import gguf
    from safetensors.numpy import load_file

    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch, vocab)
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(path, out)
    config = json.loads((out / "config.json").read_text())
    n_vocab = len(gguf.GGUFReader(str(path)).get_field("tokenizer.ggml.tokens").data)
    assert config["model_type"] == {"gemma3": "gemma3_text"}.get(arch, arch)
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (n_vocab, HIDDEN, 1)
    assert config["rms_norm_eps"] == float(np.float32(1e-6))
    assert config["tie_word_embeddings"] == (arch == "gemma3")
    weights = load_file(str(out / "model.safetensors"))  # an HF checkpoint: float32 throughout
    assert weights["model.embed_tokens.weight"].shape == (n_vocab, HIDDEN)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (HIDDEN, FFN)
    assert all(w.dtype == np.float32 for w in weights.values())
    # The Q8_0 embedding is gguf's dequantization of it, exactly.
    reader = gguf.GGUFReader(str(path))
    blocks = next(t for t in reader.tensors if t.name == "token_embd.weight")
    assert np.array_equal(gguf.dequantize(blocks.data, blocks.tensor_type), weights["model.embed_tokens.weight"])
    if arch == "qwen2":
        assert weights["model.layers.0.self_attn.q_proj.bias"].shape == (HEADS * HEAD_DIM,)


def test_gguf_special_token_id_out_of_range_is_a_value_error():
    from gristmill.model.loader.gguf_tokenizer import gguf_tokenizer_settings

    with pytest.raises(ValueError, match="bos_token_id 5 is not a token id"):
        gguf_tokenizer_settings({"tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.bos_token_id": 5})


def test_convert_gguf_without_vocabulary_is_a_value_error(tmp_path):
    import gguf

    path = tmp_path / "novocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_embedding_length(HIDDEN)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="no tokenizer.ggml.tokens"):
        convert_gguf(path, tmp_path)


def dequantize_q8_0(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(rows, cols) int8 values and (rows, cols / 32) fp16 scales -> float32 (rows, cols),
    as llama.cpp dequantizes Q8_0: value x scale."""
    rows, cols = values.shape
    return (values.view(rows, cols // 32, 32).float() * scales.float()[:, :, None]).view(rows, cols)


# -- config.json read as JSON: the fields transformers' config classes give ----------------

_LLAMA3_1B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16",
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}}
_GEMMA3_270M = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144,
    "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "query_pre_attn_scalar": 256,
    "sliding_window": 512, "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 3,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None,
    "final_logit_softcapping": None, "attn_logit_softcapping": None, "tie_word_embeddings": True,
    "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "torch_dtype": "bfloat16"}
# Gemma 3 4B's text half as its multimodal config.json has it (no layer_types, the older keys).
_GEMMA3_4B_TEXT = {
    "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
    "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "query_pre_attn_scalar": 256}

CONFIGS = {
    # Each family with every optional field left out: the class defaults.
    "llama-bare": {"model_type": "llama"},
    "qwen2-bare": {"model_type": "qwen2"},
    "qwen3-bare": {"model_type": "qwen3"},
    "gemma3_text-bare": {"model_type": "gemma3_text"},
    "gemma3-bare": {"model_type": "gemma3"},
    # Shapes given, the rest left out: head_dim = hidden / heads, kv heads = heads, ...
    "llama2-7b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                  "vocab_size": 32000, "rope_scaling": None},
    "llama3.2-1b": _LLAMA3_1B,
    "llama3-no-original-length": {**_LLAMA3_1B, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
    "llama-old-linear": {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                         "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 20000.0},
    "llama-rope-parameters": {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "attention_bias": True, "mlp_bias": True,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 1234.0}},
    "qwen2.5-0.5b": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
                     "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                     "num_key_value_heads": 2, "max_position_embeddings": 32768, "max_window_layers": 21,
                     "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 32768,
                     "use_sliding_window": False, "tie_word_embeddings": True, "vocab_size": 151936,
                     "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu"},
    "qwen3-0.6b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
                   "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu",
                   "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
                   "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": True,
                   "bos_token_id": 151643, "eos_token_id": 151645},
    "qwen3-no-head-dim": {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4},
    "gemma3-270m": _GEMMA3_270M,
    "gemma3-270m-no-layer-types": {k: v for k, v in _GEMMA3_270M.items()
                                   if k not in ("layer_types", "rope_theta", "rope_local_base_freq",
                                                "query_pre_attn_scalar", "head_dim")},
    "gemma3-4b-multimodal": {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
                             "text_config": _GEMMA3_4B_TEXT, "eos_token_id": [1, 106]},
    "gemma3-pattern-4": {**_GEMMA3_4B_TEXT, "num_hidden_layers": 9, "sliding_window_pattern": 4,
                         "tie_word_embeddings": False, "final_logit_softcapping": 30.0},
    "gemma3-rope-parameters": {"model_type": "gemma3_text", "num_hidden_layers": 3, "layer_types": [
        "sliding_attention", "full_attention", "sliding_attention"], "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}}},
    "gemma3-bidirectional": {**_GEMMA3_270M, "use_bidirectional_attention": True},
    "bert-bare": {"model_type": "bert"},
    "all-minilm-l6-v2": {"architectures": ["BertModel"], "model_type": "bert", "hidden_act": "gelu",
                         "hidden_size": 384, "intermediate_size": 1536, "layer_norm_eps": 1e-12,
                         "max_position_embeddings": 512, "num_attention_heads": 12, "num_hidden_layers": 6,
                         "pad_token_id": 0, "position_embedding_type": "absolute", "type_vocab_size": 2,
                         "vocab_size": 30522},
    "bert-classifier": {"architectures": ["BertForSequenceClassification"], "model_type": "bert",
                        "hidden_size": 64, "num_attention_heads": 4, "type_vocab_size": 1,
                        "id2label": {"0": "negative", "1": "neutral", "2": "positive"},
                        "label2id": {"negative": 0, "neutral": 1, "positive": 2}},
    "bert-num-labels": {"model_type": "bert", "num_labels": 5},
}


def _transformers_config(raw: dict, tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = transformers.AutoConfig.from_pretrained(str(tmp_path))
    return config.text_config if config.model_type == "gemma3" else config


def _assert_fields_are_transformers(ours, theirs, raw: dict) -> None:
    """Every ModelConfig field is what transformers' config gives (where it has no such
    attribute: what the model classes took in its place). `raw`: the config.json."""
    import dataclasses

    gemma, bert = ours.model_type == "gemma3_text", ours.model_type == "bert"
    names_labels = "id2label" in raw or "num_labels" in raw  # (transformers names two when the file does not)
    expected = {
        "model_type": theirs.model_type,
        "head_dim": getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads,
        "hidden_act": theirs.hidden_activation if gemma else theirs.hidden_act,
        "attention_bias": getattr(theirs, "attention_bias", False),
        "mlp_bias": getattr(theirs, "mlp_bias", False),
        "layer_types": tuple(theirs.layer_types) if gemma else None,
        **{name: getattr(theirs, name) if gemma else None
           for name in ("query_pre_attn_scalar", "sliding_window", "final_logit_softcapping")},
        **{name: getattr(theirs, name) if bert else None for name in ("type_vocab_size", "layer_norm_eps")},
        "architectures": tuple(theirs.architectures or ()),
        "bidirectional": bool(getattr(theirs, "use_bidirectional_attention", False)) if gemma else False,
        "id2label": theirs.id2label if names_labels else None,
    }
    if bert:  # no rotary, no RMSNorm, no LM head (BertConfig's tie_word_embeddings is BertForMaskedLM's)
        expected.update(num_key_value_heads=theirs.num_attention_heads, rms_norm_eps=None,
                        rope_parameters=None, tie_word_embeddings=False)
    assert ours.num_labels == theirs.num_labels
    for f in dataclasses.fields(ours):
        want = expected[f.name] if f.name in expected else getattr(theirs, f.name)
        assert getattr(ours, f.name) == want, f.name
        assert type(getattr(ours, f.name)) is type(want) or want is None, f.name


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_fields_are_what_transformers_gives(name, tmp_path):
    from gristmill.model.loader import load_config

    raw = CONFIGS[name]
    theirs = _transformers_config(raw, tmp_path)
    ours = load_config(tmp_path)
    _assert_fields_are_transformers(ours, theirs, raw)
    assert ours.hidden_activation == ours.hidden_act


@pytest.mark.parametrize("arch, vocab", [("llama", "llama"), ("qwen3", "gpt2"), ("gemma3", "llama")])
def test_converted_gguf_config_fields_are_what_transformers_gives(tmp_path, arch, vocab):
    from gristmill.model.loader import load_config

    path = write_tiny_gguf(tmp_path / "tiny.gguf", arch, vocab)
    out = tmp_path / "out"
    out.mkdir()
    convert_gguf(path, out)
    raw = json.loads((out / "config.json").read_text())
    _assert_fields_are_transformers(load_config(out), _transformers_config(raw, tmp_path), raw)


def _gemma3_config_of(path: Path, layers: int, hidden: int, heads: int, head_dim: int, keys: dict) -> dict:
    """model_config of a Gemma 3 GGUF holding only metadata: these sizes and `keys` (with
    their "gemma3." prefix left out) besides."""
    import gguf

    from gristmill.gguf_file import GGUFFile
    from gristmill.model.loader.gguf_model import model_config

    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(layers)
    writer.add_embedding_length(hidden)
    writer.add_head_count(heads)
    writer.add_key_length(head_dim)
    writer.add_token_list(["<pad>", "<eos>", "<bos>", "<unk>", "<end_of_turn>"])
    writer.add_eos_token_id(1)
    for key, value in keys.items():
        add = writer.add_array if isinstance(value, list) else writer.add_float32 if isinstance(value, float) \
            else writer.add_uint32
        add(f"gemma3.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model_config(GGUFFile(path))[1]


SLIDES, GLOBAL = "sliding_attention", "full_attention"


@pytest.mark.parametrize("keys, layer_types", [
    ({"attention.sliding_window": 512}, [SLIDES] * 5 + [GLOBAL] + [SLIDES] * 2),  # (what the converter writes)
    ({"attention.sliding_window": 512, "attention.sliding_window_pattern": 2}, [SLIDES, GLOBAL] * 4),
    ({"attention.sliding_window": 512, "attention.sliding_window_pattern": [True, False] * 3 + [False, True]},
     [SLIDES, GLOBAL] * 3 + [GLOBAL, SLIDES]),
    ({}, [GLOBAL] * 8),  # no window: every layer global
])
def test_gemma3_layers_slide_as_llama_cpp_reads_the_file(tmp_path, keys, layer_types):
    config = _gemma3_config_of(tmp_path / "g.gguf", 8, 64, 4, 16, keys)
    assert config["layer_types"] == layer_types


def test_gemma3_attention_scale_rope_and_softcap_are_what_llama_cpp_reads(tmp_path):
    # The 27B (62 layers) scales attention by hidden / heads (its config's 168), not its head_dim.
    assert _gemma3_config_of(tmp_path / "27b.gguf", 62, 5376, 32, 128, {})["query_pre_attn_scalar"] == 168
    config = _gemma3_config_of(tmp_path / "1b.gguf", 26, 1152, 4, 256, {
        "rope.freq_base": 2e6, "rope.freq_base_swa": 2e4, "rope.scaling.factor": 8.0,
        "final_logit_softcapping": 30.0})
    assert config["query_pre_attn_scalar"] == 256
    assert config["rope_parameters"] == {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 2e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}
    assert config["final_logit_softcapping"] == 30.0
    assert config["eos_token_id"] == [1, 4]  # (<end_of_turn> ends generation too, as llama.cpp has it)


def test_config_reading_imports_neither_torch_nor_transformers(tmp_path):
    import subprocess
    import sys

    (tmp_path / "config.json").write_text(json.dumps(_GEMMA3_270M))
    code = ("import sys; from gristmill.model.loader.config import load_config; "
            f"c = load_config({str(tmp_path)!r}); assert c.num_hidden_layers == 18; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).parents[2])
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("raw, error", [
    ({"model_type": "mistral"}, "model type 'mistral'.*not supported"),
    ({"model_type": "bert", "position_embedding_type": "relative_key"},
     "position_embedding_type 'relative_key' is not supported"),
    ([1, 2], "not a JSON object"),
])
def test_config_of_an_unsupported_model_is_a_value_error(tmp_path, raw, error):
    from gristmill.model.loader import load_config

    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=error):
        load_config(tmp_path)


# -- the conversion's faster pieces give what the slower ones gave --------------------------

@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "F16", "F32"])
def test_dequantize_is_gguf_dequantize_bit_for_bit(type_name):
    import gguf

    from gristmill.model.loader import _dequantize

    tensor_type = gguf.GGMLQuantizationType[type_name]
    block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
    rng = np.random.default_rng(7)
    rows, cols = 37, 2 * 256 if block_size == 256 else 3 * 32
    raw = rng.integers(0, 256, size=rows * cols // block_size * type_size, dtype=np.uint8)
    data = raw.view({"F16": np.float16, "F32": np.float32}.get(type_name, np.uint8)).reshape(rows, -1)
    with np.errstate(all="ignore"):  # (random bytes: some scales are inf or nan, alike in both)
        expected = gguf.dequantize(data, tensor_type).reshape(-1)
        got = _dequantize(data, tensor_type, chunk_blocks=5)  # several chunks, the last one short
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert got.view(np.uint32).tobytes() == expected.astype(np.float32).view(np.uint32).tobytes()


def _sentencepiece_like_vocab() -> list[str]:
    pieces, _ = _trained_bpe(byte_level=False)
    # duplicates, a run of spaces and a piece holding no split make ties and edge cases
    return ["<pad>", "<eos>", "\u2581\u2581", "a", "b", "ab", "ba", "aba", "abab", "x"] + pieces + ["ab", "a"]


@pytest.mark.parametrize("scoring", ["file order", "scores with ties"])
def test_derive_merges_is_generate_merges(scoring):
    from transformers.tokenization_utils_base import generate_merges

    from gristmill.model.loader.gguf_tokenizer import derive_merges

    tokens = _sentencepiece_like_vocab()
    vocab = {token: index for index, token in enumerate(tokens)}
    if scoring == "file order":  # Gemma's
        scores = {token: -index for index, token in enumerate(tokens)}
    else:  # Llama 2's: the file's scores, here with many equal
        scores = dict(zip(tokens, [float(-(i // 7)) for i in range(len(tokens))]))
    expected = generate_merges(vocab, scores)
    assert len(expected) > 100
    assert derive_merges(vocab, scores) == expected


def test_derive_merges_declines_what_it_cannot_pass_on():
    from gristmill.model.loader.gguf_tokenizer import derive_merges

    vocab = {"a": 0, " b": 1, "a b": 2}  # a piece with a space cannot be written "left right"
    assert derive_merges(vocab, {t: -i for t, i in vocab.items()}) is None
    assert derive_merges({"a": 0, "b": 1}, {"b": 0.0, "a": 1.0}) is None  # not the vocabulary's order


def test_tokenizer_classes_are_what_auto_tokenizer_picks():
    from transformers import TokenizersBackend
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    from gristmill.model.loader import _GGUF_MODEL_TYPES
    from gristmill.model.loader.gguf_tokenizer import TOKENIZER_CLASSES, _tokenizer_class

    assert sorted(TOKENIZER_CLASSES) == sorted(_GGUF_MODEL_TYPES.values())
    for model_type in TOKENIZER_CLASSES:
        assert _tokenizer_class(model_type) is (TOKENIZER_MAPPING.get(CONFIG_MAPPING[model_type], None)
                                                or TokenizersBackend), model_type


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}])
def test_streamed_safetensors_are_what_save_file_writes(tmp_path, metadata):
    from safetensors.numpy import save_file

    from gristmill.model.loader.safetensors_io import TensorSource, write_safetensors

    rng = np.random.default_rng(3)
    arrays = {"b.weight": rng.standard_normal((7, 5)).astype(np.float32),
              "a.weight.q8_0": rng.integers(-128, 128, (7, 64), dtype=np.int8),
              "a.weight.q8_0_scale": rng.standard_normal((7, 2)).astype(np.float16),
              "a.weight": rng.standard_normal((3,)).astype(np.float32),
              "model.layers.10.x": np.zeros((0, 4), dtype=np.float32),
              "model.layers.2.x": rng.standard_normal((2, 3)).astype(np.float32)}
    save_file(arrays, str(tmp_path / "reference.safetensors"), metadata=metadata)
    # Each tensor in pieces of two rows, in another order than the file's.
    sources = [TensorSource(name, array.dtype, array.shape,
                            lambda a=array: (np.ascontiguousarray(a[i:i + 2]) for i in range(0, max(len(a), 1), 2)))
               for name, array in reversed(arrays.items())]
    write_safetensors(tmp_path / "streamed.safetensors", sources, metadata=metadata)
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    with pytest.raises(ValueError, match="bytes more than its shape"):
        write_safetensors(tmp_path / "short.safetensors",
                          [TensorSource("x", np.float32, (4,), lambda: [np.zeros(3, np.float32)])])


def test_safetensors_reader_reads_what_safetensors_reads_and_refuses_a_cut_file(tmp_path):
    from safetensors.torch import load_file, save_file

    from gristmill.model.loader.safetensors_io import SafetensorsReader

    tensors = {"w": torch.randn(5, 7), "q": torch.randint(-128, 127, (3, 64), dtype=torch.int8),
               "s": torch.randn(3, 2).to(torch.bfloat16), "h": torch.randn(4).half(),
               "empty": torch.zeros(0, 3), "flag": torch.tensor([True, False])}
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    expected = load_file(str(path))
    with SafetensorsReader(path) as reader:
        assert sorted(reader.keys()) == sorted(tensors)
        for name in tensors:
            got = reader.read(name)
            assert got.dtype == expected[name].dtype and torch.equal(got, expected[name]), name
    data = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:len(data) - 3])
    with pytest.raises(ValueError, match="does not fit the file"):
        SafetensorsReader(tmp_path / "cut.safetensors")
    (tmp_path / "header.safetensors").write_bytes(data[:20])
    with pytest.raises(ValueError, match="not a whole safetensors file"):
        SafetensorsReader(tmp_path / "header.safetensors")
