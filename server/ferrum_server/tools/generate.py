"""`ferrum-executor generate`: run the reference scheduler against a server from the shell.

One --target is one executor; several (comma-separated or repeated flags) or a dns:/// name
drive a fleet (``ferrum_client.fleet``), and each --json result then names the executor that
produced its last token and how often it failed over.

Prompts are token ids: a JSON file holding a list of lists (or {"prompts": [...]}) or random
prompts from a seed. Tokens stream to stdout as they are produced ("index<TAB>token"), or, with
--json, one JSON document with every result is printed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
from pathlib import Path
from typing import Any

from ferrum_client import AsyncExecutorClient, pb
from ferrum_client.fleet import FleetSpec, parse_fleet_spec
from ferrum_client.scheduler import (
    DEFAULT_MAX_PREFILL_STEP_TOKENS,
    DEFAULT_MIN_PREFILL_SHARE,
    DEFAULT_TARGET_STEP_MS,
    Backend,
    SchedulerConfig,
)

from ferrum_server.config import DTYPES
from ferrum_server.server_process import start_server_process


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--target",
        action="append",
        help="executors: HOST:PORT[,HOST:PORT...] or dns:///NAME:PORT (re-resolved every "
        "30 s); repeated flags add up. More than one executor runs as a fleet (placement "
        "and failover: docs/scheduler.md)",
    )
    where.add_argument(
        "--local", action="store_true", help="start a server subprocess for this run"
    )
    parser.add_argument("--model", default="tiny", help="model for --local")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype for --local")
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra `serve` flag for --local (repeatable, e.g. --server-arg=--block-size=32)",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--prompts", type=Path, help="JSON file: a list of token-id lists")
    source.add_argument("--random", type=int, default=4, help="number of random prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-prompt", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--stop-token-ids", default="", help="comma-separated ids")
    parser.add_argument("--max-step-tokens", type=int, default=512)
    parser.add_argument(
        "--max-prefill-step-tokens",
        type=int,
        default=DEFAULT_MAX_PREFILL_STEP_TOKENS,
        help="most tokens of a burst's prefill-only steps, while nothing decodes",
    )
    parser.add_argument(
        "--target-step-ms",
        type=float,
        default=DEFAULT_TARGET_STEP_MS,
        help="lower the step budget so a step takes about this long (0 = fixed budget)",
    )
    parser.add_argument(
        "--min-prefill-share",
        type=float,
        default=DEFAULT_MIN_PREFILL_SHARE,
        help="share of the step-time target that prefill may always take (0..1)",
    )
    parser.add_argument("--pipeline-depth", type=int, default=1)
    parser.add_argument(
        "--no-align-first-tokens",
        dest="align_first_tokens",
        action="store_false",
        help="start each prompt as soon as it is prefilled (lower TTFT in a burst)",
    )
    parser.add_argument(
        "--decode-continuation",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep two steps in flight with every running request in each (decodes continue "
        "from the token the executor selected; see docs/scheduler.md); on by default",
    )
    parser.add_argument("--json", action="store_true", help="print all results as JSON at the end")


def read_prompt_file(path: Path) -> list[list[int]]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if isinstance(data, dict):
        data = data.get("prompts")
    if not isinstance(data, list) or not all(
        isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in data
    ):
        raise ValueError(f"{path}: expected a list of non-empty token-id lists")
    return [list(p) for p in data]


def load_prompts(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    if args.prompts is not None:
        return read_prompt_file(args.prompts)
    rng = random.Random(args.seed)
    return [
        [rng.randrange(vocab_size) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
        for _ in range(args.random)
    ]


async def _generate(
    spec: FleetSpec, args: argparse.Namespace, config: SchedulerConfig
) -> dict[str, Any]:
    """One executor: the plain gRPC backend. Several (or a DNS name): the fleet."""
    if len(spec.addresses) == 1 and not spec.dns_names:
        target = spec.addresses[0]
        async with AsyncExecutorClient(target, timeout_s=600) as client:
            info = await client.get_info()
            return await _run(client, info, args, config, target)
    from ferrum_client.fleet import ExecutorFleet
    from ferrum_client.fleet_backend import OPEN_TIMEOUT_S, FleetBackend

    async with ExecutorFleet(spec) as fleet:
        await fleet.wait_serving(OPEN_TIMEOUT_S)
        info = await fleet.serving()[0].client.get_info()
        report = await _run(FleetBackend(fleet), info, args, config, "")
        report["executors"] = fleet.metrics()
        return report


async def _run(
    backend: AsyncExecutorClient | Backend,
    info: pb.GetInfoResponse,
    args: argparse.Namespace,
    config: SchedulerConfig,
    target: str,
) -> dict[str, Any]:
    from ferrum_client.scheduler import GenerationParams, Scheduler

    stops = tuple(int(t) for t in args.stop_token_ids.split(",") if t.strip())
    prompts = load_prompts(args, info.model_info.vocab_size)
    scheduler = Scheduler(backend, config)
    params = GenerationParams(max_new_tokens=args.max_new_tokens, stop_token_ids=stops)
    results = []
    if args.json:
        results = await scheduler.generate(prompts, params)
    else:
        async for index, token in scheduler.stream(prompts, params):
            sys.stdout.write(f"{index}\t{token}\n")
        sys.stdout.flush()
    return {
        "model": info.model_info.model_id,
        "results": [
            {
                "index": r.index,
                "prompt_tokens": len(prompts[r.index]),
                "output_ids": r.output_ids,
                "finish_reason": r.finish_reason,
                "error": r.error,
                "ttft_ms": round(r.first_token_s * 1e3, 1),
                # The executor that produced the last token, and moves after a lost executor.
                "executor": r.executor or (target if r.output_ids else ""),
                "failovers": r.failovers,
            }
            for r in results
        ],
        "steps": scheduler.stats.steps,
    }


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    """The scheduler's settings from the command line (ValueError when out of range)."""
    return SchedulerConfig(
        max_step_tokens=args.max_step_tokens,
        max_prefill_step_tokens=args.max_prefill_step_tokens,
        pipeline_depth=args.pipeline_depth,
        target_step_ms=args.target_step_ms,
        min_prefill_share=args.min_prefill_share,
        align_first_tokens=args.align_first_tokens,
        decode_continuation=args.decode_continuation,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    process = None
    try:
        config = scheduler_config(args)  # bad settings fail before a server starts
        spec = parse_fleet_spec(args.target) if args.target else FleetSpec()
        if args.prompts is not None:
            read_prompt_file(args.prompts)  # fail before starting anything
        if args.local:
            process, port = start_server_process(
                [
                    "--model", args.model,
                    "--dtype", args.dtype,
                    "--metrics-port", "-1",
                    "--log-level", "warning",
                    *args.server_arg,
                ],
                timeout_s=600,
            )  # fmt: skip
            spec = FleetSpec((f"127.0.0.1:{port}",))
        report = asyncio.run(_generate(spec, args, config))
    except (ValueError, OSError, RuntimeError) as exc:
        sys.stderr.write(f"ferrum-executor generate: {exc}\n")
        return 2
    finally:
        if process is not None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
    if args.json:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
    return 0 if all(r["finish_reason"] in ("length", "stop") for r in report["results"]) else 1
