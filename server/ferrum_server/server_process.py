"""Start `ferrum-executor serve` as a subprocess on a free loopback port, and stop it (tools and
tests)."""

from __future__ import annotations

import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any


def start_server_process(
    extra_args: Sequence[str] = (), timeout_s: float = 120.0, **popen: Any
) -> tuple[subprocess.Popen[bytes], int]:
    """Start `ferrum-executor serve` on 127.0.0.1, port 0; return (process, port) once SERVING.

    The port file's folder is removed once the port is read (or the start fails): every bench
    run and test starts servers, and each left a folder behind in the temp directory."""
    folder = tempfile.mkdtemp(prefix="ferrum-")
    try:
        port_file = pathlib.Path(folder) / "port"
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ferrum_server",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--port-file",
                str(port_file),
                *extra_args,
            ],
            **popen,
        )
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with code {process.returncode}")
            if time.monotonic() > deadline:
                process.kill()
                raise TimeoutError("the server did not start in time")
            time.sleep(0.05)
        return process, int(port_file.read_text())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def stop_server_processes(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every server (they drain together), then wait up to 60 s for each; kill one
    that has not stopped by then."""
    for process in processes:
        process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
