"""Loading a script that is not in a package (a benchmark, a deploy hook, a fuzz target) as a
module, so tests can call its functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(name: str, path: Path) -> ModuleType:
    """The script at `path`, executed as module `name` (registered in sys.modules, which
    dataclasses need to resolve the script's annotations)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
