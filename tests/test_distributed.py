"""gdnkit.distributed: a packed batch split along its token axis over processes equals one process on the whole batch.

Each world size is one spawn of gloo processes running every case (process start-up, not compute, is the cost).
Every rank builds the same global inputs from a seed, runs its shard, and checks its outputs and gradients against
a token-by-token float64 recurrence written here (float64 inputs) or the single-process call on the whole batch
(float32). The loss of rank r weighs o and the final states with weights of its own, so the final states'
gradients must sum over ranks; initial_state's and A_log's per-rank parts are all-reduced as a caller would.
"""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import gdnkit
import gdnkit.distributed

H, HV, K, V = 2, 4, 8, 6  # K != V: the transition's V' = K columns differ from v's


def _rel(x, ref) -> float:
    x, ref = x.detach().double(), ref.detach().double()
    return float((x - ref).norm() / ref.norm().clamp_min(1e-300))


def oracle(q, k, v, g, beta, h0, offsets, scale, A_log=None, dt_bias=None, qk_l2norm=False, beta_sigmoid=False):
    """The gated delta rule token by token in float64, [1, T, ...] packed by offsets; h0 [N, HV, K, V]."""
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    if qk_l2norm:
        q, k = (x * (x * x).sum(-1, keepdim=True).add(1e-6).rsqrt() for x in (q, k))  # FLA's eps inside
    if A_log is not None:
        g = -A_log.double().exp() * F.softplus(g + (0 if dt_bias is None else dt_bias.double()))
    if beta_sigmoid:
        beta = beta.sigmoid()
    rep = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    outs, finals = [], []
    for n, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        S = h0[n].double()
        for t in range(a, b):
            S = g[0, t, :, None, None].exp() * S
            u = beta[0, t, :, None] * (v[0, t] - torch.einsum("hkv,hk->hv", S, k[0, t]))
            S = S + k[0, t, :, :, None] * u[:, None, :]
            outs.append(scale * torch.einsum("hkv,hk->hv", S, q[0, t]))
        finals.append(S)
    return torch.stack(outs)[None], torch.stack(finals)


def _case(seed, world, options=False):
    """Global inputs, offsets (an empty sequence, one spanning every rank) and shard bounds (one shard empty
    where world >= 3), all from `seed`, the same in every process."""
    rng = random.Random(seed)
    T = rng.randint(44, 60)
    cuts = sorted(rng.sample(range(1, T), 3))
    # sequence 0 short, sequence 1 long (spans every shard), an empty sequence, the rest
    offsets = [0, 3, T - 6, T - 6, T - 2, T] if seed % 2 else [0] + cuts[:1] + [cuts[0]] + cuts[1:] + [T]
    if world >= 3:
        cuts = sorted(rng.sample(range(5, T - 8), world - 2))
        bounds = [0, cuts[0], *cuts, T]  # shard 1 empty
    elif world == 2:
        bounds = [0, 0, T] if seed % 10 == 1 else [0, rng.randint(5, T - 5), T]
    else:
        bounds = [0, T]
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    N = len(offsets) - 1
    x = dict(q=rnd(1, T, H, K), k=F.normalize(rnd(1, T, H, K), dim=-1), v=rnd(1, T, HV, V),
             g=F.logsigmoid(rnd(1, T, HV)) * 0.3, beta=torch.rand(1, T, HV, generator=gen, dtype=torch.float64),
             h0=rnd(N, HV, K, V), w_o=rnd(1, T, HV, V), w_h=[rnd(N, HV, K, V) for _ in range(world)])
    if options:
        x.update(g=rnd(1, T, HV), beta=rnd(1, T, HV), A_log=rnd(HV) * 0.5, dt_bias=rnd(HV) * 0.5)
    return x, offsets, bounds


