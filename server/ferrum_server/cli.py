"""`ferrum-executor serve`: its flags, the configuration they build, and the serving loop.

The `ferrum-executor` command line itself (serve plus the demo, generate and bench tools) is
`ferrum_server.tools.cli`; it registers `serve` through `add_serve_command`.

Every `serve` flag also reads the environment variable FERRUM_<FLAG> (dashes as underscores),
so containers can be configured either way; flags win over the environment.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ferrum_server.config import DTYPES, EngineConfig, ServerConfig
from ferrum_server.security import SecurityConfig


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


@dataclass(frozen=True, slots=True)
class Flag:
    name: str
    kind: Callable[[str], Any]
    default: str
    help: str
    choices: tuple[str, ...] | None = None

    @property
    def env(self) -> str:
        return "FERRUM_" + self.name.upper().replace("-", "_")


SERVE_FLAGS: tuple[Flag, ...] = (
    Flag("model", str, "tiny", "'tiny' (built-in random weights) or a Hugging Face folder"),
    Flag("host", str, "127.0.0.1", "gRPC listen address"),
    Flag("port", int, "50051", "gRPC port; 0 = any free port"),
    Flag("device", str, "cpu", "cpu or cuda[:N]"),
    Flag("dtype", str, "float32", "compute dtype", DTYPES),
    Flag("block-size", int, "16", "KV block size in tokens"),
    Flag(
        "kv-cache-bytes",
        int,
        "0",
        "KV pool bytes; 0 = what GPU memory x utilisation leaves after weights, activations "
        "and graphs (CUDA) or 256 MiB (CPU)",
    ),
    Flag(
        "gpu-memory-utilization",
        float,
        "0.9",
        "fraction of total GPU memory for weights, peak activations, CUDA graphs and the KV pool",
    ),
    Flag("max-batch-tokens", int, "4096", "most tokens in one forward"),
    Flag("max-batch-size", int, "256", "most items in one forward, and most live sequences"),
    Flag("max-sequence-length", int, "0", "longest sequence; 0 = the model's positions"),
    Flag("torch-threads", int, "0", "CPU intra-op threads; 0 = torch's default"),
    Flag(
        "kernel-backend",
        str,
        "auto",
        "attention/sampling kernels: auto (Triton on CUDA), torch, triton",
        ("auto", "torch", "triton"),
    ),
    Flag("prefix-caching", _bool, "true", "reuse KV blocks of shared prompt prefixes"),
    Flag(
        "cuda-graphs",
        _bool,
        "true",
        "replay decode-only steps from CUDA graphs captured at start-up (CUDA only)",
    ),
    Flag(
        "cuda-graph-max-batch",
        int,
        "256",
        "largest decode batch captured as a CUDA graph; larger steps run eagerly",
    ),
    Flag(
        "swap-space-bytes",
        int,
        str(1024**3),
        "host memory for KV swapped out by preemption; 0 = recompute only",
    ),
    Flag("grace-s", float, "30", "seconds in-flight calls may run after SIGTERM"),
    Flag("metrics-port", int, "9400", "Prometheus /metrics port; 0 = any free port, -1 = off"),
    Flag("metrics-host", str, "0.0.0.0", "Prometheus listen address"),
    Flag(
        "liveness-timeout-s",
        float,
        "120",
        "engine heartbeat deadline before the liveness health service reports NOT_SERVING",
    ),
    Flag("log-level", str, "info", "debug, info, warning, error"),
    Flag(
        "log-format",
        str,
        "auto",
        "json, console, or auto (console on a terminal)",
        ("auto", "json", "console"),
    ),
    Flag("debug-reflection", _bool, "false", "gRPC server reflection (needs the 'debug' extra)"),
    # -- security (see docs/readme/hardening.md) --
    Flag("tls-cert", str, "", "PEM certificate chain; with --tls-key turns TLS on"),
    Flag("tls-key", str, "", "PEM private key of --tls-cert"),
    Flag("tls-client-ca", str, "", "PEM CA bundle client certificates must chain to (mutual TLS)"),
    Flag("auth-token-file", str, "", "file of role:token lines (roles read, execute); '' = off"),
    Flag("health-port", int, "-1", "plaintext port serving only grpc.health.v1; -1 = off"),
    # -- limits --
    Flag("max-message-bytes", int, "0", "max message size both ways; 0 = derived from limits"),
    Flag("max-concurrent-rpcs", int, "1024", "concurrent RPCs before RESOURCE_EXHAUSTED; 0 = off"),
    Flag("max-concurrent-streams", int, "256", "HTTP/2 streams per connection"),
    Flag("max-metadata-bytes", int, "16384", "request metadata (headers) per call"),
    # -- idempotency and fencing --
    Flag(
        "require-fencing",
        _bool,
        "false",
        "refuse mutating calls with executor_instance_id 0 (FAILED_PRECONDITION)",
    ),
    Flag("step-ledger-size", int, "4096", "step ids remembered for exactly-once retries"),
    Flag(
        "release-on-disconnect",
        _bool,
        "true",
        "release the caches a StepStream opened or touched when it ends abnormally",
    ),
)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    for flag in SERVE_FLAGS:
        # Booleans also work as bare switches: --cuda-graphs / --no-cuda-graphs.
        switch = flag.kind is _bool
        # argparse applies `type` to string defaults too, so a bad environment value fails
        # with the same one-line usage error as a bad flag.
        parser.add_argument(
            f"--{flag.name}",
            type=flag.kind,
            default=os.environ.get(flag.env, flag.default),
            choices=flag.choices,
            help=f"{flag.help} [env {flag.env}, default {flag.default}]",
            nargs="?" if switch else None,
            const=True if switch else None,
        )
        if switch:
            parser.add_argument(
                f"--no-{flag.name}",
                dest=flag.name.replace("-", "_"),
                action="store_const",
                const=False,
                default=argparse.SUPPRESS,
                help=f"same as --{flag.name} false",
            )
    parser.add_argument(
        "--port-file",
        type=pathlib.Path,
        default=None,
        help="write the bound port here once SERVING (for --port 0)",
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
        kernel_backend=args.kernel_backend,
        prefix_caching=args.prefix_caching,
        swap_space_bytes=args.swap_space_bytes,
        require_fencing=args.require_fencing,
        cuda_graphs=args.cuda_graphs,
        cuda_graph_max_batch=args.cuda_graph_max_batch,
    )
    if engine.model != "tiny" and not pathlib.Path(engine.model).is_dir():
        raise ValueError(f"model path {engine.model} is not a folder")
    server = ServerConfig(
        host=args.host,
        port=args.port,
        grace_s=args.grace_s,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        reflection=args.debug_reflection,
        liveness_timeout_s=args.liveness_timeout_s,
        max_message_bytes=args.max_message_bytes,
        max_concurrent_rpcs=args.max_concurrent_rpcs,
        max_concurrent_streams=args.max_concurrent_streams,
        max_metadata_bytes=args.max_metadata_bytes,
        health_port=args.health_port,
        release_on_disconnect=args.release_on_disconnect,
        step_ledger_size=args.step_ledger_size,
        security=SecurityConfig(
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
            auth_token_file=args.auth_token_file,
        ),
    )
    return engine, server


async def _serve(
    engine: EngineConfig, server: ServerConfig, port_file: pathlib.Path | None
) -> None:
    from ferrum_server.app import start_server

    running = await start_server(engine, server)
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
            os._exit(1)  # a second signal: exit at once, without draining
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    await stop.wait()
    await running.drain(server.grace_s)


def cmd_serve(args: argparse.Namespace) -> int:
    from ferrum_server import logs
    from ferrum_server.app import startup_event

    try:
        engine, server = _configs(args)
        logs.configure(args.log_level, args.log_format)
    except ValueError as exc:
        sys.stderr.write(f"ferrum-executor: invalid configuration: {exc}\n")
        return 2
    logs.get("ferrum_server").info("startup", **startup_event(engine, server))
    try:
        asyncio.run(_serve(engine, server, args.port_file))
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"ferrum-executor: cannot start: {exc}\n")
        return 2
    return 0


def add_serve_command(subcommands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `serve` (its flags and `cmd_serve`) to a command line's subcommands."""
    serve = subcommands.add_parser("serve", help="run the executor gRPC server")
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)
