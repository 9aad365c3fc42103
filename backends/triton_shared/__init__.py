"""Triton pieces more than one backend uses: the launch table, host-side sizes, jit helpers, the qk l2norm passes
(gdnkit/prologue.py), the context-parallel segment scan, and the token-by-token kernel (triton_generic's decode and
serving; the causal repair after both backends' chunked forwards). Not a backend: it
registers nothing, and imports no backend. Its modules import triton; import them inside the functions that launch
them, so a backend still imports without triton."""