def _distributed_side(x, offsets, bounds, rank, dtype, options, grad=True, group=None):
    """This rank's run: its outputs, its shard's gradients, and the all-reduced replicated gradients."""
    lo, hi = bounds[rank], bounds[rank + 1]
    leaf = lambda t: t.to(dtype).clone().requires_grad_(grad)  # noqa: E731
    shard = {name: leaf(x[name][:, lo:hi]) for name in ("q", "k", "v", "g", "beta")}
    h0 = leaf(x["h0"])
    extra = {}
    if options:
        extra = dict(use_gate_in_kernel=True, A_log=leaf(x["A_log"]), dt_bias=leaf(x["dt_bias"]),
                     use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True)
        h0 = leaf(x["h0"].transpose(-1, -2))
    cu = torch.tensor(offsets, dtype=torch.int32)
    o, ht = gdnkit.distributed.chunk_gated_delta_rule(
        shard["q"], shard["k"], shard["v"], shard["g"], shard["beta"], initial_state=h0, output_final_state=True,
        cu_seqlens=cu, group=group, **extra)
    if options:
        ht = ht.transpose(-1, -2)
    if not grad:
        return o, ht, None
    loss = (o.double() * x["w_o"][:, lo:hi]).sum() + (ht.double() * x["w_h"][rank]).sum()
    loss.backward()
    grads = {name: t.grad for name, t in shard.items()}
    replicated = {"h0": h0.grad.transpose(-1, -2) if options else h0.grad}
    if options:
        replicated.update(A_log=extra["A_log"].grad, dt_bias=extra["dt_bias"].grad)
    for t in replicated.values():
        dist.all_reduce(t, group=group)
    grads.update(replicated)
    return o, ht, grads


def _whole_side(x, offsets, world, dtype, options, use_oracle):
    """The whole batch in one process (the oracle, or gdnkit's single-process call) and its gradients for the
    sum of every rank's loss."""
    leaf = lambda t: t.to(dtype).clone().requires_grad_()  # noqa: E731
    t = {name: leaf(x[name]) for name in ("q", "k", "v", "g", "beta", "h0")}
    extra = {name: leaf(x[name]) for name in ("A_log", "dt_bias")} if options else {}
    scale = K ** -0.5
    if use_oracle:
        o, ht = oracle(t["q"], t["k"], t["v"], t["g"], t["beta"], t["h0"], offsets, scale,
                       extra.get("A_log"), extra.get("dt_bias"), qk_l2norm=options, beta_sigmoid=options)
    else:
        flags = dict(use_gate_in_kernel=True, use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True) \
            if options else {}
        o, ht = gdnkit.chunk_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"], scale, t["h0"], True,
                                              cu_seqlens=torch.tensor(offsets, dtype=torch.int32), **extra, **flags)
    loss = (o.double() * x["w_o"]).sum() + (ht.double() * sum(x["w_h"][:world])).sum()
    loss.backward()
    grads = {name: v.grad for name, v in {**t, **extra}.items()}
    return o.detach(), ht.detach(), grads


def _check_case(world, rank, seed, dtype, options=False, group=None):
    x, offsets, bounds = _case(seed, world, options=options)
    use_oracle = dtype == torch.float64
    o, ht, grads = _distributed_side(x, offsets, bounds, rank, dtype, options, group=group)
    o_ref, ht_ref, grads_ref = _whole_side(x, offsets, world, dtype, options, use_oracle)
    lo, hi = bounds[rank], bounds[rank + 1]
    tol = 1e-10 if dtype == torch.float64 else 5e-6
    where = f"seed {seed} world {world} rank {rank} {dtype} options={options} offsets {offsets} bounds {bounds}"
    assert o.shape == (1, hi - lo, HV, V) and o.dtype == dtype, where
    if hi > lo:
        assert _rel(o, o_ref[:, lo:hi]) < tol, f"o: {_rel(o, o_ref[:, lo:hi]):.2e} {where}"
    assert _rel(ht, ht_ref) < tol, f"final states: {_rel(ht, ht_ref):.2e} {where}"
    for name, got in grads.items():
        want = grads_ref[name] if name in ("h0", "A_log", "dt_bias") else grads_ref[name][:, lo:hi]
        if want.numel() == 0:
            assert got is None or got.numel() == 0, f"d{name} {where}"
            continue
        assert got is not None, f"d{name} is None {where}"
        assert _rel(got, want) < tol, f"d{name}: {_rel(got, want):.2e} {where}"


