"""gdnkit: the gated delta rule (GDN) as fast as the hardware allows, behind FLA's API.

    o, final_state = gdnkit.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)

`gdnkit.explain(...)` says which backend a call would run and why the others would not.
"""
from ._version import __version__
from .api import available_backends, chunk_gated_delta_rule, explain, fused_recurrent_gated_delta_rule
from .dispatch import BackendNotSupportedError

__all__ = ["__version__", "chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "explain",
           "available_backends", "BackendNotSupportedError"]
