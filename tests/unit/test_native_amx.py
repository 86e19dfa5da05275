"""FERRUM_CPU_AMX and the native module's AMX state, in fresh processes (the switch is read once,
when the module loads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from ferrum_kernels import native

pytestmark = pytest.mark.skipif(not native.available(), reason="no C++ toolchain")

_PROBE = """
import json, logging
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record)
logging.getLogger("ferrum_kernels.native").addHandler(Keep())
logging.getLogger("ferrum_kernels.native").setLevel(logging.INFO)
from ferrum_kernels import native
module = native.load()
loaded = [r for r in records if r.getMessage() == "native_kernels"]
print(json.dumps({"amx": loaded[0].amx, "available": module.amx_available(),
                  "was_on": module.set_amx(True)}))
"""


def _probe(setting: str | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "FERRUM_CPU_AMX"}
    if setting is not None:
        env["FERRUM_CPU_AMX"] = setting
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True
    )
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("setting", [None, "1", "0"])
def test_ferrum_cpu_amx_switches_the_tiles_and_the_load_line_says_so(setting: str | None) -> None:
    """Unset or 1: AMX on where the CPU, the build and Linux allow it; 0: off (the register
    tiles run). The native_kernels line names the state; without AMX it is "unavailable" and
    the switch changes nothing."""
    got = _probe(setting)
    if not got["available"]:
        assert got["amx"] == "unavailable" and got["was_on"] is True
    elif setting == "0":
        assert got["amx"] == "off" and got["was_on"] is False
    else:
        assert got["amx"] == "on" and got["was_on"] is True
