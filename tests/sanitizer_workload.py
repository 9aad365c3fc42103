"""Every kernel of the GPU backends once, at small shapes: the program tests/test_sanitizer.py runs under
NVIDIA's compute-sanitizer (memcheck, racecheck, synccheck, initcheck).

Run as `python tests/sanitizer_workload.py BACKEND [CASE ...]` on a CUDA machine (no CASE: every case of CASES
that BACKEND takes, in one process). Shapes are small so an instrumented run stays within minutes, but the cases
reach each kernel and route: varlen with an empty and a one-token sequence and chunk tails, GVA, initial and final
states, the qk l2norm, gate and beta options, training (forward + backward), context parallelism (a few long
sequences at few heads: segments), a NaN input (the causal repair of its chunk), and for triton_generic the fused
recurrent decode with a state pool (1-D and 2-D slot indices, padding rows). One case per process is what lets
initcheck, which checks every load, finish: the test runs the cases side by side.
Prints one line per case and `WORKLOAD DONE` at the end; a sanitizer error is reported by the tool itself. Each
case also prints `RANGE name 0xSTART 0xEND` for every output it got (o, the final state, each gradient) and the
probe cases `tma-store-probe*` (tilelang_sm90) for their two destinations: tests/sanitizer_reports.py attributes
initcheck's reports to them.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import gdnkit

K = V = 128


def _inputs(lengths, H, HV, *, dtype=torch.bfloat16, grad=False, seed=0, state=True):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lengths)
    rnd = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    q = rnd(1, T, H, K).to(dtype)
    k = F.normalize(rnd(1, T, H, K), dim=-1).to(dtype)
    v = rnd(1, T, HV, V).to(dtype)
    g = F.logsigmoid(rnd(1, T, HV))
    beta = torch.rand(1, T, HV, device="cuda", generator=gen)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, device="cuda", dtype=torch.int32)
    h0 = rnd(len(lengths), HV, K, V) if state else None
    tensors = [q, k, v, g, beta] + ([h0] if state else [])
    if grad:
        for t in tensors:
            t.requires_grad_(True)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0, cu_seqlens=cu)


# (lengths, H, HV, training, options) of the chunked calls
_CHUNKED = {
    "varlen": ((0, 1, 64, 135, 70), 2, 8, False, {}),
    "varlen-training": ((0, 1, 64, 135, 70), 2, 8, True, {}),
    "l2norm-training": ((200, 1), 4, 16, True, dict(use_qk_l2norm_in_kernel=True)),
    # few long sequences at few heads: context parallelism's segments (forward and backward)
    "segments-training": ((3000, 1100), 2, 4, True, {}),
    "long-inference": ((4160,), 4, 16, False, {}),
}


def print_range(name: str, t: torch.Tensor | None, row: int = 0) -> None:
    """`RANGE name 0xSTART 0xEND [ROW]` for the device bytes t holds: one line for a contiguous tensor, else one per
    contiguous piece (its rows, recursively). ROW: bytes a token, where given (a report then names its token)."""
    if t is None or t.numel() == 0:
        return
    if not t.is_contiguous():
        for piece in t:
            print_range(name, piece, row)
        return
    start = t.data_ptr()
    print(f"RANGE {name} {start:#x} {start + t.numel() * t.element_size():#x}{f' {row}' if row else ''}", flush=True)


def _print_outputs(o, ht, call: dict) -> None:
    # [1, T, heads, dim] tensors: a report in them names its token
    token_bytes = lambda t: t.stride(1) * t.element_size() if t is not None else 0  # noqa: E731
    print_range("o", o, token_bytes(o))
    print_range("final_state", ht)
    for name, t in call.items():
        if isinstance(t, torch.Tensor):
            print_range(f"grad:{name}", t.grad, token_bytes(t.grad) if name in ("q", "k", "v") else 0)


def _chunked(name: str, backend: str) -> None:
    lengths, H, HV, training, options = _CHUNKED[name]
    call = _inputs(lengths, H, HV, grad=training)
    with torch.set_grad_enabled(training):
        o, ht = gdnkit.chunk_gated_delta_rule(**call, output_final_state=True, backend=backend, **options)
        if training:
            (o.float().square().sum() + ht.square().sum()).backward()
    _print_outputs(o, ht, call)


def _gate_and_beta_options(backend: str) -> None:
    """The gate and beta activations in the call (raw inputs)."""
    call = _inputs((130, 7), 2, 4, grad=True, state=False)
    A_log = torch.zeros(4, device="cuda", requires_grad=True)
    dt_bias = torch.zeros(4, device="cuda", requires_grad=True)
    o, _ = gdnkit.chunk_gated_delta_rule(**call, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                         use_beta_sigmoid_in_kernel=True, backend=backend)
    o.float().square().sum().backward()
    _print_outputs(o, None, dict(call, A_log=A_log, dt_bias=dt_bias))


def _nan_input(backend: str) -> None:
    """A NaN in v mid-chunk: the forward's causal repair walks that sequence again from its chunk."""
    with torch.inference_mode():
        call = _inputs((100, 150), 2, 8)
        call["v"][0, 130, 3, 5] = float("nan")
        o, ht = gdnkit.chunk_gated_delta_rule(**call, output_final_state=True, backend=backend)
    _print_outputs(o, ht, {})


