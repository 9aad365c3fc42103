"""tilelang_sm90's host side on a CPU, the kernels replaced by stand-ins that record their launches and compute in
torch: which kernels a forward or backward launches for each route, their arguments, and that the route's
results match the plain path's."""
import dataclasses
import inspect
import sys

import pytest
import torch
import torch.nn.functional as F

import gdnkit
from gdnkit.prologue import triton_reads

from .helpers import K, V, _rel, _tilelang


def _assert_padding_finite(cu, *loaded) -> None:
    """The tokens past the last sequence, which a kernel's whole-chunk loads reach, hold finite values (the
    forward's zeroed copy), never a padded buffer's NaN: a masked-out NaN would still poison the last chunk."""
    end = int(cu[-1])
    assert all(torch.isfinite(x[0, end:]).all() for x in loaded), "a kernel would load the caller's padding"


def _intra_stand_in(k, g, beta, cu, table, a, gamma, tm, bound):
    """What the intra-chunk kernel writes (its contract, in float64): gamma per chunk row, Tb = T diag(beta)
    rows, T's rows into tm and the walks' chunk sums into bound unless each is the 1-element placeholder."""
    _assert_padding_finite(cu, k, g, beta)
    grp = g.shape[2] // k.shape[2]
    for row, (seq, ic) in enumerate(table.tolist()):
        t0 = int(cu[seq]) + ic * 64
        n = min(int(cu[seq + 1]) - t0, 64)
        for hv in range(g.shape[2]):
            kk = k[0, t0:t0 + n, hv // grp].double()
            gs, bs = g[0, t0:t0 + n, hv].double().cumsum(0), beta[0, t0:t0 + n, hv].double()
            i = torch.arange(n)
            A = torch.where(i[:, None] > i[None, :], (kk @ kk.T) * bs[:, None] * torch.exp(gs[:, None] - gs[None, :]), 0.0)
            Tm = torch.linalg.inv(torch.eye(n, dtype=torch.float64) + A)
            a[0, t0:t0 + n, hv] = torch.nn.functional.pad(Tm * bs[None, :], (0, 64 - n)).to(a.dtype)
            if tm.numel() > 1:
                tm[0, t0:t0 + n, hv] = torch.nn.functional.pad(Tm, (0, 64 - n)).to(tm.dtype)
            gamma[hv, row, :n] = gs.float()
            gamma[hv, row, n:] = gs[-1].float()
            if bound.numel() > 1:   # lead_in.py's bound: g_t + log max(1, |1 - beta_t ||k_t||^2|) summed
                kn = (kk * kk).sum(1)
                bound[row, hv] = (gs[-1] + torch.log(torch.clamp((1 - bs * kn).abs(), min=1.0)).sum()).float()


def test_wide_route_picked_by_the_longest_walk():
    """16/64 1x32768 cut in two: a walk of a chunk keeps the wide route (257 wide steps against 512 64-column
    ones), a slow head's 175-chunk walk sends it to the pass without segments (431 x 1.45 > 512); each pass gets
    its cu_seqlens (and the wide one its walks) as they are where it is picked, zeros where not."""
    pytest.importorskip("triton")
    from gdnkit import seqlayout
    from gdnkit.backends.tilelang_sm90 import context_parallel
    layout = seqlayout.sequence_layout(torch.tensor([0, 32768]))
    plan = context_parallel.plan_segments(layout, 256)
    assert plan.own.tolist() == [256, 256]
    settle = torch.tensor([[0] * 64, [1] * 64], dtype=torch.int32)
    slow = settle.clone()
    slow[1, 5] = 175
    for walk, wide in ((settle, True), (slow, False)):
        wide_cu, wide_walk, plain_cu, choice = context_parallel.pick(plan, walk, layout)
        assert bool(choice) == wide and choice.dtype == torch.bool and choice.dim() == 0
        assert torch.equal(wide_cu, plan.segments.cu_seqlens if wide else torch.zeros_like(wide_cu))
        assert torch.equal(wide_walk, walk if wide else torch.zeros_like(walk))
        assert torch.equal(plain_cu, torch.zeros_like(plain_cu) if wide else layout.cu_seqlens)


def test_wide_route_in_waves_picked_by_the_longest_walk():
    """16/48 with 28672 + 4096 tokens in 64-chunk segments: 8 x 48 programs in three waves of the SMs, each wave
    as long as its longest program, against the plain pass at 128 columns (one wide step for one): a walk of a
    chunk keeps the segments (3 x 65 steps against 448), a slow head's 100-chunk walk does not (3 x 164)."""
    pytest.importorskip("triton")
    from gdnkit import seqlayout
    from gdnkit.backends.tilelang_sm90 import context_parallel
    layout = seqlayout.sequence_layout(torch.tensor([0, 28672, 32768]))
    plan = context_parallel.plan_segments(layout, 64)
    assert plan.own.tolist() == [64] * 8
    settle = torch.ones(8, 48, dtype=torch.int32)
    slow = settle.clone()
    slow[3, 7] = 100
    for walk, wide in ((settle, True), (slow, False)):
        *_, choice = context_parallel.pick(plan, walk, layout, waves=3)
        assert bool(choice) == wide
    # in one wave (against the 64-column pass) the same segments are cheaper than its 448 steps even slow
    assert bool(context_parallel.pick(plan, slow, layout, waves=1)[-1])


@pytest.mark.parametrize("waves", [1, 3])
@pytest.mark.parametrize("picked", ["wide", "plain"])
@pytest.mark.parametrize("lengths,state", [([700], False), ([130, 0, 451, 3], True)], ids=["one-long", "varlen-state"])
def test_wide_route_choice_host_side(lengths, state, picked, waves, monkeypatch, sm90_config):
    """With the wide route the forward launches both its pass over segments and the pass without segments (at 64
    columns beside one wave of segments, at 128 beside several), and the device picks one (context_parallel.pick):
    the other runs over empty sequences. Either pick gives the plain path's output and final states (float64
    stand-ins of the kernels)."""
    pytest.importorskip("triton")
    from gdnkit.backends.reference.backend import reference_forward
    from gdnkit.backends.reference.chunked import chunked_gdn
    from gdnkit.backends.tilelang_sm90 import context_parallel
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    sm90_config(block_v=None)
    calls = []
    _stand_in_forward_kernels(monkeypatch, fwd, calls)
    sm90_config(segment_chunks=None)
    # the wide route, on a CPU: 2-chunk segments in one wave or in several
    sm90_config(wide_segment_chunks=2 if waves == 1 else 0, wide_waves_segment_chunks=(2, waves))
    ratio = "wide_step_ratio" if waves == 1 else "waves_step_ratio"
    sm90_config(**{ratio: 0.0 if picked == "wide" else 1e9})
    launched = []   # per state-pass launch: (chained, whether any of its sequences has a token)
    block_vs = []   # the unchained (plain) pass's V tile
    factory = fwd.state_output_kernel

    def recording(*args):
        kernel, chained = factory(*args), args[8]
        if not chained:
            block_vs.append(args[5])
        return lambda *a: launched.append((chained, bool(a[5].diff().any()))) or kernel(*a)
    monkeypatch.setattr(fwd, "state_output_kernel", recording)

    gen = torch.Generator().manual_seed(3)
    H, HV, T, N = 1, 2, sum(lengths) + 5, len(lengths)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = F.normalize(r(1, T, H, K), dim=-1).half()
    k = F.normalize(r(1, T, H, K), dim=-1).half()
    v, g = r(1, T, HV, V).half(), F.logsigmoid(r(1, T, HV)) * torch.tensor((3.0, 1e-3))   # one head barely decays
    beta = torch.rand(1, T, HV, generator=gen)
    h0 = r(N, HV, K, V) * 0.1 if state else None
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      cu_seqlens=cu)
    got = {}
    o, ht, _ = fwd.forward(problem, inputs, intermediates=got)
    assert got["context_parallel"] == "chained" and got["wide_segments"]
    assert bool(got["wide_choice"]) == (picked == "wide")
    assert sorted(launched) == sorted([(True, picked == "wide"), (False, picked == "plain")]), launched
    assert block_vs == [64 if waves == 1 else 128]
    d = lambda t: None if t is None else t.double()  # noqa: E731
    p64, i64 = validate_inputs(CHUNK_MODE, d(q), d(k), d(v), d(g), d(beta), initial_state=d(h0),
                               output_final_state=True, cu_seqlens=cu)
    ref_o, ref_ht = reference_forward(p64, i64, chunked_gdn)
    assert _rel(o, ref_o) < 2e-3 and _rel(ht, ref_ht) < 1e-3
    assert o[:, sum(lengths):].abs().max() == 0
    _assert_in_family(calls, H, HV, "float16", training=False)


