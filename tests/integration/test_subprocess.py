"""The CLI: a real server subprocess driven by the client over loopback, and start-up errors."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from ferrum_server.server_process import start_server_process
from ferrum_server.tools.demo import run_demo


def test_demo_scheduler_drives_a_server_subprocess(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    process, port = start_server_process(["--block-size", "8"])
    try:
        assert list(tmp_path.iterdir()) == []  # the port file's folder is gone once read
        report = asyncio.run(run_demo(f"127.0.0.1:{port}", num_requests=3, max_new_tokens=6))
        again = asyncio.run(run_demo(f"127.0.0.1:{port}", num_requests=3, max_new_tokens=6))
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
    assert code == 0
    assert report["generated_tokens"] == 18
    assert report["requests"] == again["requests"]  # deterministic greedy outputs
    assert report["free_blocks_after"] == report["total_blocks"]


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--block-size", "0"], "block size"),
        (["--model", "/does/not/exist"], "does/not/exist"),
        (["--dtype", "float64"], "invalid choice"),
        (["--max-batch-tokens", "0"], "max batch tokens"),
        (["--kv-cache-bytes", str(1 << 50)], "exceeds"),
        (["--metrics-port", "70000"], "metrics port"),
    ],
)
def test_bad_configuration_exits_nonzero_with_one_clear_line(
    args: list[str], fragment: str
) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ferrum_server", "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr


def test_a_server_that_fails_to_start_leaves_no_folder_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(RuntimeError, match="exited with code"):
        start_server_process(["--block-size", "0"], stderr=subprocess.DEVNULL)
    assert list(tmp_path.iterdir()) == []


def test_port_in_use_exits_nonzero_with_one_clear_line() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "ferrum_server",
                "serve",
                "--port",
                str(port),
                "--metrics-port",
                "-1",
                "--log-level",
                "error",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 2
    assert f"cannot bind 127.0.0.1:{port}" in result.stderr
    assert result.stderr.count("\n") == 1
