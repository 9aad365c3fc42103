"""A soak on the GPU (`pytest -m gpu tests/test_soak.py`; GDNKIT_SOAK_CALLS sets the count, 10000 by default):
mixed random calls as an engine and a trainer make them, in one process.

Prefill (packed, fresh cu_seqlens tensors and one preallocated buffer rewritten in place, under inference_mode and
not), decode and multi-token verify against a state pool, training steps with gradients. Checked along the way:
a rewritten buffer's calls equal fresh-tensor calls bit for bit (never stale offsets), decode matches the float64
oracle on sampled steps; at the end: GPU memory back where it was after warm-up, and every internal cache within
its bound.
"""
from __future__ import annotations

import gc
import os
import random

import pytest
import torch
import torch.nn.functional as F

import gdnkit

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CALLS = int(os.environ.get("GDNKIT_SOAK_CALLS", "10000"))
H, HV, K, V = 2, 4, 128, 128
SLOTS = 64
MEMORY_SLACK = 16 << 20  # bytes: cached layouts and plans (a few KB each) may come and go within their bounds


def _tensors(rng: random.Random, T: int, *, raw=False, grad=False):
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k = rnd(1, T, H, K), rnd(1, T, H, K)
    if not raw:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    call = dict(q=q.cuda().bfloat16(), k=k.cuda().bfloat16(), v=rnd(1, T, HV, V).cuda().bfloat16(),
                g=(rnd(1, T, HV) if raw else F.logsigmoid(rnd(1, T, HV))).cuda(),
                beta=(rnd(1, T, HV) if raw else torch.rand(1, T, HV, generator=gen)).cuda())
    if grad:
        for t in call.values():
            t.requires_grad_()
    return call


def _lengths(rng: random.Random, n: int, longest: int):
    return [rng.choice([0, 1, rng.randrange(1, longest)]) for _ in range(n)]


def _offsets(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _cache_sizes():
    from gdnkit import seqlayout
    sizes = {"seqlayout entries": (len(seqlayout._entries), seqlayout.CACHED_TENSORS),
             "seqlayout layouts": (len(seqlayout._layouts), seqlayout.LAYOUTS_KEPT)}
    from gdnkit.backends.triton_shared import segments as tcp
    from gdnkit.backends.triton_shared import launch
    sizes["triton cut_segments"] = (tcp.cut_segments.cache_info().currsize, tcp.cut_segments.cache_info().maxsize)
    sizes["triton launch fits"] = (len(launch._FITTED), 64)
    try:
        from gdnkit.backends.tilelang_sm90 import context_parallel as scp
        sizes["sm90 plan_segments"] = (scp.plan_segments.cache_info().currsize, scp.plan_segments.cache_info().maxsize)
    except ImportError:
        pass
    sizes["dense layouts"] = (seqlayout.dense_layout.cache_info().currsize, seqlayout.dense_layout.cache_info().maxsize)
    return sizes


def test_soak():
    import oracle  # tests/ is on sys.path
    rng = random.Random(0)
    pool = torch.zeros(SLOTS, HV, K, V, device="cuda", dtype=torch.bfloat16)
    buffer = torch.zeros(17, device="cuda", dtype=torch.int32)  # an engine's preallocated cu_seqlens
    with torch.inference_mode():
        inference_buffer = torch.zeros(17, device="cuda", dtype=torch.int32)
    checked = {"rewritten": 0, "oracle": 0}
    warm = max(200, CALLS // 20)
    baseline = None

    for i in range(CALLS):
        if i == warm:
            gc.collect()
            torch.cuda.synchronize()
            baseline = torch.cuda.memory_allocated()
        kind = rng.choice(["prefill", "prefill-buffer", "decode", "verify", "train"])
        if kind in ("prefill", "prefill-buffer"):
            lengths = _lengths(rng, rng.randrange(1, 16), 300)
            offsets = _offsets(lengths)
            call = _tensors(rng, offsets[-1] + rng.choice([0, 0, 5]))
            fresh = torch.tensor(offsets, device="cuda", dtype=rng.choice([torch.int32, torch.int64]))
            if kind == "prefill":
                o, _ = gdnkit.chunk_gated_delta_rule(**call, cu_seqlens=fresh)
            else:
                inference = rng.random() < 0.5
                buf = inference_buffer if inference else buffer
                with torch.inference_mode(inference):
                    buf[:len(offsets)].copy_(fresh)
                    o, _ = gdnkit.chunk_gated_delta_rule(**call, cu_seqlens=buf[:len(offsets)])
                    o_fresh, _ = gdnkit.chunk_gated_delta_rule(**call, cu_seqlens=fresh)
                assert torch.equal(o, o_fresh), (i, offsets)
                checked["rewritten"] += 1
        elif kind in ("decode", "verify"):
            N = rng.randrange(1, 9)
            C = 1 if kind == "decode" else rng.randrange(2, 5)
            slots = torch.tensor(rng.sample(range(SLOTS), N * C), device="cuda", dtype=torch.int32).view(N, C)
            if kind == "decode":
                slots = slots[:, 0]
            read = slots if slots.dim() == 1 else slots[:, 0]
            read[torch.rand(N, device="cuda") < 0.2] = -1  # padding rows
            lengths = [1] * N if kind == "decode" else [rng.randrange(1, C + 1) for _ in range(N)]
            offsets = _offsets(lengths)
            call = _tensors(rng, offsets[-1], raw=True)
            A_log, dt_bias = torch.zeros(HV, device="cuda"), torch.zeros(HV, device="cuda")
            args = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                        use_beta_sigmoid_in_kernel=True, ssm_state_indices=slots,
                        cu_seqlens=torch.tensor(offsets, device="cuda", dtype=torch.int32))
            sample = checked["oracle"] * 500 <= i  # the first pool call after every 500
            before = pool.clone() if sample else None
            with torch.inference_mode():
                o, _ = gdnkit.fused_recurrent_gated_delta_rule(**call, initial_state=pool, **args)
            if sample:
                want_o, _, want_pool = oracle.run(**{n: t.cpu() for n, t in call.items()}, initial_state=before.cpu(),
                                                  **{n: (t.cpu() if isinstance(t, torch.Tensor) else t)
                                                     for n, t in args.items()})
                err = (o.double().cpu() - want_o).norm() / want_o.norm().clamp_min(1e-30)
                assert err < 2e-2, (i, float(err))
                perr = (pool.double().cpu() - want_pool).norm() / want_pool.norm().clamp_min(1e-30)
                assert perr < 2e-2, (i, float(perr))
                checked["oracle"] += 1
        else:
            lengths = _lengths(rng, rng.randrange(1, 5), 500)
            offsets = _offsets(lengths)
            call = _tensors(rng, offsets[-1], grad=True)
            h0 = torch.randn(len(lengths), HV, K, V, device="cuda", requires_grad=True)
            o, ht = gdnkit.chunk_gated_delta_rule(**call, initial_state=h0, output_final_state=True,
                                                  cu_seqlens=torch.tensor(offsets, device="cuda"))
            (o.float().square().mean() + ht.square().mean()).backward()
            assert all(torch.isfinite(t.grad).all() for t in (*call.values(), h0))
        del o

    gc.collect()
    torch.cuda.synchronize()
    if baseline is not None:
        grown = torch.cuda.memory_allocated() - baseline
        assert grown < MEMORY_SLACK, f"GPU memory grew by {grown} bytes over {CALLS - warm} calls"
    sizes = _cache_sizes()
    assert all(n <= bound for n, bound in sizes.values()), sizes
    assert checked["rewritten"] > 0 and (checked["oracle"] > 0 or CALLS < 500)
