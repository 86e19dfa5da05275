"""Regenerate the committed Python code and typed stubs from proto/.

Usage: python scripts/gen_proto.py [--out DIR]

protoc sees the contract under the virtual path `ferrum_client/pb/`, so the generated modules
import each other as `ferrum_client.pb.*` with no post-processing. The drift test runs this
script into a temporary folder and compares the result with the committed files.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto" / "ferrum" / "executor" / "v1"
VIRTUAL_PREFIX = "ferrum_client/pb"
GENERATED = (
    "executor_pb2.py",
    "executor_pb2.pyi",
    "executor_pb2_grpc.py",
    "executor_pb2_grpc.pyi",
)


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc into out_root (a folder playing the role of client/); return written files."""
    out_root.mkdir(parents=True, exist_ok=True)
    bin_dir = pathlib.Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    protos = sorted(p.name for p in PROTO_DIR.glob("*.proto"))
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{VIRTUAL_PREFIX}={PROTO_DIR}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *[f"{VIRTUAL_PREFIX}/{name}" for name in protos],
    ]
    subprocess.run(cmd, check=True, env=env, cwd=ROOT)
    return [out_root / VIRTUAL_PREFIX / name for name in GENERATED]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "client")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))


if __name__ == "__main__":
    main()
