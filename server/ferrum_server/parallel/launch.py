"""How the ranks of a split model come to exist and find each other.

Two launch modes (docs/parallelism.md):

- **spawn** (``--tensor-parallel-size N``): the serving process is rank 0 and starts ranks
  1..N-1 itself, as child processes on this host (``python -m ferrum_server.parallel.follower``)
  that meet it at a free loopback port. On CUDA rank r runs on the r-th device from the one
  configured; on CPU the ranks share the cores (each gets its share of the threads).
- **one process per rank** (``--rank R --world-size N --dist-init tcp://HOST:PORT``): an
  orchestrator starts every rank (one container per GPU); rank 0 serves gRPC, the others follow.

Either way every rank joins one torch.distributed group (gloo on CPU, NCCL on GPU) whose
collectives fail after ``--collective-timeout-s``, so a rank that dies or hangs makes the others
fail instead of waiting forever.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ferrum_server import logs
from ferrum_server.config import EngineConfig
from ferrum_server.parallel.group import SINGLE_RANK, TensorParallel, collective_backend

_LOG = logs.get(__name__)

FOLLOWER_MODULE = "ferrum_server.parallel.follower"
# How long a clean stop waits for spawned followers to exit before killing them.
FOLLOWER_EXIT_S = 10.0
# One process per rank: how long a rank waits at --dist-init for the others (at least).
RENDEZVOUS_MIN_S = 900.0


def check_launch(config: EngineConfig) -> None:
    """What EngineConfig cannot check field by field: --rank needs --world-size, and more than
    one rank needs a place to meet (ValueError, one line)."""
    if config.rank and not config.world_size:
        raise ValueError(f"--rank {config.rank} needs --world-size")
    if config.world_size > 1 and not config.dist_init.startswith("tcp://"):
        raise ValueError(
            f"--world-size {config.world_size} needs --dist-init tcp://HOST:PORT (rank 0's "
            f"address), got {config.dist_init!r}"
        )
    if config.parallel_size > 1 and config.model == "tiny":
        raise ValueError("the built-in tiny model runs on one rank (no tensor parallelism)")


def rank_config(config: EngineConfig, rank: int, dist_init: str) -> EngineConfig:
    """The configuration rank ``rank`` of a spawned group runs with: its own device (CUDA) or
    its share of the cores (CPU), in the one-process-per-rank form."""
    size = config.tensor_parallel_size
    device = config.device
    if device.startswith("cuda"):
        first = int(device.partition(":")[2] or 0)
        device = f"cuda:{first + rank}"
    threads = config.torch_threads
    if device == "cpu" and not threads:
        threads = max(1, len(os.sched_getaffinity(0)) // size)
    return dataclasses.replace(
        config,
        device=device,
        torch_threads=threads,
        rank=rank,
        world_size=size,
        dist_init=dist_init,
    )


def free_loopback_address() -> str:
    """tcp://127.0.0.1:PORT with a port free right now (rank 0 listens there at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


@dataclass
class RankGroup:
    """This process's place in the launch: its own configuration and, in spawn mode, the
    follower processes it started (and must stop)."""

    config: EngineConfig  # this rank's (world_size set whenever the model is split)
    followers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.config.parallel_size

    def join(self) -> TensorParallel:
        """Join the group (blocks until every rank has; on the thread that runs forwards)."""
        if self.size == 1:
            return SINGLE_RANK
        return join_group(self.config)

    def stop_followers(self, timeout_s: float = FOLLOWER_EXIT_S) -> list[int | None]:
        """Wait for spawned followers to exit (after rank 0 told them to stop, or failed),
        killing those still running after timeout_s; their exit codes."""
        codes: list[int | None] = []
        for process in self.followers:
            try:
                codes.append(process.wait(timeout_s))
            except subprocess.TimeoutExpired:
                process.kill()
                codes.append(process.wait())
        return codes


def open_group(config: EngineConfig) -> RankGroup:
    """This process's rank configuration; in spawn mode, start ranks 1..N-1 first."""
    check_launch(config)
    if not config.spawns_followers:
        return RankGroup(config)
    address = free_loopback_address()
    followers = []
    try:
        for rank in range(1, config.tensor_parallel_size):
            follower = rank_config(config, rank, address)
            followers.append(
                subprocess.Popen(
                    [sys.executable, "-m", FOLLOWER_MODULE, config_json(follower)],
                    stdin=subprocess.DEVNULL,
                )
            )
    except BaseException:
        for process in followers:
            process.kill()
        raise
    _LOG.info("tensor_parallel_spawned", ranks=config.tensor_parallel_size, dist_init=address)
    return RankGroup(rank_config(config, 0, address), followers)


def rendezvous_timeout_s(config: EngineConfig) -> float:
    """How long a rank waits for the others to arrive at --dist-init. One process per rank: the
    orchestrator restarts containers with back-offs of up to minutes, so a restarted pair must
    still meet. Spawned: the followers start at once beside rank 0."""
    if config.spawns_followers or not config.world_size:
        return config.collective_timeout_s
    return max(config.collective_timeout_s, RENDEZVOUS_MIN_S)


def join_group(config: EngineConfig) -> TensorParallel:
    """init_process_group for this rank: the ranks meet at --dist-init (a TCP store rank 0
    serves), then every collective fails after --collective-timeout-s."""
    device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    host, _, port = config.dist_init.removeprefix("tcp://").rpartition(":")
    store = dist.TCPStore(  # type: ignore[attr-defined]
        host,
        int(port),
        world_size=config.world_size,
        is_master=config.rank == 0,
        timeout=timedelta(seconds=rendezvous_timeout_s(config)),
    )
    dist.init_process_group(
        backend=collective_backend(device),
        store=store,
        rank=config.rank,
        world_size=config.world_size,
        timeout=timedelta(seconds=config.collective_timeout_s),
    )
    _LOG.info("tensor_parallel_joined", rank=config.rank, world_size=config.world_size)
    return TensorParallel.from_default_group()


def leave_group() -> None:
    """Tear the group down (a later engine in this process may start another)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def config_json(config: EngineConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def config_from_json(text: str) -> EngineConfig:
    return EngineConfig(**json.loads(text))
