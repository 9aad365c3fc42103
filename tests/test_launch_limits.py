"""Launch limits of the GPU backends: CUDA grids (first axis up to 2^31 - 1 programs, second and third up to
65535) and offsets past int32 (T * HV * V > 2^31).

triton_generic launches every chunked kernel on one grid axis (sizes.flat_grid, taken apart in the kernels by
jit_helpers.grid_2d / grid_3d): on CPU every launch of a forward and backward at sequence and chunk counts past 65535
is recorded (kernels not run) and checked against the limits, and the interpreter checks the flat grids' program
ids at head dims where every logical axis has several programs. tilelang_sm90 declines problems past its grid
axis (triton_generic takes them). The `gpu` tests run the shapes that failed on the H100 and one past int32
offsets, comparing far sequences with the float64 reference of each alone.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any triton kernel is defined

import gdnkit  # noqa: E402
from gdnkit.problem import CHUNK_MODE, RECURRENT_MODE, validate_inputs  # noqa: E402

pytest.importorskip("triton")

from gdnkit.backends.triton_generic import (BACKEND, backward_chunk, backward_state, backward_wy,  # noqa: E402
                                            chunked, fused_recurrent, intra_chunk, output, state_pass)
from gdnkit.backends.triton_shared import recurrence, segments, sizes  # noqa: E402

FIRST_AXIS, OTHER_AXES = 2**31 - 1, 65535
LAUNCHING = (intra_chunk, state_pass, output, backward_state, backward_chunk, backward_wy, segments)


def within_cuda_limits(grid) -> bool:
    grid = tuple(grid)
    return 1 <= len(grid) <= 3 and 1 <= grid[0] <= FIRST_AXIS and all(1 <= d <= OTHER_AXES for d in grid[1:])


@pytest.fixture
def recorded(monkeypatch):
    """Every launch of the chunked kernels recorded as (kernel name, grid), none run."""
    launches = []

    def record(name, dtype, kernel, grid, *args, **kwargs):
        launches.append((name, tuple(grid)))

    for module in LAUNCHING:
        monkeypatch.setattr(module, "launch", record)

    class CausalRepair:   # the token-by-token kernel after the chunked forward, launched without the table
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append(("causal_repair", tuple(grid)))
    monkeypatch.setattr(recurrence, "recurrent_kernel", CausalRepair())
    return launches


def test_flat_grid():
    assert sizes.flat_grid(3, 70000, 64) == (3 * 70000 * 64,)
    assert sizes.flat_grid(FIRST_AXIS) == (FIRST_AXIS,)
    with pytest.raises(ValueError, match="grid limit"):
        sizes.flat_grid(2, 2**30)


def _call(B, T, H, HV, K, V, lengths=None, grad=True):
    q = torch.zeros(B, T, H, K, dtype=torch.float16)
    call = dict(q=q, k=q.clone(), v=torch.zeros(B, T, HV, V, dtype=torch.float16), g=torch.zeros(B, T, HV),
                beta=torch.zeros(B, T, HV), output_final_state=True)
    if lengths is not None:
        call["cu_seqlens"] = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    for n in ("q", "k", "v", "g", "beta"):
        call[n].requires_grad_(grad)
    return call


@pytest.mark.parametrize("shape", [
    dict(B=1, T=70000, H=1, HV=1, K=16, V=16, lengths=[1] * 70000),   # 70000 sequences and chunks
    dict(B=1100, T=8, H=16, HV=64, K=16, V=16),                       # dense: B * HV = 70400 (the H100's 4096 x 8)
    dict(B=1, T=70000 * 64, H=1, HV=1, K=16, V=16),                   # one sequence of 70000 chunks
])
def test_every_chunked_launch_within_cuda_grid_limits(recorded, shape):
    problem, inputs = validate_inputs(CHUNK_MODE, **_call(**shape))
    o, ht, saved = BACKEND.chunk_forward(problem, inputs)
    BACKEND.chunk_backward(problem, saved, torch.zeros_like(o), torch.zeros_like(ht))
    names = {name for name, _ in recorded}
    assert {"kkt", "diag_inverse", "solve", "w_u", "local_du", "reverse", "backward_chunk", "backward_wy",
            "causal_repair"} <= names
    assert names & {"fused", "state"}
    assert all(within_cuda_limits(grid) for _, grid in recorded), recorded
    # the logical grids were past the second axis' limit: these launches are the ones that failed before
    assert max(grid[0] for _, grid in recorded) > OTHER_AXES


def test_segment_scans_within_cuda_grid_limits(recorded):
    n_seg, HV, K, V = 70000, 1, 4, 4
    aug = torch.zeros(n_seg, HV, K, V + K)
    seg_offsets = torch.arange(n_seg + 1, dtype=torch.int32)   # as many sequences, one segment each
    segments.segment_scan(aug, None, seg_offsets, n_seg, HV, K, V, False, True, "ieee")
    need = torch.zeros(n_seg, HV, dtype=torch.int32)
    lead_in_states = torch.zeros(n_seg, HV, K, V)
    segments.segment_scan(aug, None, seg_offsets, n_seg, HV, K, V, False, False, "ieee", need=need,
                           lead_in_states=lead_in_states, seq_of=torch.arange(n_seg, dtype=torch.int32))
    assert len(recorded) == 2 and all(within_cuda_limits(grid) and grid[0] == n_seg for _, grid in recorded)


def test_decode_launch_within_cuda_grid_limits(monkeypatch):
    """The token-by-token kernel's one-axis grid at 300000 sequences of 64 value heads."""
    grids = []

    class Recorder:
        def __getitem__(self, grid):
            grids.append(tuple(grid))
            return lambda *args, **kwargs: None

    monkeypatch.setattr(fused_recurrent, "recurrent_kernel", Recorder())
    N, HV = 300000, 64
    call = _call(N, 1, 16, HV, 16, 16, grad=False)
    problem, inputs = validate_inputs(RECURRENT_MODE, **call)
    fused_recurrent.fused_recurrent_forward(problem, inputs)
    assert len(grids) == 1 and within_cuda_limits(grids[0]) and grids[0][0] >= N * HV


