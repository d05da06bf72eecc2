#!/usr/bin/env python3
"""cputime.py FILE CMD [ARGS...]: runs CMD with its output passed through and
appends to FILE the CPU seconds it used, user plus system, CMD and every
descendant it waited for (getrusage(RUSAGE_CHILDREN)): what the benchmarks
report as CPU seconds per GB beside each bandwidth, for Stellar and for each
peer alike. Exits with CMD's status (128 + N when a signal N ended it)."""
import resource
import subprocess
import sys

if len(sys.argv) < 3:
    sys.exit(__doc__)
rc = subprocess.call(sys.argv[2:])
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
with open(sys.argv[1], "a") as f:
    f.write(f"{usage.ru_utime + usage.ru_stime:.4f}\n")
sys.exit(rc if rc >= 0 else 128 - rc)
