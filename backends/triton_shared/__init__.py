"""Triton pieces more than one backend uses: the launch table, host-side sizes, jit helpers, the qk l2norm passes
(gdnkit/prologue.py) and the context-parallel segment scan (triton_generic and tilelang_sm90). Not a backend: it
registers nothing, and imports no backend. Its modules import triton; import them inside the functions that launch
them, so a backend still imports without triton."""
