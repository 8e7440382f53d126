"""Triton kernels of the CUDA backend. Each computes in float32 and rounds once to the
activation dtype. Under TRITON_INTERPRET=1 they run on CPU tensors, which is how CI tests
them against the torch reference (tests/model/test_triton_kernels.py).

- `rms_norm`, `residual_norm`: a row each.
- `qkv_rotary`: the fused q/k/v projection's output -> q, k (per-head norm where the
  family has one, then rotary), v: one program per (token, q or k head).
- `act_mul`: act(gate) * up over the fused gate/up projection's output.
- `write_kv`: this step's k, v into the paged cache at their slots (-1: skipped).
- `paged_attention`: causal attention of a step's queries over the paged cache, with
  sliding window and GQA; one launch for all decodes (a program per sequence and KV
  head), one for all prefill chunks (a program per block of queries, KV head).
  Decodes over long contexts are split by key position (flash-decoding): a program per
  sequence, KV head and partition of `AttentionShape.partition` keys, then a launch that
  combines the partitions. A sequence's partitions depend on its own length alone, and
  one partition gives the unsplit launch's numbers exactly, so which launch runs never
  changes a result.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(n))


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, dim, eps, offset,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps) * (w + offset)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, offset: float, eps: float) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, device=x.device, dtype=x.dtype)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), shape[-1], eps, offset,
                                         BLOCK=_pow2(shape[-1]))
    return out.view(shape)


@triton.jit
def _residual_norm_kernel(x_ptr, d_ptr, wd_ptr, wo_ptr, x_out_ptr, h_ptr, dim, eps_d, off_d, eps_o, off_o,
                          HAS_DELTA_NORM: tl.constexpr, HAS_OUT_NORM: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    dtype = x_out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA_NORM:
        wd = tl.load(wd_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        d = d * tl.rsqrt(tl.sum(d * d, axis=0) / dim + eps_d) * (wd + off_d)
        d = d.to(dtype).to(tl.float32)  # the normed delta is an activation of its own
    x = (x + d).to(dtype)
    tl.store(x_out_ptr + row * dim + cols, x, mask=mask)
    if HAS_OUT_NORM:
        xf = x.to(tl.float32)
        wo = tl.load(wo_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        h = xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / dim + eps_o) * (wo + off_o)
        tl.store(h_ptr + row * dim + cols, h.to(dtype), mask=mask)


def residual_norm(x: torch.Tensor, delta: torch.Tensor, delta_norm, out_norm):
    """(x + delta_norm(delta), out_norm of that); norms given as (weight, offset, eps) or None."""
    x, delta = x.contiguous(), delta.contiguous()
    rows, dim = x.shape
    x_out = torch.empty_like(x)
    h = torch.empty_like(x) if out_norm else None
    wd, off_d, eps_d = delta_norm or (x, 0.0, 0.0)
    wo, off_o, eps_o = out_norm or (x, 0.0, 0.0)
    if rows:
        _residual_norm_kernel[(rows,)](x, delta, wd, wo, x_out, h if h is not None else x_out, dim,
                                       eps_d, off_d, eps_o, off_o, HAS_DELTA_NORM=delta_norm is not None,
                                       HAS_OUT_NORM=out_norm is not None, BLOCK=_pow2(dim))
    return x_out, h


@triton.jit
def _qkv_rotary_kernel(qkv_ptr, pos_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr,
                       slot_ptr, k_cache_ptr, v_cache_ptr,
                       stride_t, num_heads, num_kv_heads, eps, q_off, k_off,
                       HAS_NORM: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, WRITE_KV: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    c = tl.arange(0, HALF_P)
    mask = c < HALF
    is_q = (c * 0 + h) < num_heads  # as a vector: masks combine element-wise everywhere
    is_k = (c * 0 + h) >= num_heads
    dtype = q_ptr.dtype.element_ty
    src = qkv_ptr + t * stride_t + h * (2 * HALF)
    x1 = tl.load(src + c, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        wq1 = tl.load(qw_ptr + c, mask=mask & is_q, other=0.0).to(tl.float32)
        wq2 = tl.load(qw_ptr + HALF + c, mask=mask & is_q, other=0.0).to(tl.float32)
        wk1 = tl.load(kw_ptr + c, mask=mask & is_k, other=0.0).to(tl.float32)
        wk2 = tl.load(kw_ptr + HALF + c, mask=mask & is_k, other=0.0).to(tl.float32)
        off = tl.where(h < num_heads, q_off, k_off)
        r = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF) + eps)
        x1 = (x1 * r * (wq1 + wk1 + off)).to(dtype).to(tl.float32)
        x2 = (x2 * r * (wq2 + wk2 + off)).to(dtype).to(tl.float32)
    p = tl.load(pos_ptr + t).to(tl.int64)
    cos = tl.load(cos_ptr + p * HALF + c, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + p * HALF + c, mask=mask, other=0.0)
    o1 = (x1 * cos - x2 * sin).to(dtype)
    o2 = (x2 * cos + x1 * sin).to(dtype)
    q_dst = q_ptr + (t * num_heads + h) * (2 * HALF)
    tl.store(q_dst + c, o1, mask=mask & is_q)
    tl.store(q_dst + HALF + c, o2, mask=mask & is_q)
    if WRITE_KV:  # k and v straight into the paged cache (slot -1: a padding row)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        write = mask & is_k & ((c * 0 + slot) >= 0)
        dst = (slot * num_kv_heads + h - num_heads) * (2 * HALF)
        tl.store(k_cache_ptr + dst + c, o1, mask=write)
        tl.store(k_cache_ptr + dst + HALF + c, o2, mask=write)
        v_src = src + num_kv_heads * (2 * HALF)
        tl.store(v_cache_ptr + dst + c, tl.load(v_src + c, mask=write), mask=write)
        tl.store(v_cache_ptr + dst + HALF + c, tl.load(v_src + HALF + c, mask=write), mask=write)
    else:
        k_dst = k_ptr + (t * num_kv_heads + h - num_heads) * (2 * HALF)
        tl.store(k_dst + c, o1, mask=mask & is_k)
        tl.store(k_dst + HALF + c, o2, mask=mask & is_k)


def qkv_rotary(qkv: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
               q_norm, k_norm, cos: torch.Tensor, sin: torch.Tensor, kv_cache=None):
    """qkv: (n, (heads + 2 kv_heads) * head_dim), the fused projection's output. Returns
    q (n, heads, dim), k (n, kv_heads, dim) normed (q_norm, k_norm: (weight, offset, eps)
    or None) and rotated, and v, a view of qkv. With kv_cache = (slot_mapping, k_cache,
    v_cache), k and v go straight into the cache instead, and come back as None."""
    n = qkv.shape[0]
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q = torch.empty(n, num_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    write = kv_cache is not None
    k = None if write else torch.empty(n, num_kv_heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    v = None if write else qkv[:, (num_heads + num_kv_heads) * head_dim:].view(n, num_kv_heads, head_dim)
    slots, k_cache, v_cache = kv_cache if write else (positions, q, q)
    qw, q_off, eps = q_norm or (cos, 0.0, 0.0)
    kw, k_off, _ = k_norm or (cos, 0.0, 0.0)
    if n:
        _qkv_rotary_kernel[(n, num_heads + num_kv_heads)](
            qkv, positions, qw, kw, cos, sin, q, q if write else k, slots, k_cache, v_cache, qkv.stride(0),
            num_heads, num_kv_heads, eps, q_off, k_off, HAS_NORM=q_norm is not None, HALF=head_dim // 2,
            HALF_P=_pow2(head_dim // 2), WRITE_KV=write)
    return q, k, v


@triton.jit
def _act_mul_kernel(x_ptr, out_ptr, inter, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:  # silu
        a = gate * tl.sigmoid(gate)
    elif ACT == 1:  # gelu, tanh approximation: 0.5 (1 + tanh z) = sigmoid(2 z)
        a = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate))
    else:  # gelu (erf)
        a = 0.5 * gate * (1.0 + tl.erf(gate * 0.7071067811865476))
    a = a.to(dtype).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (a * up).to(dtype), mask=mask)


ACT_CODES = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu": 2}


def act_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up of a (n, 2 * inter) tensor [gate | up]: (n, inter)."""
    gate_up = gate_up.contiguous()
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(n, inter, device=gate_up.device, dtype=gate_up.dtype)
    block = min(1024, _pow2(inter))
    if n:
        _act_mul_kernel[(n, triton.cdiv(inter, block))](gate_up, out, inter, ACT=ACT_CODES[activation], BLOCK=block)
    return out


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     num_kv_heads, DIM: tl.constexpr, DIM_P: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, DIM_P)
        mask = d < DIM
        dst = (slot * num_kv_heads + h) * DIM + d
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(k_cache_ptr + dst, k, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: (n, kv_heads, dim), last dim contiguous; caches (blocks, block_size, kv_heads, dim)."""
    n, kv_heads, dim = k.shape
    if n:
        _write_kv_kernel[(n, kv_heads)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1),
                                        v.stride(0), v.stride(1), kv_heads, DIM=dim, DIM_P=_pow2(dim))


# Triton compiles a variant per argument "shape" it sees: ints equal to 1 or divisible by
# 16, pointers 16-byte aligned or not. Arguments that change from step to step are not
# specialized (and the step's index buffers are uploaded 16-byte aligned), so a new
# batch never stalls on a compile mid-run.
@triton.jit(do_not_specialize=["stride_bt", "window", "num_splits"])
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr,
        prog_seq_ptr, prog_block_ptr, part_out_ptr, part_lse_ptr, scale, stride_qt, stride_qh, stride_ot,
        stride_oh, stride_bt, num_kv_heads, window, num_splits, HAS_WINDOW: tl.constexpr,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, DIM: tl.constexpr, DIM_P: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DECODE: tl.constexpr,
        PARTITION: tl.constexpr, IEEE: tl.constexpr):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:  # program i: sequence i, its one query token
        seq = pid
        q_block = 0
    else:
        seq = tl.load(prog_seq_ptr + pid)
        q_block = tl.load(prog_block_ptr + pid)
    q_begin = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + seq)
    prior = seq_len - q_len  # cached tokens before this step's

    # Rows: BLOCK_Q query tokens x GROUP_P query heads of this KV head.
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P
    rows = tl.arange(0, BLOCK_M)
    tok = q_block * BLOCK_Q + rows // GROUP_P
    head = kv_head * GROUP + rows % GROUP_P
    row_ok = (tok < q_len) & (rows % GROUP_P < GROUP)
    d = tl.arange(0, DIM_P)
    d_ok = d < DIM
    q_rows = (q_begin + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = prior + tok

    last_tok = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len)
    hi = prior + last_tok  # one past the last key any row sees
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(prior + q_block * BLOCK_Q - window + 1, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    if PARTITION:  # this program's keys: those of partition `split` (an empty range past the end)
        lo = tl.maximum(lo, split * PARTITION)
        hi = tl.minimum(hi, split * PARTITION + PARTITION)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_P], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < hi
        block = tl.load(table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        slot = block * BLOCK_SIZE + k_pos % BLOCK_SIZE
        kv_off = (slot * num_kv_heads + kv_head) * DIM
        k = tl.load(k_cache_ptr + kv_off[None, :] + d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee") * scale
        else:
            s = tl.dot(q, k) * scale
        seen = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            seen = seen & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if PARTITION:  # float32 partials of (sequence, head, split), and each row's log-sum-exp
        part = (seq.to(tl.int64) * (num_kv_heads * GROUP) + head) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * DIM + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(part_lse_ptr + part, m_i + tl.log(l_i), mask=row_ok)
    else:
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _combine_splits_kernel(part_out_ptr, part_lse_ptr, seq_lens_ptr, out_ptr, stride_ot, stride_oh, num_heads,
                           num_splits, PARTITION: tl.constexpr, DIM: tl.constexpr, DIM_P: tl.constexpr):
    """out[seq, head] from the partitions its keys fill, weighted by their sums of exp."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, DIM_P)
    d_ok = d < DIM
    used = tl.cdiv(tl.load(seq_lens_ptr + seq), PARTITION)
    base = (seq * num_heads + head) * num_splits
    m = tl.full([], float("-inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([DIM_P], tl.float32)
    for split in range(0, used):
        lse = tl.load(part_lse_ptr + base + split)
        part = tl.load(part_out_ptr + (base + split) * DIM + d, mask=d_ok, other=0.0)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        weight = tl.exp(lse - m_safe)
        total = total * alpha + weight
        acc = acc * alpha + weight * part
        m = m_new
    out = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


class AttentionShape:
    """The launch parameters of one model's attention (every layer shares them)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 max_model_len: int = 0):
        self.num_heads = num_heads
        self.group = num_heads // num_kv_heads
        self.group_p = _pow2(self.group)
        self.dim, self.dim_p = head_dim, _pow2(head_dim, 16)
        # tl.dot needs 16 rows: queries of a block x the heads sharing a KV head.
        self.decode_block_q = max(1, 16 // self.group_p)
        self.prefill_block_q = max(1, 64 // self.group_p)
        # Keys per iteration: a prefill block holds 64 query rows, so wide heads take fewer keys.
        self.decode_block_n = 64
        self.prefill_block_n = 32 if self.dim_p >= 256 else 64
        self.ieee = dtype == torch.float32
        self.num_warps = 8 if self.dim_p >= 256 else 4
        # Decodes over more keys than this are split (flash-decoding), in partitions of it:
        # 512 keys, more for long max_model_len, so that a sequence has at most 32.
        self.partition = max(512, _pow2(-(-max_model_len // 32)))

    def decode_splits(self, longest: int) -> int:
        """Partitions of a decode launch whose longest sequence has `longest` keys: 1 (the
        unsplit launch) up to `partition` keys."""
        return 1 if longest <= self.partition else -(-longest // self.partition)


def prefill_programs(query_start: np.ndarray, num_decodes: int, block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, query block) of each program of the prefill launch."""
    counts = -(-np.diff(query_start[num_decodes:]) // block_q)
    seqs = np.repeat(np.arange(num_decodes, len(query_start) - 1), counts)
    blocks = np.arange(len(seqs)) - np.repeat(np.cumsum(counts) - counts, counts)
    return seqs, blocks


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    query_start: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scale: float, window: int | None, shape: AttentionShape, num_seqs: int,
                    programs: tuple[torch.Tensor, torch.Tensor] | None = None, splits: int = 1) -> None:
    """Attention of q (tokens, heads, dim) over the paged cache into `out`. programs=None:
    a decode launch, sequence i's one token is q[i], its keys in `splits` partitions
    (AttentionShape.decode_splits); else the (sequence, query block) of each program of a
    prefill launch (see prefill_programs)."""
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    decode = programs is None
    split = decode and splits > 1
    grid = (num_seqs if decode else programs[0].shape[0], num_kv_heads, splits if split else 1)
    if grid[0] == 0:
        return
    prog_seq, prog_block = programs if programs is not None else (seq_lens, seq_lens)
    part_out = part_lse = out
    if split:
        part_out = torch.empty(num_seqs, shape.num_heads, splits, shape.dim, device=q.device, dtype=torch.float32)
        part_lse = torch.empty(num_seqs, shape.num_heads, splits, device=q.device, dtype=torch.float32)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, query_start, seq_lens, block_tables, prog_seq, prog_block, part_out, part_lse,
        scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), num_kv_heads,
        window or 0, splits, HAS_WINDOW=bool(window),
        GROUP=shape.group, GROUP_P=shape.group_p, DIM=shape.dim, DIM_P=shape.dim_p, BLOCK_SIZE=block_size,
        BLOCK_Q=shape.decode_block_q if decode else shape.prefill_block_q,
        BLOCK_N=shape.decode_block_n if decode else shape.prefill_block_n, DECODE=decode,
        PARTITION=shape.partition if split else 0, IEEE=shape.ieee, num_warps=4 if decode else shape.num_warps)
    if split:
        _combine_splits_kernel[(num_seqs, shape.num_heads)](
            part_out, part_lse, seq_lens, out, out.stride(0), out.stride(1), shape.num_heads, splits,
            PARTITION=shape.partition, DIM=shape.dim, DIM_P=shape.dim_p)


@triton.jit
def _store_kernel(ptr, offset):
    tl.store(ptr + offset, 1.0)


def illegal_memory_access(device) -> None:
    """Queue a store 1 TiB past a small allocation: a real illegal memory access (the
    `device_error` fault), reported by the device at its next synchronization."""
    target = torch.zeros(1, dtype=torch.float32, device=device)
    _store_kernel[(1,)](target, 1 << 40)
