"""gdnkit where GDN already runs: torch.compile (always on), transformers and FLA (opt-in, one call each).

    gdnkit.integrations.transformers.enable()   # transformers' GDN layers compute with gdnkit
    gdnkit.integrations.fla.enable()            # FLA's chunk_gated_delta_rule routes to gdnkit

Each module imports its target library only when called.
"""
