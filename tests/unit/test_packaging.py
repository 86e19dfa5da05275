"""Packaging contracts: the thin client never imports torch; generated code matches the
.proto files; version floors cover the generated code; buf lint passes."""

from __future__ import annotations

import filecmp
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
GENERATED = ROOT / "client" / "ferrum_client" / "pb"


def test_client_imports_without_torch() -> None:
    code = (
        "import sys\n"
        "import ferrum_client, ferrum_client.handles, ferrum_client.batch\n"
        "import ferrum_client.fleet, ferrum_client.fleet_backend, ferrum_client.prefix\n"
        "heavy = [m for m in ('torch', 'numpy', 'ferrum_server') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_generated_code_matches_proto(tmp_path: pathlib.Path) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import gen_proto
    finally:
        sys.path.pop(0)
    written = gen_proto.generate(tmp_path)
    assert written
    for fresh in written:
        committed = GENERATED / fresh.name
        assert committed.exists(), f"{fresh.name} is not committed"
        assert filecmp.cmp(fresh, committed, shallow=False), (
            f"{fresh.name} drifted from the .proto: run python scripts/gen_proto.py"
        )


def _floor(requirement: str) -> tuple[int, ...]:
    version = re.search(r">=\s*([\d.]+)", requirement)
    assert version, requirement
    return tuple(int(p) for p in version.group(1).split("."))


def test_dependency_floors_cover_generated_code() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {re.split(r"[<>=]", d)[0].strip(): _floor(d) for d in deps}
    grpc_code = (GENERATED / "executor_pb2_grpc.py").read_text()
    grpc_version = re.search(r"GRPC_GENERATED_VERSION = '([\d.]+)'", grpc_code)
    assert grpc_version
    assert floors["grpcio"] >= tuple(int(p) for p in grpc_version.group(1).split("."))
    pb_code = (GENERATED / "executor_pb2.py").read_text()
    runtime = re.search(r"Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+)", pb_code)
    assert runtime
    assert floors["protobuf"] >= tuple(int(p) for p in runtime.groups())


def test_buf_lint_standard() -> None:
    buf = shutil.which("buf") or str(pathlib.Path(sys.executable).parent / "buf")
    if not pathlib.Path(buf).exists():
        pytest.skip("buf is not installed (pip install buf-bin)")
    result = subprocess.run([buf, "lint"], cwd=ROOT / "proto", capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
