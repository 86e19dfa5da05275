"""CI smoke of the atheris fuzz target: its seeds always, and a short fuzz run when atheris is
installed. The full, time-boxed run:

    python tests/fuzz/fuzz_validation.py -max_total_time=60
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from helpers_scripts import load_script

TARGET = pathlib.Path(__file__).resolve().parent.parent / "fuzz" / "fuzz_validation.py"


def _load() -> object:
    return load_script("fuzz_validation", TARGET)


def test_seeds_decode_and_run_cleanly() -> None:
    fuzz = _load()
    for seed in fuzz.SEEDS:  # type: ignore[attr-defined]
        fuzz.run_one(seed)  # type: ignore[attr-defined]
    assert fuzz.decode(b"") is None  # type: ignore[attr-defined]
    assert fuzz.decode(b"\x03\xff\xff\xff") is None  # type: ignore[attr-defined]


def test_short_coverage_guided_run() -> None:
    pytest.importorskip("atheris")
    result = subprocess.run(
        [sys.executable, str(TARGET), "-runs=3000", "-max_total_time=20"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Done" in result.stderr