def test_tilelang_declines_past_its_grid_axis():
    from gdnkit.backends.tilelang_sm90 import BACKEND as TILELANG
    MAX_SEQUENCES = TILELANG.support.max_sequences
    from gdnkit.dispatch import probe_machine

    machine = probe_machine()
    for n, declined in ((MAX_SEQUENCES, False), (MAX_SEQUENCES + 1, True)):
        problem, _ = validate_inputs(CHUNK_MODE, **_call(1, n, 1, 1, 128, 128, lengths=[1] * n, grad=False))
        reasons = TILELANG.supports(problem, machine)
        assert any("sequences" in r for r in reasons) == declined, reasons


def test_flat_grids_take_program_ids_apart_in_order():
    """Under the interpreter (or on a GPU): K = V = 128, so the V-block and K-block axes of the 3-D logical grids
    (output, local dU, per-chunk gradients) have several programs, and two batch rows: every program finds its
    own tile, or the result is wrong. Unfused output pass, GVA."""
    gen = torch.Generator().manual_seed(0)
    B, T, H, HV, K, V = 2, 70, 1, 2, 128, 128
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    call = dict(q=F.normalize(rnd(B, T, H, K), dim=-1), k=F.normalize(rnd(B, T, H, K), dim=-1), v=rnd(B, T, HV, V),
                g=F.logsigmoid(rnd(B, T, HV)), beta=torch.sigmoid(rnd(B, T, HV)), initial_state=rnd(B, HV, K, V))
    leaves = {n: t.clone().requires_grad_() for n, t in call.items()}
    o_ref, ht_ref = gdnkit.chunk_gated_delta_rule(**leaves, output_final_state=True, backend="reference")
    do, dht = rnd(*o_ref.shape), rnd(*ht_ref.shape)
    g_ref = torch.autograd.grad([o_ref, ht_ref], list(leaves.values()), [do, dht])

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cast = {n: t.to(device, torch.float32).requires_grad_() for n, t in call.items()}
    problem, inputs = validate_inputs(CHUNK_MODE, **cast, output_final_state=True)
    old, chunked.FUSE_OUTPUT = chunked.FUSE_OUTPUT, "never"
    try:
        o, ht, saved = BACKEND.chunk_forward(problem, inputs)
        grads = BACKEND.chunk_backward(problem, saved, do.to(device, torch.float32), dht.to(device, torch.float32))
    finally:
        chunked.FUSE_OUTPUT = old
    rel = lambda x, r: float((x.double().cpu() - r).norm() / r.norm())  # noqa: E731
    errs = {"o": rel(o, o_ref.detach()), "ht": rel(ht, ht_ref.detach())}
    errs.update({n: rel(x, r) for n, x, r in zip(call, grads, g_ref)})
    bound = 2e-5 if device == "cpu" else 1e-4
    assert all(e < bound for e in errs.values()), errs


