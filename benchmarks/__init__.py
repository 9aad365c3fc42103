"""gdnkit.benchmarks: the grids, the runner and the results of `python -m gdnkit bench`.

Nothing here is imported by gdnkit's own code; the anchors (fla, flash_qla) are imported lazily by
impls.py only. See README.md beside this file.
"""
import os as _os

# A benchmark times the backend it means on every call: under auto dispatch (the integrations' end-to-end runs)
# a first call must not run on a stand-in while tilelang_sm90 builds (first_call.py sets it per measurement).
_os.environ.setdefault("GDNKIT_STAND_IN", "0")