def _state_stand_in(has_h0, store_ht, store_states=False, emit_output=True, chained=False, store_x=False):
    """What the state/output kernel writes: O rows of every sequence (of cu) if emit_output, final states if
    asked, every chunk's entering state (bf16) if store_states, and with store_x each chunk's X = V - diag(Gamma)
    K S0 into o's argument (the rows of its sequences). chained: each program first walks walk[n, hv]
    chunks before its segment from zero, or from its h0 row where that reaches the sequence's start
    (walk == before[n]), writing only its own chunks."""
    def run(q, k, a, v, gamma, cu, chunk_offsets, h0, o, ht, scale, hs, walk=None, before=None):
        assert not chained or walk.shape[0] == cu.numel() - 1   # else placeholders the kernel never reads
        _assert_padding_finite(cu, q, k, v)
        grp = v.shape[2] // k.shape[2]
        for n in range(cu.numel() - 1):
            bos, eos, c0 = int(cu[n]), int(cu[n + 1]), int(chunk_offsets[n])
            for hv in range(v.shape[2]):
                pre = int(walk[n, hv]) if chained else 0
                exact = not chained or pre == int(before[n])
                run_bos, run_c0 = bos - 64 * pre, c0 - pre
                S = h0[n, hv].double() if has_h0 and exact else torch.zeros(k.shape[-1], v.shape[-1], dtype=torch.float64)
                for ic in range(pre + -(-(eos - bos) // 64)):
                    t0 = run_bos + ic * 64
                    m = min(eos - t0, 64)
                    qq, kk = q[0, t0:t0 + m, hv // grp].double(), k[0, t0:t0 + m, hv // grp].double()
                    tb, vv = a[0, t0:t0 + m, hv, :m].double(), v[0, t0:t0 + m, hv].double()
                    gs = gamma[hv, run_c0 + ic, :m].double()
                    own = ic >= pre
                    if store_states and own:
                        hs[run_c0 + ic, hv] = S.to(hs.dtype)
                        S = S.to(hs.dtype).double()  # the kernels' S0 operands are bf16 too
                    i = torch.arange(m)
                    X = vv - gs.exp()[:, None] * (kk @ S)
                    if store_x and own:
                        o[0, t0:t0 + m, hv] = X.to(o.dtype)
                    U = tb @ X
                    P = torch.where(i[:, None] >= i[None, :], (qq @ kk.T) * torch.exp(gs[:, None] - gs[None, :]), 0.0)
                    if emit_output and own:
                        o[0, t0:t0 + m, hv] = (scale * ((qq @ S) * gs.exp()[:, None] + P @ U)).to(o.dtype)
                    S = S * gs[-1].exp() + kk.T @ (U * torch.exp(gs[-1] - gs)[:, None])
                if store_ht:
                    ht[n, hv] = S.float()
    return run


def _propagator_stand_in(k, a, v, gamma, cu, chunk_offsets, aug, gate):
    """What the propagator writes per segment (of cu): [E | P], the chain S -> Gamma_C S + K^T diag(Gamma_C /
    Gamma) Tb (V - diag(Gamma) K S) run from zeros with V (E), and from the identity with V = 0 (P); nothing
    for a (segment, head) whose gate holds 0 (gate [rows, HV]: row n, or its last row)."""
    grp = a.shape[2] // k.shape[2]
    Kd, Vd = k.shape[-1], v.shape[-1]
    for n in range(cu.numel() - 1):
        bos, eos, c0 = int(cu[n]), int(cu[n + 1]), int(chunk_offsets[n])
        for hv in range(a.shape[2]):
            if int(gate[min(n, gate.shape[0] - 1), hv]) == 0:
                continue
            S = torch.cat([torch.zeros(Kd, Vd, dtype=torch.float64), torch.eye(Kd, dtype=torch.float64)], dim=1)
            for ic in range(-(-(eos - bos) // 64)):
                t0 = bos + ic * 64
                m = min(eos - t0, 64)
                kk, vv = k[0, t0:t0 + m, hv // grp].double(), v[0, t0:t0 + m, hv].double()
                tb = a[0, t0:t0 + m, hv, :m].double()
                gs = gamma[hv, c0 + ic, :m].double()
                rhs = torch.cat([vv, torch.zeros(m, Kd, dtype=torch.float64)], dim=1)
                U = tb @ (rhs - gs.exp()[:, None] * (kk @ S))
                S = S * gs[-1].exp() + kk.T @ (U * torch.exp(gs[-1] - gs)[:, None])
            aug[n, hv] = S.float()


def _backward_state_stand_in(has_dht, store_dh0, chained=False, ds_only=False):
    """What the backward's reverse pass writes: per chunk its dS_end (bf16, also the operand the chain uses),
    dU and dX rows, and dh0; nothing for a (segment, head) whose gate holds 0 (as the propagator's). chained: each
    program first walks walk[n, hv] chunks after its segment, last first, from zero, or from its dht row where
    that reaches the sequence's end (walk == after[n]; the walk then ends at seq_end[n]), writing only its own
    chunks. ds_only: dh0 alone is written (du, dv and dh are (1, 1, 1, 1) stubs); chained, the run is the walk
    alone, from the segment's end."""
    def run(q, k, a, do, gamma, cu, chunk_offsets, dht, du, dv, dh, dh0, scale, gate, walk, after, seq_end):
        n_prog = cu.numel() - 1
        assert not chained or walk.shape[0] == n_prog   # else placeholders the kernel never reads
        assert not ds_only or du.shape == dv.shape == dh.shape == (1, 1, 1, 1)
        grp = a.shape[2] // k.shape[2]
        for n in range(n_prog):
            bos, c0, own_end = int(cu[n]), int(chunk_offsets[n]), int(chunk_offsets[n + 1])
            if chained and ds_only:
                bos, c0 = int(cu[n + 1]), own_end
            for hv in range(a.shape[2]):
                if int(gate[min(n, gate.shape[0] - 1), hv]) == 0:
                    continue
                post = int(walk[n, hv]) if chained else 0
                exact = not chained or post == int(after[n])
                eos = int(seq_end[n]) if chained and exact else int(cu[n + 1]) + 64 * post
                end = own_end + post
                dS = dht[n, hv].double() if has_dht and exact else torch.zeros(k.shape[-1], do.shape[-1], dtype=torch.float64)
                for ic in reversed(range(end - c0)):
                    own = c0 + ic < own_end and not ds_only
                    t0 = bos + ic * 64
                    m = min(eos - t0, 64)
                    qq, kk = q[0, t0:t0 + m, hv // grp].double(), k[0, t0:t0 + m, hv // grp].double()
                    tb, dO = a[0, t0:t0 + m, hv, :m].double(), do[0, t0:t0 + m, hv].double()
                    gs = gamma[hv, c0 + ic, :m].double()
                    if own:
                        dh[c0 + ic, hv] = dS.to(dh.dtype)
                    i = torch.arange(m)
                    P = torch.where(i[:, None] >= i[None, :], (qq @ kk.T) * torch.exp(gs[:, None] - gs[None, :]), 0.0)
                    dU = scale * P.T @ dO + torch.exp(gs[-1] - gs)[:, None] * (kk @ dS.to(q.dtype).double())
                    dX = tb.T @ dU
                    if own:
                        du[0, t0:t0 + m, hv], dv[0, t0:t0 + m, hv] = dU.to(du.dtype), dX.to(dv.dtype)
                    dS = (scale * qq.T @ (gs.exp()[:, None] * dO) + gs[-1].exp() * dS
                          - kk.T @ (gs.exp()[:, None] * dX))
                if store_dh0:
                    dh0[n, hv] = dS.float()
    return run


def _grads_in(grads_dt: str):
    """The stand-in for a chunk_grads build that writes dq / dk in grads_dt: the buffers handed to it must be
    of that dtype (the inputs' without l2norm in the kernel, fp32 with it)."""
    def kernel(*args):
        dq, dk = args[14], args[15]
        assert str(dq.dtype) == f"torch.{grads_dt}" and dk.dtype == dq.dtype, (dq.dtype, grads_dt)
        return _chunk_grads_stand_in(*args)
    return kernel


def _chunk_grads_stand_in(q, k, v, do, du, dx, tb, tm, gamma, beta, h, dh, cu, table, dq, dk, dg, dbeta, scale):
    """What the per-chunk gradient kernel writes: the reference's chunk_local_grads on each chunk's rows, dq and
    dk summed over each key head's value heads in value head order."""
    from gdnkit.backends.reference.chunked_backward import chunk_local_grads
    grp = v.shape[2] // k.shape[2]
    for row, (seq, ic) in enumerate(table.tolist()):
        t0 = int(cu[seq]) + ic * 64
        m = min(int(cu[seq + 1]) - t0, 64)
        for hk in range(k.shape[2]):
            sums = [0.0, 0.0]
            for hv in range(hk * grp, (hk + 1) * grp):
                rows = lambda x: x[0, t0:t0 + m, hv].double()  # noqa: E731
                qq, kk = q[0, t0:t0 + m, hk].double(), k[0, t0:t0 + m, hk].double()
                got = chunk_local_grads(qq, kk, rows(v), rows(do), rows(beta), gamma[hv, row, :m].double(),
                                        tm[0, t0:t0 + m, hv, :m].double(), h[row, hv].double(), rows(du), rows(dx),
                                        dh[row, hv].double(), scale)
                sums = [sums[0] + got[0], sums[1] + got[1]]
                dg[0, t0:t0 + m, hv], dbeta[0, t0:t0 + m, hv] = got[2].float(), got[3].float()
            dq[0, t0:t0 + m, hk], dk[0, t0:t0 + m, hk] = sums[0].float(), sums[1].float()


def _backward_fused_stand_in(has_dinit, store_dh0):
    """What the fused backward writes per (sequence or segment, value head), chunks last to first from its dinit
    row (or zero): the reverse pass's chain (dS_end rounded to bf16 as the kernel hands it over) and each chunk's
    chunk_local_grads, dq and dk per chunk and value head into dqk (S0's buffer: a chunk's slot written after its
    S0 is read; all 64 rows of each in group_sum.slot_offset's order), dh0 at the run's start. It reads each
    chunk's X (xv: dv's buffer, from the recompute) before it writes that chunk's dV there."""
    from gdnkit.backends.reference.chunked_backward import chunk_local_grads
    from gdnkit.backends.tilelang_sm90.group_sum import slot_offset

    def run(q, k, xv, do, a, tm, hs, gamma, beta, cu, chunk_offsets, dinit, dqk, dv, dg, dbeta, dh0, scale):
        assert xv.data_ptr() == dv.data_ptr()   # X costs no memory of its own
        rr, jj = torch.meshgrid(torch.arange(64), torch.arange(k.shape[-1]), indexing="ij")
        slot = slot_offset(rr, jj).flatten()
        grp = xv.shape[2] // k.shape[2]
        for n in range(cu.numel() - 1):
            bos, eos, c0 = int(cu[n]), int(cu[n + 1]), int(chunk_offsets[n])
            for hv in range(xv.shape[2]):
                dS = dinit[n, hv].double() if has_dinit else torch.zeros(k.shape[-1], xv.shape[-1], dtype=torch.float64)
                for ic in reversed(range(-(-(eos - bos) // 64))):
                    t0 = bos + ic * 64
                    m = min(eos - t0, 64)
                    rows = lambda x: x[0, t0:t0 + m, hv].double()  # noqa: E731
                    qq, kk = q[0, t0:t0 + m, hv // grp].double(), k[0, t0:t0 + m, hv // grp].double()
                    gs, dO = gamma[hv, c0 + ic, :m].double(), rows(do)
                    dse = dS.to(xv.dtype).double()
                    i = torch.arange(m)
                    P = torch.where(i[:, None] >= i[None, :], (qq @ kk.T) * torch.exp(gs[:, None] - gs[None, :]), 0.0)
                    dU = scale * P.T @ dO + torch.exp(gs[-1] - gs)[:, None] * (kk @ dse)
                    dX = a[0, t0:t0 + m, hv, :m].double().T @ dU
                    # chunk_local_grads makes X from V: V is given as X + diag(Gamma) K S0 (float64)
                    s0 = hs[c0 + ic, hv].double()
                    vv = rows(xv) + gs.exp()[:, None] * (kk @ s0)
                    got = chunk_local_grads(qq, kk, vv, dO, rows(beta), gs, tm[0, t0:t0 + m, hv, :m].double(),
                                            s0, dU, dX, dse, scale)
                    dqdk = torch.zeros(2, 64, k.shape[-1], dtype=torch.float64)   # all 64 rows, the kernel's order
                    dqdk[:, :m] = torch.stack(got[:2])
                    dqk[c0 + ic, hv].view(2, -1)[:, slot] = dqdk.flatten(1).to(dqk.dtype)
                    dg[0, t0:t0 + m, hv], dbeta[0, t0:t0 + m, hv] = got[2].float(), got[3].float()
                    dv[0, t0:t0 + m, hv] = dX.to(dv.dtype)
                    dS = (scale * qq.T @ (gs.exp()[:, None] * dO) + gs[-1].exp() * dS
                          - kk.T @ (gs.exp()[:, None] * dX))
                if store_dh0:
                    dh0[n, hv] = dS.float()
    return run


def _recorded(calls: list, name: str, factory):
    """A kernel factory stand-in that records (name, its arguments): checked against precompile.family."""
    def record(*args):
        bound = inspect.signature(factory).bind(*args)
        bound.apply_defaults()   # the lru cache's key: a defaulted flag spelt out is the same kernel
        calls.append((name, tuple(bound.arguments.values())))
        return factory(*args)
    return record


def _stand_in(monkeypatch, factory, stand_in) -> None:
    """stand_in compiles in the factory's place (kernel_build.kernel_factory's `uncached`), so the factory's
    caching and dry-run recording stay; the markers of its "builds" go to a scratch cache directory, and a first
    call never sends its kernels to worker processes (which would compile the real ones)."""
    import os
    import tempfile

    from gdnkit.backends.tilelang_sm90 import kernel_build
    monkeypatch.setenv("TILELANG_CACHE_DIR", os.path.join(tempfile.gettempdir(), "gdnkit-stand-in-kernels"))
    monkeypatch.setattr(kernel_build, "WORKERS", 1)
    monkeypatch.setattr(factory, "uncached", stand_in)


def _stand_in_forward_kernels(monkeypatch, fwd, calls: list) -> None:
    _stand_in(monkeypatch, fwd.intra_chunk_kernel, _recorded(calls, "intra_chunk_kernel",
                                                             lambda H, HV, dt, emit_t=False, emit_bound=False: _intra_stand_in))
    _stand_in(monkeypatch, fwd.state_output_kernel, _recorded(
        calls, "state_output_kernel",
        lambda H, HV, dt, has_h0, store_ht, bv, store_states=False, emit_output=True, chained=False, store_x=False,
        per_sm=1: _state_stand_in(has_h0, store_ht, store_states, emit_output, chained, store_x)))


def _assert_in_family(calls: list, H: int, HV: int, dtype: str, training: bool) -> None:
    """Every kernel the call asked for is one `python -m gdnkit warm` builds ahead (precompile.family)."""
    from gdnkit.backends.tilelang_sm90 import precompile
    family = {(job.factory, job.args) for job in precompile.family(H, HV, dtype, training)}
    assert calls and set(calls) <= family, set(calls) - family


@pytest.mark.parametrize("case", ["dense", "varlen-gva-options", "segments", "segments-weak-gates", "segments-mixed-gates",
                                  "segments-chained", "segments-chained-mixed-gates", "segments-exact",
                                  "fused-dense", "fused-varlen-gva-options", "fused-segments",
                                  "fused-segments-weak-gates", "fused-segments-mixed-gates",
                                  "segments-wide-mixed-gates", "fused-segments-wide-mixed-gates",
                                  "fused-segments-wide-plain-mixed-gates", "segments-waves-mixed-gates",
                                  "fused-segments-waves-mixed-gates", "fused-segments-waves-plain-mixed-gates"])
def test_backward_host_side_with_kernel_stand_ins(case, monkeypatch, sm90_config, poisoned_empty):
    """The sm90 training path around its four launches, on a CPU: the forward keeps T (every chunk's state only
    with keep_states; the backward recomputes them), the backward hands them with dS_end, dU and dX from the
    reverse pass to the per-chunk kernel, sums dq/dk over GVA's value heads and undoes the options' prologue.
    With segments (context parallelism) each segment's dS_end comes from: the gated route (a fixed lead-in over
    the chunks after it, the exact route behind it, run for the pairs the device flags: gates that settle,
    gates that barely decay, and one head of each), the chained route (where the exact route does not pay: the
    same lead-in, the reverse pass walking forward where it left a pair unsettled), or the exact route alone.
    fused-*: the same through the fused kernel (GDNKIT_SM90_FUSED_BACKWARD), its segments the wide route's, each
    from its dS_end by the gated route; dq / dk per chunk and value head summed here. *-wide-*: the forward takes
    the wide route too (its pass over segments picked, or with -plain- the pass over sequences), and the recompute
    replays both launches at 64 columns, the wide one walking as the forward did; *-waves-*: the same in several
    waves (the pass over sequences at 128 columns). The kernels are float64
    stand-ins of their contracts; every gradient is checked against autograd through the float64 reference."""
    from gdnkit.backends.tilelang_sm90 import config
    pytest.importorskip("triton")
    from gdnkit.backends.tilelang_sm90 import BACKEND, context_parallel
    from gdnkit.backends.tilelang_sm90 import backward as bwd
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    fused = case.startswith("fused-")
    sm90_config(fused_backward=fused)
    case = case.removeprefix("fused-")
    waves = "-waves-" in case
    wide = "-wide-" in case or waves
    picked = "plain" if "-plain-" in case else "wide"
    case = case.replace("-wide", "").replace("-waves", "").replace("-plain", "")
    segments = case.startswith("segments")
    sm90_config(block_v=None if wide else 64)
    if wide:   # the wide route in the forward and the backward (2-chunk segments), the device's pick forced
        if waves:   # in three waves of the SMs (plan.wide_waves_segment_chunks), training as inference
            sm90_config(wide_segment_chunks=0, wide_waves_segment_chunks=(2, 3))
        else:
            sm90_config(wide_segment_chunks=2)
        sm90_config(**{"waves_step_ratio" if waves else "wide_step_ratio": 0.0 if picked == "wide" else 1e9})
    sm90_config(segment_chunks=2 if segments else 0)
    sm90_config(lead_in_route=case != "segments-exact")
    chained = case.startswith("segments-chained")
    if chained:
        sm90_config(exact_route_pays=False)
    flags = []   # the gated routes' device flags: (reverse, transitions needed per segment and head)
    real_needed = bwd.lead_in.transitions_needed
    monkeypatch.setattr(bwd.lead_in, "transitions_needed", lambda *a, reverse=False, **kw: flags.append(
        (reverse, real_needed(*a, reverse=reverse, **kw).tolist())) or real_needed(*a, reverse=reverse, **kw))
    real_reverse = bwd.lead_in.reverse_lead_in   # the backward's: its walks and the same flags
    monkeypatch.setattr(bwd.lead_in, "reverse_lead_in", lambda *a, **kw: (
        lambda walk_need: flags.append((True, walk_need[1].tolist())) or walk_need)(real_reverse(*a, **kw)))
    walks = []   # the chained routes' walks: (chunks per segment and head, reverse)
    real_walks = bwd.lead_in.walk_lengths
    monkeypatch.setattr(bwd.lead_in, "walk_lengths", lambda *a, reverse=False, **kw: walks.append(
        (real_walks(*a, reverse=reverse, **kw).tolist(), reverse)) or real_walks(*a, reverse=reverse, **kw))
    calls = []
    _stand_in(monkeypatch, fwd.propagator_kernel, _recorded(calls, "propagator_kernel",
                                                           lambda H, HV, dt: _propagator_stand_in))
    _stand_in_forward_kernels(monkeypatch, fwd, calls)
    _stand_in(monkeypatch, bwd.backward_state_kernel, _recorded(
        calls, "backward_state_kernel",
        lambda H, HV, dt, has_dht, store_dh0, bv, chained=False, ds_only=False:
        _backward_state_stand_in(has_dht, store_dh0, chained, ds_only)))
    _stand_in(monkeypatch, bwd.chunk_grads_kernel, _recorded(calls, "chunk_grads_kernel",
                                                             lambda H, HV, dt, grads_dt: _grads_in(grads_dt)))
    _stand_in(monkeypatch, bwd.backward_fused_kernel, _recorded(
        calls, "backward_fused_kernel",
        lambda H, HV, dt, has_dinit, store_dh0: _backward_fused_stand_in(has_dinit, store_dh0)))
    # the fused path's dq / dk per value head are written into S0's buffer (recomputed, not the forward's)
    s0_buffers, sums_in_s0 = [], []
    real_entering, real_sums = fwd.entering_states_and_x, bwd.chunk_group_sums
    monkeypatch.setattr(fwd, "entering_states_and_x", lambda problem, s, hs, xs: (
        s0_buffers.append(hs.data_ptr()) or real_entering(problem, s, hs, xs)))
    monkeypatch.setattr(bwd, "chunk_group_sums", lambda dqk, *a, **kw: sums_in_s0.append(
        dqk.data_ptr() in s0_buffers) or real_sums(dqk, *a, **kw))
    # the qk l2norm's backward: in the fused path's group sums, else the prologue's Triton pass (q's and k's)
    from gdnkit.backends.triton_shared import l2norm
    l2norm_passes, real_pass = [], l2norm.l2norm_backward
    monkeypatch.setattr(l2norm, "l2norm_backward", lambda *a: l2norm_passes.append(1) or real_pass(*a))

    gen = torch.Generator().manual_seed(4)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    varlen = case == "varlen-gva-options"
    H, HV = (1, 2) if varlen or case.endswith("mixed-gates") else (1, 1)
    B, T, lengths = {"dense": (2, 100, None), "varlen-gva-options": (1, 300, [130, 0, 167])}.get(
        case, (1, 400, [333, 0, 60]))
    N = B if lengths is None else len(lengths)
    q, k = r(B, T, H, K).half(), r(B, T, H, K).half()
    if not varlen:
        q, k = F.normalize(q.float(), dim=-1).half(), F.normalize(k.float(), dim=-1).half()
    v, g, beta = r(B, T, HV, V).half(), r(B, T, HV), r(B, T, HV)
    if not varlen:
        scale = torch.tensor([0.3, 1e-3]) if case.endswith("mixed-gates") else 1e-3 if case == "segments-weak-gates" \
            else 0.3
        g, beta = F.logsigmoid(g) * scale, torch.sigmoid(beta)
    if case == "dense":   # a gate under the floor (-30): its gradient is zero (fused: in the group sums' launch)
        g[1, 40, 0] = -40.0
    opts = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=r(HV) * 0.5, dt_bias=r(HV),
                use_beta_sigmoid_in_kernel=True) if varlen else {}
    h0 = r(N, HV, K, V) * 0.1
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    leaves = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, **{n: opts[n] for n in ("A_log", "dt_bias") if n in opts})
    leaves = {n: t.detach().requires_grad_() for n, t in leaves.items()}
    problem, inputs = validate_inputs(CHUNK_MODE, **leaves, output_final_state=True, cu_seqlens=cu,
                                      **{n: x for n, x in opts.items() if n not in ("A_log", "dt_bias")})
    assert problem.needs_grad
    # what a first call builds before it runs (kernel_build's dry run): compiling and launching nothing
    from gdnkit.backends.tilelang_sm90 import _every_launch, kernel_build
    dry = {(job.factory, job.args) for job in kernel_build.recorded_jobs(lambda: _every_launch(problem, inputs))}
    assert dry and calls == []
    for record in (flags, walks, s0_buffers, sums_in_s0, l2norm_passes):   # the assertions below are the call's
        record.clear()
    o, ht, saved = BACKEND.chunk_forward(problem, inputs)
    # S0 per chunk: by default the backward runs the forward's state pass again; the same bits as keeping them
    assert saved.hs is None
    before_kept = len(calls)
    with config.configured(keep_states=True):
        kept = BACKEND.chunk_forward(problem, inputs)[2].hs
    assert kept is not None and torch.equal(fwd.entering_states(problem, saved), kept)
    after_kept = len(calls)   # (the kernels of the keep_states forward and of this check are not the step's)
    do, dht = r(*o.shape).half(), r(*ht.shape)
    from gdnkit.backends.tilelang_sm90 import lead_in_bound
    token_sums, real_token_sums = [], lead_in_bound._chunk_sums   # the flags' window sums over tokens
    monkeypatch.setattr(lead_in_bound, "_chunk_sums", lambda *a: token_sums.append(1) or real_token_sums(*a))
    if fused and segments and not wide:
        # the fused path in the wide route's segments (2 chunks) behind a forward without them, which the rules give
        # nowhere (a forward that leaves them to its backward takes them itself): the backward follows its plan
        saved.plan = dataclasses.replace(saved.plan, fused_segment_chunks=2)
    grads = BACKEND.chunk_backward(problem, saved, do, dht)
    if not (fused and segments and not wide):   # (not the plan just forced above, which the rules never give)
        launched = set(calls[:before_kept] + calls[after_kept:])
        assert launched <= dry, str((sorted(launched - dry), sorted(dry)))   # the dry run asked for every kernel
    assert sums_in_s0 == ([True] if fused else []), sums_in_s0
    # the fused path's gated route reads its flags' sums from the training forward's per-row bounds where its
    # intra kernel wrote them (the wide route's), else it sums the window's tokens
    assert (saved.row_bounds is not None) == (wide or chained), saved.row_bounds
    if fused and segments:
        assert bool(token_sums) == (saved.row_bounds is None), token_sums
    # the unfused path's prologue takes the Triton pass only where Triton reads these CPU tensors (the CPU
    # suite's interpreter; on a GPU machine this host test's tensors take the torch form)
    assert len(l2norm_passes) == (2 if varlen and not fused and triton_reads(q) else 0), l2norm_passes

    d64 = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
    p64, i64 = validate_inputs(CHUNK_MODE, **d64, output_final_state=True, cu_seqlens=cu,
                               **{n: x for n, x in opts.items() if n not in ("A_log", "dt_bias")})
    ref_o, ref_ht = gdnkit.chunk_gated_delta_rule(**d64, output_final_state=True, cu_seqlens=cu,
                                                 backend="reference",
                                                 **{n: x for n, x in opts.items() if n not in ("A_log", "dt_bias")})
    ref = dict(zip(d64, torch.autograd.grad([ref_o, ref_ht], list(d64.values()), [do.double(), dht.double()])))
    got = dict(q=grads.dq, k=grads.dk, v=grads.dv, g=grads.dg, beta=grads.dbeta, initial_state=grads.dinitial_state,
               A_log=grads.dA_log, dt_bias=grads.ddt_bias)
    assert _rel(o, ref_o) < 2e-3 and _rel(ht, ref_ht) < 2e-3
    errs = {n: _rel(got[n], ref[n]) for n in ref}
    assert all(e < 2e-3 for e in errs.values()), errs  # fp16 inputs, bf16 S0 / dS_end: ~3e-4 measured
    if lengths is not None:
        assert grads.dq[:, sum(lengths):].abs().max() == 0 and grads.dv[:, sum(lengths):].abs().max() == 0
    if case == "dense":
        assert grads.dg[1, 40, 0] == 0 and grads.dg[1, 39:42].count_nonzero() == 3 * HV - 1
    # the backward's flags: 4 segments (3 of the first sequence, one of the third; the second is empty); the gates
    # decay by ~15 a chunk, so the 1-chunk lead-in (2-chunk segments) settles; weak gates leave segments 0 and 1
    # unsettled, which need the transitions of segments 1 and 2
    # (the staged path's backward after a wide-route forward takes the chained route, the fused path the gated one)
    reverse_chained = chained or (wide and not fused)
    backward_flags = [f for reverse, f in flags if reverse]
    assert backward_flags == ([] if reverse_chained else {
        "segments": [[[0], [0], [0], [0]]], "segments-weak-gates": [[[0], [1], [1], [0]]],
        "segments-mixed-gates": [[[0, 0], [0, 1], [0, 1], [0, 0]]]}.get(case, [])), flags
    # chained (and the wide route's forward): the walks instead, forward (chunks before each segment; two forward
    # calls above) and reverse (after it): one chunk for the decaying head where there is one, all of them to the
    # sequence's boundary for the barely decaying one
    fwd_walk, bwd_walk = {"segments-chained": ([[0], [1], [1], [0]], [[1], [1], [0], [0]]),
                          "segments-chained-mixed-gates": ([[0, 0], [1, 2], [1, 4], [0, 0]],
                                                           [[1, 4], [1, 2], [0, 0], [0, 0]])}.get(
        "segments-chained-mixed-gates" if wide else case, (None, None))
    assert walks == ([] if fwd_walk is None else [(fwd_walk, False)] * 2 + [(bwd_walk, True)] * reverse_chained), \
        walks
    # (the reverse pass's arguments end (..., chained, ds_only); ds_only chained builds are the gated lead-ins)
    walked = {name for name, args in calls if name == "state_output_kernel" and args[8]
              or name == "backward_state_kernel" and args[-2] and not args[-1]}
    want_walked = {"state_output_kernel"} if chained or wide else set()
    assert walked == (want_walked | {"backward_state_kernel"} if reverse_chained else want_walked), walked
    led_in = any(name == "backward_state_kernel" and args[-2] and args[-1] for name, args in calls)
    assert led_in == (segments and not reverse_chained and case != "segments-exact"), calls
    # the recompute (state_output_kernel's arguments 5-10: block_v, store_states, emit_output, chained, store_x,
    # per_sm) runs the three-warpgroup kernel, also for a wide-route forward's 128-column pass over segments,
    # which it replays walking as the forward did: S0 only (the check of entering_states above, and the staged
    # path's) or S0 and X (the fused path's, two programs an SM at 64 columns)
    recomputes = {args[5:10] for name, args in calls if name == "state_output_kernel" and args[6] and not args[7]}
    assert all(per_sm == fwd.recompute_per_sm(args[5], args[9]) for name, (*args, per_sm) in calls
               if name == "state_output_kernel"), calls
    assert {bv for bv, *_ in recomputes} <= set(fwd.NARROW_BLOCK_V), recomputes
    assert not wide or {(64, True, False, True, x) for x in {False, fused}} <= recomputes, recomputes
    launched = {name for name, _ in calls}
    assert ("backward_fused_kernel" in launched) == fused and ("chunk_grads_kernel" in launched) != fused, launched
    _assert_in_family(calls, H, HV, "float16", training=True)


@pytest.mark.parametrize("case", ["dense", "varlen-trailing-state-v-first", "no-tokens"])
def test_forward_host_side_with_kernel_stand_ins(case, monkeypatch, sm90_config, poisoned_empty):
    """Everything forward() does around its two launches, checked on a CPU: the packed view of dense and
    varlen batches, the cached layout's tables, outputs allocated empty (poisoned here) with only the
    tokens past cu_seqlens[-1] zeroed, those tokens' NaN kept from every kernel's loads, initial/final states in
    both layouts, no-token batches. The TileLang kernels are replaced by float64 stand-ins of what they write."""
    from gdnkit.backends.reference.backend import reference_forward
    from gdnkit.backends.reference.chunked import chunked_gdn
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    sm90_config(block_v=64)
    calls = []
    _stand_in_forward_kernels(monkeypatch, fwd, calls)

    gen = torch.Generator().manual_seed(2)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    H, HV = 1, 2
    svf = case == "varlen-trailing-state-v-first"
    B, T, lengths = {"dense": (2, 100, None), "varlen-trailing-state-v-first": (1, 589, [130, 0, 451, 3]),
                     "no-tokens": (1, 6, [0, 0])}[case]
    N = B if lengths is None else len(lengths)
    q = F.normalize(r(B, T, H, K), dim=-1).half()
    k = F.normalize(r(B, T, H, K), dim=-1).half()
    v, g, beta = r(B, T, HV, V).half(), F.logsigmoid(r(B, T, HV)) * 0.2, torch.rand(B, T, HV, generator=gen)
    h0 = r(N, HV, K, V) * 0.1
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    if lengths is not None:
        for x in (q, k, v, g, beta):   # a padded buffer's tokens past the last sequence
            x[:, sum(lengths):] = float("nan")
    problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      cu_seqlens=cu, state_v_first=svf)
    o, ht, _ = fwd.forward(problem, inputs)
    d = lambda t: t.double()  # noqa: E731
    p64, i64 = validate_inputs(CHUNK_MODE, d(q), d(k), d(v), d(g), d(beta), initial_state=d(h0),
                               output_final_state=True, cu_seqlens=cu, state_v_first=svf)
    ref_o, ref_ht = reference_forward(p64, i64, chunked_gdn)
    assert o.shape == v.shape and o.dtype == v.dtype and ht.shape == h0.shape and ht.dtype == torch.float32
    assert not o.isnan().any() and not ht.isnan().any()
    if case == "no-tokens":
        assert o.abs().max() == 0 and torch.equal(ht, h0) and not calls   # nothing launched
    else:
        assert _rel(o, ref_o) < 2e-3 and _rel(ht, ref_ht) < 1e-3
        _assert_in_family(calls, H, HV, "float16", training=False)
    if lengths is not None:
        assert o[:, sum(lengths):].abs().max() == 0


@pytest.mark.parametrize("route,gate_scale,settled", [("exact", 0.3, None), ("gated", 3.0, True),
                                                    ("gated", 1e-3, False), ("gated", (3.0, 1e-3), "mixed"),
                                                    ("chained", 3.0, True), ("chained", 1e-3, False),
                                                    ("chained", (3.0, 1e-3), "mixed")],
                         ids=["exact", "gated-settled", "gated-unsettled", "gated-mixed", "chained-settled",
                              "chained-unsettled", "chained-mixed"])
@pytest.mark.parametrize("lengths,state", [([700], False), ([130, 0, 451, 3], True)], ids=["one-long", "varlen-state"])
def test_context_parallel_host_side_matches_the_plain_path(lengths, state, route, gate_scale, settled, monkeypatch,
                                                           sm90_config):
    """The context-parallel forward's glue: segment plan, the segments' initial states (exact: the
    propagator's [E | P] handed to triton_generic's segment scan, interpreted here; gated: a fixed lead-in and
    the exact route behind it, run or skipped per (segment, head) by the device's flags; chained: the same
    lead-in, and the state pass over segments walking back where the flags say a start is unsettled; each for
    gates that settle in a chunk, gates that barely decay, and one head of each), then the state pass over
    segments from those states, which also gives the final states. The three TileLang kernels are replaced by float64 stand-ins of their contracts, so this checks
    everything around them against the plain path and float64."""
    pytest.importorskip("triton")
    from gdnkit.backends.reference.backend import reference_forward
    from gdnkit.backends.reference.chunked import chunked_gdn
    from gdnkit.backends.tilelang_sm90 import context_parallel
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    sm90_config(block_v=64)
    calls = []
    _stand_in_forward_kernels(monkeypatch, fwd, calls)
    monkeypatch.setattr(fwd, "propagator_kernel", _recorded(calls, "propagator_kernel",
                                                            lambda H, HV, dt: _propagator_stand_in))

    gen = torch.Generator().manual_seed(1)
    H, HV, T, N = 1, 2, sum(lengths) + 5, len(lengths)  # 5 tokens past the last sequence
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q = F.normalize(r(1, T, H, K), dim=-1).half()
    k = F.normalize(r(1, T, H, K), dim=-1).half()
    v, g = r(1, T, HV, V).half(), F.logsigmoid(r(1, T, HV)) * torch.tensor(gate_scale)
    beta = torch.rand(1, T, HV, generator=gen)
    h0 = r(N, HV, V, K) * 0.1 if state else None  # state_v_first layout
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      cu_seqlens=cu, state_v_first=True)
    sm90_config(lead_in_route=route != "exact")
    if route == "chained":   # the route where the exact one does not pay
        sm90_config(exact_route_pays=False)
    results = {}
    for segs in (0, 2):
        sm90_config(segment_chunks=segs)
        if segs:
            layout = fwd.seqlayout.sequence_layout(cu)
            assert fwd.plan_of(problem, layout, torch.device("cpu")).segment_chunks == 2
        got = {}
        results[segs] = fwd.forward(problem, inputs, intermediates=got)[:2]
        assert got["context_parallel"] == (route if segs else None)
        if segs and route == "gated":
            need = got["transitions_needed"]
            if settled == "mixed":   # head 0 decays, head 1 barely: only head 1's transitions run
                assert need[:, 0].sum() == 0 and need[:, 1].sum() > 0
            else:
                assert (int(need.sum()) == 0) == settled
        if segs and route == "chained":   # one chunk settles a decaying head; a barely decaying one walks it all
            walk, before = got["walk_lengths"], context_parallel.plan_segments(layout, 2).walks.before
            short, whole = before.clamp_max(1), before
            want = {True: (short, short), False: (whole, whole), "mixed": (short, whole)}[settled]
            assert all(torch.equal(walk[:, hv], want[hv]) for hv in range(HV)), (walk, before)
    d = lambda t: None if t is None else t.double()  # noqa: E731
    p64, i64 = validate_inputs(CHUNK_MODE, d(q), d(k), d(v), d(g), d(beta), initial_state=d(h0),
                               output_final_state=True, cu_seqlens=cu, state_v_first=True)
    ref_o, ref_ht = reference_forward(p64, i64, chunked_gdn)
    (o_plain, ht_plain), (o_cp, ht_cp) = results[0], results[2]
    assert _rel(o_cp, o_plain) < 2e-3 and _rel(ht_cp, ht_plain) < 1e-3
    assert _rel(o_cp, ref_o) < 2e-3 and _rel(ht_cp, ref_ht) < 1e-3
    assert o_cp[:, sum(lengths):].abs().max() == 0
    _assert_in_family(calls, H, HV, "float16", training=False)


def test_a_first_call_under_auto_dispatch_goes_on_while_its_kernels_build(monkeypatch, sm90_config, tmp_path):
    """The backend's part of the stand-in: on an empty cache, chunk_forward_unless_building raises KernelsBuilding
    once the dry run has started the builds (held here), explain()'s plan says kernels are building, and resume()
    waits and runs the call, with the same result as the forward run directly. The kernels are the float64
    stand-ins; the "builds" only leave their markers."""
    import threading
    pytest.importorskip("triton")   # the backend's forward ends with the causal repair, a Triton kernel

    from gdnkit.backends.tilelang_sm90 import BACKEND, kernel_build
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    from gdnkit.dispatch import KernelsBuilding
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    from test_dispatch import fake_machine
    sm90_config(block_v=64)
    _stand_in_forward_kernels(monkeypatch, fwd, [])
    monkeypatch.setenv("TILELANG_CACHE_DIR", str(tmp_path))   # nothing built yet
    monkeypatch.setattr(kernel_build, "WORKERS", 4)
    monkeypatch.setattr(kernel_build, "_started_workers", lambda n: [])
    monkeypatch.setattr(kernel_build, "_pending", {})
    monkeypatch.setattr(kernel_build, "_failed", set())
    monkeypatch.setattr(kernel_build, "_loaded", set())   # none held: as a fresh process (earlier tests loaded them)
    gate, built = threading.Event(), []

    def build(jobs, workers, report=lambda *r: None, started=None):
        assert gate.wait(60)
        for job in jobs:
            built.append(job.factory)
            kernel_build._mark_built(job)
            report(job, 0.1, None)
        return [(job, 0.1, None) for job in jobs]
    monkeypatch.setattr(kernel_build, "build", build)

    gen = torch.Generator().manual_seed(5)
    q = F.normalize(torch.randn(1, 100, 1, K, generator=gen), dim=-1).half()
    k = F.normalize(torch.randn(1, 100, 1, K, generator=gen), dim=-1).half()
    v = torch.randn(1, 100, 2, V, generator=gen).half()
    g, beta = F.logsigmoid(torch.randn(1, 100, 2, generator=gen)) * 0.2, torch.rand(1, 100, 2, generator=gen)
    problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta, output_final_state=True)

    with pytest.raises(KernelsBuilding) as building:
        BACKEND.chunk_forward_unless_building(problem, inputs)
    assert building.value.first and building.value.what == "H=1, HV=2, float16"
    assert "kernels: 2 building in the background (H=1, HV=2, float16)" in BACKEND.plan(
        problem, inputs, fake_machine("hopper_sm90", "triton+tilelang"))
    gate.set()
    o, ht, _ = building.value.resume()
    assert sorted(built) == ["intra_chunk_kernel", "state_output_kernel"]
    direct_o, direct_ht, _ = fwd.forward(problem, inputs)
    assert torch.equal(o, direct_o) and torch.equal(ht, direct_ht)
    assert kernel_build.wait_for_builds(timeout=60) and not kernel_build.building()
    o_again, _, _ = BACKEND.chunk_forward_unless_building(problem, inputs)   # built: runs here
    assert torch.equal(o_again, o)


# torch operators that launch no kernel on a GPU (allocations, views, casts to the dtype a tensor has already)
_NO_KERNEL_OPS = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::view", "aten::reshape",
                  "aten::to", "aten::contiguous", "aten::resolve_conj", "aten::resolve_neg", "aten::as_strided",
                  "aten::select", "aten::slice", "aten::t", "aten::transpose", "aten::alias", "aten::detach",
                  "aten::lift_fresh", "aten::detach_", "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::flatten"}


@pytest.mark.parametrize("fused", [True, False])
def test_a_training_steps_launches(fused, monkeypatch, sm90_config):
    """What one training step launches (a forward keeping what the backward needs, then the backward) on the GPU's
    code path, every kernel a counting no-op: TileLang kernels by factory, Triton kernels by name, torch operators
    that launch. An eager step's host time is mostly its launches (docs/performance.md, "Host time of an eager
    call"), so this inventory changes only on purpose. 16/32, one sequence of 8192 tokens, on a 132-SM stand-in:
    the wide route's segments (the device picks between its pass over segments and the one over sequences, both
    launched). A cu_seqlens tensor on the GPU adds its device check to the forward (one Triton launch, seqlayout);
    the backward reads the forward's layout."""
    pytest.importorskip("triton")
    import collections
    import importlib
    import pkgutil

    from gdnkit.backends import tilelang_sm90, triton_shared
    from gdnkit.backends.tilelang_sm90 import BACKEND
    from gdnkit.backends.tilelang_sm90 import backward as bwd
    from gdnkit.backends.tilelang_sm90 import forward as fwd
    from gdnkit.backends.triton_shared import launch
    from gdnkit.problem import CHUNK_MODE, validate_inputs
    from torch.profiler import ProfilerActivity, profile

    sm90_config(fused_backward=fused)
    monkeypatch.setenv("TRITON_INTERPRET", "1")   # the host takes the GPU's Triton paths (triton_reads)
    launched = collections.Counter()

    def count(kernel, *args, **kwargs):
        launched["triton " + getattr(kernel, "fn", kernel).__name__] += 1   # (a JITFunction's own function)
    for pkg in (tilelang_sm90, triton_shared):   # every module holding enqueue by name
        for module in pkgutil.iter_modules(pkg.__path__):
            importlib.import_module(f"{pkg.__name__}.{module.name}")
    real_enqueue = launch.enqueue
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("gdnkit") and getattr(module, "enqueue", None) is real_enqueue:
            monkeypatch.setattr(module, "enqueue", count)
    monkeypatch.setattr(fwd, "_sm_count_of", lambda device: 132)
    for factory in (fwd.intra_chunk_kernel, fwd.state_output_kernel, fwd.propagator_kernel, bwd.backward_state_kernel,
                    bwd.chunk_grads_kernel, bwd.backward_fused_kernel):
        name = "tilelang " + factory.__name__.removesuffix("_kernel")
        _stand_in(monkeypatch, factory, lambda *a, name=name, **k: lambda *args: launched.update([name]))

    gen = torch.Generator().manual_seed(5)
    H, HV, T = 16, 32, 8192
    q, k = (F.normalize(torch.randn(1, T, H, K, generator=gen), dim=-1).bfloat16().requires_grad_() for _ in range(2))
    v = torch.randn(1, T, HV, V, generator=gen).bfloat16().requires_grad_()
    g = F.logsigmoid(torch.randn(1, T, HV, generator=gen)).requires_grad_()
    beta = torch.rand(1, T, HV, generator=gen).requires_grad_()
    do = torch.randn(1, T, HV, V, generator=gen).bfloat16()

    def step():
        problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta, cu_seqlens=torch.tensor([0, T]))
        BACKEND.chunk_backward(problem, BACKEND.chunk_forward(problem, inputs)[2], do, None)
    step()   # first call: plans and layouts cached
    launched.clear()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    def launches(e) -> bool:   # a top-level operator that launches, or a view or cast that copied after all
        copied = any(c.name in ("aten::_to_copy", "aten::clone", "aten::copy_") for c in e.cpu_children)
        return e.name not in _NO_KERNEL_OPS or copied
    torch_ops = collections.Counter(
        e.name for e in prof.events() if e.name.startswith("aten::") and launches(e)
        and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")))
    both = {"tilelang intra_chunk": 1, "triton _walks_kernel": 1, "triton _pick_kernel": 1,
            "tilelang state_output": 4,   # forward: the pass over segments and the one over sequences; recompute: both
            "triton recurrent_kernel": 1}   # the forward's causal repair (reads each chunk's last row of o)
    if fused:
        want = {**both, "triton _needs_kernel": 1, "tilelang backward_state": 2, "tilelang propagator": 1,
                "triton gated_segment_states_kernel": 1,   # the gated route's dS_end per segment
                "tilelang backward_fused": 1, "triton _chunk_group_sums_kernel": 1}   # (the gate floor's backward in it)
        want_torch = {"aten::clamp_min": 1}   # the gate floor
    else:
        want = {**both, "triton _walks_kernel": 2, "tilelang backward_state": 1, "tilelang chunk_grads": 1}
        want_torch = {"aten::clamp_min": 1, "aten::ge": 1, "aten::where": 1}   # the floor and its backward
    assert dict(launched) == want, dict(launched)
    assert dict(torch_ops) == want_torch, dict(torch_ops)
