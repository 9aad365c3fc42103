"""tilelang_sm90's algebra in float64 on a CPU: the solve, a model of the kernels' tile dataflow against the
recurrence, and the group sums of the fused backward (Triton's interpreter) with and without the qk l2norm's
backward."""

import pytest
import torch
import torch.nn.functional as F

from .helpers import K


@pytest.mark.parametrize("lengths,H,HV,dtype", [((77, 0, 130), 2, 8, torch.bfloat16), ((40,), 4, 4, torch.float16),
                                                 ((0,), 2, 4, torch.bfloat16), ((33, 64), 1, 3, torch.float32)])
def test_group_sums_add_each_key_heads_value_heads(lengths, H, HV, dtype):
    """The fused backward's GVA sums (group_sum.py; Triton, interpreted on a CPU) from dq / dk per chunk and value
    head: each token's rows from its chunk's slots (in the kernel's accumulator order, slot_offset: a permutation
    of the slot that rows_from_slot undoes), each key head's value heads added in fp32 and written in the
    gradients' dtype, within one unit in its last place of the float64 sum (the interpreter's casts truncate); a
    group of one is a copy; a tail chunk's rows past its sequence, whatever they hold, stay out of the output; the
    tokens past the last sequence are zero; no chunks, no launch; the same bits from finer runs (segments)."""
    pytest.importorskip("triton")
    from gdnkit import seqlayout
    from gdnkit.backends.tilelang_sm90.group_sum import chunk_group_sums, rows_from_slot, slot_offset
    rr, jj = torch.meshgrid(torch.arange(64), torch.arange(K), indexing="ij")
    offsets = slot_offset(rr, jj)
    assert sorted(offsets.flatten().tolist()) == list(range(64 * K))
    assert torch.equal(rows_from_slot(torch.zeros(64 * K, dtype=torch.long).index_put_((offsets.flatten(),),
                                                                                      torch.arange(64 * K))),
                       torch.arange(64 * K).view(64, K))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    layout, total = seqlayout.sequence_layout(cu), int(cu[-1]) + 5
    dqk = torch.randn(layout.n_chunks, HV, 2, 64, K, generator=torch.Generator().manual_seed(len(lengths)))
    dqk = dqk.to(torch.bfloat16)
    dq, dk = chunk_group_sums(dqk, layout, H, total, dtype)
    rows = rows_from_slot(dqk.double().reshape(layout.n_chunks, HV, 2, 64 * K))
    want = torch.zeros(2, total, H, K, dtype=torch.float64)
    for n, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        for t in range(bos, eos):
            c, row = int(layout.chunk_offsets[n]) + (t - bos) // 64, (t - bos) % 64
            want[:, t] = rows[c, :, :, row].view(H, HV // H, 2, K).sum(1).transpose(0, 1)
    assert dq.shape == dk.shape == (1, total, H, K) and dq.dtype == dk.dtype == dtype
    tol = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 1e-6}[dtype]
    for got, w in zip((dq, dk), want):
        assert torch.allclose(got[0].double(), w, rtol=tol, atol=tol)
    # the same from the fused kernel's runs cut finer (one chunk each, as segments): the same bits
    starts = [bos + 64 * w for bos, eos in zip(cu[:-1].tolist(), cu[1:].tolist()) for w in range(-(-(eos - bos) // 64))]
    runs = (torch.tensor([*starts, int(cu[-1])], dtype=torch.int32),
            torch.arange(len(starts) + 1, dtype=torch.int32), 1)
    if starts:
        for got, again in zip((dq, dk), chunk_group_sums(dqk, layout, H, total, dtype, runs)):
            assert torch.equal(got, again)


@pytest.mark.parametrize("form", ["triton", "torch"])
@pytest.mark.parametrize("lengths,H,HV,dtype", [((77, 0, 130), 2, 8, torch.bfloat16), ((40,), 4, 4, torch.float16),
                                                 ((33, 64), 1, 3, torch.float32)])
def test_group_sums_take_the_qk_l2norm_backward(lengths, H, HV, dtype, form, bf16_interpreter, monkeypatch):
    """With the prologue's qk l2norm (use_qk_l2norm_in_kernel), the fused path's group sums leave dq / dk w.r.t.
    the raw q / k in their dtype: rstd (S - y (y . S)) of each token's summed slots S, y = x rstd made again
    from the raw rows, against the float64 sum and formula, in the Triton kernel (interpreted on a CPU) and its
    torch form; the tokens past the last sequence stay zero."""
    pytest.importorskip("triton")
    from gdnkit import prep, seqlayout
    from gdnkit.backends.tilelang_sm90 import group_sum
    if form == "torch":
        monkeypatch.setattr(group_sum, "triton_reads", lambda t: False)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    layout, total = seqlayout.sequence_layout(cu), int(cu[-1]) + 5
    gen = torch.Generator().manual_seed(len(lengths) + H)
    dqk = torch.randn(layout.n_chunks, HV, 2, 64, K, generator=gen).to(torch.bfloat16)
    raws = [torch.randn(1, total, H, K, generator=gen).to(dtype) for _ in range(2)]
    rstds = [torch.rsqrt((x.float() ** 2).sum(-1, keepdim=True) + prep.L2NORM_EPS) for x in raws]
    got = group_sum.chunk_group_sums(dqk, layout, H, total, dtype, None, (raws[0], rstds[0], raws[1], rstds[1]))
    rows = group_sum.rows_from_slot(dqk.double().reshape(layout.n_chunks, HV, 2, 64 * K))
    sums = torch.zeros(2, total, H, K, dtype=torch.float64)
    for n, (bos, eos) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        for t in range(bos, eos):
            c, row = int(layout.chunk_offsets[n]) + (t - bos) // 64, (t - bos) % 64
            sums[:, t] = rows[c, :, :, row].view(H, HV // H, 2, K).sum(1).transpose(0, 1)
    bound = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}[dtype]
    for out, x, rstd, S in zip(got, raws, rstds, sums):
        assert out.shape == (1, total, H, K) and out.dtype == dtype
        y = x[0].double() * rstd[0].double()
        want = rstd[0].double() * (S - y * (y * S).sum(-1, keepdim=True))
        valid = int(cu[-1])
        err = float((out[0, :valid].double() - want[:valid]).norm() / want[:valid].norm().clamp_min(1e-300))
        assert err <= bound, err
        assert not out[0, valid:].any()


@pytest.mark.parametrize("form", ["triton", "torch"])
@pytest.mark.parametrize("segments", [False, True], ids=["sequences", "segments"])
def test_group_sums_take_the_gate_floors_backward(form, segments, monkeypatch):
    """With gate_floor, the fused path's group sums also leave dg w.r.t. the gate before its floor, in place: dg
    zeroed where that gate is below -30 (the -inf resets too) or NaN, every other entry's bits kept, the tokens past
    the last sequence untouched; by the sequences' programs or by finer runs (segments); dq / dk the same bits as
    without it. In the Triton kernel (interpreted on a CPU) and its torch form."""
    pytest.importorskip("triton")
    from gdnkit import seqlayout
    from gdnkit.backends.tilelang_sm90 import group_sum
    if form == "torch":
        monkeypatch.setattr(group_sum, "triton_reads", lambda t: False)
    H, HV, lengths = 2, 6, (77, 0, 130, 1)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    layout, total = seqlayout.sequence_layout(cu), int(cu[-1]) + 5
    gen = torch.Generator().manual_seed(11)
    dqk = torch.randn(layout.n_chunks, HV, 2, 64, K, generator=gen).to(torch.bfloat16)
    g = torch.randn(1, total, HV, generator=gen) * 20 - 20            # about a fifth below the floor
    g[0, 3, 1], g[0, 100, 5], g[0, 207, 0] = float("-inf"), float("nan"), -30.0   # a reset, a NaN, the floor itself
    dg0 = torch.randn(1, total, HV, generator=gen)
    runs = None
    if segments:   # one chunk a run, as the wide route's segments cut them
        starts = [b + 64 * w for b, e in zip(cu[:-1].tolist(), cu[1:].tolist()) for w in range(-(-(e - b) // 64))]
        runs = (torch.tensor([*starts, int(cu[-1])], dtype=torch.int32),
                torch.arange(len(starts) + 1, dtype=torch.int32), 1)
    dg = dg0.clone()
    got = group_sum.chunk_group_sums(dqk, layout, H, total, torch.bfloat16, runs, gate_floor=(g, dg))
    end = int(cu[-1])
    kept = g[0, :end] >= -30.0
    assert 0 < int((~kept).sum()) < kept.numel() // 2 and bool(kept[207, 0]) and not bool(kept[100, 5])
    assert torch.equal(dg[0, :end], torch.where(kept, dg0[0, :end], torch.zeros(())))
    assert torch.equal(dg[0, end:], dg0[0, end:])
    for a, b in zip(got, group_sum.chunk_group_sums(dqk, layout, H, total, torch.bfloat16, runs)):
        assert torch.equal(a, b)


def test_solve_algebra_float64():
    """T = (I + A)^-1 as the kernel forms it: Dinv from 16x16 forward substitutions, N = Dinv Aoff,
    T = (I - N)(I + N N) Dinv (exact: N is strictly block-lower with 4 blocks, so N^4 = 0)."""
    gen = torch.Generator().manual_seed(0)
    C, BLK = 64, 16
    k = F.normalize(torch.randn(C, 128, generator=gen, dtype=torch.float64), dim=-1)
    beta = torch.rand(C, generator=gen, dtype=torch.float64)
    gamma = F.logsigmoid(torch.randn(C, generator=gen, dtype=torch.float64)).cumsum(0)
    i = torch.arange(C)
    strict = i[:, None] > i[None, :]
    D = torch.exp((gamma[:, None] - gamma[None, :]).masked_fill(~strict, float("-inf")))
    A = (beta[:, None] * (k @ k.T) * D).masked_fill(~strict, 0)

    same_block = (i[:, None] // BLK) == (i[None, :] // BLK)
    Dinv = torch.zeros(C, C, dtype=torch.float64)
    for b in range(C // BLK):  # one "thread" per column c: solve (I + A_bb) x = e_c
        blk = A[b * BLK:(b + 1) * BLK, b * BLK:(b + 1) * BLK]
        for c in range(BLK):
            col = torch.zeros(BLK, dtype=torch.float64)
            for r in range(BLK):
                col[r] = (1.0 if r == c else 0.0) - sum(blk[r, m] * col[m] for m in range(r))
            Dinv[b * BLK:(b + 1) * BLK, b * BLK + c] = col
    Aoff = A.masked_fill(same_block, 0)
    N = Dinv @ Aoff
    eye = torch.eye(C, dtype=torch.float64)
    Tm = (eye - N) @ (eye + N @ N) @ Dinv
    expected = torch.linalg.inv(eye + A)
    assert torch.allclose(Tm, expected, atol=1e-12, rtol=1e-10)


def _emulate(q, k, v, g, beta, h0, cu, scale):
    """The two kernels' dataflow in float64, tile by tile, including what the TMA boxes of a tail chunk
    read (the next sequence's rows, zeros past the tensor's end) and every select the kernels use."""
    C = 64
    _, T, H, Kd = k.shape
    HV, Vd = v.shape[2], v.shape[3]
    grp = HV // H

    def box(x, t0):  # a TMA box of 64 rows from row t0 of [1, T, ...]: zeros past the end
        out = x.new_zeros((C,) + tuple(x.shape[2:]))
        n = max(0, min(C, T - t0))
        out[:n] = x[0, t0:t0 + n]
        return out

    from gdnkit.seqlayout import sequence_layout
    layout = sequence_layout(cu)
    table, offsets = layout.chunk_indices.tolist(), layout.chunk_offsets.tolist()
    w = torch.full((1, T, HV, Kd), float("nan"), dtype=torch.float64)  # never-written rows are garbage
    u = torch.full((1, T, HV, Vd), float("nan"), dtype=torch.float64)
    gamma = torch.full((HV, len(table), C), float("nan"), dtype=torch.float64)  # one row per table entry
    i = torch.arange(C)
    for row, (seq, ic) in enumerate(table):
        bos, eos = int(cu[seq]), int(cu[seq + 1])
        t0 = bos + ic * C
        n_valid = min(eos - t0, C)
        valid = i < n_valid
        for hv in range(HV):
            kk, vv = box(k[:, :, hv // grp], t0), box(v[:, :, hv], t0)
            gs = torch.where(valid, box(g[:, :, hv], t0), 0.0).cumsum(0)
            bs = torch.where(valid, box(beta[:, :, hv], t0), 0.0)
            A = torch.where(i[:, None] > i[None, :], (kk @ kk.T) * bs[:, None] * torch.exp(gs[:, None] - gs[None, :]), 0.0)
            Tm = torch.linalg.inv(torch.eye(C, dtype=torch.float64) + A)
            W = Tm @ (kk * (bs * gs.exp())[:, None])
            U = Tm @ (vv * bs[:, None])
            n = n_valid
            w[0, t0:t0 + n, hv], u[0, t0:t0 + n, hv], gamma[hv, row] = W[:n], U[:n], gs
    o = torch.zeros(1, T, HV, Vd, dtype=torch.float64)
    ht = torch.zeros(len(cu) - 1, HV, Kd, Vd, dtype=torch.float64)
    for seq in range(len(cu) - 1):
        bos, eos = int(cu[seq]), int(cu[seq + 1])
        for hv in range(HV):
            S = h0[seq, hv].clone()
            for ic in range(-(-(eos - bos) // C)):
                t0 = bos + ic * C
                n_valid = min(eos - t0, C)
                valid = i < n_valid
                qq, kk = box(q[:, :, hv // grp], t0), box(k[:, :, hv // grp], t0)
                ww, up = box(w[:, :, hv], t0), box(u[:, :, hv], t0)
                gs = gamma[hv, offsets[seq] + ic]
                Sb = S  # (the kernel rounds this to bf16)
                Un = torch.where(valid[:, None], up - ww @ Sb, 0.0)
                P = torch.where((i[:, None] >= i[None, :]) & valid[:, None], (qq @ kk.T) * torch.exp(gs[:, None] - gs[None, :]), 0.0)
                O = (qq @ Sb) * gs.exp()[:, None] + P @ Un
                o[0, t0:t0 + n_valid, hv] = (O * scale)[:n_valid]
                gl = gs[n_valid - 1]
                Ud = torch.where(valid[:, None], Un * torch.exp(gl - gs)[:, None], 0.0)
                S = S * gl.exp() + kk.T @ Ud
            ht[seq, hv] = S
    return o, ht


def test_kernel_dataflow_float64():
    """The kernels' tile dataflow (tail boxes reading the next sequence, selects, gamma rows per chunk, decay folded
    into U) reproduces the reference in float64: the masking argument of the kernels, checked on CPU."""
    from gdnkit.backends.reference.backend import reference_forward
    from gdnkit.backends.reference.chunked import chunked_gdn
    from gdnkit.problem import CHUNK_MODE, validate_inputs

    H, HV, Kd, Vd = 1, 2, 16, 8
    cu = torch.tensor([0, 1, 65, 200, 200, 260])  # lengths 1, 64, 135, 0, 60; 3 tokens after the last
    T, N = 263, 5
    gen = torch.Generator().manual_seed(1)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = F.normalize(r(1, T, H, Kd), dim=-1), F.normalize(r(1, T, H, Kd), dim=-1)
    v, g, beta = r(1, T, HV, Vd), F.logsigmoid(r(1, T, HV)) * 3, torch.rand(1, T, HV, generator=gen, dtype=torch.float64)
    h0 = r(N, HV, Kd, Vd)
    o, ht = _emulate(q, k, v, g, beta, h0, cu, Kd ** -0.5)
    problem, inputs = validate_inputs(CHUNK_MODE, q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      cu_seqlens=cu)
    ref_o, ref_ht = reference_forward(problem, inputs, chunked_gdn)
    assert torch.allclose(o[:, :260], ref_o[:, :260], atol=1e-10, rtol=1e-8)
    assert torch.allclose(ht, ref_ht, atol=1e-10, rtol=1e-8)
