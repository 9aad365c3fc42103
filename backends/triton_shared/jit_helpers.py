"""Small jit helpers and constants the Triton kernel modules share: flat-grid program ids, chunk and sequence
bounds, state tiles, the masked decay, and the dot precision per dtype."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 64
LOG2E = tl.constexpr(1.4426950408889634)  # a jit-visible global must be constexpr


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs: tf32x3 (three tf32 products, ~fp32 accuracy on tensor cores; "ieee" lowers to FMA loops
    that spill everything). bf16/fp16 operands are exact on tensor cores anyway; "tf32" only touches the
    few fp32 x fp32 products (the dA products of the backward)."""
    return "tf32x3" if dtype == torch.float32 else "tf32"


@triton.jit
def grid_2d(N0):
    """(i0, i1) of a program of the logical grid (N0, N1), launched flat (sizes.flat_grid): the hardware's
    second and third grid axes stop at 65535 programs, too few for N1 = sequences x heads or for the chunks of
    a long packed batch. i0 varies fastest, as on the hardware's first axis, so programs start in the order a
    (N0, N1) grid starts them."""
    pid = tl.program_id(0)
    return pid % N0, pid // N0


@triton.jit
def grid_3d(N0, N1):
    """(i0, i1, i2) of a program of the logical grid (N0, N1, N2), launched flat (as grid_2d)."""
    pid = tl.program_id(0)
    rest = pid // N0
    return pid % N0, rest % N1, rest // N1


@triton.jit
def decay(g_rows, g_cols, mask):
    """exp2(g_rows[t] - g_cols[s]) where mask, else 0; masked before the exp2 so it cannot overflow."""
    return tl.exp2(tl.where(mask, g_rows[:, None] - g_cols[None, :], float("-inf")))


@triton.jit
def chunk_rows(pid_t, i_b, T, cu_seqlens, chunk_indices, IS_VARLEN: tl.constexpr):
    """A program of a per-chunk grid: (bos, sequence length, chunk within the sequence, global chunk index,
    the chunk's 64 row indices within the sequence, which of them lie inside it)."""
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + pid_t * 2).to(tl.int64)
        i_t = tl.load(chunk_indices + pid_t * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        i_c = pid_t.to(tl.int64)
    else:
        bos = i_b.to(tl.int64) * T
        length = T.to(tl.int64) + 0 * bos
        i_t = pid_t.to(tl.int64)
        i_c = i_b.to(tl.int64) * tl.cdiv(T, 64) + pid_t
    r = i_t * 64 + tl.arange(0, 64)
    return bos, length, i_t, i_c, r, r < length


@triton.jit
def sequence_bounds(i_n, T, cu_seqlens, chunk_offsets, IS_VARLEN: tl.constexpr):
    """A program of a per-sequence grid: (bos, sequence length, global index of its first chunk)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        length = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
        boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    else:
        bos = i_n.to(tl.int64) * T
        length = T.to(tl.int64) + 0 * bos
        boh = i_n.to(tl.int64) * tl.cdiv(T, 64)
    return bos, length, boh


@triton.jit
def state_tile(i_v, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, STATE_V_FIRST: tl.constexpr):
    """The [K, BV] state tile i_v: its rows, its columns, the column mask, and its element offsets in a
    [K, V] state (or a [V, K] one with state_v_first)."""
    ck = tl.arange(0, K)
    cv = i_v * BV + tl.arange(0, BV)
    if STATE_V_FIRST:
        s_off = cv[None, :] * K + ck[:, None]
    else:
        s_off = ck[:, None] * V + cv[None, :]
    return ck, cv, cv < V, s_off
