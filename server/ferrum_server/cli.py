"""`ferrum-executor`: serve the executor, or run the demo against a fresh local server."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from ferrum_server.config import DTYPES, EngineConfig, ServerConfig


def _env(name: str, default: str) -> str:
    return os.environ.get(f"FERRUM_{name}", default)


def _add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=_env("MODEL", "tiny"),
        help="'tiny' (built-in random weights) or a HF folder path",
    )
    parser.add_argument("--host", default=_env("HOST", "127.0.0.1"))
    parser.add_argument(
        "--port", type=int, default=int(_env("PORT", "50051")), help="0 picks a free port"
    )
    parser.add_argument("--device", default=_env("DEVICE", "cpu"), help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default=_env("DTYPE", "float32"), choices=DTYPES)
    parser.add_argument("--block-size", type=int, default=int(_env("BLOCK_SIZE", "16")))
    parser.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=int(_env("KV_CACHE_BYTES", "0")),
        help="KV pool bytes; 0 = from free GPU memory (CUDA) or 256 MiB (CPU)",
    )
    parser.add_argument(
        "--gpu-memory-utilization", type=float, default=float(_env("GPU_MEMORY_UTILIZATION", "0.9"))
    )
    parser.add_argument(
        "--max-batch-tokens", type=int, default=int(_env("MAX_BATCH_TOKENS", "4096"))
    )
    parser.add_argument("--max-batch-size", type=int, default=int(_env("MAX_BATCH_SIZE", "256")))
    parser.add_argument(
        "--max-sequence-length", type=int, default=int(_env("MAX_SEQUENCE_LENGTH", "0"))
    )
    parser.add_argument("--torch-threads", type=int, default=int(_env("TORCH_THREADS", "0")))
    parser.add_argument("--grace-s", type=float, default=float(_env("GRACE_S", "30")))
    parser.add_argument(
        "--port-file",
        type=pathlib.Path,
        default=None,
        help="write the bound port here once SERVING (for port 0)",
    )


def _configs(args: argparse.Namespace) -> tuple[EngineConfig, ServerConfig]:
    engine = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_batch_tokens=args.max_batch_tokens,
        max_batch_size=args.max_batch_size,
        max_sequence_length=args.max_sequence_length,
        torch_threads=args.torch_threads,
    )
    return engine, ServerConfig(host=args.host, port=args.port, grace_s=args.grace_s)


async def _serve(
    engine: EngineConfig, server: ServerConfig, port_file: pathlib.Path | None
) -> None:
    from ferrum_server.app import start_server

    running = await start_server(engine, server)
    logging.getLogger("ferrum_server").info("serving on %s:%d", server.host, running.port)
    if port_file is not None:
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(running.port))
        tmp.replace(port_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    count = 0

    def on_signal() -> None:
        nonlocal count
        count += 1
        if count > 1:
            os._exit(1)  # second signal: exit at once
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()
    await running.drain(server.grace_s)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        engine, server = _configs(args)
    except ValueError as exc:
        sys.stderr.write(f"ferrum-executor: invalid configuration: {exc}\n")
        return 2
    try:
        asyncio.run(_serve(engine, server, args.port_file))
    except (ValueError, FileNotFoundError, OSError) as exc:
        sys.stderr.write(f"ferrum-executor: cannot start: {exc}\n")
        return 2
    return 0


def start_server_process(
    extra_args: Sequence[str] = (), timeout_s: float = 120.0
) -> tuple[subprocess.Popen[bytes], int]:
    """Start `ferrum-executor serve` on 127.0.0.1, port 0; return (process, port) once SERVING."""
    folder = tempfile.mkdtemp(prefix="ferrum-")
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


def cmd_demo(args: argparse.Namespace) -> int:
    from ferrum_server.demo import run_demo

    process, port = start_server_process(["--model", args.model, "--dtype", args.dtype])
    try:
        report = asyncio.run(
            run_demo(
                f"127.0.0.1:{port}", num_requests=args.requests, max_new_tokens=args.max_new_tokens
            )
        )
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    sys.stdout.write(json.dumps(report, indent=2) + "\n")
    return 0 if report["free_blocks_after"] == report["total_blocks"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ferrum-executor", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the executor gRPC server")
    _add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
    demo = sub.add_parser("demo", help="start a local server and drive a short generation")
    demo.add_argument("--model", default="tiny")
    demo.add_argument("--dtype", default="float32", choices=DTYPES)
    demo.add_argument("--requests", type=int, default=4)
    demo.add_argument("--max-new-tokens", type=int, default=16)
    demo.set_defaults(func=cmd_demo)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return int(args.func(args))
