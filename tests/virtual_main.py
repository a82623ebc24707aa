"""Run sharded cases on a virtual mesh in a fresh interpreter (a virtual mesh owns its process's world).

Usage: python tests/virtual_main.py OUT.pkl case[,case...] [backend]
"""

import pickle
import sys

import spmd_cases

if __name__ == "__main__":
    out, names = sys.argv[1], sys.argv[2].split(",")
    backend = sys.argv[3] if len(sys.argv) > 3 else "eager"
    results = {name: spmd_cases.run_case(name, backend=backend, virtual=True) for name in names}
    with open(out, "wb") as f:
        pickle.dump(results, f)