def tma_store_probe_program(R: int = 64, C: int = 64):
    """One tile of src into shared memory, then out to dst [R, 2, C]: value head 0 by the threads, value head 1 by
    a TMA tensor store (cp.async.bulk.tensor) from a plain kernel. C: the tile's columns, as the state pass's V tile
    (32 or 64: 64- or 128-byte rows, each with its own shared-memory swizzle)."""
    import tilelang.language as T

    @T.prim_func
    def tma_store_probe(src: T.Tensor((R, C), "bfloat16"), dst: T.Tensor((R, 2, C), "bfloat16")):
        with T.Kernel(1, threads=128):
            s = T.alloc_shared((R, C), "bfloat16")
            for r, c in T.Parallel(R, C):
                s[r, c] = src[r, c]
            for r, c in T.Parallel(R, C):
                dst[r, 0, c] = s[r, c]
            T.fence_proxy_async()
            T.tma_copy(s, dst[0:R, 1, 0:C])
            T.tma_store_wait(0)

    return tma_store_probe


def tma_store_probe_4d_program(R: int = 64, C: int = 32):
    """The state pass's own store of a full chunk, in its form: two warpgroups with their registers moved by
    setmaxnreg (the first gives them back and idles, as the state pass's TMA producer), the second writes a tile of
    R tokens x C columns into shared memory and stores it by T.copy (lowered to a TMA store issued by one elected
    thread) into a [1, tokens, heads, V] tensor at value head 1 and the second V tile (columns C to 2C); the same
    threads write value head 0's tile themselves."""
    import tilelang.language as T

    @T.prim_func
    def tma_store_probe_4d(src: T.Tensor((R, C), "bfloat16"), dst: T.Tensor((1, R, 2, 2 * C), "bfloat16")):
        with T.Kernel(1, threads=256):
            s = T.alloc_shared((R, C), "bfloat16")
            tx = T.get_thread_binding()
            if tx < 128:
                T.set_max_nreg(40, 0)
            else:
                T.set_max_nreg(232, 1)
                for r, c in T.Parallel(R, C):
                    s[r, c] = src[r, c]
                for r, c in T.Parallel(R, C):
                    dst[0, r, 0, C + c] = s[r, c]
                T.copy(s, dst[0, 0:R, 1, C:2 * C])

    return tma_store_probe_4d


