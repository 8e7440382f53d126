"""Decode steps replayed from CUDA graphs.

At start, the whole decode forward (embedding, every layer, final norm, LM head) is
captured once per batch size of a ladder up to max_num_seqs, reading its inputs from
static device buffers. A decode-only step of n sequences is padded to the next size of
the ladder: padding rows write no KV (slot -1) and attend to nothing (length 0). Each
step then costs two copies into the buffers and one graph launch, instead of hundreds of
kernel launches from Python. Where max_model_len passes the attention's partition, each
size is captured twice: its decodes unsplit, and split into partitions (flash-decoding,
see triton_kernels), replayed when a sequence of the step is longer than one partition.
"""

from __future__ import annotations

import bisect
import logging
import time

import numpy as np
import torch

from gristmill.model.context import forward_context
from gristmill.model.metadata import HostStep, StepMetadata

logger = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The ladder: 1, 2, 4, 8, then every 16 up to max_num_seqs, which is always on it."""
    sizes = {s for s in (1, 2, 4, 8) if s < max_num_seqs}
    sizes.update(range(16, max_num_seqs, 16))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def padded_batch_size(n: int, sizes: list[int]) -> int | None:
    """The smallest size of the ladder that holds n rows, or None past its top."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class StaticInputs:
    """The buffers every captured graph reads, as views of one int32 device tensor laid
    out like a host mirror, so one copy fills them: ids, positions, slots, sequence
    lengths, token sources, query starts (0..n, never rewritten), then the step's block
    tables packed to its own width; one device copy spreads those into the full-width
    table.

    In front of them, never copied over, `sampled`: the ids the last step sampled, written
    on the device. A graph takes its input ids as `pool[source]`, pool being `sampled`
    followed by the host's ids: the source of a token from the host is its own index past
    `sampled`, that of a placeholder (async scheduling) the row of `sampled` holding it."""

    VECTORS = 7  # sampled, ids, positions, slots, sequence lengths, sources, query starts

    def __init__(self, max_rows: int, max_blocks: int, device, pin: bool = True):
        self.max_rows, self.max_blocks = max_rows, max_blocks
        self.span = span = -(-(max_rows + 1) // 4) * 4  # each vector 16-byte aligned
        self.vector_size = self.VECTORS * span
        size = self.vector_size + max_rows * max_blocks
        self.device_buffer = torch.zeros(size, dtype=torch.int32, device=device)
        self.host_buffer = torch.zeros(size, dtype=torch.int32, pin_memory=pin)
        self.block_tables = torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device)
        vectors = self.device_buffer[:self.vector_size].split(span)
        (self.sampled, self.input_ids, self.positions, self.slot_mapping, self.seq_lens,
         self.sources) = (v[:max_rows] for v in vectors[:6])
        self.query_start = vectors[6][:max_rows + 1]
        self.pool = self.device_buffer[:2 * span]
        self.own_sources = span + np.arange(max_rows, dtype=np.int32)
        host = self.host_buffer.numpy()
        host[6 * span:6 * span + max_rows + 1] = np.arange(max_rows + 1)
        host[3 * span:3 * span + max_rows] = -1
        host[5 * span:5 * span + max_rows] = self.own_sources
        self.device_buffer.copy_(self.host_buffer)

    def metadata(self, rows: int, block_size: int, splits: int = 1) -> StepMetadata:
        return StepMetadata(slot_mapping=self.slot_mapping[:rows], query_start=self.query_start[:rows + 1],
                            seq_lens=self.seq_lens[:rows], block_tables=self.block_tables[:rows],
                            num_decodes=rows, block_size=block_size,
                            extras={"programs": None, "decode_splits": splits})

    def ids(self, rows: int) -> torch.Tensor:
        """The input ids of the first `rows` rows: the host's, or the last step's sampled ones."""
        return self.pool.index_select(0, self.sources[:rows])

    def fill(self, step: HostStep, rows: int, source: np.ndarray | None = None) -> None:
        """Write a decode-only step of n <= rows sequences, padded to `rows`. `source`: per
        token, the row of `sampled` holding its id, or -1 for the id in the step."""
        n, width = step.num_tokens, step.block_tables.shape[1]
        if width > self.max_blocks:
            raise ValueError(f"a sequence has {width} KV blocks, more than the {self.max_blocks} "
                             f"the graphs were captured for")
        m, host = self.span, self.host_buffer.numpy()
        for k, part in enumerate((step.input_ids, step.positions, step.slot_mapping, step.seq_lens), start=1):
            host[k * m:k * m + n] = part
            host[k * m + n:k * m + rows] = -1 if k == 3 else 0
        sources = host[5 * m:5 * m + rows]
        sources[:] = self.own_sources[:rows]
        if source is not None:
            placeholders = np.flatnonzero(source >= 0)
            sources[placeholders] = source[placeholders]
        packed = host[self.vector_size:self.vector_size + rows * width].reshape(rows, width)
        packed[:n] = step.block_tables
        packed[n:] = 0
        used = self.vector_size + rows * width
        self.device_buffer[m:used].copy_(self.host_buffer[m:used], non_blocking=True)
        self.block_tables[:rows, :width].copy_(self.device_buffer[self.vector_size:used].view(rows, width))


