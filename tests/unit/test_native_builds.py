"""The native kernels' source compiles for every CPU family it has paths for, not only this
one: a test run here builds it with ``-march=native`` alone, so a path behind another ISA's
``#if`` (portable loops, AVX2, AVX-512 without bfloat16, bfloat16 without AMX, AMX) would
otherwise break unseen on the machines that take it. Each is checked with ``g++
-fsyntax-only`` (about 20 s of one core each; they run side by side)."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from ferrum_kernels import native

# What each target exercises: no AVX2 (the portable loops); AVX2 + FMA; AVX-512F without
# bfloat16; AVX512_BF16 without AMX (as Zen 4); AMX.
_TARGETS = ("x86-64-v2", "haswell", "skylake-avx512", "cooperlake", "sapphirerapids")


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++")
def test_the_native_source_compiles_for_every_cpu_family(tmp_path: Path) -> None:
    from torch.utils.cpp_extension import include_paths

    source = tmp_path / "native.cpp"
    source.write_text(native._source())
    includes = [f"-I{p}" for p in include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    flags = [f for f in native._FLAGS if not f.startswith("-march")]
    runs = {
        target: subprocess.Popen(
            [
                "g++",
                "-fsyntax-only",
                f"-march={target}",
                "-DTORCH_EXTENSION_NAME=check",
                *flags,
                *includes,
                str(source),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for target in _TARGETS
    }
    failed = {}
    for target, run in runs.items():
        _, stderr = run.communicate(timeout=600)
        if run.returncode != 0:
            failed[target] = "\n".join(line for line in stderr.splitlines() if "error" in line)
    assert not failed, failed
