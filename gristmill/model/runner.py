"""ModelRunner: owns the model (loaded by model/loading.py) and the KV cache, turns a
SchedulerOutput into tokens.

At start it picks one backend (model/backends) from the device and dtype, and on CUDA
sizes the KV cache from `gpu_memory_utilization` and captures decode steps as CUDA
graphs (model/cuda/graphs.py). Each step: the scheduled tokens as one `HostStep`
(numpy), uploaded once, one forward, the LM head over the sampled rows, the logits
controls (model/logits.py), the structured-output masks (model/masking.py), the sampler."""

from __future__ import annotations

import logging
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gristmill import startup
from gristmill.config import EngineConfig
from gristmill.errors import RequestError
from gristmill.faults import InjectedFault
from gristmill.model.context import forward_context
from gristmill.model.layers import PagedAttention
from gristmill.model.loading import load_model, pick_device
from gristmill.model.logits import LogitsControls
from gristmill.model.lora import LoRAModel
from gristmill.model.masking import GrammarMasks
from gristmill.model.metadata import HostStep, StepMetadata, build_host_step
from gristmill.model.sampler import Sampler, SamplerRow
from gristmill.outputs import Logprob
from gristmill.step import ScheduledRequest, SchedulerOutput, StepTokens

logger = logging.getLogger(__name__)

def use_cpu_threads(threads: int | None) -> int:
    """Runs torch's CPU ops and the kernels on `threads` threads (None: as they are), and
    says at start when that is more than the CPUs this process may use (they would take
    turns on the cores, each waiting on the others at every matrix). Returns the count."""
    if threads is not None:
        torch.set_num_threads(threads)
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        if cpus and threads > cpus:
            startup.warn(f"cpu_threads={threads} is more than the {cpus} CPUs this process may run on: the "
                         f"threads take turns on them, which is slower; set cpu_threads={cpus} or fewer")
    return torch.get_num_threads()


