"""EngineConfig: every knob of the engine, documented and validated."""

from __future__ import annotations

import os
import random
from dataclasses import Field, dataclass, field, fields, replace

from gristmill.chat.reasoning import REASONING_PARSERS, check_reasoning_parser_name
from gristmill.chat.tool_calls import NO_PARSER, TOOL_PARSERS, get_tool_parser
from gristmill.errors import RequestError
from gristmill.pooling_params import TASKS


def _field(default, doc: str):
    """A field with its documentation in `metadata["help"]`, where code can read it: the
    command line builds one documented flag per field from it."""
    return field(default=default, metadata={"help": doc})


def field_doc(config_field: Field) -> str:
    """The documentation of an `EngineConfig` field, as `fields(EngineConfig)` gives it."""
    return config_field.metadata["help"]


@dataclass(slots=True)
class EngineConfig:
    """Configuration of one engine. Invalid values raise `RequestError` naming the field.

    Each field's documentation is in its metadata (read it with `field_doc`).
    """

    model: str | None = _field(None, "HF model directory or GGUF file; None = the bundled Gemma 3 270M.")
    task: str = _field(
        "auto", 'What the engine does with its model: "generate" (text), "embed" (a vector per prompt), '
                '"classify" (label probabilities) or "score" (the relevance of text pairs, by a cross-encoder '
                'or the cosine of two embeddings); "auto" = from the model (a *ForSequenceClassification: '
                "classify, or score with one label; an encoder or a sentence-transformers model: embed; else "
                "generate). With model None, embed and score use the bundled all-MiniLM-L6-v2.")
    max_model_len: int | None = _field(None, "Longest prompt + output, in tokens; None = the model's own limit.")
    block_size: int = _field(16, "Tokens per KV cache block.")
    kv_cache_memory_gb: float | None = _field(
        None, "Memory given to the KV cache, in GiB; ignored when num_kv_blocks is set. None = 1 GiB on "
              "CPU; on CUDA, what gpu_memory_utilization leaves after the weights and activations.")
    gpu_memory_utilization: float = _field(
        0.9, "Fraction of the GPU's memory the engine may use, weights included; the KV cache gets what "
             "is left of it (CUDA only, when kv_cache_memory_gb and num_kv_blocks are unset).")
    num_kv_blocks: int | None = _field(None, "Exact number of KV cache blocks (overrides kv_cache_memory_gb).")
    max_num_batched_tokens: int | None = _field(
        None, "Most tokens (prefill chunks + decodes) computed in one engine step. None = 2048 on "
              "CPU, 8192 on CUDA (and at least max_num_seqs).")
    max_num_seqs: int | None = _field(
        None, "Most requests running at once. None = 128 on CPU, 256 on CUDA (at most "
              "max_num_batched_tokens).")
    enable_prefix_caching: bool = _field(
        True, "Reuse the KV cache blocks of a prompt prefix an earlier request computed (full "
              "blocks only); cached blocks nobody uses are evicted least recently used first.")
    device: str = _field("auto", '"auto" (CUDA when available, else CPU), "cpu" or "cuda[:N]".')
    dtype: str = _field(
        "auto", '"auto" (bfloat16 on CUDA, float32 on CPU), "float32", "bfloat16" or "float16".')
    kv_cache_dtype: str = _field(
        "auto", '"auto" (the model\'s dtype), "float32", "bfloat16" or "float16": what the KV cache holds. '
                "On CPU, float16 or bfloat16 hold twice the tokens in the same memory and a decode step "
                "reads half the bytes; keys and values are rounded to it as they are written. On CUDA: "
                '"auto" or the model\'s dtype.')
    quantization: str | None = _field(
        "auto", '"auto" (int8 on CPU, float on CUDA; an encoder such as BERT quantizes its activations '
                "to 7 bits, which the AVX2 kernel multiplies faster: docs/performance.md), "
                '"int8" (every linear layer, the LM head '
                "included, in int8: weights and each token's activations in blocks of 32 channels), "
                '"q4" (4-bit weights, the LM head int8: fewer bytes a step, more quality lost, see '
                'docs/performance.md) or None / "none" (the exact float path).')
    load_format: str = _field(
        "auto", '"auto" (the weights of the checkpoint) or "dummy" (random weights made on the device, '
                "no weight file read: for benchmarks of a model's shape from its config.json alone).")
    enforce_eager: bool = _field(
        False, "CUDA: run every step eagerly instead of replaying decode steps from CUDA graphs "
               "(captured at start for batch sizes up to max_num_seqs).")
    async_scheduling: bool | None = _field(
        None, "Schedule and launch each step before the previous one's tokens reach the host, so "
              "the host's work overlaps the device's (a request that stops on EOS computes one "
              "extra token, dropped). None = on with CUDA, off on CPU, where it cannot overlap.")
    structured_output_backend: str = _field(
        "llguidance", 'Grammar engine of structured output: "llguidance" (the default) or "xgrammar" '
                      "(pip install xgrammar; see docs/structured_output.md).")
    fast_forward: bool = _field(
        True, "Structured output: text the grammar forces (a JSON key, a call's name and markers) "
              "is appended without sampling, as the tokenizer spells it, and computed in the next "
              "step with the token sampled before it (llguidance's fast-forward tokens; not for "
              "requests with logprobs or logits controls). False = every token sampled under "
              "the mask.")
    reasoning_parser: str | None = _field(
        None, "How a chat's reasoning (the text between <think> and </think>) is kept apart from its "
              f"answer: {', '.join(map(repr, REASONING_PARSERS))}; None = chosen from the model's chat "
              "template (one that writes <think>: 'qwen3' when it has enable_thinking, else "
              "'deepseek_r1'; no split for other models); 'none' = no split, whatever the template.")
    tool_call_parser: str | None = _field(
        None, "How a chat's tool calls are read from its answer: "
              f"{', '.join(map(repr, TOOL_PARSERS))}; None = chosen from the model's chat template "
              "('hermes' when it writes <tool_call>, 'pythonic' for Llama 3.2 / 4's pythonic "
              "instruction, 'llama3_json' for <|python_tag|>; none for other models: a request "
              "with tools is then refused); 'none' = no tool calls, whatever the template.")
    enable_lora: bool = _field(
        False, "Serve LoRA adapters over the model: requests name one with a LoRARequest "
               "(docs/lora.md); each step runs the base matmuls once for all rows and each "
               "adapter's low-rank update on its own rows.")
    max_loras: int = _field(
        1, "With enable_lora: most adapters held at once (slots); a step's rows use at most this many "
           "distinct adapters, others wait, and the least recently used idle adapter makes room.")
    max_lora_rank: int = _field(
        16, "With enable_lora: the highest adapter rank accepted (each slot is sized for it).")
    seed: int | None = _field(
        0, "Seed of the engine's random stream, used by requests without a seed of their own; "
           "None = a random one.")
    cpu_threads: int | None = _field(
        None, "Threads the CPU kernels and torch's CPU ops run on, as llama.cpp's --threads; None = "
              "torch's choice (OMP_NUM_THREADS where set, else one a physical core). Set in the process "
              "that runs the engine core: with an in-process LLM, the caller's.")
    cache_dir: str | None = _field(
        None, "Where converted GGUF models and int8 weights are cached; None = ~/.cache/gristmill.")
    max_waiting_requests: int | None = _field(
        None, "Most requests waiting to be scheduled; past it new requests get "
              "EngineOverloadedError. None = unbounded.")
    step_timeout_s: float = _field(
        60.0, "A step of the engine-core process that runs longer than this is a hang: the "
              "core is killed and every request fails with EngineDeadError.")
    start_timeout_s: float = _field(
        600.0, "Longest wait for the engine-core process to load the model and report ready.")

    def __post_init__(self):
        def check(ok: bool, name: str, message: str):
            if not ok:
                raise RequestError(f"EngineConfig.{name}: {message}", param=name)

        check(self.model is None or isinstance(self.model, (str, os.PathLike)), "model",
              f"must be a model directory or GGUF file path (a str), got {self.model!r}")
        if isinstance(self.model, os.PathLike):
            self.model = os.fspath(self.model)
        if type(self.device).__name__ == "device":  # a torch.device
            self.device = str(self.device)
        if self.seed is None:
            self.seed = random.randrange(2**63)
        check(_is_int(self.seed) and -2**63 <= self.seed < 2**64, "seed",
              f"must be an integer in [-2**63, 2**64) or None, got {self.seed!r}")
        check(isinstance(self.enforce_eager, bool), "enforce_eager", f"must be True or False, got {self.enforce_eager!r}")
        check(self.task in ("auto", *TASKS), "task",
              f"must be 'auto', 'generate', 'embed', 'classify' or 'score', got {self.task!r}")
        check(self.max_model_len is None or _positive_int(self.max_model_len), "max_model_len",
              f"must be a positive integer or None, got {self.max_model_len!r}")
        check(_positive_int(self.block_size) and self.block_size & (self.block_size - 1) == 0,
              "block_size", f"must be a positive power of two, got {self.block_size!r}")
        check(self.kv_cache_memory_gb is None or _positive_number(self.kv_cache_memory_gb),
              "kv_cache_memory_gb", f"must be > 0 or None, got {self.kv_cache_memory_gb!r}")
        check(_positive_number(self.gpu_memory_utilization) and self.gpu_memory_utilization <= 1,
              "gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}")
        check(self.num_kv_blocks is None or _positive_int(self.num_kv_blocks), "num_kv_blocks",
              f"must be a positive integer or None, got {self.num_kv_blocks!r}")
        check(self.max_num_seqs is None or _positive_int(self.max_num_seqs), "max_num_seqs",
              f"must be a positive integer or None, got {self.max_num_seqs!r}")
        check(self.max_num_batched_tokens is None or _positive_int(self.max_num_batched_tokens),
              "max_num_batched_tokens", f"must be a positive integer or None, got {self.max_num_batched_tokens!r}")
        check(None in (self.max_num_seqs, self.max_num_batched_tokens)
              or self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
              f"must be >= max_num_seqs ({self.max_num_seqs}) so every running request can "
              f"decode in one step, got {self.max_num_batched_tokens}; raise it or lower max_num_seqs")
        check(self.structured_output_backend in ("llguidance", "xgrammar"), "structured_output_backend",
              f"must be 'llguidance' or 'xgrammar', got {self.structured_output_backend!r}")
        check(self.async_scheduling in (None, True, False), "async_scheduling",
              f"must be True, False or None, got {self.async_scheduling!r}")
        check(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching",
              f"must be True or False, got {self.enable_prefix_caching!r}")
        check(isinstance(self.device, str) and (self.device in ("auto", "cpu") or self.device.startswith("cuda")),
              "device", f"must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
              f"must be 'auto', 'float32', 'bfloat16' or 'float16', got {self.dtype!r}")
        check(self.kv_cache_dtype in ("auto", "float32", "bfloat16", "float16"), "kv_cache_dtype",
              f"must be 'auto', 'float32', 'bfloat16' or 'float16', got {self.kv_cache_dtype!r}")
        check(self.load_format in ("auto", "dummy"), "load_format",
              f"must be 'auto' or 'dummy', got {self.load_format!r}")
        if isinstance(self.quantization, str) and self.quantization.lower() == "none":
            self.quantization = None
        check(self.quantization in (None, "auto", "int8", "q4"), "quantization",
              f"must be 'auto', 'int8', 'q4' or None ('none'), got {self.quantization!r}")
        try:
            check_reasoning_parser_name(self.reasoning_parser)
        except ValueError as exc:
            check(False, "reasoning_parser", f"{exc} (or None: from the chat template; 'none': no split)")
        if self.tool_call_parser not in (None, NO_PARSER):
            try:
                get_tool_parser(self.tool_call_parser)
            except (ValueError, TypeError) as exc:
                check(False, "tool_call_parser", f"{exc} (or None: from the chat template; 'none': no tool calls)")
        check(isinstance(self.enable_lora, bool), "enable_lora", f"must be True or False, got {self.enable_lora!r}")
        check(_positive_int(self.max_loras), "max_loras", f"must be a positive integer, got {self.max_loras!r}")
        check(_positive_int(self.max_lora_rank) and self.max_lora_rank <= 512, "max_lora_rank",
              f"must be an integer in [1, 512], got {self.max_lora_rank!r}")
        check(self.cpu_threads is None or _positive_int(self.cpu_threads), "cpu_threads",
              f"must be a positive integer or None (torch's choice), got {self.cpu_threads!r}")
        check(self.max_waiting_requests is None or _positive_int(self.max_waiting_requests),
              "max_waiting_requests", f"must be a positive integer or None, got {self.max_waiting_requests!r}")
        for name in ("step_timeout_s", "start_timeout_s"):
            value = getattr(self, name)
            check(_positive_number(value), name,
                  f"must be a number of seconds > 0, got {value!r}")

    def for_device(self, device_type: str) -> "EngineConfig":
        """This config with the limits left None set for a device of `device_type` ("cpu"
        or "cuda"): a GPU step is cheap on the host only when it is large (`STEP_LIMITS`).
        A limit given keeps the other within it."""
        if None not in (self.max_num_seqs, self.max_num_batched_tokens):
            return self
        seqs, tokens = STEP_LIMITS["cuda" if device_type == "cuda" else "cpu"]
        if self.max_num_seqs is not None:
            seqs, tokens = self.max_num_seqs, max(tokens, self.max_num_seqs)
        elif self.max_num_batched_tokens is not None:
            seqs, tokens = min(seqs, self.max_num_batched_tokens), self.max_num_batched_tokens
        return replace(self, max_num_seqs=seqs, max_num_batched_tokens=tokens)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from keyword arguments, rejecting unknown names with the list of valid ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise RequestError(f"unknown engine option(s) {unknown}; valid options: {sorted(known)}",
                               param=unknown[0])
        return cls(**kwargs)


#: (max_num_seqs, max_num_batched_tokens) where the config leaves them None. On CUDA a
#: decode step of 256 rows costs the host about what one of 128 does, and the H100
#: figures in docs/performance.md were measured at 256 rows.
STEP_LIMITS = {"cpu": (128, 2048), "cuda": (256, 8192)}


def _positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