def _check_inference_and_repeat(world, rank):
    """Under no_grad the same outputs as with autograd; two runs bitwise equal."""
    x, offsets, bounds = _case(5, world)
    o1, ht1, _ = _distributed_side(x, offsets, bounds, rank, torch.float64, False, grad=False)
    with torch.no_grad():
        o2, ht2, _ = _distributed_side(x, offsets, bounds, rank, torch.float64, False, grad=False)
    o3, ht3, _ = _distributed_side(x, offsets, bounds, rank, torch.float64, False)
    assert torch.equal(o1, o2) and torch.equal(ht1, ht2)
    assert torch.equal(o1, o3.detach()) and torch.equal(ht1, ht3.detach())


def _check_no_h0_no_cu(world, rank):
    """cu_seqlens=None: one sequence of every shard's tokens; no initial state, no final state."""
    x, _, bounds = _case(7, world)
    T = bounds[-1]
    lo, hi = bounds[rank], bounds[rank + 1]
    shard = {name: x[name][:, lo:hi].clone().requires_grad_() for name in ("q", "k", "v", "g", "beta")}
    o, ht = gdnkit.distributed.chunk_gated_delta_rule(*shard.values())
    assert ht is None
    (o * x["w_o"][:, lo:hi]).sum().backward()
    full = {name: x[name].clone().requires_grad_() for name in ("q", "k", "v", "g", "beta")}
    o_ref, _ = oracle(*full.values(), torch.zeros(1, HV, K, V, dtype=torch.float64), [0, T], K ** -0.5)
    (o_ref * x["w_o"]).sum().backward()
    if hi > lo:
        assert _rel(o, o_ref[:, lo:hi]) < 1e-10
        for name in shard:
            assert _rel(shard[name].grad, full[name].grad[:, lo:hi]) < 1e-10, name


def _expect(exc_type, match, fn):
    with pytest.raises(exc_type, match=match):
        fn()


def _check_bad_inputs(world, rank):
    x, offsets, bounds = _case(3, world)
    lo, hi = bounds[rank], bounds[rank + 1]
    args = lambda lo=lo, hi=hi: [x[n][:, lo:hi] for n in ("q", "k", "v", "g", "beta")]  # noqa: E731
    cu = torch.tensor(offsets, dtype=torch.int32)
    call = gdnkit.distributed.chunk_gated_delta_rule
    # the last rank drops its last token: the shards no longer make cu_seqlens[-1]
    short = args(lo, hi - 1) if rank == world - 1 else args()
    _expect(ValueError, "sum to", lambda: call(*short, cu_seqlens=cu))
    # one rank's offsets differ (same total)
    other = torch.tensor([0, 1] + offsets[2:], dtype=torch.int32) if rank == 0 else cu
    _expect(ValueError, "cu_seqlens must be the same", lambda: call(*args(), cu_seqlens=other))
    # one rank's offsets cut one more sequence (same total), or it passes none
    more = torch.tensor(offsets[:2] + [offsets[1] + 1] + offsets[2:], dtype=torch.int32) if rank == 0 else cu
    _expect(ValueError, "cu_seqlens must be the same", lambda: call(*args(), cu_seqlens=more))
    _expect(ValueError, "cu_seqlens must be the same",
            lambda: call(*args(), cu_seqlens=None if rank == world - 1 else cu))
    # one rank's initial_state has the wrong shape: it names it, the others say which rank rejected its inputs
    h0 = x["h0"] if rank != world - 1 else x["h0"][:-1]
    _expect(ValueError, "initial_state" if rank == world - 1 else f"rank\\(s\\) \\[{world - 1}\\]",
            lambda: call(*args(), initial_state=h0, cu_seqlens=cu))
    # one rank asks for final states, the others do not
    _expect(ValueError, "same head shapes", lambda: call(*args(), output_final_state=rank == 0, cu_seqlens=cu))
    _expect(TypeError, "unexpected keyword", lambda: call(*args(), cu_seqlens=cu, chunk_size=64))
    # one rank records a graph, the others do not: the backward's collective would wait forever
    graded = [t.clone().requires_grad_(rank == 0) for t in args()]
    _expect(ValueError, "agree on whether gradients", lambda: call(*graded, cu_seqlens=cu))
    # a rank whose local call fails after the ranks agreed: it raises after the gather (no rank waits for it); the
    # others compose NaNs from its row, not silent zeros
    real = gdnkit.distributed.api.chunk_gated_delta_rule

    def broken(*a, **kw):
        raise RuntimeError("the local call broke")
    gdnkit.distributed.api.chunk_gated_delta_rule = broken if rank == 1 else real
    try:
        if rank == 1:
            _expect(RuntimeError, "local call broke",
                    lambda: call(*args(), initial_state=x["h0"], output_final_state=True, cu_seqlens=cu))
        else:
            _, ht = call(*args(), initial_state=x["h0"], output_final_state=True, cu_seqlens=cu)
            assert ht.isnan().any()
    finally:
        gdnkit.distributed.api.chunk_gated_delta_rule = real
    # the group still works after every rejection
    o, _ = call(*args(), cu_seqlens=cu)
    assert o.shape == (1, hi - lo, HV, V)


