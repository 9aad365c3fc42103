"""The warm-up route of the sm90 forward's context parallelism (backends/tilelang_sm90/warmup.py), in float64
on a CPU: each segment's initial state from a few chunks run from zero is within e^LOG_BOUND of the exact one,
the warm-up is the shortest that the bound allows, and it reaches back to the sequence's start (exact) where
the gates barely decay."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from gdnkit.backends.tilelang_sm90 import warmup

CHUNK = warmup.CHUNK


def _run(S, k, v, g, beta, lo, hi):
    """The token recurrence over [lo, hi) for one value head: S <- e^g (I - beta k k^T) S + beta k v^T."""
    for t in range(lo, hi):
        S = S * math.exp(g[t])
        S = S + beta[t] * torch.outer(k[t], v[t] - S.T @ k[t])
    return S


@settings(max_examples=25, deadline=None)
@given(n_chunks=st.integers(3, 7), seg=st.integers(1, 3), limit=st.integers(1, 6),
       rates=st.lists(st.sampled_from([1e-4, 0.05, 0.2, 1.0]), min_size=2, max_size=2),
       key_norm=st.sampled_from([1.0, 1.6]), beta_max=st.sampled_from([1.0, 2.0]), seed=st.integers(0, 2**16))
def test_warmup_states_are_within_the_bound_and_shortest(n_chunks, seg, limit, rates, key_norm, beta_max, seed):
    gen = torch.Generator().manual_seed(seed)
    H, HV, Kd, Vd = 1, 2, 8, 4
    T = n_chunks * CHUNK - 5                       # a tail chunk
    k = torch.nn.functional.normalize(torch.randn(1, T, H, Kd, generator=gen, dtype=torch.float64), dim=-1)
    k = k * key_norm
    v = torch.randn(1, T, HV, Vd, generator=gen, dtype=torch.float64)
    g = -torch.rand(1, T, HV, generator=gen, dtype=torch.float64) * torch.tensor(rates, dtype=torch.float64)
    beta = torch.rand(1, T, HV, generator=gen, dtype=torch.float64) * beta_max
    h0 = torch.randn(HV, Kd, Vd, generator=gen, dtype=torch.float64)

    starts = list(range(0, n_chunks, seg))          # one sequence cut every `seg` chunks
    t = warmup.tables([s * CHUNK for s in starts] + [T], [0, len(starts)], starts, [0, T], torch.device("cpu"))
    log_b = warmup.log_norm_bound(g, k, beta)
    m = warmup.warmup_chunks(t, g, k, beta, limit).tolist()

    for j, s in enumerate(starts):
        x0 = s * CHUNK
        if s == 0:
            assert m[j] == 0
            continue
        if m[j] == limit + 1:                       # no warm-up within the limit: the bound says why
            assert s > limit and all((log_b[x0 - CHUNK * mm:x0].sum(0) > warmup.LOG_BOUND).any() for mm in
                                     range(1, limit + 1))
            continue
        assert 1 <= m[j] <= min(s, limit)
        x = x0 - CHUNK * m[j]
        bound = log_b[x:x0].sum(0)                   # per head
        exact = m[j] == s
        assert exact or (bound <= warmup.LOG_BOUND).all()
        if m[j] > 1:                                 # one chunk fewer would not do
            assert (log_b[x + CHUNK:x0].sum(0) > warmup.LOG_BOUND).any()
        for hv in range(HV):
            kh, vh, gh, bh = k[0, :, hv // (HV // H)], v[0, :, hv], g[0, :, hv].tolist(), beta[0, :, hv].tolist()
            at_x = _run(h0[hv], kh, vh, gh, bh, 0, x)
            true = _run(at_x, kh, vh, gh, bh, x, x0)
            warm = _run(h0[hv] if exact else torch.zeros(Kd, Vd, dtype=torch.float64), kh, vh, gh, bh, x, x0)
            err = (warm - true).norm()
            assert err <= math.exp(bound[hv]) * at_x.norm() * (1 + 1e-9) + 1e-12, (err, bound[hv])
            if exact:
                assert err <= 1e-12 * (1 + true.norm())


@settings(max_examples=25, deadline=None)
@given(n_chunks=st.integers(3, 9), seg=st.integers(1, 4), limit=st.integers(1, 8), first=st.integers(1, 3),
       rate=st.sampled_from([1e-3, 0.1, 0.3, 1.0]), reverse=st.booleans(), seed=st.integers(0, 2**16))
def test_lengths_from_a_first_window_equal_the_full_search(n_chunks, seg, limit, first, rate, reverse, seed):
    """warmup_lengths reads a short window first and the whole `limit` only where that leaves a segment unsettled:
    its answer is warmup_chunks' over the whole limit, whichever branch it takes."""
    gen = torch.Generator().manual_seed(seed)
    T = n_chunks * CHUNK - 9
    k = torch.nn.functional.normalize(torch.randn(1, T, 1, 8, generator=gen, dtype=torch.float64), dim=-1)
    g = -torch.rand(1, T, 2, generator=gen, dtype=torch.float64) * rate
    beta = torch.rand(1, T, 2, generator=gen, dtype=torch.float64)
    starts = list(range(0, n_chunks, seg))
    t = warmup.tables([s * CHUNK for s in starts] + [T], [0, len(starts)], starts, [0, T], torch.device("cpu"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(warmup, "FIRST_WINDOW", first)
        got = warmup.warmup_lengths(t, g, k, beta, limit, reverse)
    assert got == warmup.warmup_chunks(t, g, k, beta, limit, reverse).tolist()


def test_launch_gathers_each_warmup_as_its_own_sequence():
    """Two sequences: segments 1 and 2 of the first need 2 and 1 chunks, the second's first segment none."""
    t = warmup.tables([0, 192, 384, 500, 628], [0, 3, 4], [0, 3, 6, 8], [0, 500, 628], torch.device("cpu"))
    w = warmup.launch(t, [0, 2, 1, 0], torch.device("cpu"))
    assert w.segments == (1, 2) and w.exact == (False, False)
    assert w.tokens.tolist() == list(range(64, 192)) + list(range(320, 384))
    assert w.chunk_rows.tolist() == [1, 2, 5]
    assert w.cu_seqlens.tolist() == [0, 128, 192] and w.chunk_offsets.tolist() == [0, 2, 3]
    w = warmup.launch(t, [0, 3, 6, 0], torch.device("cpu"))   # both reach back to the sequence's start
    assert w.exact == (True, True) and w.chunk_rows.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5]


def _run_back(D, k, F, g, beta, hi, lo):
    """The adjoint recurrence over tokens [lo, hi), last first: D <- e^g (I - beta k k^T) D + F_t (the backward's
    dS chain, with arbitrary per-token injections F)."""
    for t in reversed(range(lo, hi)):
        D = math.exp(g[t]) * (D - beta[t] * torch.outer(k[t], k[t] @ D)) + F[t]
    return D


@settings(max_examples=20, deadline=None)
@given(n_chunks=st.integers(3, 7), seg=st.integers(1, 3), limit=st.integers(1, 6),
       rates=st.lists(st.sampled_from([1e-4, 0.05, 0.2, 1.0]), min_size=2, max_size=2),
       beta_max=st.sampled_from([1.0, 2.0]), seed=st.integers(0, 2**16))
def test_reverse_warmup_bounds_the_dS_chain(n_chunks, seg, limit, rates, beta_max, seed):
    """The backward's warm-up: each segment's dS_end from the chunks after it, run from zero (from dht where
    they reach the sequence's end), within the bound of the true one."""
    gen = torch.Generator().manual_seed(seed)
    H, HV, Kd, Vd = 1, 2, 8, 4
    T = n_chunks * CHUNK - 5
    k = torch.nn.functional.normalize(torch.randn(1, T, H, Kd, generator=gen, dtype=torch.float64), dim=-1)
    g = -torch.rand(1, T, HV, generator=gen, dtype=torch.float64) * torch.tensor(rates, dtype=torch.float64)
    beta = torch.rand(1, T, HV, generator=gen, dtype=torch.float64) * beta_max
    F = torch.randn(T, HV, Kd, Vd, generator=gen, dtype=torch.float64)
    dht = torch.randn(HV, Kd, Vd, generator=gen, dtype=torch.float64)
    starts = list(range(0, n_chunks, seg))
    bounds = [s * CHUNK for s in starts] + [T]
    t = warmup.tables(bounds, [0, len(starts)], starts, [0, T], torch.device("cpu"))
    log_b = warmup.log_norm_bound(g, k, beta)
    m = warmup.warmup_chunks(t, g, k, beta, limit, reverse=True).tolist()
    w = warmup.launch(t, m, torch.device("cpu"), reverse=True)
    for j in range(len(starts)):
        e, after = bounds[j + 1], t.after_host[j]
        if after == 0:
            assert m[j] == 0
            continue
        if m[j] == limit + 1:
            assert after > limit
            continue
        x = min(e + CHUNK * m[j], T)
        exact = m[j] == after
        assert (exact and x == T) or (log_b[e:x].sum(0) <= warmup.LOG_BOUND).all()
        i = w.segments.index(j)
        assert w.tokens[int(w.cu_seqlens[i]):int(w.cu_seqlens[i + 1])].tolist() == list(range(e, x))
        for hv in range(HV):
            kh, gh, bh = k[0, :, 0], g[0, :, hv].tolist(), beta[0, :, hv].tolist()
            at_x = _run_back(dht[hv], kh, F[:, hv], gh, bh, T, x)
            true = _run_back(at_x, kh, F[:, hv], gh, bh, x, e)
            warm = _run_back(dht[hv] if exact else torch.zeros(Kd, Vd, dtype=torch.float64), kh, F[:, hv], gh, bh, x, e)
            bound = math.exp(float(log_b[e:x, hv].sum()))
            assert (warm - true).norm() <= bound * at_x.norm() * (1 + 1e-9) + 1e-12
