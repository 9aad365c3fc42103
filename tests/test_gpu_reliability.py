"""On a GPU (`pytest -m gpu`): repeatability, cu_seqlens buffers rewritten in place (eager and in CUDA graphs), the
device-side check of cached offsets, the fuzz at small shapes on the GPU backends, and a first training step on the
stand-in while tilelang_sm90 builds."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import gdnkit

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

H, HV, K, V = 2, 4, 128, 128


def _backends(mode="chunk"):
    if not torch.cuda.is_available():
        return ["triton_generic", "tilelang_sm90"]
    names = [b for b in gdnkit.available_backends() if b != "reference"]
    return [b for b in names if mode == "chunk" or b != "tilelang_sm90"]


def _inputs(T, seed=0, B=1, grad=False, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    call = dict(q=F.normalize(rnd(B, T, H, K), dim=-1).to("cuda", dtype),
                k=F.normalize(rnd(B, T, H, K), dim=-1).to("cuda", dtype),
                v=rnd(B, T, HV, V).to("cuda", dtype), g=F.logsigmoid(rnd(B, T, HV)).cuda(),
                beta=torch.rand(B, T, HV, generator=gen).cuda())
    if grad:
        for t in call.values():
            t.requires_grad_()
    return call


def _nan_filled_free_memory(n_bytes: int = 1 << 30) -> None:
    """Leaves the caching allocator's free blocks NaN-filled: what a later allocation reuses unwritten reads NaN."""
    torch.empty(n_bytes // 4, device="cuda").fill_(float("nan"))
    torch.cuda.synchronize()


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("case", ["varlen-training", "l2norm-training", "segments-training", "long-inference"])
def test_every_output_is_written_by_the_kernels(backend, case, monkeypatch):
    """initcheck's question without the sanitizer, so for TMA stores too: with every buffer gdnkit allocates
    NaN-filled (torch.empty poisoned) and the allocator's free memory NaN, a call's outputs, final states and
    gradients equal bit for bit those of the same call on clean memory. The causal repair is off for the poisoned
    call: it would rewrite (and so hide) a chunk whose output rows a kernel left unwritten, as NaN."""
    from sanitizer_workload import _CHUNKED, _inputs as workload_inputs   # tests/ is on sys.path
    lengths, h, hv, training, options = _CHUNKED[case]

    def run():
        call = workload_inputs(lengths, h, hv, grad=training)
        with torch.set_grad_enabled(training):
            o, ht = gdnkit.chunk_gated_delta_rule(**call, output_final_state=True, backend=backend, **options)
            if not training:
                return [o, ht]
            leaves = [t for t in call.values() if isinstance(t, torch.Tensor) and t.requires_grad]
            do = torch.randn(o.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(5)).to(o.dtype)
            return [o.detach(), ht.detach(), *torch.autograd.grad([o, ht], leaves, [do, torch.ones_like(ht)])]

    want = [t.clone() for t in run()]
    from conftest import poison_empty
    poison_empty(monkeypatch)
    from gdnkit.backends.triton_shared import recurrence
    monkeypatch.setattr(recurrence, "repair_nonfinite_chunks", lambda *a, **k: None)
    _nan_filled_free_memory()
    got = run()
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(want, got)):
        assert torch.isfinite(b).all(), f"output {i}: NaN where no kernel wrote"
        assert torch.equal(a, b), f"output {i} differs on poisoned memory"


@pytest.mark.parametrize("backend", _backends())
def test_thousand_repeats_are_bitwise_identical(backend):
    """Forward and backward at one quick point, 1000 times: every output and gradient bit for bit the first one."""
    call = _inputs(700, grad=True)
    cu = torch.tensor([0, 1, 300, 300, 700], device="cuda", dtype=torch.int32)
    h0 = torch.randn(4, HV, K, V, device="cuda", requires_grad=True)
    do = torch.randn(1, 700, HV, V, device="cuda", dtype=torch.bfloat16)
    leaves = [*call.values(), h0]

    def step():
        o, ht = gdnkit.chunk_gated_delta_rule(**call, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                              backend=backend)
        grads = torch.autograd.grad([o, ht], leaves, [do, torch.ones_like(ht)])
        return [o.detach(), ht.detach(), *grads]

    first = step()
    for i in range(999):
        again = step()
        same = [torch.equal(a, b) for a, b in zip(first, again)]
        assert all(same), (i, same)


