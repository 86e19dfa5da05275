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
# bfloat16 (the emulated bfloat16 GEMM, as Ice Lake); AVX512_BF16 without AMX (as Zen 4); AMX.
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


@pytest.mark.skipif(not native.available(), reason="no C++ toolchain")
def test_a_source_built_alone_exposes_its_functions_and_a_rebuild_reuses_it() -> None:
    """``build_alone``, how the benchmarks' ``--old REV`` build a revision's kernel: a whole
    translation unit (here the shared header ahead of a small function using it) becomes its
    own module, and the same source again is the same build."""
    source = native.with_common_header(
        "#include <torch/extension.h>\n"
        '#include "common.h"\n'
        "int64_t bf16_bits(double x) { return ferrum::float_to_bf16(static_cast<float>(x)); }\n"
    )
    module = native.build_alone("test_alone", source, ["bf16_bits"])
    assert [module.bf16_bits(x) for x in (1.0, -2.0, 1.00390625)] == [0x3F80, 0xC000, 0x3F80]
    assert native.build_alone("test_alone", source, ["bf16_bits"]).__name__ == module.__name__


def test_the_shared_header_can_be_a_revisions_own() -> None:
    """A benchmark's ``--old REV`` builds that revision's kernel ahead of that revision's
    ``common.h`` (the two change together), given as `header`; by default the working tree's."""
    kernel = '#include "common.h"\nint64_t answer() { return 42; }\n'
    theirs = native.with_common_header(kernel, header="#pragma once\n// the revision's header\n")
    assert "// the revision's header" in theirs and "namespace ferrum" not in theirs
    assert '#include "common.h"' not in theirs and "#pragma once" not in theirs
    assert "namespace ferrum" in native.with_common_header(kernel)


_BEFORE_PROMPT_PARTIALS = "dad7ce16e711477707ab8569d0c3aab01ade4d4e"  # PrefixPartials in the kernel


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", *args], cwd=Path(native.__file__).parent, capture_output=True, text=True
    )


def test_a_kernel_at_a_revision_comes_with_that_revisions_header() -> None:
    """``--old REV``'s source: the revision's kernel after the revision's ``common.h``, or None
    where both are the working tree's (the package's build serves)."""
    if _git("rev-parse", "--verify", "--quiet", _BEFORE_PROMPT_PARTIALS).returncode != 0:
        pytest.skip("the revision is not in this clone's history")
    old = native.kernel_at_revision(_BEFORE_PROMPT_PARTIALS, "decode_attention.cpp")
    assert old is not None
    assert "struct PrefixPartials" in old and "struct PromptPartials" not in old
    assert "namespace ferrum" in old and '#include "common.h"' not in old
    if _git("diff", "--quiet", "HEAD", "--", "csrc/gemm.cpp", "csrc/common.h").returncode == 0:
        assert native.kernel_at_revision("HEAD", "gemm.cpp") is None