def _check_half_initial_state(world, rank):
    """A bfloat16 / float16 initial_state is taken as float32, as the single-process call takes it: the results of
    its float32 value, and its gradient in its own dtype, whose all-reduced parts make the whole batch's."""
    x, offsets, bounds = _case(11, world)
    lo, hi = bounds[rank], bounds[rank + 1]
    cu = torch.tensor(offsets, dtype=torch.int32)
    names = ("q", "k", "v", "g", "beta")
    shard = [x[n][:, lo:hi].float() for n in names]
    for half in (torch.bfloat16, torch.float16):
        h0 = x["h0"].to(half).requires_grad_()
        o, ht = gdnkit.distributed.chunk_gated_delta_rule(*shard, initial_state=h0, output_final_state=True,
                                                          cu_seqlens=cu)
        o32, ht32 = gdnkit.distributed.chunk_gated_delta_rule(*shard, initial_state=h0.detach().float(),
                                                              output_final_state=True, cu_seqlens=cu)
        assert ht.dtype == torch.float32 and torch.equal(o, o32) and torch.equal(ht, ht32), half
        ((o.double() * x["w_o"][:, lo:hi]).sum() + (ht.double() * x["w_h"][rank]).sum()).backward()
        assert h0.grad.dtype == half
        d_h0 = h0.grad.float()
        dist.all_reduce(d_h0)
        h0_1 = x["h0"].to(half).requires_grad_()
        o1, ht1 = gdnkit.chunk_gated_delta_rule(*(x[n].float() for n in names), initial_state=h0_1,
                                                output_final_state=True, cu_seqlens=cu)
        ((o1.double() * x["w_o"]).sum() + (ht1.double() * sum(x["w_h"][:world])).sum()).backward()
        assert _rel(d_h0, h0_1.grad) < 1e-2, (half, _rel(d_h0, h0_1.grad))  # per-rank parts rounded to 16 bits


def _check_subgroup(world, rank):
    """A group of ranks 1..P-1 of the world: shards and ranks are the group's."""
    members = list(range(1, world))
    group = dist.new_group(members)  # every rank creates every group
    if rank in members:
        _check_case(len(members), members.index(rank), 60 + world, torch.float64, group=group)


def _check_group_of_one(world, rank):
    """A group of one process runs the single-process call on its own inputs: the same bits."""
    singles = [dist.new_group([r]) for r in range(world)]  # every rank creates every group
    x, offsets, _ = _case(9, 1)
    cu = torch.tensor(offsets, dtype=torch.int32)
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    o, ht = gdnkit.distributed.chunk_gated_delta_rule(*args, initial_state=x["h0"], output_final_state=True,
                                                      cu_seqlens=cu, group=singles[rank])
    o_ref, ht_ref = gdnkit.chunk_gated_delta_rule(*args, initial_state=x["h0"], output_final_state=True,
                                                  cu_seqlens=cu)
    assert torch.equal(o, o_ref) and torch.equal(ht, ht_ref)


def _worker(rank, world, init_file, checks):
    torch.set_num_threads(1)  # before any op: a forked child must not use the parent's OpenMP pool
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for name, args in checks:
            globals()[name](world, rank, *args)
    finally:
        dist.destroy_process_group()


def _spawn(world, checks):
    """CPU processes are forked from this one after it has imported gdnkit and probed the machine (seconds each
    under spawn, which re-imports everything per process)."""
    gdnkit.available_backends()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world, os.path.join(tmp, "rendezvous"), checks), nprocs=world, join=True,
                           start_method="fork")


