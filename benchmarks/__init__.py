"""gdnkit.benchmarks: the grids, the runner and the results of `python -m gdnkit bench`.

Nothing here is imported by gdnkit's own code; the anchors (fla, flash_qla) are imported lazily by
impls.py only. See README.md beside this file.
"""
