"""CI smoke of the atheris fuzz target: its seeds always, and a short fuzz run when atheris is
installed. The full, time-boxed run:

    python tests/fuzz/fuzz_validation.py -max_total_time=60
"""

from __future__ import annotations

import os
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


def test_short_coverage_guided_run(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("atheris")
    fuzz = _load()
    fuzz.write_seeds(tmp_path)  # type: ignore[attr-defined]
    result = subprocess.run(
        [sys.executable, str(TARGET), "-runs=3000", "-max_total_time=20", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Done" in result.stderr


def test_a_run_without_a_corpus_folder_reuses_one(tmp_path: pathlib.Path) -> None:
    """Not a fresh temporary folder per run (libFuzzer's exit skips Python's cleanups, so each
    was left behind): the one $FERRUM_FUZZ_CORPUS names, seeded, every time."""
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    env = {**os.environ, "FERRUM_FUZZ_CORPUS": str(corpus), "TMPDIR": str(tmp_path / "tmp")}
    (tmp_path / "tmp").mkdir()
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, str(TARGET), "-runs=50"],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert f"fuzz corpus: {corpus}" in result.stderr
    seeds = len(_load().SEEDS)  # type: ignore[attr-defined]
    assert {f"seed-{i}" for i in range(seeds)} <= {p.name for p in corpus.iterdir()}
    assert list((tmp_path / "tmp").iterdir()) == []  # nothing left in the temp directory