def _case_checks(seeds, options_seed):
    checks = [("_check_case", (seed, dtype)) for seed in seeds for dtype in (torch.float64, torch.float32)]
    return checks + [("_check_case", (options_seed, torch.float64, True))]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_matches_one_process(world):
    checks = _case_checks(seeds=[world * 10, world * 10 + 1], options_seed=world * 10 + 2)
    checks += [("_check_inference_and_repeat", ()), ("_check_no_h0_no_cu", ())]
    if world == 2:
        checks += [("_check_bad_inputs", ()), ("_check_group_of_one", ()), ("_check_half_initial_state", ())]
    if world == 4:
        checks += [("_check_subgroup", ())]
    _spawn(world, checks)


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "context_parallel.py"


def test_the_example_runs():
    """examples/context_parallel.py runs as written: two processes, each within its bound of the single-process
    call (the script asserts it too)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    found = re.findall(r"rank (\d) of 2 \((\w+)\): max error against one process (\S+)", out.stdout)
    assert sorted(rank for rank, _, _ in found) == ["0", "1"], out.stdout
    assert all(float(err) < (1e-2 if backend == "nccl" else 1e-4) for _, backend, err in found), out.stdout


def test_needs_an_initialised_process_group():
    x, offsets, _ = _case(1, 1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        gdnkit.distributed.chunk_gated_delta_rule(*(x[n] for n in ("q", "k", "v", "g", "beta")))


# GPU: the same contract with CUDA tensors and the backends dispatch picks there (tilelang_sm90 on Hopper at
# K = V = 128, triton_generic elsewhere). CUDA cannot be forked, so these processes are spawned.

GPU_HEADS = (4, 8, 128, 128)  # H, HV, K, V: a head configuration `gdnkit warm` builds ahead


def _gpu_case(seed, world, device):
    """~5000 packed tokens: a short sequence, an empty one, one spanning every shard, a last short one; uneven
    shards."""
    rng = random.Random(seed)
    T = 5000 + rng.randint(0, 63)
    offsets = [0, 300, 300, T - 400, T]
    cuts = sorted(rng.sample(range(600, T - 800), world - 1))
    bounds = [0, *cuts, T]
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    Hq, Hv, Kd, Vd = GPU_HEADS
    N = len(offsets) - 1
    x = dict(q=rnd(1, T, Hq, Kd), k=F.normalize(rnd(1, T, Hq, Kd), dim=-1), v=rnd(1, T, Hv, Vd),
             g=F.logsigmoid(rnd(1, T, Hv)), beta=torch.rand(1, T, Hv, generator=gen, dtype=torch.float64),
             h0=rnd(N, Hv, Kd, Vd), w_o=rnd(1, T, Hv, Vd), w_h=[rnd(N, Hv, Kd, Vd) for _ in range(world)])
    return {name: [t.to(device) for t in x[name]] if name == "w_h" else x[name].to(device) for name in x}, offsets, \
        bounds


def _gpu_run(x, offsets, lo, hi, dtype, distributed, world, rank, backend=None):
    """Outputs and gradients of one side: this rank's shard through gdnkit.distributed, or the whole batch in one
    call (loss: the sum of every rank's)."""
    names = ("q", "k", "v", "g", "beta")
    cast = lambda t: t.to(dtype) if t.dtype == torch.float64 and dtype != torch.float64 and t.dim() == 4 else t  # noqa
    t = {n: cast(x[n][:, lo:hi]).clone().requires_grad_() for n in names}
    h0 = x["h0"].float().clone().requires_grad_() if dtype != torch.float64 else x["h0"].clone().requires_grad_()
    gates = {n: t[n].float() if dtype != torch.float64 else t[n] for n in ("g", "beta")}
    cu = torch.tensor(offsets, dtype=torch.int32, device=x["q"].device)
    fn = gdnkit.distributed.chunk_gated_delta_rule if distributed else gdnkit.chunk_gated_delta_rule
    extra = {} if backend is None else {"backend": backend}
    o, ht = fn(t["q"], t["k"], t["v"], gates["g"], gates["beta"], None, h0, True, cu_seqlens=cu, **extra)
    w_h = x["w_h"][rank] if distributed else sum(x["w_h"][:world])
    ((o.double() * x["w_o"][:, lo:hi]).sum() + (ht.double() * w_h).sum()).backward()
    if distributed:
        dist.all_reduce(h0.grad)
    return o.detach(), ht.detach(), {**{n: v.grad for n, v in t.items()}, "h0": h0.grad}


def _check_gpu_case(world, rank, device, dtype):
    """This rank's shard against float64 (the reference backend on the whole batch): within twice the error of
    the single-process call on the whole batch in the same dtype (whose chunks start elsewhere), plus a little."""
    x, offsets, bounds = _gpu_case(40 + world, world, torch.device(device))
    lo, hi = bounds[rank], bounds[rank + 1]
    T = bounds[-1]
    o, ht, grads = _gpu_run(x, offsets, lo, hi, dtype, True, world, rank)
    o1, ht1, grads1 = _gpu_run(x, offsets, 0, T, dtype, False, world, rank)
    o64, ht64, grads64 = _gpu_run(x, offsets, 0, T, torch.float64, False, world, rank, backend="reference")
    slack = 1e-3 if dtype != torch.float32 else 1e-5
    pairs = [("o", o, o1[:, lo:hi], o64[:, lo:hi]), ("final states", ht, ht1, ht64)]
    pairs += [(f"d{n}", grads[n], grads1[n] if n == "h0" else grads1[n][:, lo:hi],
               grads64[n] if n == "h0" else grads64[n][:, lo:hi]) for n in grads]
    for name, got, single, exact in pairs:
        err, err1 = _rel(got, exact), _rel(single, exact)
        assert err < 2 * err1 + slack, f"{name}: {err:.2e} vs float64, the single call {err1:.2e} ({dtype}, rank {rank})"


def _gpu_worker(rank, world, init_file, backend, same_device, checks):
    device = "cuda:0" if same_device else f"cuda:{rank}"
    torch.cuda.set_device(torch.device(device))
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for name, args in checks:
            globals()[name](world, rank, device, *args)
    finally:
        dist.destroy_process_group()


def _spawn_gpu(world, backend, same_device, checks):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_gpu_worker, args=(world, os.path.join(tmp, "rendezvous"), backend, same_device, checks),
                 nprocs=world, join=True)