def _run_tma_store_probe(program, pass_configs: dict, columns: int, dst_shape: tuple, halves) -> None:
    """Compiles a probe program, runs it from a random [64, columns] bf16 tile into an empty dst of dst_shape,
    checks that both halves of dst (halves(dst): {"by-threads": ..., "by-tma": ...}) hold the tile, then has torch
    read each half on its own and prints its `RANGE` lines, which tests/sanitizer_reports.py attributes initcheck's
    reports to."""
    import tilelang

    from gdnkit.backends.tilelang_sm90.forward import TARGET
    kernel = tilelang.compile(program, target=TARGET, pass_configs=pass_configs)
    src = torch.randn(64, columns, device="cuda").to(torch.bfloat16)
    dst = torch.empty(dst_shape, device="cuda", dtype=torch.bfloat16)
    kernel(src, dst)
    torch.cuda.synchronize()
    for name, half in halves(dst).items():
        assert torch.equal(half.contiguous(), src), f"the probe's {name} half differs from its source"
        print_range(name, half)


def _tma_store_probe(backend: str, columns: int = 64) -> None:
    """Whether initcheck sees writes made by TMA stores of `columns`-wide tiles from a plain kernel
    (tma_store_probe_program: the two halves are every second row of dst)."""
    import tilelang
    _run_tma_store_probe(tma_store_probe_program(C=columns),
                         {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}, columns, (64, 2, columns),
                         lambda dst: {"by-threads": dst[:, 0], "by-tma": dst[:, 1]})


def _tma_store_probe_4d(backend: str, columns: int = 32) -> None:
    """As _tma_store_probe, for the state pass's own form of the store (tma_store_probe_4d_program), compiled with
    the state pass's pass configs."""
    from gdnkit.backends.tilelang_sm90 import state_output_narrow
    _run_tma_store_probe(tma_store_probe_4d_program(C=columns), state_output_narrow.PASS_CONFIGS, columns,
                         (1, 64, 2, 2 * columns),
                         lambda dst: {"by-threads": dst[0, :, 0, columns:], "by-tma": dst[0, :, 1, columns:]})


def decode(backend: str) -> None:
    H, HV, N = 2, 8, 6
    pool = torch.randn(16, HV, K, V, device="cuda")
    with torch.inference_mode():
        call = _inputs((1,) * N, H, HV, state=False)
        call.pop("initial_state")
        idx = torch.tensor([3, 0, -1, 7, 9, 15], device="cuda", dtype=torch.int32)
        gdnkit.fused_recurrent_gated_delta_rule(**call, initial_state=pool, ssm_state_indices=idx, backend=backend)
        call = _inputs((4, 4, 3), H, HV, state=False)
        call.pop("initial_state")
        idx = torch.tensor([[1, 2, 4, 5], [6, 8, 10, 11], [-1, 12, 13, 14]], device="cuda", dtype=torch.int32)
        acc = torch.tensor([1, 2, 1], device="cuda", dtype=torch.int32)
        gdnkit.fused_recurrent_gated_delta_rule(**call, initial_state=pool, ssm_state_indices=idx,
                                                num_accepted_tokens=acc, backend=backend)
        call = _inputs((5, 0, 9), H, HV)
        gdnkit.fused_recurrent_gated_delta_rule(**call, output_final_state=True, backend=backend)


# name -> (run(backend), the backends it is for; None: every GPU backend)
CASES = {**{name: (lambda backend, name=name: _chunked(name, backend), None) for name in _CHUNKED},
         "gate-and-beta-options": (_gate_and_beta_options, None),
         "nan-input": (_nan_input, None),
         "decode": (decode, ("triton_generic",)),
         "tma-store-probe": (_tma_store_probe, ("tilelang_sm90",)),
         "tma-store-probe-32": (lambda backend: _tma_store_probe(backend, 32), ("tilelang_sm90",)),
         "tma-store-probe-4d": (_tma_store_probe_4d, ("tilelang_sm90",))}


def cases_for(backend: str) -> list[str]:
    """The cases of CASES that run on `backend`."""
    return [name for name, (_, only) in CASES.items() if only is None or backend in only]


def main(backend: str, names: list[str]) -> None:
    for name in names or cases_for(backend):
        if name not in cases_for(backend):
            raise SystemExit(f"unknown case {name!r} for {backend}; cases: {', '.join(cases_for(backend))}")
        CASES[name][0](backend)
        torch.cuda.synchronize()
        print(f"{name} {backend} done", flush=True)
    print("WORKLOAD DONE", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2:])
