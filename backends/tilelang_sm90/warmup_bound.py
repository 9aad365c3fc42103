"""warmup.warmup_chunks as one Triton launch: per segment, the fewest chunks next to it whose summed norm bound
is below LOG_BOUND for every value head (warmup.py says why that bound suffices).

The PyTorch form of the same search (gathers of the window's g, beta and k, float64 casts and bounds, a sum per
chunk, a cumulative sum, the first chunk where every head is settled) was ~35 small ops a call, twice a training
call: ~0.1 ms of device time in ~50 launches and as many host dispatches at 4/8 1x8192 (H200, session 9),
where the whole backward takes 0.37 ms. One program per segment walks its window a chunk at a time instead.

Imported only where context parallelism runs (context_parallel.available: triton importable)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = tl.constexpr(64)  # a jit-visible global must be constexpr (the interpreter does not check it)
# tokens a step: 64 made [64, HV] float64 tiles that spilled 1.6-5 KB a thread, and unrolled loops over the rows
# and key heads still 0.4-1.4 KB; 16 rows with both loops rolled: 162-219 registers, no spills (sm90, Triton
# 3.6, offline builds at 2/6, 4/8, 16/64)
ROWS = tl.constexpr(16)


@triton.jit
def _warmup_chunks_kernel(g, k, beta, starts, ends, seq_ends, before, after, out, limit, n_tok,
                          H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, HVP: tl.constexpr,
                          KP: tl.constexpr, REVERSE: tl.constexpr, LOG_BOUND: tl.constexpr):
    """Segment j: its window's chunks m = 1 .. limit, away from it (before it; after it with REVERSE). Per
    token and value head log b_t = g_t + log max(1, |1 - beta_t ||k_t||^2|) in float64 (||k_t||^2 in fp32, as
    warmup.log_norm_bound), tokens outside the sequence adding 0; the answer is the first m whose running sum
    is <= LOG_BOUND for every head, or m = the chunks available (exact), or limit + 1; 0 where none are."""
    j = tl.program_id(0).to(tl.int64)
    hv = tl.arange(0, HVP)
    mh = hv < HV
    ck = tl.arange(0, KP)
    mk = ck < K
    row = tl.arange(0, ROWS).to(tl.int64)
    if REVERSE:
        base = tl.load(ends + j)
        edge = tl.load(seq_ends + j)        # tokens at or past it lie beyond the sequence
        avail = tl.load(after + j)
    else:
        base = tl.load(starts + j)
        avail = tl.load(before + j)
        edge = base - CHUNK * avail         # tokens before it lie before the sequence
    total = tl.zeros([HVP], dtype=tl.float64)
    first = avail * 0 + limit + 1
    for m in range(0, limit):
        chunk_sum = tl.zeros([HVP], dtype=tl.float64)
        for r0 in range(0, CHUNK, ROWS):
            if REVERSE:
                tok = base + m * CHUNK + r0 + row
                inside = tok < edge
            else:
                tok = base - 1 - m * CHUNK - r0 - row
                inside = tok >= edge
            tok = tl.minimum(tl.maximum(tok, 0), n_tok - 1)
            gg = tl.load(g + tok[:, None] * HV + hv[None, :], mask=mh[None, :], other=0.0).to(tl.float64)
            bb = tl.load(beta + tok[:, None] * HV + hv[None, :], mask=mh[None, :], other=0.0).to(tl.float64)
            kk = tl.zeros([ROWS, HVP], dtype=tl.float32)
            for h in range(H):              # ||k||^2 of key head h, to the value heads that share it
                kt = tl.load(k + (tok[:, None] * H + h) * K + ck[None, :], mask=mk[None, :], other=0.0)
                norm = tl.sum(kt.to(tl.float32) * kt.to(tl.float32), 1)
                kk += tl.where((hv // (HV // H) == h)[None, :], norm[:, None], 0.0)
            stretch = tl.log(tl.maximum(tl.abs(1.0 - bb * kk.to(tl.float64)), 1.0))
            chunk_sum += tl.sum(tl.where(inside[:, None] & mh[None, :], gg + stretch, 0.0), 0)
        total += chunk_sum
        settled = tl.sum(tl.where(mh & (total > LOG_BOUND), 1, 0), 0) == 0   # padding heads never block
        ok = (m + 1 <= avail) & (settled | (m + 1 == avail))
        first = tl.where(ok & (first == limit + 1), m + 1, first)
    tl.store(out + j, tl.where(avail == 0, 0, first))


def warmup_chunks(starts: torch.Tensor, ends: torch.Tensor, seq_ends: torch.Tensor, before: torch.Tensor,
                  after: torch.Tensor, g: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, limit: int,
                  reverse: bool, log_bound: float) -> torch.Tensor:
    """[n_seg] int64 (warmup.warmup_chunks' contract), from the segment tables and the kernels' inputs g, beta
    [1, tokens, HV] and k [1, tokens, H, K], each contiguous."""
    _, n_tok, HV = g.shape
    H, K = k.shape[2], k.shape[3]
    n_seg = starts.shape[0]
    out = torch.empty(n_seg, dtype=torch.int64, device=g.device)
    if n_seg:
        _warmup_chunks_kernel[(n_seg,)](g, k, beta, starts, ends, seq_ends, before, after, out, limit, n_tok,
                                        H=H, HV=HV, K=K, HVP=triton.next_power_of_2(HV),
                                        KP=triton.next_power_of_2(K), REVERSE=reverse, LOG_BOUND=log_bound,
                                        num_warps=4)
    return out
