"""Depth sweep of memfit against plain PyTorch and checkpoint_sequential (see memfit.bench.depth_sweep).

Same as ``memfit bench depth-sweep``, with the results and the README of this repository as the
defaults wherever it is run from: ``python benchmarks/depth_sweep.py [--quick] [--device cuda]``.
"""

import os
import sys
from pathlib import Path

# Read by OpenMP when torch loads, so it must be set before the import below; see the module.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))  # run from a checkout without installing

from memfit.bench.depth_sweep import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(out=ROOT / "benchmarks" / "results", readme=ROOT / "README.md"))
