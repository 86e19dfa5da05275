"""A split model's processes (issue #16): both launch modes started as `ferrum-executor serve`,
a rank that dies (the others exit non-zero within the collective timeout, never hang), a clean
stop of every rank, and dimensions that cannot be split refused before anything starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from ferrum_client import ExecutorClient, pb
from ferrum_server.parallel.launch import free_loopback_address
from ferrum_server.server_process import start_server_process
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers_server import LiveServer, tiny_folder

COLLECTIVE_TIMEOUT_S = 6.0
SERVING = health_pb2.HealthCheckResponse.SERVING


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found.extend(int(child) for child in text)
    return found


def _health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status  # type: ignore[no-any-return]


def _eventually(check: object, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def _free_port() -> int:
    return int(free_loopback_address().rpartition(":")[2])


def _per_rank_flags(*extra: str) -> list[str]:
    """The flags every rank of a 2-rank one-process-per-rank group shares."""
    address = free_loopback_address()
    return ["--model", tiny_folder(), "--world-size", "2", "--dist-init", address,
            "--metrics-port", "-1", *extra]  # fmt: skip


def _start_follower(common: list[str], port: int) -> subprocess.Popen[bytes]:
    """Rank 1 as `ferrum-executor serve`, its health on `port`."""
    return subprocess.Popen(
        [sys.executable, "-m", "ferrum_server", "serve", *common, "--rank", "1",
         "--port", str(port)],
    )  # fmt: skip


def _greedy(target: str, prompt: list[int], steps: int) -> list[int]:
    with ExecutorClient(target, timeout_s=60) as client:
        first = client.prefill(pb.PrefillRequest(request_id="g", input_tokens=prompt)).completed
        tokens = [first.output.token.token_id]
        cache_id = first.kv_cache.cache_id
        for step in range(steps - 1):
            decoded = client.decode(
                pb.DecodeRequest(
                    cache_id=cache_id, input_token=tokens[-1], position=len(prompt) + step
                )
            )
            tokens.append(decoded.completed.output.token.token_id)
        client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id))
    return tokens


def test_a_killed_follower_takes_rank_0_down_within_the_timeout(tmp_path: Path) -> None:
    """Spawn mode: SIGKILL the follower while steps run. Rank 0 reports NOT_SERVING, the step
    that met the failure answers INTERNAL (later ones UNAVAILABLE: nothing ran for them), and
    the process exits 1 well within the collective timeout."""
    process, port = start_server_process(
        [
            "--model",
            tiny_folder(),
            "--tensor-parallel-size",
            "2",
            "--collective-timeout-s",
            str(COLLECTIVE_TIMEOUT_S),
            "--metrics-port",
            "-1",
            "--log-format",
            "json",
        ],
        # Append mode, as a container's log pipe: rank 0 and its follower share this stdout
        # (each writes a line in one write, logs.configure), and O_APPEND puts every write at
        # the end of the file.
        stdout=open(tmp_path / "log.jsonl", "ab"),  # noqa: SIM115
    )
    target = f"127.0.0.1:{port}"
    try:
        (follower,) = _children(process.pid)
        codes: list[grpc.StatusCode] = []
        stop = threading.Event()

        def decode_forever() -> None:
            with ExecutorClient(target, timeout_s=30) as client:
                first = client.prefill(pb.PrefillRequest(request_id="r", input_tokens=[1, 2, 3]))
                cache, token, position = first.completed.kv_cache.cache_id, 5, 3
                while not stop.is_set():
                    try:
                        client.decode(
                            pb.DecodeRequest(cache_id=cache, input_token=token, position=position)
                        )
                    except Exception as exc:
                        codes.append(exc.code)  # type: ignore[attr-defined]
                        return
                    position += 1

        worker = threading.Thread(target=decode_forever)
        worker.start()
        time.sleep(1.0)  # steps are running
        killed = time.monotonic()
        os.kill(follower, signal.SIGKILL)
        code = process.wait(timeout=COLLECTIVE_TIMEOUT_S + 10)
        took = time.monotonic() - killed
        stop.set()
        worker.join(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert code == 1
    assert took < COLLECTIVE_TIMEOUT_S  # a dead peer is found at once, not by the timeout
    assert codes and codes[0] in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)
    events = [
        json.loads(line)
        for line in (tmp_path / "log.jsonl").read_text().splitlines()
        if line.startswith("{")
    ]
    states = [e.get("state") for e in events if e.get("event") == "lifecycle"]
    assert states[-2:] == ["faulted", "aborted"]


def test_one_process_per_rank_serves_follows_and_stops_together(live_server: LiveServer) -> None:
    """--rank/--world-size/--dist-init: rank 1 serves only health (SERVING once it follows),
    rank 0 serves the executor with the tokens of the unsplit model; SIGTERM to both (as a pod
    gets it) drains rank 0, rank 1 follows until told to stop, and both exit 0."""
    follower_port = _free_port()
    common = _per_rank_flags()
    follower = _start_follower(common, follower_port)
    try:
        leader, port = start_server_process([*common, "--rank", "0"])
        try:
            assert _eventually(lambda: _health(follower_port) == SERVING, 30)
            got = _greedy(f"127.0.0.1:{port}", [1, 2, 3, 4, 5], 8)
            # The same model unsplit: the built-in tiny weights the folder was saved from.
            assert got == _greedy(live_server.target, [1, 2, 3, 4, 5], 8)
            follower.send_signal(signal.SIGTERM)  # first: it must not leave before rank 0
            leader.send_signal(signal.SIGTERM)
            assert leader.wait(timeout=60) == 0
            assert follower.wait(timeout=30) == 0
        finally:
            if leader.poll() is None:
                leader.kill()
    finally:
        if follower.poll() is None:
            follower.kill()


def test_a_follower_exits_non_zero_when_rank_0_dies() -> None:
    common = _per_rank_flags("--collective-timeout-s", str(COLLECTIVE_TIMEOUT_S))
    follower = _start_follower(common, _free_port())
    try:
        leader, _ = start_server_process([*common, "--rank", "0"])
        leader.kill()
        leader.wait(timeout=10)
        killed = time.monotonic()
        assert follower.wait(timeout=COLLECTIVE_TIMEOUT_S + 10) == 1
        assert time.monotonic() - killed < COLLECTIVE_TIMEOUT_S + 5
    finally:
        if follower.poll() is None:
            follower.kill()


def test_an_indivisible_model_is_refused_in_one_line_before_anything_starts(
    tmp_path: Path,
) -> None:
    """`serve` exits 2 with one line naming the dimension: the folder holds only config.json,
    so no weight was read, and no follower was started."""
    (tmp_path / "config.json").write_text((Path(tiny_folder()) / "config.json").read_text())
    result = subprocess.run(
        [sys.executable, "-m", "ferrum_server", "serve", "--model", str(tmp_path),
         "--tensor-parallel-size", "3", "--log-format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "num_attention_heads (4) is not divisible by 3" in lines[0]
    assert "tensor_parallel_spawned" not in result.stdout


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"rank": 1}, "--rank 1 needs --world-size"),
        ({"world_size": 2}, "--world-size 2 needs --dist-init tcp://HOST:PORT"),
        ({"world_size": 2, "rank": 1, "dist_init": "10.0.0.1:29500"}, "needs --dist-init"),
    ],
    ids=["rank-alone", "no-dist-init", "not-tcp"],
)
def test_an_incomplete_launch_is_refused_in_one_line(
    flags: dict[str, object], message: str
) -> None:
    from ferrum_server.config import EngineConfig
    from ferrum_server.startup import check_split

    with pytest.raises(ValueError, match=message) as refused:
        check_split(EngineConfig(model=tiny_folder(), **flags))  # type: ignore[arg-type]
    assert "\n" not in str(refused.value)
