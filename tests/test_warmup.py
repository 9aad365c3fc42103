"""The warm-up route of the sm90 forward's context parallelism (backends/tilelang_sm90/warmup.py), in float64
on a CPU: each segment's initial state from a few chunks run from zero is within e^LOG_BOUND of the exact one,
the warm-up is the shortest that the bound allows, and it reaches back to the sequence's start (exact) where
the gates barely decay."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from gdnkit.backends.tilelang_sm90 import warmup

CHUNK = warmup.CHUNK


def _log_norm_bound(g, k, beta):
    """log b_t per token and value head [tokens, HV] in float64: the bound's definition (warmup.warmup_chunks)."""
    HV, H = g.shape[-1], k.shape[2]
    kk = (k[0].float() ** 2).sum(-1).double().repeat_interleave(HV // H, dim=1)     # ||k_t||^2 per value head
    return g[0].double() + (1 - beta[0].double() * kk).abs().clamp_min(1.0).log()


def _warmup_chunks_reference(t, g, k, beta, limit, reverse=False):
    """warmup.warmup_chunks' contract in PyTorch over all tokens: running bound sums per chunk away from each
    segment, the first chunk count where every head is settled (or the chunks available), else limit + 1."""
    log_b = _log_norm_bound(g, k, beta)
    out = []
    for j in range(t.starts.shape[0]):
        avail = (t.after_host if reverse else t.before_host)[j]
        first = limit + 1
        total = torch.zeros(g.shape[-1], dtype=torch.float64)
        for m in range(1, limit + 1):
            if reverse:
                lo, hi = t.ends_host[j] + CHUNK * (m - 1), min(t.ends_host[j] + CHUNK * m, t.seq_ends_host[j])
            else:
                lo = max(t.starts_host[j] - CHUNK * m, t.starts_host[j] - CHUNK * avail)
                hi = t.starts_host[j] - CHUNK * (m - 1)
            total = total + log_b[lo:max(lo, hi)].sum(0)
            if m <= avail and ((total <= warmup.LOG_BOUND).all() or m == avail):
                first = m
                break
        out.append(0 if avail == 0 else first)
    return out


def _run(S, k, v, g, beta, lo, hi):
    """The token recurrence over [lo, hi) for one value head: S <- e^g (I - beta k k^T) S + beta k v^T."""
    for t in range(lo, hi):
        S = S * math.exp(g[t])
        S = S + beta[t] * torch.outer(k[t], v[t] - S.T @ k[t])
    return S


@settings(max_examples=25, deadline=None)
@given(n_chunks=st.integers(3, 7), seg=st.integers(1, 3), limit=st.integers(0, 6),
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
    log_b = _log_norm_bound(g, k, beta)
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
@given(n_chunks=st.integers(3, 9), seg=st.integers(1, 4), limit=st.integers(0, 8), first=st.integers(1, 3),
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


def _segmented_draw(lengths, seg, heads, K, rate, beta_max, seed):
    """(tables, g, k, beta): sequences of `lengths` packed and cut every `seg` chunks, keys of norm 1 to 1.6,
    gates -U(0, rate), beta U(0, beta_max), all float64."""
    gen = torch.Generator().manual_seed(seed)
    H, HV = heads
    T = sum(lengths)
    k = torch.nn.functional.normalize(torch.randn(1, T, H, K, generator=gen, dtype=torch.float64), dim=-1)
    k = k * (1 + 0.6 * torch.rand(1, T, H, 1, generator=gen, dtype=torch.float64))
    g = -torch.rand(1, T, HV, generator=gen, dtype=torch.float64) * rate
    beta = torch.rand(1, T, HV, generator=gen, dtype=torch.float64) * beta_max
    seq_starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cuts, seg_offsets, rows, row = [], [0], [], 0
    for a, b in zip(seq_starts[:-1], seq_starts[1:]):
        starts = list(range(a, b, seg * CHUNK))
        cuts += starts
        rows += [row + (s - a) // CHUNK for s in starts]
        row += -(-(b - a) // CHUNK)
        seg_offsets.append(len(cuts))
    return warmup.tables(cuts + [T], seg_offsets, rows, seq_starts, torch.device("cpu")), g, k, beta


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 5 * CHUNK), min_size=1, max_size=3), seg=st.integers(1, 3),
       limit=st.integers(0, 6), heads=st.sampled_from([(1, 1), (1, 3), (2, 4), (2, 6)]), K=st.sampled_from([8, 24]),
       rate=st.sampled_from([1e-3, 0.05, 0.2, 0.3, 1.0]), beta_max=st.sampled_from([1.0, 2.0]), reverse=st.booleans(),
       seed=st.integers(0, 2**16))
# three value heads padded to four, settled by the bound after one chunk, both directions: a padding head that
# counted as unsettled (a bug this test once let through on its random draws) turns these into exact searches
@example(lengths=[129], seg=1, limit=1, heads=(1, 3), K=8, rate=1.0, beta_max=1.0, reverse=False, seed=0)
@example(lengths=[129], seg=1, limit=1, heads=(1, 3), K=8, rate=1.0, beta_max=1.0, reverse=True, seed=0)
def test_the_search_kernel_matches_its_definition(lengths, seg, limit, heads, K, rate, beta_max, reverse, seed):
    """warmup_chunks (two Triton launches, warmup_bound.py) against the definition in PyTorch:
    several sequences with tails, grouped heads, a K that is not a power of two, keys of norm up to 1.6 and
    beta up to 2 (stretching maps), both directions."""
    t, g, k, beta = _segmented_draw(lengths, seg, heads, K, rate, beta_max, seed)
    got = warmup.warmup_chunks(t, g, k, beta, limit, reverse).tolist()
    assert got == _warmup_chunks_reference(t, g, k, beta, limit, reverse)


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 5 * CHUNK), min_size=1, max_size=3), seg=st.integers(1, 3),
       window=st.integers(0, 5), heads=st.sampled_from([(1, 1), (1, 3), (2, 4)]), K=st.sampled_from([8, 24]),
       rate=st.sampled_from([1e-3, 0.05, 0.3, 1.0]), beta_max=st.sampled_from([1.0, 2.0]), reverse=st.booleans(),
       seed=st.integers(0, 2**16))
