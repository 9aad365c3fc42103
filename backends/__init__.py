"""GDN backends. Each subpackage but triton_shared registers one backend with gdnkit.dispatch; none imports another.
triton_shared holds the Triton pieces more than one of them (and gdnkit/prologue.py) uses."""
