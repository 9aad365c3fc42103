"""`python -m gdnkit.benchmarks ...`: the same command line as `python -m gdnkit bench ...`."""
from .cli import main

raise SystemExit(main())
