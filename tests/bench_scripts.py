"""The scripts of bench/ as modules, for the tests that check their figures and tables.

bench/ is not a package: its scripts are run by path and import their neighbours by name
(run_bench imports harness_build), so one is loaded here with bench/ on the path, and
registered under its name, as a dataclass defined in it looks its module up there.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def load_bench(script: str, name: str | None = None) -> ModuleType:
    """bench/`script` loaded afresh as module `name` (default: the script's stem)."""
    path = BENCH_DIR / script
    spec = importlib.util.spec_from_file_location(name or path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.path.insert(0, str(BENCH_DIR))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH_DIR))
    return module