def test_decode_graph_follows_a_cu_seqlens_buffer_rewritten_between_replays():
    """vLLM's pattern: one preallocated cu_seqlens buffer, rewritten in place every step, the decode (verify) call
    captured once. The recurrent kernel reads the offsets on the device, so each replay computes the new layout."""
    N, C, slots = 4, 3, 32
    pool = torch.randn(slots, HV, K, V, device="cuda") * 0.1
    cu = torch.tensor([0, 1, 3, 6, 8], device="cuda", dtype=torch.int32)
    idx = torch.arange(N * C, device="cuda", dtype=torch.int32).view(N, C)
    call = _inputs(8, seed=1)

    def step():
        return gdnkit.fused_recurrent_gated_delta_rule(**call, initial_state=pool, ssm_state_indices=idx,
                                                       cu_seqlens=cu)[0]

    with torch.inference_mode():
        step()  # warm up (compiles the kernel, reads nothing the capture needs)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for offsets in ([0, 2, 4, 6, 8], [0, 3, 3, 5, 8], [0, 1, 2, 3, 4]):
            cu.copy_(torch.tensor(offsets, device="cuda"))
            before = pool.clone()
            graph.replay()
            replayed, after = out.clone(), pool.clone()
            pool.copy_(before)
            eager = gdnkit.fused_recurrent_gated_delta_rule(**call, initial_state=pool,
                                                            ssm_state_indices=idx,
                                                            cu_seqlens=torch.tensor(offsets, device="cuda"))[0]
            assert torch.equal(replayed, eager) and torch.equal(after, pool)


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("inference", [False, True], ids=["normal-buffer", "inference-buffer"])
def test_chunked_eager_calls_follow_a_buffer_rewritten_in_place(backend, inference):
    """The same cu_seqlens buffer rewritten each step (copy_, slices of it made anew; a buffer made under
    inference_mode has no version counter): every call equals the call with a fresh tensor of the same values, bit
    for bit, i.e. never the stale layout."""
    call = _inputs(600, seed=2)
    with torch.inference_mode(inference):
        buffer = torch.zeros(8, device="cuda", dtype=torch.int32)
    with torch.inference_mode():
        for offsets in ([0, 100, 600], [0, 1, 2, 600], [0, 599, 600], [0, 300, 300, 450, 600]):
            buffer[:len(offsets)].copy_(torch.tensor(offsets))
            cu = buffer[:len(offsets)]
            o, _ = gdnkit.chunk_gated_delta_rule(**call, cu_seqlens=cu, backend=backend)
            fresh, _ = gdnkit.chunk_gated_delta_rule(**call, cu_seqlens=torch.tensor(offsets, device="cuda"),
                                                     backend=backend)
            assert torch.equal(o, fresh), offsets


@pytest.mark.parametrize("backend", _backends())
def test_chunked_call_captured_with_cu_seqlens_replays(backend):
    call = _inputs(500, seed=3)
    cu = torch.tensor([0, 7, 300, 500], device="cuda", dtype=torch.int32)
    with torch.inference_mode():
        eager, _ = gdnkit.chunk_gated_delta_rule(**call, cu_seqlens=cu, backend=backend)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out, _ = gdnkit.chunk_gated_delta_rule(**call, cu_seqlens=cu, backend=backend)
        for _ in range(3):
            graph.replay()
            assert torch.equal(out, eager)


_DEVICE_CHECK = textwrap.dedent("""
    import sys, torch, gdnkit
    case, backend = sys.argv[1], sys.argv[2]
    T, H, HV, K = 300, 2, 4, 128
    q = torch.randn(1, T, H, K, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, T, HV, K, device="cuda", dtype=torch.bfloat16)
    g, b = -torch.rand(1, T, HV, device="cuda"), torch.rand(1, T, HV, device="cuda")
    cu = torch.tensor([0, 100, 300], device="cuda", dtype=torch.int32)
    call = lambda: gdnkit.chunk_gated_delta_rule(q, q, v, g, b, cu_seqlens=cu, backend=backend)[0]
    call()
    torch.cuda.synchronize()
    if case == "eager":
        cu.data[1] = 150          # a write torch's version counter does not see
        call()
    else:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        graph.replay()
        torch.cuda.synchronize()
        cu.copy_(torch.tensor([0, 150, 300]))   # the captured launch shapes are stale now
        graph.replay()
    torch.cuda.synchronize()
    print("NOT CAUGHT")
""")


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("case", ["eager", "graph"])
def test_stale_offsets_are_caught_on_the_device(backend, case):
    """Offsets changed where the host cannot see it (eager: through .data; a graph: replayed after the buffer changed)
    end in a device-side assert, never in a silently wrong result. Run apart: the assert ends the CUDA context."""
    run = subprocess.run([sys.executable, "-c", _DEVICE_CHECK, case, backend], capture_output=True, text=True,
                         timeout=600)
    assert "NOT CAUGHT" not in run.stdout
    assert run.returncode != 0 and "device-side assert" in (run.stderr + run.stdout), run.stderr[-2000:]


