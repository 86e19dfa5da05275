"""How long a served executor takes to answer a gRPC health check while it runs steps.

Starts `ferrum-executor serve` on a workload's model (W1's by default), drives it with the
reference scheduler (prompts of `--prompt-tokens` random tokens, a few new tokens each, so the
run is mostly prefill steps of hundreds of milliseconds), and meanwhile sends a health check
every `--interval-ms` over its own channel, timing each answer. Prints the latency percentiles
and the run's wall time. A health check is answered by the server's gRPC thread, which needs the
GIL: while the engine thread holds it (a native kernel that does not release it), the answer
waits. Admission probes and the parse of the next step wait the same way. Run it alone on a
quiet machine.

    python benchmarks/probe_latency_bench.py [--workload w1] [--dtype bfloat16] [--prompts 48]
        [--prompt-tokens 256] [--new-tokens 8] [--interval-ms 10] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

import grpc
from ferrum_client import AsyncExecutorClient
from ferrum_client.scheduler import GenerationParams, Scheduler, SchedulerConfig
from ferrum_server.server_process import start_server_process, stop_server_processes
from ferrum_server.tools.bench.harness import percentile
from ferrum_server.tools.bench.workloads import WORKLOADS, ensure_model
from grpc_health.v1 import health_pb2, health_pb2_grpc


async def _measure(target: str, args: argparse.Namespace, vocab: int) -> dict[str, float]:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(vocab) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)
    ]
    latencies: list[float] = []
    stop = asyncio.Event()

    async def checks() -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            await health.Check(health_pb2.HealthCheckRequest(), timeout=30)  # connected
            while not stop.is_set():
                started = time.perf_counter()
                await health.Check(health_pb2.HealthCheckRequest(), timeout=30)
                latencies.append((time.perf_counter() - started) * 1e3)
                await asyncio.sleep(args.interval_ms / 1e3)

    task = asyncio.create_task(checks())
    scheduler = Scheduler(AsyncExecutorClient(target, timeout_s=600), SchedulerConfig())
    started = time.perf_counter()
    try:
        await scheduler.generate(prompts, GenerationParams(max_new_tokens=args.new_tokens))
    finally:
        wall = time.perf_counter() - started
        stop.set()
        await task
    if not latencies:
        raise SystemExit("no health check was answered during the run")
    return {
        "checks": float(len(latencies)),
        "p50_ms": percentile(latencies, 50),
        "p90_ms": percentile(latencies, 90),
        "p99_ms": percentile(latencies, 99),
        "max_ms": max(latencies),
        "wall_s": wall,
    }


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Prints the health checks' latency percentiles; returns them (and the wall time)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="w1", choices=sorted(WORKLOADS))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--interval-ms", type=float, default=10.0)
    parser.add_argument("--max-batch-tokens", type=int, default=1024)
    parser.add_argument("--cache-dir", type=Path, help="where workload weights are kept")
    args = parser.parse_args(argv)
    if min(args.prompts, args.prompt_tokens, args.new_tokens) < 1 or args.interval_ms < 0:
        parser.error("--prompts, --prompt-tokens and --new-tokens must be >= 1, --interval-ms >= 0")
    workload = WORKLOADS[args.workload]
    folder = ensure_model(workload, args.cache_dir)
    serve_args = [
        "--model", str(folder),
        "--dtype", args.dtype,
        "--kv-cache-bytes", str(1 << 30),
        "--max-batch-tokens", str(args.max_batch_tokens),
        "--metrics-port", "-1",
        "--log-level", "warning",
    ]  # fmt: skip
    process, port = start_server_process(serve_args, timeout_s=600)
    try:
        result = asyncio.run(_measure(f"127.0.0.1:{port}", args, workload.model.vocab_size))
    finally:
        stop_server_processes([process])
    sys.stdout.write(
        f"{args.workload} {args.dtype}, {args.prompts} x {args.prompt_tokens}-token prompts: "
        f"{result['checks']:.0f} health checks, p50 {result['p50_ms']:.2f} p90 "
        f"{result['p90_ms']:.2f} p99 {result['p99_ms']:.2f} max {result['max_ms']:.2f} ms; "
        f"wall {result['wall_s']:.2f} s\n"
    )
    return result


if __name__ == "__main__":
    main()
