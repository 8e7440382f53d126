"""Tiny random-weight base models and LoRA adapters made by `peft`, as users bring them:
a decoder directory (llama, qwen3, gemma3; all-MiniLM-L6-v2's tokenizer) and PEFT adapter
directories saved with `save_pretrained`, with `peft`'s own model as the reference."""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path

from tests.pooling_models import _decoder_config, _root, with_tokenizer

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@cache
def tiny_base(family: str) -> Path:
    """A `family` ("llama", "qwen3", "gemma3") causal LM directory whose weights are large
    enough that every layer, and every adapter, moves the logits."""
    import torch
    import transformers

    config = _decoder_config(family, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2:  # (out, in) matrices and the embedding: unit-scale activations
                param.copy_(torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[1]))
    path = _root() / f"lora-base-{family}"
    model.save_pretrained(path)
    return with_tokenizer(path)


def make_adapter(base: Path, name: str, seed: int, r: int = 8, lora_alpha: float = 16,
                 targets: tuple[str, ...] = ALL_TARGETS, use_rslora: bool = False) -> Path:
    """A PEFT LoRA adapter of random A and B (not PEFT's zero B: an adapter that changes
    the output) over `base`, saved as a user's training run saves it."""
    path = _root() / f"adapter-{base.name}-{name}"
    if path.exists():
        return path
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(targets), use_rslora=use_rslora,
                             init_lora_weights=False)
    peft.get_peft_model(model, config).save_pretrained(path)
    return path


def peft_model(base: Path, adapter: Path | None):
    """`peft`'s own model of `adapter` over `base` (the base alone for None), in float32."""
    import peft
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    if adapter is None:
        return model.eval()
    return peft.PeftModel.from_pretrained(model, adapter).eval()


def broken_adapter(adapter: Path, directory: Path) -> Path:
    """An adapter in `directory` whose config is `adapter`'s (it reads well) and whose
    weights are not safetensors: it fails when an engine loads it, not before."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    (directory / "adapter_model.safetensors").write_bytes(b"not safetensors")
    return directory
