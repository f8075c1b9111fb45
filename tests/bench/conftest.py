"""The benchmarks are scripts in bench/, not part of the package: put bench/ on the path so
their modules import as they do when run (`python bench/fleet.py`)."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[2] / "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