# ---- GPU: the shapes that failed on the H100, and offsets past int32 --------------------------------------------

def _gpu_call(lengths, H, HV, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lengths)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda")  # noqa: E731
    return dict(q=F.normalize(rnd(1, T, H, 128), dim=-1).to(dtype), k=F.normalize(rnd(1, T, H, 128), dim=-1).to(dtype),
                v=rnd(1, T, HV, 128).to(dtype), g=F.logsigmoid(rnd(1, T, HV) + 2), beta=torch.sigmoid(rnd(1, T, HV)),
                cu_seqlens=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                                        device="cuda"))


def _check_sequences_alone(call, o, grads, pick, do, bound=1e-2):
    """Sequences `pick` of a packed call against the float64 reference of each alone: o and (where grads) dq, dk,
    dv, dg, dbeta on its tokens."""
    cu = call["cu_seqlens"].tolist()
    for n in pick:
        s, e = cu[n], cu[n + 1]
        one = {m: call[m][:, s:e].double().detach().requires_grad_() for m in ("q", "k", "v", "g", "beta")}
        o_ref, _ = gdnkit.chunk_gated_delta_rule(**one, output_final_state=True, backend="reference")
        err = (o[:, s:e].double() - o_ref).norm() / o_ref.norm()
        assert err < bound, f"sequence {n}: o {float(err):.3g}"
        if grads is not None:
            g_ref = torch.autograd.grad(o_ref, list(one.values()), do[:, s:e].double())
            for m, r in zip(one, g_ref):
                err = (grads[m][:, s:e].double() - r).norm() / r.norm()
                assert err < 3 * bound, f"sequence {n}: d{m} {float(err):.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton_generic", None])
@pytest.mark.parametrize("N, T, H, HV", [(4096, 8, 16, 64), (8192, 4, 32, 32)])
def test_gpu_many_short_sequences(backend, N, T, H, HV):
    """The H100's failures (a launch grid axis past 65535): forward and backward, far sequences checked."""
    call = _gpu_call([T] * N, H, HV)
    leaves = {m: call[m].requires_grad_() for m in ("q", "k", "v", "g", "beta")}
    o, _ = gdnkit.chunk_gated_delta_rule(**call, output_final_state=True, backend=backend)
    do = torch.randn_like(o)
    grads = dict(zip(leaves, torch.autograd.grad(o, list(leaves.values()), do)))
    _check_sequences_alone(call, o.detach(), grads, [0, 1, N // 2, N - 1], do)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton_generic", None])
def test_gpu_offsets_past_int32(backend):
    """bf16, HV = 64, V = 128, 2^31 / (64 * 128) + 64 tokens: v's element offsets pass 2^31 in the last chunks
    (4.3 GB a tensor). Two sequences, the second of 100 tokens at the far end, checked against the reference of
    it alone, forward and backward."""
    if torch.cuda.get_device_properties(0).total_memory < 70 * 2**30:
        pytest.skip("needs ~70 GB of GPU memory")
    total = 2**31 // (64 * 128) + 64
    assert total * 64 * 128 > 2**31 > (total - 100) * 64 * 128   # the far sequence's last tokens are past 2^31
    call = _gpu_call([total - 100, 100], 16, 64)
    leaves = {m: call[m].requires_grad_() for m in ("q", "k", "v", "g", "beta")}
    o, _ = gdnkit.chunk_gated_delta_rule(**call, output_final_state=True, backend=backend)
    do = torch.randn_like(o)
    grads = dict(zip(leaves, torch.autograd.grad(o, list(leaves.values()), do)))
    _check_sequences_alone(call, o.detach(), grads, [1], do)
