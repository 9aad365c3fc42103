"""The lead-ins of the sm90 context parallelism (backends/tilelang_sm90/lead_in.py), in float64 on a CPU: where
the device flags a segment's fixed lead-in as settled, its initial state from those chunks run from zero is
within e^LOG_BOUND of the exact one (exact where it reaches the sequence's start); the flags and the chained
route's walk lengths against their definitions; the lead-in launch's gathers."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from gdnkit.backends.tilelang_sm90 import lead_in
from gdnkit.backends.tilelang_sm90.config import current

pytest.importorskip("triton")  # the lead-in kernels run in Triton's interpreter on a CPU (the gpu extra)

CHUNK = lead_in.CHUNK
LOG_BOUND = current().log_bound   # the bound the lead-in functions take by default


def _log_norm_bound(g, k, beta):
    """log b_t per token and value head [tokens, HV] in float64: the bound's definition (lead_in.py)."""
    HV, H = g.shape[-1], k.shape[2]
    kk = (k[0].float() ** 2).sum(-1).double().repeat_interleave(HV // H, dim=1)     # ||k_t||^2 per value head
    return g[0].double() + (1 - beta[0].double() * kk).abs().clamp_min(1.0).log()


def _row_sums(t, log_b):
    """[n_rows, HV] fp32: the bound summed over each chunk-table row's tokens (the intra kernel's emit_bound)."""
    return torch.stack([log_b[int(a):int(b)].sum(0) for a, b in zip(t.row_starts, t.row_ends)]).float()


def _run(S, k, v, g, beta, lo, hi):
    """The token recurrence over [lo, hi) for one value head: S <- e^g (I - beta k k^T) S + beta k v^T."""
    for t in range(lo, hi):
        S = S * math.exp(g[t])
        S = S + beta[t] * torch.outer(k[t], v[t] - S.T @ k[t])
    return S


@settings(max_examples=25, deadline=None)
@given(n_chunks=st.integers(3, 7), seg=st.integers(1, 3), window=st.integers(0, 6),
       rates=st.lists(st.sampled_from([1e-4, 0.05, 0.2, 1.0]), min_size=2, max_size=2),
       key_norm=st.sampled_from([1.0, 1.6]), beta_max=st.sampled_from([1.0, 2.0]), seed=st.integers(0, 2**16))
def test_settled_lead_in_states_are_within_the_bound(n_chunks, seg, window, rates, key_norm, beta_max, seed):
    """Per segment and head, the lead-in of m = min(window, available) chunks: where transitions_needed leaves
    it unflagged (settled: the bound summed over its chunks <= LOG_BOUND, or it reaches the sequence's start),
    its state run from zero (from h0 where it reaches the start) is within e^bound of the true state; where it
    flags it, the bound says why. Keys of norm 1.6 and beta up to 2 stretch the maps."""
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
    t = lead_in.tables([s * CHUNK for s in starts] + [T], [0, len(starts)], starts, [0, T], torch.device("cpu"))
    log_b = _log_norm_bound(g, k, beta)
    need = lead_in.transitions_needed(t, g, k, beta, window)

    for j, s in enumerate(starts[1:], start=1):
        x0 = s * CHUNK
        m = min(window, s)
        x = x0 - CHUNK * m
        bound = log_b[x:x0].sum(0)                  # per head
        exact = m == s
        for hv in range(HV):
            if need[j - 1, hv]:                     # flagged: the lead-in falls short, by the bound
                assert not exact and bound[hv] > LOG_BOUND
                continue
            assert exact or bound[hv] <= LOG_BOUND
            kh, vh, gh, bh = k[0, :, hv // (HV // H)], v[0, :, hv], g[0, :, hv].tolist(), beta[0, :, hv].tolist()
            at_x = _run(h0[hv], kh, vh, gh, bh, 0, x)
            true = _run(at_x, kh, vh, gh, bh, x, x0)
            lead_in_states = _run(h0[hv] if exact else torch.zeros(Kd, Vd, dtype=torch.float64), kh, vh, gh, bh, x, x0)
            err = (lead_in_states - true).norm()
            assert err <= math.exp(bound[hv]) * at_x.norm() * (1 + 1e-9) + 1e-12, (err, bound[hv])
            if exact:
                assert err <= 1e-12 * (1 + true.norm())


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
    return lead_in.tables(cuts + [T], seg_offsets, rows, seq_starts, torch.device("cpu")), g, k, beta


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 5 * CHUNK), min_size=1, max_size=3), seg=st.integers(1, 3),
       window=st.integers(0, 5), heads=st.sampled_from([(1, 1), (1, 3), (2, 4)]), K=st.sampled_from([8, 24]),
       rate=st.sampled_from([1e-3, 0.05, 0.3, 1.0]), beta_max=st.sampled_from([1.0, 2.0]), reverse=st.booleans(),
       seed=st.integers(0, 2**16))