def test_needed_transitions_match_their_definition(lengths, seg, window, heads, K, rate, beta_max, reverse, seed):
    """warmup.transitions_needed (the gated route's device flags): per segment j and value head, a warm-up of
    m = min(window, available) chunks is settled if m reaches the sequence's boundary or the bound summed over
    those m chunks is <= LOG_BOUND; where it is not, the segment handing j its state (j - 1; j + 1 with reverse)
    is flagged. Against the bound in PyTorch; every other flag is 0."""
    t, g, k, beta = _segmented_draw(lengths, seg, heads, K, rate, beta_max, seed)
    log_b = _log_norm_bound(g, k, beta)
    want = torch.zeros(t.starts.shape[0], heads[1], dtype=torch.int32)
    for j in range(t.starts.shape[0]):
        avail = (t.after_host if reverse else t.before_host)[j]
        m = min(window, avail)
        if avail == 0:
            continue
        if reverse:
            lo, hi = t.ends_host[j], min(t.ends_host[j] + CHUNK * m, t.seq_ends_host[j])
        else:
            lo, hi = t.starts_host[j] - CHUNK * m, t.starts_host[j]
        unsettled = (m < avail) & (log_b[lo:hi].sum(0) > warmup.LOG_BOUND)
        want[j + 1 if reverse else j - 1] = unsettled.to(torch.int32)
    got = warmup.transitions_needed(t, g, k, beta, window, reverse)
    assert got.dtype == torch.int32 and torch.equal(got, want)


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
@given(n_chunks=st.integers(3, 7), seg=st.integers(1, 3), limit=st.integers(0, 6),
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
    log_b = _log_norm_bound(g, k, beta)
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
