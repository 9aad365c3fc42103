"""Host-side integer helpers for block sizes and grids, in plain Python.

triton.cdiv and triton.next_power_of_2 cost ~2 us a call on the host (Triton 3.6 and 3.9 alike: they go
through Triton's constexpr-function wrapper), against ~0.1 us for the same arithmetic here; a training
call's forward and backward make ~50 of them, a decode step ~10, and both are host-bound at small sizes."""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative integers."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for 0, as triton's)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


# A launch's programs: CUDA's first grid axis takes up to 2^31 - 1 (the second and third 65535), and Triton's
# program ids are int32.
MAX_PROGRAMS = 2**31 - 1


def flat_grid(*dims: int) -> tuple[int]:
    """The one-axis grid of a logical grid `dims` (first dim fastest): what every chunked kernel is launched
    with, its program ids taken apart again by jit_helpers.grid_2d / grid_3d."""
    n = 1
    for d in dims:
        n *= d
    if n > MAX_PROGRAMS:
        raise ValueError(f"a launch of {' x '.join(map(str, dims))} = {n} programs is past CUDA's grid limit of "
                         f"{MAX_PROGRAMS}: split the call")
    return (n,)
