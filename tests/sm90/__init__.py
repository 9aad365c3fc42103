"""The tilelang_sm90 backend's tests, by area: compile, plan, algebra, host (stand-ins), numerics (GPU)."""
