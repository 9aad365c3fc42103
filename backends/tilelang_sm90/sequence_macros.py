"""TileLang macros a per-sequence program shares (the state passes, the propagator, the backward's reverse passes):
its sequence's bounds in the packed tensors and the chunk table, and the chained route's walked run."""
import tilelang.language as T

CHUNK = 64


@T.macro
def sequence_bounds(cu_seqlens, chunk_offsets, n):
    """Program n's sequence (or segment): its first and end token, its chunk count, and its first row of the
    chunk table (and of gamma). Shared by the state kernels and the propagator, which walk whole sequences."""
    bos = cu_seqlens[n]
    eos = cu_seqlens[n + 1]
    return bos, eos, T.ceildiv(eos - bos, CHUNK), chunk_offsets[n]


@T.macro
def walked_run(walk, before, n, hv, bos, c0, chained):
    """The chained route's run of program (n, hv) in the forward's state passes: (pre, exact, bos_run, c0_run):
    `pre` chunks walked back before the program's own (whole chunks: segments are cut at chunk bounds inside a
    sequence), exact where the walk starts at the sequence's start (then from h0); run chunk i starts at token
    bos_run + i * C and is row c0_run + i of the chunk table. Unchained builds: no walk, (0, True, bos, c0)."""
    if chained:
        pre = walk[n, hv]
        exact = pre == before[n]
    else:
        pre, exact = 0, True
    return pre, exact, bos - pre * CHUNK, c0 - pre
