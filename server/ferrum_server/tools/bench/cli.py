"""`ferrum-executor bench`: its flags and `cmd_bench`, which runs the harness."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from ferrum_client.scheduler import (
    DEFAULT_CONTINUATION_LEAD_MS,
    DEFAULT_MAX_PREFILL_STEP_TOKENS,
    DEFAULT_MIN_PREFILL_SHARE,
    DEFAULT_TARGET_STEP_MS,
)

from ferrum_server.config import DTYPES

# Local executors one bench run may start (each is a full server process with its own KV pool).
MAX_LOCAL_EXECUTORS = 16


def _csv_ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _csv_floats(text: str) -> list[float]:
    return [float(t) for t in text.split(",") if t.strip()]


def _lead_ms(text: str) -> float | None:
    """--continuation-lead-ms: milliseconds (0 or more), or 'none' to plan at once."""
    if text.strip().lower() == "none":
        return None
    value = float(text)
    if not 0 <= value < 1e6:
        raise argparse.ArgumentTypeError("must be within [0, 1e6) ms, or 'none'")
    return value


def add_bench_args(bench: argparse.ArgumentParser) -> None:
    # The names of workloads.WORKLOADS (not imported here: it loads torch).
    bench.add_argument(
        "--workload", default="w1", choices=("w1", "w1-moe", "w1-long", "w2-prefix", "smoke")
    )
    bench.add_argument(
        "--dtype",
        default="float32,bfloat16",
        help=f"comma-separated, from {', '.join(DTYPES)} [default float32,bfloat16]",
    )
    bench.add_argument(
        "--compare",
        default="",
        help="comma-separated: hf (= hf-static,hf-cb), hf-static, hf-cb, vllm, inproc",
    )
    bench.add_argument("--mode", default="offline", choices=("offline", "online"))
    bench.add_argument("--rate", type=float, default=4.0, help="online: requests per second")
    bench.add_argument("--max-step-tokens", type=int, default=512, help="scheduler budget")
    bench.add_argument(
        "--max-prefill-step-tokens",
        type=int,
        default=DEFAULT_MAX_PREFILL_STEP_TOKENS,
        help="most tokens of a burst's prefill-only steps (at least --max-step-tokens)",
    )
    bench.add_argument(
        "--target-step-ms",
        type=float,
        default=DEFAULT_TARGET_STEP_MS,
        help="scheduler step-time target (0 = fixed budget)",
    )
    bench.add_argument(
        "--min-prefill-share",
        type=float,
        default=DEFAULT_MIN_PREFILL_SHARE,
        help="share of the step-time target prefill may always take (0..1)",
    )
    bench.add_argument(
        "--prefill-shares",
        type=_csv_floats,
        default=[],
        help="other guaranteed prefill shares to run as well (the step-time target kept)",
    )
    bench.add_argument(
        "--budgets",
        type=_csv_ints,
        default=[],
        help="fixed budgets (no step-time target) to run as well: the trade-off table",
    )
    bench.add_argument("--pipeline-depth", type=int, default=1)
    bench.add_argument(
        "--extra-depths", type=_csv_ints, default=[], help="extra pipeline depths to run"
    )
    bench.add_argument(
        "--unaligned",
        action="store_true",
        help="also run the scheduler with first tokens not aligned (align_first_tokens=False)",
    )
    bench.add_argument(
        "--no-continuation",
        dest="without_continuation",
        action="store_true",
        help="also run the scheduler without decode continuation (decode_continuation=False)",
    )
    bench.add_argument(
        "--continuation-lead-ms",
        type=_lead_ms,
        default=DEFAULT_CONTINUATION_LEAD_MS,
        help="how long before the predicted end of the step in flight a continued step is "
        "planned while prompts are still to arrive (online); 'none' plans it at once",
    )
    bench.add_argument(
        "--planned-at-once",
        action="store_true",
        help="also run the scheduler planning each continued step at once "
        "(continuation_lead_ms=None)",
    )
    bench.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds of every system, interleaved (each round starts one system further "
        "along); each row is the median round",
    )
    bench.add_argument(
        "--executors",
        type=int,
        default=1,
        help="ferrum-grpc: start this many local executors and drive them as one fleet "
        "(they share this machine's cores: on 2 cores two executors are not twice as fast)",
    )
    bench.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="also run ferrum-grpc with the model split over N ranks on this machine (they "
        "share its cores); the row reports the collectives' time per step",
    )
    bench.add_argument(
        "--against",
        metavar="REV",
        default=None,
        help="also run ferrum-grpc with its server from git revision REV (checked out in a "
        "temporary worktree) in the same rounds: the row ferrum-grpc@<commit>",
    )
    bench.add_argument("--hf-batch-size", type=int, default=16)
    bench.add_argument("--torch-threads", type=int, default=0)
    bench.add_argument("--vllm-venv", default=None, help="vLLM CPU venv (see scripts/)")
    bench.add_argument(
        "--cache-dir", type=Path, default=None, help="where workload weights are kept"
    )
    bench.add_argument(
        "--output", type=Path, default=Path("bench-results/bench.json"), help="JSON report"
    )
    bench.add_argument("--no-progress", action="store_true")


def cmd_bench(args: argparse.Namespace) -> int:
    from ferrum_server.tools.bench.harness import COMPARE_CHOICES, format_table, run_bench
    from ferrum_server.tools.bench.revision import RevisionCheckout, revision_checkout

    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    compare = [c.strip() for c in args.compare.split(",") if c.strip()]
    bad = [d for d in dtypes if d not in DTYPES] + [c for c in compare if c not in COMPARE_CHOICES]
    if args.repeat < 1:
        sys.stderr.write("ferrum-executor bench: --repeat must be >= 1\n")
        return 2
    if not 1 <= args.executors <= MAX_LOCAL_EXECUTORS:
        sys.stderr.write(
            f"ferrum-executor bench: --executors must be in 1..{MAX_LOCAL_EXECUTORS}\n"
        )
        return 2
    if not 1 <= args.tensor_parallel_size <= MAX_LOCAL_EXECUTORS:
        sys.stderr.write(
            f"ferrum-executor bench: --tensor-parallel-size must be in 1..{MAX_LOCAL_EXECUTORS}\n"
        )
        return 2
    shares = [args.min_prefill_share, *args.prefill_shares]
    if not all(0 <= share <= 1 for share in shares):
        sys.stderr.write("ferrum-executor bench: prefill shares must be within 0..1\n")
        return 2
    if bad or not dtypes:
        sys.stderr.write(f"ferrum-executor bench: unknown choice(s): {', '.join(bad)}\n")
        return 2
    with contextlib.ExitStack() as stack:
        against: RevisionCheckout | None = None
        if args.against is not None:
            try:
                against = stack.enter_context(revision_checkout(args.against))
            except ValueError as exc:
                sys.stderr.write(f"ferrum-executor bench: --against: {exc}\n")
                return 2
        report = run_bench(
            args.workload,
            dtypes,
            compare,
            mode=args.mode,
            rate=args.rate,
            max_step_tokens=args.max_step_tokens,
            max_prefill_step_tokens=args.max_prefill_step_tokens,
            target_step_ms=args.target_step_ms,
            min_prefill_share=args.min_prefill_share,
            budgets=args.budgets,
            prefill_shares=args.prefill_shares,
            pipeline_depth=args.pipeline_depth,
            extra_depths=args.extra_depths,
            unaligned=args.unaligned,
            without_continuation=args.without_continuation,
            continuation_lead_ms=args.continuation_lead_ms,
            planned_at_once=args.planned_at_once,
            repeat=args.repeat,
            hf_batch_size=args.hf_batch_size,
            torch_threads=args.torch_threads,
            vllm_venv=args.vllm_venv,
            cache_dir=args.cache_dir,
            progress=not args.no_progress,
            executors=args.executors,
            tensor_parallel_size=args.tensor_parallel_size,
            against=against,
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    sys.stdout.write(format_table(report) + "\n")
    sys.stdout.write(f"report written to {args.output}\n")
    failed = [
        name
        for section in report["by_dtype"].values()
        for name, why in section["skipped"].items()
        if why.startswith("failed") and not name.startswith(("vllm", "hf"))
    ]
    return (
        1
        if failed or not all("ferrum-grpc" in s["results"] for s in report["by_dtype"].values())
        else 0
    )