@dataclass
class StepInputs:
    input_ids: torch.Tensor       # (num_tokens,)
    positions: torch.Tensor       # (num_tokens,)
    metadata: StepMetadata
    sample_indices: torch.Tensor  # (num_samples,) rows of the hidden states to sample from
    sample_items: list[ScheduledRequest]  # of each sampled row


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path | None = None):
        #: The threads the CPU kernels and torch's CPU ops run on (EngineConfig.cpu_threads).
        self.cpu_threads = use_cpu_threads(config.cpu_threads)
        self.device = pick_device(config.device)
        #: The config with the step limits it leaves None set for this device.
        self.config = config = config.for_device(self.device.type)
        if self.device.type == "cuda":
            self._check_cuda()
        loaded = load_model(config, self.device, model_dir)
        self.model_dir, self.hf_config, self.max_model_len = loaded.model_dir, loaded.hf_config, loaded.max_model_len
        self.vocab_size, self.dtype, self.quantization = loaded.hf_config.vocab_size, loaded.dtype, loaded.quantization
        self.backend, self.model, self.task = loaded.backend, loaded.model, loaded.task
        #: The model's pooler for a pooling task (and what the client is told of it), or None.
        self.pooler, self.pooler_info = loaded.pooler, loaded.pooler_info
        if self.device.type == "cuda":
            self.memory_at_start = loaded.memory_at_start
        #: On CPU: the memory figures checked before the load (model/memory.py), or None.
        self.memory_need = loaded.memory_need
        self.backend.prepare(self.model, self.max_model_len)
        #: The LoRA adapter slots (EngineConfig.enable_lora), or None.
        self.lora = LoRAModel(self.model, config.max_loras, config.max_lora_rank, self.dtype, self.device) \
            if config.enable_lora else None
        self.block_size = config.block_size
        self.num_blocks = self._num_kv_blocks()
        self._allocate_kv_cache()
        self.sampler = Sampler(config.seed, self.device)
        self.controls = LogitsControls(self.device)
        self.masks = GrammarMasks(self.device, self.sampler)
        self.generators: dict[str, torch.Generator] = {}
        #: The prompt logprobs the last forward computed (`_prompt_logprobs`), for its step.
        self._prompt_entries: dict | None = None
        self.graphs = None
        self._greedy: torch.Tensor | None = None  # argmax of the last forward's logits, when it came with them
        #: Plain steps ask the LM head for their argmax alone (`forward`'s greedy_only).
        self._greedy_from_head = hasattr(self.model, "greedy_tokens")
        #: Async scheduling pays where a GPU computes while the host goes on.
        self.prefers_async = self.device.type == "cuda"
        #: The ids sampled by the last step, on the device, row j for the request
        #: `_row_ids[j]`: a step launched before they reach the host reads its
        #: placeholder tokens from here.
        self.token_buffer = torch.zeros(config.max_num_seqs, dtype=torch.int32, device=self.device)
        self._row_ids: list[str] = []
        self._row_map: dict[str, int] | None = {}
        #: The request ids of the sampled rows of the step being launched.
        self._step_ids: list[str] = []
        if self.device.type == "cuda" and not config.enforce_eager and self.pooler is None:
            from gristmill.model.cuda.graphs import CudaGraphs
            self.graphs = CudaGraphs(self.model, self.backend, config.max_num_seqs, self.max_model_len,
                                     self.block_size)
            self.token_buffer = self.graphs.inputs.sampled
            self.graphs.capture()

    def _check_cuda(self) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError(f"device={self.config.device!r}, but torch sees no CUDA GPU (torch "
                               f"{torch.__version__}); use device='cpu' or 'auto'")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(self.device)

    # -- the KV cache ----------------------------------------------------------------

    def _kv_layers(self) -> list[PagedAttention]:
        return [m for m in self.model.modules() if isinstance(m, PagedAttention)]

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV cache holds (EngineConfig.kv_cache_dtype; "auto": the model's dtype)."""
        name = self.config.kv_cache_dtype
        dtype = self.dtype if name == "auto" else getattr(torch, name)
        if dtype != self.dtype and self.device.type != "cpu":
            raise RequestError(f"EngineConfig.kv_cache_dtype={name!r} is for CPU; on {self.device.type} the KV "
                               f"cache holds the model's dtype ({str(self.dtype).removeprefix('torch.')}): "
                               f"leave it 'auto'", param="kv_cache_dtype")
        return dtype

    def _bytes_per_block(self) -> int:
        per_token = sum(2 * a.num_kv_heads * a.head_dim for a in self._kv_layers())
        return per_token * self.block_size * (torch.finfo(self.kv_dtype).bits // 8)

    def _num_kv_blocks(self) -> int:
        config, per_block = self.config, self._bytes_per_block()
        if per_block == 0:  # no KV cache (an encoder): blocks enough for the scheduler's bookkeeping
            return config.max_num_seqs * -(-self.max_model_len // self.block_size)
        if self.device.type == "cuda":
            from gristmill.model.cuda.memory import kv_cache_blocks
            blocks = kv_cache_blocks(self, self.memory_at_start, per_block)
        elif config.num_kv_blocks:
            blocks = config.num_kv_blocks
        else:
            gb = config.kv_cache_memory_gb if config.kv_cache_memory_gb is not None else 1.0
            blocks = max(1, int(gb * 2**30) // per_block)
        logger.info("KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB) on %s", blocks, self.block_size,
                    blocks * self.block_size, blocks * per_block / 2**30, self.device)
        return blocks

    def _allocate_kv_cache(self) -> None:
        attn = self._kv_layers()
        if not attn:
            self.kv_cache = None
            return
        kv_heads, head_dim = attn[0].num_kv_heads, attn[0].head_dim
        # One allocation for every layer: (2, num_layers, num_blocks, block_size, kv_heads, head_dim).
        shape = (2, len(attn), self.num_blocks, self.block_size, kv_heads, head_dim)
        if self.device.type == "cpu":
            self.kv_cache = _untouched_zeros(shape, self.kv_dtype)
        else:
            self.kv_cache = torch.zeros(shape, device=self.device, dtype=self.kv_dtype)
        for i, layer in enumerate(attn):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    @property
    def argmax_first(self) -> bool:
        return self.masks.argmax_first

    @argmax_first.setter
    def argmax_first(self, value: bool) -> None:
        self.masks.argmax_first = value

    # -- one step ------------------------------------------------------------------

    def execute(self, out: SchedulerOutput) -> StepTokens:
        return self.launch(out).result()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> "LaunchedStep":
        """Queue a step on the device (forward, sampling, the copy of the ids to the host)
        and return without waiting for it. Its placeholder tokens (async scheduling) are
        read on the device from the step launched before."""
        for request_id in out.finished_request_ids:
            self.generators.pop(request_id, None)
        if self.pooler is not None:
            return self._pool(out)
        logits, items = self.forward(out, greedy_only=out.plain)
        prompt_logprobs, self._prompt_entries = self._prompt_entries, None
        if not items:
            self._row_ids, self._row_map = [], {}
            return LaunchedStep([], None, prompt_logprobs)
        if out.plain:  # (most steps of a greedy batch job: no pass over the rows)
            tokens, pending = self.sampler.sample_greedy(logits, self._greedy)
        else:
            tokens, pending = self._sample(logits, items)
        self.token_buffer[:len(items)].copy_(tokens)
        self._row_ids, self._row_map = self._step_ids, None
        return LaunchedStep(self._step_ids, pending, prompt_logprobs)

    def _sample(self, logits: torch.Tensor, items: list[ScheduledRequest]):
        rows = [SamplerRow(item.sampling_params, None if item.sampling_params.seed is None else self._generator(item))
                for item in items]
        if self.controls.apply(logits, items, self.token_buffer, self._rows):
            self._greedy = None  # the forward's argmax saw the logits before them
        constrained = [(j, item) for j, item in enumerate(items)
                       if item.matcher is not None and item.matcher.constrains_next]
        deferred = []
        if constrained:
            deferred, self._greedy = self.masks.mask(logits, constrained, rows, self._greedy)
        tokens, pending = self.sampler.sample(logits, rows, self._greedy)
        if deferred:
            tokens, pending = self.masks.resample_refused(logits, deferred, rows, tokens, pending)
        return tokens, pending

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput,
                greedy_only: bool = False) -> tuple[torch.Tensor | None, list[ScheduledRequest]]:
        """Run the model over a step; returns (logits of the sampled rows, their
        ScheduledRequests). The KV cache is updated for every scheduled token. The logits
        may live in a reused buffer (a CUDA graph's, the int8 LM head's): valid until
        the next call. `greedy_only` (a plain step: its tokens are the logits' argmax):
        where the LM head gives the argmax without the logits (a GGUF head on CPU), only
        that is made (`self._greedy`), and the logits are None."""
        self._greedy = None
        self._prompt_entries = None
        if not out.scheduled:
            return None, []
        host, items = self.host_step(out)
        self._step_ids = [item.request_id for item in items]
        source = self._token_source(host, items)
        lora = self._lora_step(out, host)
        if self.graphs is not None and lora is None and self.graphs.can_run(host):
            logits, self._greedy = self.graphs.run(host, source)
            if len(items) < host.num_tokens:
                rows = torch.from_numpy(host.sample_indices).to(self.device)
                logits, self._greedy = logits[rows], self._greedy[rows]
            return logits, items
        input_ids, positions, metadata, sample_indices = self.backend.upload(host)
        if source is not None:
            rows = torch.from_numpy(source).to(self.device)
            taken = self.token_buffer[rows.clamp(min=0)].to(input_ids.dtype)
            input_ids = torch.where(rows >= 0, taken, input_ids)
        metadata.lora = lora
        with forward_context(metadata, self.backend):
            hidden = self.model(input_ids, positions)
            if any(s.sampling_params.prompt_logprobs is not None for s in out.scheduled):
                # (first: the LM head's output buffer is reused by the sampled rows' logits)
                self._prompt_entries = self._prompt_logprobs(hidden, host, out)
            if not items:
                return None, []
            rows = hidden[sample_indices]
            if greedy_only and self._greedy_from_head:
                self._greedy = self.model.greedy_tokens(rows)
                if self._greedy is not None:
                    return None, items
                self._greedy_from_head = False  # (this head cannot: not asked again)
            return self.model.compute_logits(rows), items

    #: Prompt rows whose logits are made at once, for prompt logprobs (a 262k vocabulary
    #: in float32: 1 MiB a row).
    PROMPT_LOGPROBS_ROWS = 256

    def _prompt_logprobs(self, hidden: torch.Tensor, host: HostStep, out: SchedulerOutput) -> dict | None:
        """request id -> {token: Logprob} of each prompt token this step's chunk of it
        predicts (the token, then the top-k), for the requests that ask for them."""
        entries = {}
        starts = host.query_start.tolist()
        for i, item in enumerate(_host_order(out)):
            k = item.sampling_params.prompt_logprobs
            first = item.num_computed_tokens
            last = min(first + item.num_new_tokens, item.num_prompt_tokens - 1)  # rows with a next prompt token
            if k is None or last <= first:
                continue
            found = entries[item.request_id] = []
            for begin in range(first, last, self.PROMPT_LOGPROBS_ROWS):
                end = min(begin + self.PROMPT_LOGPROBS_ROWS, last)
                rows = hidden[starts[i] + begin - first:starts[i] + end - first]
                logprobs = self.model.compute_logits(rows).float().log_softmax(dim=-1)
                targets = torch.tensor(item.token_ids[begin + 1:end + 1], device=logprobs.device)
                chosen = logprobs.gather(1, targets[:, None])
                ranks = (logprobs > chosen).sum(dim=-1) + 1
                top_values, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], targets[:, None][:, :0])
                for target, value, rank, values, ids in zip(targets.tolist(), chosen[:, 0].tolist(), ranks.tolist(),
                                                            top_values.tolist(), top_ids.tolist()):
                    entry = {target: Logprob(value, rank)}
                    for place, (top_value, top_id) in enumerate(zip(values, ids), 1):
                        entry.setdefault(top_id, Logprob(top_value, place))
                    found.append(entry)
        return entries

    def _pool(self, out: SchedulerOutput) -> "PooledStep":
        """A pooling step: every scheduled request is a whole prompt; the model's hidden
        states of each are pooled (`self.pooler`) and finished as its params ask."""
        if not out.scheduled:
            return PooledStep([], [])
        host, items = self.host_step(out)  # (every item samples: its prompt ends in this step)
        input_ids, positions, metadata, _ = self.backend.upload(host)
        metadata.lora = self._lora_step(out, host)
        extra = {}
        if getattr(self.model, "uses_token_types", False):
            types = np.zeros(host.num_tokens, dtype=np.int64)
            for item, start in zip(items, host.query_start.tolist()):
                if item.token_type_ids is not None:
                    types[start:start + len(item.token_type_ids)] = item.token_type_ids
            extra["token_type_ids"] = torch.from_numpy(types).to(self.device)
        starts = host.query_start.tolist()
        with forward_context(metadata, self.backend):
            hidden = self.model(input_ids, positions, **extra)
            pooled = self.pooler(hidden, list(zip(starts[:-1], starts[1:]))).float()
        return PooledStep([item.request_id for item in items], self._finish_pooled(pooled, items))

    def _finish_pooled(self, pooled: torch.Tensor, items: list[ScheduledRequest]) -> list[np.ndarray]:
        """Each request's vector as its PoolingParams ask: an embedding cut to
        `dimensions` and normalized (or not); a classifier's logits as probabilities
        (softmax; a sigmoid for one label) unless `use_activation` is False."""
        info = self.pooler_info
        if info.head == "embed":
            wanted = [(item.pooling.dimensions or info.dimensions,
                       info.default_normalize if item.pooling.normalize is None else item.pooling.normalize)
                      for item in items]
            if all(w == wanted[0] for w in wanted):  # (most steps: one op for all rows)
                dims, normalize = wanted[0]
                rows = pooled[:, :dims]
                rows = torch.nn.functional.normalize(rows, dim=-1) if normalize else rows
                return list(rows.cpu().numpy())
            return [(torch.nn.functional.normalize(row[:dims], dim=-1) if normalize else row[:dims]).cpu().numpy()
                    for row, (dims, normalize) in zip(pooled, wanted)]
        activated = torch.sigmoid(pooled) if pooled.shape[1] == 1 else torch.softmax(pooled, dim=-1)
        raw, activated = pooled.cpu().numpy(), activated.cpu().numpy()
        return [raw[j] if item.pooling.use_activation is False else activated[j] for j, item in enumerate(items)]

    def load_lora(self, slot: int, lora) -> None:
        """Put LoRA adapter `lora` (a LoRARequest) in `slot`; LoRAAdapterError when it
        cannot run on this model (the slot then keeps what it held)."""
        self.lora.load(slot, lora)

    def _lora_step(self, out: SchedulerOutput, host: HostStep):
        """The step's rows by adapter slot (model/lora.py), or None: no row uses one."""
        if self.lora is None:
            return None
        return self.lora.step_of([s.lora_slot for s in _host_order(out)], host.query_start)

    def host_step(self, out: SchedulerOutput) -> tuple[HostStep, list[ScheduledRequest]]:
        """The step's inputs in numpy, decodes first, and the ScheduledRequest of each
        sampled row."""
        ordered = _host_order(out)
        sequences = [(s.new_token_ids, s.num_computed_tokens, s.block_ids, s.samples) for s in ordered]
        return build_host_step(sequences, self.block_size), [s for s in ordered if s.samples]

    def make_device_error(self) -> None:
        """The `device_error` fault. On CUDA, a kernel writes far outside any allocation: a
        real illegal memory access, which the device reports at the next synchronization
        (asynchronously, as real ones come) and which leaves the CUDA context unusable. A CPU
        has no such failure: there it raises at once."""
        if self.device.type != "cuda":
            raise InjectedFault("injected fault at 'device_error' (GRISTMILL_FAULTS; on CPU it raises "
                                "instead of faulting the device)")
        from gristmill.model.cuda.triton_kernels import illegal_memory_access
        illegal_memory_access(self.device)

    def _token_source(self, host: HostStep, items: list[ScheduledRequest]) -> np.ndarray | None:
        """For each token of the step, the row of `token_buffer` holding its id when it is
        a placeholder (the last step's sampled token, not on the host yet), else -1; None
        when the step has no placeholder."""
        pending = [j for j, item in enumerate(items) if item.pending]
        if not pending:
            return None
        source = np.full(host.num_tokens, -1, dtype=np.int64)
        if self._step_ids == self._row_ids:  # the same rows as the last step (most steps)
            source[host.sample_indices[pending]] = pending
        else:
            rows, ids = self._rows(), self._step_ids
            source[host.sample_indices[pending]] = [rows[ids[j]] for j in pending]
        return source

    def _rows(self) -> dict[str, int]:
        """request id -> its row of `token_buffer` (the last step's sampled ids)."""
        if self._row_map is None:
            self._row_map = {request_id: j for j, request_id in enumerate(self._row_ids)}
        return self._row_map

    @torch.inference_mode()
    def score(self, token_ids: list[int], chunk_size: int = 512) -> torch.Tensor:
        """Log-probability of each token of `token_ids` after the ones before it: a
        (len - 1,) float tensor. Runs chunked prefills over KV blocks 0, 1, ... of the
        cache (so nothing else may be running on this runner) and needs
        ceil(len / block_size) blocks."""
        bs = self.block_size
        needed = -(-len(token_ids) // bs)
        if needed > self.num_blocks or len(token_ids) > self.max_model_len:
            raise ValueError(f"scoring {len(token_ids)} tokens needs {needed} KV blocks and "
                             f"max_model_len >= {len(token_ids)}; this runner has {self.num_blocks} "
                             f"and {self.max_model_len}")
        blocks = list(range(needed))
        scores = []
        for start in range(0, len(token_ids) - 1, chunk_size):
            end = min(start + chunk_size, len(token_ids) - 1)
            host = build_host_step([(token_ids[start:end], start, blocks, False)], bs)
            input_ids, positions, metadata, _ = self.backend.upload(host)
            with forward_context(metadata, self.backend):
                hidden = self.model(input_ids, positions)
            logprobs = self.model.compute_logits(hidden).float().log_softmax(dim=-1)
            targets = torch.tensor(token_ids[start + 1:end + 1], device=self.device, dtype=torch.long)
            scores.append(logprobs.gather(1, targets[:, None])[:, 0])
        return torch.cat(scores)

    def _generator(self, item: ScheduledRequest) -> torch.Generator | None:
        seed = item.sampling_params.seed
        if seed is None or item.sampling_params.greedy:
            return None
        generator = self.generators.get(item.request_id)
        if generator is None:
            generator = self.generators[item.request_id] = torch.Generator(device=self.device)
            generator.manual_seed(seed)
        return generator


def _host_order(out: SchedulerOutput) -> list[ScheduledRequest]:
    """A step's requests in the order of its host step's sequences: decodes first."""
    ordered = out.scheduled
    if any(len(s.new_token_ids) != 1 for s in ordered):  # a prefill chunk: decodes first (stable)
        ordered = sorted(ordered, key=lambda s: len(s.new_token_ids) != 1)
    return ordered


def _untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros whose pages the OS maps only when first written (an anonymous
    mapping): a KV cache of 1 GiB costs memory for the blocks in use, not at start.

    It asks for no 2 MiB pages (numpy's zeros would): where the kernel compacts memory to
    find one (`defrag=madvise`, the common setting), a first write into a fresh 2 MiB page
    took ~5 ms, 1.2 ms in 4 KiB pages, and a benchmark of fresh prompts keeps meeting new
    blocks (docs/performance.md). The system's own page policy applies."""
    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    pages = mmap.mmap(-1, max(nbytes, 1))
    return torch.frombuffer(pages, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)


class PooledStep:
    """A pooling step's results (computed already: `result()` waits for nothing)."""

    def __init__(self, request_ids: list[str], pooled: list[np.ndarray]):
        self.request_ids, self.pooled = request_ids, pooled

    def result(self) -> StepTokens:
        return StepTokens(self.request_ids, [], [], self.pooled)


class LaunchedStep:
    """A step queued on the device; `result()` waits for its sampled tokens."""

    def __init__(self, request_ids: list[str], pending, prompt_logprobs: dict | None = None):
        """`request_ids`: of the sampled rows, in their order."""
        self.request_ids, self.pending, self.prompt_logprobs = request_ids, pending, prompt_logprobs

    def result(self) -> StepTokens:
        if self.pending is None:
            return StepTokens([], [], [], prompt_logprobs=self.prompt_logprobs)
        return StepTokens(self.request_ids, *self.pending.result(), prompt_logprobs=self.prompt_logprobs)