# three value heads padded to four, settled by the bound after one chunk, both directions: a padding head that
# counted as unsettled (a bug the search kernel's test once let through on its random draws) flags every segment
@example(lengths=[129], seg=1, window=1, heads=(1, 3), K=8, rate=1.0, beta_max=1.0, reverse=False, seed=0)
@example(lengths=[129], seg=1, window=1, heads=(1, 3), K=8, rate=1.0, beta_max=1.0, reverse=True, seed=0)
def test_needed_transitions_match_their_definition(lengths, seg, window, heads, K, rate, beta_max, reverse, seed):
    """lead_in.transitions_needed (the gated route's device flags): per segment j and value head, a lead-in of
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
        unsettled = (m < avail) & (log_b[lo:hi].sum(0) > LOG_BOUND)
        want[j + 1 if reverse else j - 1] = unsettled.to(torch.int32)
    got = lead_in.transitions_needed(t, g, k, beta, window, reverse)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    # from per-row sums (the training forward's intra kernel writes them, fp32): the same test over the same
    # chunks, read at each segment's rows (a wrong row or direction reads another chunk's sum)
    rows = _row_sums(t, log_b)
    want_rows = torch.zeros_like(want)
    for j in range(t.starts.shape[0]):
        avail = (t.after_host if reverse else t.before_host)[j]
        if avail == 0:
            continue
        m = min(window, avail)
        first = int(t.end_rows[j]) if reverse else t.chunk_rows_host[j] - m
        total = rows[first:first + m].double().sum(0)
        want_rows[j + 1 if reverse else j - 1] = ((m < avail) & (total > LOG_BOUND)).to(torch.int32)
    got = lead_in.transitions_needed(t, g, k, beta, window, reverse, row_sums=rows)
    assert torch.equal(got, want_rows), (got, want_rows)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(1, 9 * CHUNK), min_size=1, max_size=3), seg=st.integers(1, 3),
       heads=st.sampled_from([(1, 1), (1, 3), (2, 4)]), K=st.sampled_from([8, 24]),
       rate=st.sampled_from([1e-3, 0.01, 0.05, 0.3, 1.0]), beta_max=st.sampled_from([1.0, 2.0]),
       reverse=st.booleans(), seed=st.integers(0, 2**16))
# a sequence of 70 chunks cut every chunk: walks past the kernel's first block of 64 chunk sums
@example(lengths=[70 * CHUNK], seg=1, heads=(1, 3), K=8, rate=0.01, beta_max=1.0, reverse=False, seed=0)
@example(lengths=[70 * CHUNK], seg=1, heads=(1, 3), K=8, rate=0.01, beta_max=1.0, reverse=True, seed=0)
def test_walks_match_their_definition(lengths, seg, heads, K, rate, beta_max, reverse, seed):
    """lead_in.walk_lengths (the chained route's walks): per segment j and value head, the fewest whole chunks
    next to it (before it; after it with reverse, a tail counting) whose bound summed nearest first is <=
    LOG_BOUND, or all the chunks to the sequence's boundary; 0 where there are none. Against the bound in
    PyTorch."""
    t, g, k, beta = _segmented_draw(lengths, seg, heads, K, rate, beta_max, seed)
    want = _walks_by_definition(t, _log_norm_bound(g, k, beta), reverse)
    got = lead_in.walk_lengths(t, g, k, beta, reverse)
    assert got.dtype == torch.int32 and torch.equal(got, want), (got, want)


def _walks_by_definition(t, log_b, reverse):
    """[n_seg, HV] int32: per segment and value head, the fewest whole chunks next to it (nearest first) whose
    summed bound is <= LOG_BOUND, else all of them to the sequence's boundary."""
    want = torch.zeros(t.starts.shape[0], log_b.shape[1], dtype=torch.int32)
    for j in range(t.starts.shape[0]):
        avail = (t.after_host if reverse else t.before_host)[j]
        for hv in range(log_b.shape[1]):
            total, m = 0.0, avail
            for i in range(avail):
                if reverse:
                    lo, hi = t.ends_host[j] + CHUNK * i, min(t.ends_host[j] + CHUNK * (i + 1), t.seq_ends_host[j])
                else:
                    lo, hi = t.starts_host[j] - CHUNK * (i + 1), t.starts_host[j] - CHUNK * i
                total += float(log_b[lo:hi, hv].sum())
                if total <= LOG_BOUND:
                    m = i + 1
                    break
            want[j, hv] = m
    return want


@pytest.mark.parametrize("reverse", [False, True])
def test_walks_read_on_while_any_head_lacks_its_count(reverse):
    """The walks' search reads its blocks of 64 chunk sums only until every head has its count. Four heads over a
    150-chunk sequence cut every 20 chunks, beta = 0 (the bound is the gates' sum): one settles in a chunk, one
    after 75 (the second block), one after 140 (the third), one never (to the boundary). A search that stopped
    after a block, or once any head settled, gives the slow heads' counts wrong."""
    t, g, k, beta = _segmented_draw([150 * CHUNK], 20, (1, 4), 8, 1.0, 0.0, 0)
    per_chunk = torch.tensor([-64.0, -12.0 / 74.5, -12.0 / 139.5, -1e-4], dtype=torch.float64)
    g = (per_chunk / CHUNK).expand(1, g.shape[1], 4).clone()
    want = _walks_by_definition(t, _log_norm_bound(g, k, beta), reverse)
    assert want[:, 1].max() > 64 and want[:, 2].max() > 128   # the blocks the search must read
    got = lead_in.walk_lengths(t, g, k, beta, reverse)
    assert torch.equal(got, want), (got, want)


def test_launch_gathers_each_lead_in_as_its_own_sequence():
    """Two sequences: segments 1 and 2 of the first need 2 and 1 chunks, the second's first segment none."""
    t = lead_in.tables([0, 192, 384, 500, 628], [0, 3, 4], [0, 3, 6, 8], [0, 500, 628], torch.device("cpu"))
    w = lead_in.launch(t, [0, 2, 1, 0], torch.device("cpu"))
    assert w.segments == (1, 2) and w.exact == (False, False)
    assert w.tokens.tolist() == list(range(64, 192)) + list(range(320, 384))
    assert w.chunk_rows.tolist() == [1, 2, 5]
    assert w.cu_seqlens.tolist() == [0, 128, 192] and w.chunk_offsets.tolist() == [0, 2, 3]
    w = lead_in.launch(t, [0, 3, 6, 0], torch.device("cpu"))   # both reach back to the sequence's start
    assert w.exact == (True, True) and w.chunk_rows.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5]