def _check_world_of_one(world, rank, device):
    """NCCL with one process: the single-process call, the same bits, gradients included."""
    x, offsets, _ = _gpu_case(50, 1, torch.device(device))
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    grads = []
    for fn in (gdnkit.distributed.chunk_gated_delta_rule, gdnkit.chunk_gated_delta_rule):
        args = [(x[n].to(torch.bfloat16) if x[n].dim() == 4 else x[n].float()).requires_grad_()
                for n in ("q", "k", "v", "g", "beta")]
        h0 = x["h0"].float().requires_grad_()
        o, ht = fn(*args, None, h0, True, cu_seqlens=cu)
        ((o.double() * x["w_o"]).sum() + (ht.double() * x["w_h"][0]).sum()).backward()
        grads.append([o, ht, *(t.grad for t in args), h0.grad])
    for name, got, want in zip(("o", "final states", "dq", "dk", "dv", "dg", "dbeta", "dh0"), *grads):
        assert torch.equal(got, want), name


@pytest.mark.gpu
def test_gpu_nccl_world_of_one():
    _spawn_gpu(1, "nccl", True, [("_check_world_of_one", ())])


@pytest.mark.gpu
def test_gpu_gloo_with_cuda_tensors():
    """Two processes on one GPU over gloo, CUDA tensors: the whole distributed path on the GPU's backends. Gloo takes
    CUDA tensors in every collective the call uses (all_gather and all_reduce: it copies them through pinned host
    memory), so the call does not stage them itself."""
    _spawn_gpu(2, "gloo", True, [("_check_gpu_case", (torch.bfloat16,)), ("_check_gpu_case", (torch.float32,))])


# Deselected by default (pyproject's addopts): `-m multi_gpu` (or `-m gpu`) runs them where the GPUs are.
@pytest.mark.gpu
@pytest.mark.multi_gpu
@pytest.mark.parametrize("world", [2, 4, 8])
def test_multi_gpu_nccl(world):
    """One process per GPU over NCCL."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    _spawn_gpu(world, "nccl", False, [("_check_gpu_case", (torch.bfloat16,)), ("_check_gpu_case", (torch.float32,))])