class CudaGraphs:
    """Captured decode forwards, one per batch size of the ladder."""

    def __init__(self, model: torch.nn.Module, backend, max_num_seqs: int, max_model_len: int, block_size: int):
        self.model, self.backend, self.block_size = model, backend, block_size
        self.sizes = graph_batch_sizes(max_num_seqs)
        max_blocks = -(-max_model_len // block_size)
        self.inputs = StaticInputs(self.sizes[-1], max_blocks, backend.device)
        #: Partitions of a split decode: as many as the longest sequence can fill (1: never split).
        self.splits = backend.shape.decode_splits(max_model_len)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.logits: torch.Tensor | None = None
        self.memory = 0
        self._copied: torch.cuda.Event | None = None

    def _forward(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = self.inputs
        hidden = self.model(inputs.ids(rows), inputs.positions[:rows])
        # Every graph writes its logits into the one buffer (a step's are read before the
        # next step's graph runs, in stream order): one graph's output held apiece was
        # rows x vocab for each size of the ladder, GBs at 512 rows, past the KV sizing.
        logits = self.model.compute_logits(hidden, out=self.logits[:rows])
        return logits, logits.argmax(dim=-1)  # the greedy tokens too: no launch after the graph

    @torch.no_grad()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(self.backend.device)
        head = self.model.lm_head.weight
        self.logits = torch.empty(self.sizes[-1], head.shape[0], dtype=head.dtype, device=head.device)
        variants = sorted({1, self.splits}, reverse=True)
        for rows in reversed(self.sizes):  # the largest first: the smaller reuse its memory
            for splits in variants:
                with forward_context(self.inputs.metadata(rows, self.block_size, splits), self.backend):
                    self._forward(rows)  # compiles kernels, picks cuBLAS algorithms
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        outputs = self._forward(rows)
                self.graphs[rows, splits] = (graph, outputs)
        torch.cuda.synchronize()
        #: Device memory the graphs hold (the logits buffer, their pool's live blocks).
        self.memory = torch.cuda.memory_allocated(self.backend.device) - before
        logger.info("captured CUDA graphs for decode batch sizes %s%s in %.1f s", self.sizes,
                    f", unsplit and in {self.splits} partitions" if self.splits > 1 else "",
                    time.perf_counter() - start)

    def can_run(self, step: HostStep) -> bool:
        return (step.is_decode_only and step.num_tokens <= self.sizes[-1]
                and step.block_tables.shape[1] <= self.inputs.max_blocks)

    def run(self, step: HostStep, source: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (n, vocab) of a decode-only step's rows and their argmax (n,), valid
        until the next run. `source`: see StaticInputs.fill."""
        rows = padded_batch_size(step.num_tokens, self.sizes)
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffer is read by the last step's copy
        self.inputs.fill(step, rows, source)
        self._copied = torch.cuda.Event()
        self._copied.record()
        longest = int(step.seq_lens.max())
        splits = 1 if self.backend.shape.decode_splits(longest) == 1 else self.splits
        graph, (logits, greedy) = self.graphs[rows, splits]
        graph.replay()
        return logits[:step.num_tokens], greedy[:step.num_tokens]