@pytest.mark.parametrize("examples", [int(os.environ.get("GDNKIT_FUZZ_EXAMPLES", "100"))])
def test_fuzz_on_the_gpu(examples):
    """tests/test_fuzz.py with its calls on CUDA tensors (K = V = 64 or 128: the GPU backends' head dims)."""
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          os.path.join(os.path.dirname(__file__), "test_fuzz.py")],
                         capture_output=True, text=True, timeout=3000,
                         env={**os.environ, "GDNKIT_FUZZ_DEVICE": "cuda", "GDNKIT_FUZZ_EXAMPLES": str(examples)})
    assert run.returncode == 0, run.stdout[-4000:]


_STAND_IN_SCRIPT = r"""
import json, sys, torch, torch.nn.functional as F
sys.path.insert(0, sys.argv[1])
import oracle
import gdnkit
from gdnkit.backends.tilelang_sm90 import kernel_build
H, HV, K, V, lengths = 2, 6, 128, 128, [0, 1, 70, 259]
T = sum(lengths)
cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
gen = torch.Generator().manual_seed(7)
rnd = lambda *s: torch.randn(*s, generator=gen)
raw = dict(q=F.normalize(rnd(1, T, H, K), dim=-1), k=F.normalize(rnd(1, T, H, K), dim=-1), v=rnd(1, T, HV, V),
           g=F.logsigmoid(rnd(1, T, HV)), beta=torch.rand(1, T, HV, generator=gen))
h0 = rnd(len(lengths), HV, K, V) * 0.1
call = {n: (t.to("cuda", torch.bfloat16) if n in "qkv" else t.cuda()) for n, t in raw.items()}
rel = lambda x, r: float((x.detach().double().cpu() - r.detach()).norm() / r.detach().norm())
leaves = {n: t.cpu().double().requires_grad_() for n, t in call.items()}   # the rounded inputs, on the CPU
h0_leaf = h0.double().requires_grad_()
ref_o, ref_ht, _ = oracle.run(**leaves, initial_state=h0_leaf, output_final_state=True, cu_seqlens=cu.cpu())
(ref_o.square().sum() + ref_ht.sum()).backward()
rows = []
for step in ("first", "after the build"):
    if step == "after the build":
        kernel_build.wait_for_builds()
    x = {n: t.detach().requires_grad_() for n, t in call.items()}
    s0 = h0.to("cuda").clone().requires_grad_()
    o, ht = gdnkit.chunk_gated_delta_rule(**x, initial_state=s0, output_final_state=True, cu_seqlens=cu)
    (o.float().square().sum() + ht.sum()).backward()
    errs = {"o": rel(o, ref_o), "ht": rel(ht, ref_ht), "dh0": rel(s0.grad, h0_leaf.grad),
            **{"d" + n: rel(x[n].grad, leaves[n].grad) for n in x}}
    rows.append(dict(step=step, building=kernel_build.building(), errors=errs))
print(json.dumps(rows))
"""


def test_first_calls_on_the_stand_in_and_after_the_build_match_the_oracle(tmp_path):
    """A training step at a head configuration no process has built (empty caches, a fresh process, auto dispatch,
    the stand-in on): the first step runs on the stand-in while tilelang_sm90 builds, the step after the build on
    tilelang_sm90; both match the float64 recurrence (tests/oracle.py) in outputs, final states and gradients."""
    if "tilelang_sm90" not in gdnkit.available_backends():
        pytest.skip("needs tilelang_sm90 (Hopper, tilelang)")
    env = dict(os.environ, TILELANG_CACHE_DIR=str(tmp_path / "tilelang"), TRITON_CACHE_DIR=str(tmp_path / "triton"),
               GDNKIT_STAND_IN="1")
    env.pop("GDNKIT_BACKEND", None)
    out = subprocess.run([sys.executable, "-c", _STAND_IN_SCRIPT, os.path.dirname(__file__)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "its calls run on triton_generic" in out.stderr, out.stderr[-2000:]
    first, after = json.loads(out.stdout.strip().splitlines()[-1])
    assert first["building"], "the first step ran while nothing was building: it did not take the stand-in"
    assert not after["building"]
    for row in (first, after):   # tests/test_oracle.py's bf16 bars: 1e-2 forward, 2e-2 gradients
        errors = row["errors"]
        assert errors["o"] < 1e-2 and errors["ht"] < 1e-2, row
        assert all(err < 2e-2 for name, err in errors.items() if name.startswith("d")), row