def _run_back(D, k, F, g, beta, hi, lo):
    """The adjoint recurrence over tokens [lo, hi), last first: D <- e^g (I - beta k k^T) D + F_t (the backward's
    dS chain, with arbitrary per-token injections F)."""
    for t in reversed(range(lo, hi)):
        D = math.exp(g[t]) * (D - beta[t] * torch.outer(k[t], k[t] @ D)) + F[t]
    return D


@settings(max_examples=20, deadline=None)
@given(n_chunks=st.integers(3, 7), seg=st.integers(1, 3), window=st.integers(0, 6),
       rates=st.lists(st.sampled_from([1e-4, 0.05, 0.2, 1.0]), min_size=2, max_size=2),
       beta_max=st.sampled_from([1.0, 2.0]), seed=st.integers(0, 2**16))
def test_reverse_lead_in_bounds_the_dS_chain(n_chunks, seg, window, rates, beta_max, seed):
    """The backward's lead-in (lead_in.reverse_lead_in): each segment's dS_end from the fewest of min(window,
    available) chunks after it whose bound is <= LOG_BOUND (all of them where none is; the walk the reverse pass
    takes from the segment's end), run from zero (from dht where they reach the sequence's end), within the bound
    of the true one wherever the flags of the same search leave it settled; the flags are
    transitions_needed's."""
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
    t = lead_in.tables(bounds, [0, len(starts)], starts, [0, T], torch.device("cpu"))
    log_b = _log_norm_bound(g, k, beta)
    walks, need = lead_in.reverse_lead_in(t, g, k, beta, window)
    assert torch.equal(need, lead_in.transitions_needed(t, g, k, beta, window, reverse=True))
    assert walks[-1].tolist() == [0] * HV         # the last segment's dS_end is dht itself
    for j in range(len(starts) - 1):
        e, avail = bounds[j + 1], t.after_host[j]
        for hv in range(HV):
            m = int(walks[j, hv])
            x = min(e + CHUNK * m, T)
            exact = m == avail
            # the fewest chunks of the window that settle the head, else the whole window
            sums = [float(log_b[e:min(e + CHUNK * i, T), hv].sum()) for i in range(1, min(window, avail) + 1)]
            settling = [i + 1 for i, s_i in enumerate(sums) if s_i <= LOG_BOUND]
            assert m == (settling[0] if settling else min(window, avail)), (j, hv, m, sums)
            if m == 0:
                continue
            if need[j + 1, hv]:                   # flagged: the lead-in falls short, by the bound
                assert not exact and float(log_b[e:x, hv].sum()) > LOG_BOUND
                continue
            kh, gh, bh = k[0, :, 0], g[0, :, hv].tolist(), beta[0, :, hv].tolist()
            at_x = _run_back(dht[hv], kh, F[:, hv], gh, bh, T, x)
            true = _run_back(at_x, kh, F[:, hv], gh, bh, x, e)
            start = dht[hv] if exact else torch.zeros(Kd, Vd, dtype=torch.float64)
            lead_in_states = _run_back(start, kh, F[:, hv], gh, bh, x, e)
            bound = math.exp(float(log_b[e:x, hv].sum()))
            assert exact or bound <= math.exp(LOG_BOUND) * (1 + 1e-9)
            assert (lead_in_states - true).norm() <= bound * at_x.norm() * (1 + 1e-9) + 1e-12


