"""The conformance tests build vLLM's own objects with bench/conformance/vllm_setup.py: put
bench/ on the path as tests/bench/conftest.py does. They run only where vLLM is installed
(tests/conftest.py leaves this folder out of the collection elsewhere):

    PYTHONPATH=. .venv-conformance/bin/python -m pytest -q tests/conformance
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = str(Path(__file__).resolve().parents[2] / "bench")
if BENCH not in sys.path:
    sys.path.insert(0, BENCH)
