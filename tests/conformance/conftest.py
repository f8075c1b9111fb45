"""Conformance tests run in the virtualenv that has vLLM (`./scripts/conformance`); the main
suite does not collect them. bench/ goes on the path, so the harness imports as
`conformance.*`, as it does when bench/conformance/report.py runs."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[2] / "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