@settings(max_examples=20, deadline=None)
@given(counts=st.lists(st.integers(0, 4), min_size=1, max_size=3), reverse=st.booleans(), has_h0=st.booleans(),
       flagged=st.sampled_from([0.0, 0.5, 1.0]), seed=st.integers(0, 2**16), in_place=st.booleans())
def test_gated_segment_states_match_the_scan(counts, reverse, has_h0, flagged, seed, in_place):
    """The gated route's segment states (triton_generic's gated_segment_states_kernel, one program per segment and
    head) against the scan they replace, a dependent step per segment: walking each sequence's segments from its
    boundary (first to last; last to first with reverse), a segment's state is the boundary's (h0 / dht, or zero)
    for the first, then the neighbour's transition (P S + E; P^T S + F with reverse) where need flags that
    neighbour, else its lead-in state. Flags none, half or all set, so chains of transitions of every length; in
    place (the states written over lead_in_states, the sm90 backward's form) too."""
    from gdnkit.backends.triton_shared.segments import segment_scan
    gen = torch.Generator().manual_seed(seed)
    HV, Kd, Vd = 2, 16, 16
    N, n_seg = len(counts), sum(counts)
    if n_seg == 0:
        return
    seg_offsets = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32)
    seq_of = torch.tensor([n for n, c in enumerate(counts) for _ in range(c)], dtype=torch.int64)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    aug, lead_in_states = r(n_seg, HV, Kd, Vd + Kd) * 0.3, r(n_seg, HV, Kd, Vd)
    f = r(n_seg, HV, Kd, Vd) if reverse else None
    h0 = r(N, HV, Kd, Vd) if has_h0 else None
    need = (torch.rand(n_seg, HV, generator=gen) < flagged).to(torch.int32)
    lead_in_copy = lead_in_states.clone()
    got, _ = segment_scan(aug, h0, seg_offsets, N, HV, Kd, Vd, False, False, "ieee", f=f, need=need,
                          lead_in_states=lead_in_states, seq_of=seq_of, in_place=in_place)
    assert (got.data_ptr() == lead_in_states.data_ptr()) == in_place
    lead_in_states = lead_in_copy
    want = torch.empty_like(got)
    for n in range(N):
        order = list(range(int(seg_offsets[n]), int(seg_offsets[n + 1])))
        order = order[::-1] if reverse else order
        for h in range(HV):
            S = h0[n, h].clone() if has_h0 else torch.zeros(Kd, Vd)
            for i, s in enumerate(order):
                want[s, h] = S
                P, E = aug[s, h, :, Vd:], aug[s, h, :, :Vd]
                if need[s, h]:
                    S = P.T @ S + f[s, h] if reverse else P @ S + E
                elif i + 1 < len(order):
                    S = lead_in_states[order[i + 1], h]
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()


class _PoisonedTorch:
    """torch, with every `empty` filled with -7: a flag a kernel leaves unwritten shows."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*shape, **kwargs):
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)) else shape
        return torch.full(tuple(shape), -7, **kwargs)


@pytest.mark.parametrize("reverse", [False, True])
def test_needed_transitions_write_every_flag(reverse, monkeypatch):
    """The flags are allocated empty, not zeroed (one launch fewer a backward): the search kernel writes every
    entry once, the first (last, with reverse) segment of each sequence its own 0. Poisoned allocations give
    the same flags as clean ones, over sequences of one and of several segments."""
    from gdnkit.backends.tilelang_sm90 import lead_in_bound
    t, g, k, beta = _segmented_draw([200, 40, 300, 129], 1, (2, 4), 8, 0.3, 1.0, 3)
    clean = [lead_in.transitions_needed(t, g, k, beta, w, reverse) for w in range(4)]
    monkeypatch.setattr(lead_in_bound, "torch", _PoisonedTorch())
    poisoned = [lead_in.transitions_needed(t, g, k, beta, w, reverse) for w in range(4)]
    for w, (a, b) in enumerate(zip(clean, poisoned)):
        assert (b >= 0).all() and torch.equal(a, b), f"window {w}: {b.tolist()} against {a.tolist()}"
    assert any(bool(a.any()) for a in clean)   # some flags are set: the comparison is not all zeros
