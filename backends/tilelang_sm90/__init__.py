"""tilelang_sm90: the chunked GDN forward as TileLang kernels for Hopper (sm_90a), K = V = 128, bf16/fp16.

Not registered as a backend yet (dispatch/registry.py, pyproject.toml): the kernels compile on the CPU
machines (tests/test_tilelang_sm90_compile.py checks wgmma + TMA in the generated CUDA) and wait for their
first check on an H200 (`-m gpu` in the same test file).

    intra_chunk.py   per (chunk, value head): gamma, A, T = (I + A)^-1, W, U'       (launch 1)
    state_output.py  per (sequence, value head, V tile): the state pass fused with the output  (launch 2)
    forward.py       forward(problem, inputs) -> (o, final state): prologue, kernel cache, launches

Importing this package needs neither tilelang nor a GPU; forward() imports tilelang on first use.
"""
