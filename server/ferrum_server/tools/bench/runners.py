"""One benchmark run of one system, executed in a fresh worker process so every system gets the
machine, its threads and its memory high-water mark to itself.

Each runner returns a ``RunOutput``: per request, the arrival and token times (seconds from the
run's start) and the output ids, plus whatever the system can say about its steps.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ferrum_client.scheduler import (
    DEFAULT_CONTINUATION_LEAD_MS,
    DEFAULT_MAX_PREFILL_STEP_TOKENS,
    DEFAULT_MIN_PREFILL_SHARE,
    DEFAULT_TARGET_STEP_MS,
)


@dataclass(slots=True)
class RequestTrace:
    arrival_s: float
    token_times_s: list[float]
    output_ids: list[int]


@dataclass(slots=True)
class RunOutput:
    system: str
    wall_s: float
    requests: list[RequestTrace]
    peak_rss_bytes: dict[str, int] = field(default_factory=dict)
    steps: list[dict[str, float]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class RunSpec:
    system: str  # ferrum-grpc, ferrum-inproc, hf-static, hf-cb, vllm
    workload: str
    model_dir: str
    dtype: str
    prompts: list[list[int]]
    max_new_tokens: int
    arrivals_s: list[float] | None = None
    max_step_tokens: int = 512
    max_prefill_step_tokens: int = DEFAULT_MAX_PREFILL_STEP_TOKENS
    pipeline_depth: int = 1
    target_step_ms: float = DEFAULT_TARGET_STEP_MS  # 0 = fixed budget (trade-off table)
    min_prefill_share: float = DEFAULT_MIN_PREFILL_SHARE
    align_first_tokens: bool = True
    decode_continuation: bool = True
    # SchedulerConfig.continuation_lead_ms (None: plan each continued step at once).
    continuation_lead_ms: float | None = DEFAULT_CONTINUATION_LEAD_MS
    kv_cache_bytes: int = 1024**3
    # Prefix caching on (the workload's choice; every system that has it runs with it).
    prefix_caching: bool = False
    torch_threads: int = 0
    hf_batch_size: int = 16
    vllm_python: str = ""
    progress: bool = True
    # ferrum-grpc: executors started locally and driven as one fleet (they share the cores).
    executors: int = 1
    # ferrum-grpc: ranks each executor's model is split over (docs/parallelism.md).
    tensor_parallel_size: int = 1
    # ferrum-grpc: PYTHONPATH for the server processes, a worktree of another revision's
    # packages (bench --against: revision.py); empty: this checkout's.
    server_path: str = ""


def peak_rss(pid: int | None = None) -> int:
    """VmHWM (peak resident set) of a live process, bytes; 0 if unknown."""
    path = Path(f"/proc/{pid or 'self'}/status")
    try:
        for line in path.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def minor_faults(pid: int | None = None) -> int:
    """Minor page faults a live process has taken so far (/proc/PID/stat); 0 if unknown. A
    served step that faults thousands of pages is paying the kernel to zero memory the
    allocator handed back (see ferrum_server.host_memory)."""
    try:
        stat = Path(f"/proc/{pid or 'self'}/stat").read_text()
    except OSError:
        return 0
    # The fields after the command name, which may hold spaces, sit past its closing ")":
    # state ppid pgrp session tty_nr tpgid flags minflt ...
    return int(stat.rpartition(")")[2].split()[7])


class Progress:
    """Tokens-so-far bar on stderr (tqdm when installed, a plain counter otherwise)."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self._bar: Any = None
        self._count = 0
        self._total = total
        self._label = label
        self._enabled = enabled
        self._last = 0.0
        if not enabled:
            return
        try:
            tqdm: Any = importlib.import_module("tqdm").tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, desc=label, unit="tok", file=sys.stderr, leave=False)

    def update(self, n: int = 1) -> None:
        if not self._enabled:
            return
        self._count += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last > 0.5 or self._count == self._total:
            self._last = now
            sys.stderr.write(f"\r{self._label}: {self._count}/{self._total} tokens")
            sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._enabled:
            sys.stderr.write("\n")


# -- ferrum ------------------------------------------------------------------------------------


def _scheduler_run(
    make_backend: Callable[[], Any], spec: RunSpec, label: str
) -> tuple[float, list[RequestTrace], list[dict[str, float]], dict[str, Any]]:
    from ferrum_client.scheduler import GenerationParams, Scheduler, SchedulerConfig

    params = GenerationParams(max_new_tokens=spec.max_new_tokens)
    config = SchedulerConfig(
        max_step_tokens=spec.max_step_tokens,
        max_prefill_step_tokens=spec.max_prefill_step_tokens,
        pipeline_depth=spec.pipeline_depth,
        target_step_ms=spec.target_step_ms,
        min_prefill_share=spec.min_prefill_share,
        align_first_tokens=spec.align_first_tokens,
        decode_continuation=spec.decode_continuation,
        continuation_lead_ms=spec.continuation_lead_ms,
    )

    async def go() -> tuple[float, list[Any], Scheduler]:
        # Warm-up on a few of the workload's own prompts (oneDNN primitives, allocator).
        warm = Scheduler(make_backend(), config)
        await warm.generate(spec.prompts[:4], GenerationParams(max_new_tokens=2))
        scheduler = Scheduler(make_backend(), config)
        progress = Progress(len(spec.prompts) * spec.max_new_tokens, label, spec.progress)
        scheduler.on_token = lambda _i, _t: progress.update()
        started = time.perf_counter()
        results = await scheduler.generate(spec.prompts, params, spec.arrivals_s)
        progress.close()
        return started, results, scheduler

    started, results, scheduler = asyncio.run(go())
    traces = [
        RequestTrace(
            r.arrival_s - started, [t - started for t in r.token_times_s], list(r.output_ids)
        )
        for r in results
    ]
    wall = max((t[-1] for t in (x.token_times_s for x in traces) if t), default=0.0)
    steps = [
        {
            "start_s": s.submitted_s - started,
            "end_s": s.finished_s - started,
            "decodes": s.num_decodes,
            "prefill_tokens": s.num_prefill_tokens,
            "decode_keys": s.decode_keys,
            "queue_ms": s.timing.queue_ns / 1e6,
            "forward_ms": s.timing.forward_ns / 1e6,
            "sample_ms": s.timing.sample_ns / 1e6,
            "engine_ms": s.timing.total_ns / 1e6,
            "collective_ms": s.timing.collective_ns / 1e6,
        }
        for s in scheduler.stats.records
    ]
    notes = {
        "max_step_tokens": spec.max_step_tokens,
        "max_prefill_step_tokens": spec.max_prefill_step_tokens,
        "pipeline_depth": spec.pipeline_depth,
        "target_step_ms": spec.target_step_ms,
        "min_prefill_share": spec.min_prefill_share,
        "align_first_tokens": spec.align_first_tokens,
        "decode_continuation": spec.decode_continuation,
        "continuations": scheduler.stats.continuations,
        "continuation_lead_ms": spec.continuation_lead_ms,
        "held_plans": scheduler.stats.held_plans,
        "max_in_flight": scheduler.stats.max_in_flight,
        "preemptions": scheduler.stats.preemptions,
        "finish_reasons": sorted({r.finish_reason for r in results}),
    }
    return wall, traces, steps, notes


def _max_batch_tokens(spec: RunSpec) -> int:
    """What the executor accepts in one forward: never less than a step the scheduler plans."""
    return max(4096, spec.max_step_tokens, spec.max_prefill_step_tokens)


def _engine_args(spec: RunSpec) -> list[str]:
    return [
        "--model", spec.model_dir,
        "--dtype", spec.dtype,
        "--kv-cache-bytes", str(spec.kv_cache_bytes),
        "--max-batch-tokens", str(_max_batch_tokens(spec)),
        "--prefix-caching", "true" if spec.prefix_caching else "false",
        "--torch-threads", str(spec.torch_threads),
        "--tensor-parallel-size", str(spec.tensor_parallel_size),
        "--metrics-port", "-1",
        "--log-level", "warning",
    ]  # fmt: skip


def run_ferrum_grpc(spec: RunSpec) -> RunOutput:
    from ferrum_client import AsyncExecutorClient
    from ferrum_client.fleet import ExecutorFleet
    from ferrum_client.fleet_backend import FleetBackend
    from ferrum_client.scheduler import Backend, GrpcBackend

    from ferrum_server.server_process import start_server_process, stop_server_processes

    processes: list[subprocess.Popen[bytes]] = []
    targets: list[str] = []
    popen: dict[str, Any] = {}
    if spec.server_path:  # another revision's server (bench --against)
        popen["env"] = {**os.environ, "PYTHONPATH": spec.server_path}
    try:
        for _ in range(spec.executors):
            process, port = start_server_process(_engine_args(spec), timeout_s=600, **popen)
            processes.append(process)
            targets.append(f"127.0.0.1:{port}")
    except BaseException:
        stop_server_processes(processes)
        raise
    clients: list[AsyncExecutorClient] = []

    def backend() -> Backend:
        if len(targets) > 1:
            # The fleet starts when the scheduler opens the backend, and closes with it.
            return FleetBackend(ExecutorFleet(targets), own_fleet=True)
        client = AsyncExecutorClient(targets[0], timeout_s=600)
        clients.append(client)
        return GrpcBackend(client)

    try:
        faults_before = sum(minor_faults(p.pid) for p in processes)
        wall, traces, steps, notes = _scheduler_run(backend, spec, "ferrum-grpc")
        notes["server_minor_faults"] = sum(minor_faults(p.pid) for p in processes) - faults_before
        peaks = {"server": max(peak_rss(p.pid) for p in processes)}
        if spec.tensor_parallel_size > 1:  # each follower rank's own peak beside rank 0's
            for rank, pid in enumerate(_followers(processes[0].pid), start=1):
                peaks[f"rank{rank}"] = peak_rss(pid)
        if spec.server_path:
            # What the server was started with, read back from it while it runs (Linux; ""
            # where it cannot be read, rather than the path it was meant to get).
            notes["server_path"] = _environ(processes[0].pid).get("PYTHONPATH", "")
    finally:
        stop_server_processes(processes)
    notes["executors"] = spec.executors
    notes["tensor_parallel_size"] = spec.tensor_parallel_size
    return RunOutput(
        "ferrum-grpc",
        wall,
        traces,
        {**peaks, "client": peak_rss()},
        steps,
        notes,
    )


def _environ(pid: int) -> dict[str, str]:
    """A process's environment as it started (Linux's /proc), or {} where it cannot be read."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (entry.split(b"=", 1) for entry in raw.split(b"\0") if b"=" in entry)
    return {key.decode(errors="replace"): value.decode(errors="replace") for key, value in pairs}


def _followers(pid: int) -> list[int]:
    """The child processes of a split executor's rank 0 (its followers, in start order)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children.extend(int(c) for c in (task / "children").read_text().split())
    return sorted(children)


def run_ferrum_inproc(spec: RunSpec) -> RunOutput:
    from ferrum_server import logs
    from ferrum_server.config import EngineConfig
    from ferrum_server.engine import Engine
    from ferrum_server.tools.bench.inproc import InProcessBackend

    logs.configure("warning", "console")

    engine = Engine(
        EngineConfig(
            model=spec.model_dir,
            dtype=spec.dtype,
            kv_cache_bytes=spec.kv_cache_bytes,
            max_batch_tokens=_max_batch_tokens(spec),
            prefix_caching=spec.prefix_caching,
            torch_threads=spec.torch_threads,
        )
    )
    engine.call_sync(engine.warmup, 0)
    try:
        wall, traces, steps, notes = _scheduler_run(
            lambda: InProcessBackend(engine), spec, "ferrum-inproc"
        )
    finally:
        engine.shutdown()
    return RunOutput("ferrum-inproc", wall, traces, {"process": peak_rss()}, steps, notes)


# -- transformers ------------------------------------------------------------------------------


def _torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def run_hf_static(spec: RunSpec) -> RunOutput:
    """transformers ``generate`` with static batches (arrival order, left padding)."""
    import torch

    transformers: Any = importlib.import_module("transformers")  # untyped library
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        spec.model_dir, dtype=_torch_dtype(spec.dtype), attn_implementation="sdpa"
    ).eval()
    gen = transformers.GenerationConfig(
        max_new_tokens=spec.max_new_tokens,
        min_new_tokens=spec.max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )

    class Clock(transformers.LogitsProcessor):  # type: ignore[misc]
        """Timestamps every decoding step (each yields one token per batch row)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            self.times.append(time.perf_counter())
            return scores

    def batch_inputs(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.int64)
        mask = torch.zeros(len(prompts), width, dtype=torch.int64)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        return ids, mask

    with torch.inference_mode():
        ids, mask = batch_inputs(spec.prompts[:2])
        model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)  # warm-up
        progress = Progress(len(spec.prompts) * spec.max_new_tokens, "hf-static", spec.progress)
        traces: list[RequestTrace] = []
        started = time.perf_counter()
        for begin in range(0, len(spec.prompts), spec.hf_batch_size):
            batch = spec.prompts[begin : begin + spec.hf_batch_size]
            ids, mask = batch_inputs(batch)
            clock = Clock()
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                generation_config=gen,
                logits_processor=[clock],
            )
            progress.update(len(batch) * spec.max_new_tokens)
            times = [t - started for t in clock.times]
            for row in range(len(batch)):
                new = out[row, ids.shape[1] :].tolist()
                traces.append(RequestTrace(0.0, times[: len(new)], new))
        progress.close()
    wall = max(t.token_times_s[-1] for t in traces)
    notes = {"batch_size": spec.hf_batch_size, "attention": "sdpa"}
    return RunOutput("hf-static", wall, traces, {"process": peak_rss()}, [], notes)


def run_hf_cb(spec: RunSpec) -> RunOutput:
    """transformers' continuous batching (``generate_batch``), where the version has it."""
    import torch

    transformers: Any = importlib.import_module("transformers")  # untyped library
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        spec.model_dir, dtype=_torch_dtype(spec.dtype), attn_implementation="paged|sdpa"
    ).eval()
    if not hasattr(model, "generate_batch"):
        raise RuntimeError("this transformers has no generate_batch (continuous batching)")
    gen = transformers.GenerationConfig(
        max_new_tokens=spec.max_new_tokens,
        do_sample=False,
        eos_token_id=-1,  # disabled: exactly max_new_tokens each
        pad_token_id=0,
    )
    with torch.inference_mode():
        model.generate_batch(inputs=spec.prompts[:2], generation_config=gen)  # warm-up
        started = time.perf_counter()
        outputs = model.generate_batch(
            inputs=spec.prompts,
            generation_config=gen,
            record_timestamps=True,
            progress_bar=spec.progress,
        )
    by_prompt = sorted(outputs.values(), key=lambda o: int(str(o.request_id).split("_")[-1]))
    traces = [
        RequestTrace(
            0.0,
            [float(t) - started for t in (o.timestamps or [])],
            list(o.generated_tokens),
        )
        for o in by_prompt
    ]
    wall = max((t.token_times_s[-1] for t in traces if t.token_times_s), default=0.0)
    return RunOutput("hf-cb", wall, traces, {"process": peak_rss()}, [], {"attention": "paged"})


# -- vLLM --------------------------------------------------------------------------------------

# Where the preloaded libraries are looked for besides the vLLM venv (Debian/Ubuntu's
# libgoogle-perftools4 / libtcmalloc-minimal4 install tcmalloc in the first).
SYSTEM_LIBRARY_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)
# In order of preference: vLLM's CPU guide preloads tcmalloc (its allocator) and Intel OpenMP
# (the intel-openmp wheel puts libiomp5.so in the venv's lib/).
_PRELOADS = {
    "tcmalloc": ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc*.so*"),
    "iomp": ("libiomp5.so",),
}


def vllm_preloads(venv: Path, system_dirs: Sequence[str] = SYSTEM_LIBRARY_DIRS) -> dict[str, str]:
    """The libraries vLLM's CPU worker should run with, found under the venv (lib/, lib64/,
    then any package's folder in site-packages) or the system's library folders: name ->
    path, for those found."""
    roots = [venv / "lib", venv / "lib64", *(Path(d) for d in system_dirs)]
    found: dict[str, str] = {}
    for name, patterns in _PRELOADS.items():
        for pattern in patterns:
            candidates = [p for root in roots for p in sorted(root.glob(pattern))]
            candidates += sorted(venv.glob(f"lib/python3*/site-packages/*/{pattern}"))
            path = next((p for p in candidates if p.is_file()), None)
            if path is not None:
                found[name] = str(path)
                break
    return found


def run_vllm(spec: RunSpec) -> RunOutput:
    """vLLM's CPU build, in its own venv: a subprocess runs ``vllm_worker.py``, with tcmalloc
    and Intel OpenMP preloaded when present (as vLLM's CPU guide asks); the result's notes say
    which (``ld_preload``)."""
    worker = Path(__file__).with_name("vllm_worker.py")
    env = dict(os.environ)
    # venv/bin/python: not resolved, the link points at the base interpreter.
    preloads = vllm_preloads(Path(spec.vllm_python).parent.parent)
    existing = [p for p in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]
    ld_preload = [*preloads.values(), *(p for p in existing if p not in preloads.values())]
    if ld_preload:
        env["LD_PRELOAD"] = ":".join(ld_preload)
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # compute on every core, as we do
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, spec.kv_cache_bytes // 1024**3 + 1)))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.pop("PYTHONPATH", None)
    # One folder for the run's request, result and vLLM's IPC sockets (it leaves them in the
    # temp directory, several a run, when VLLM_RPC_BASE_PATH is not set): all removed with it.
    with tempfile.TemporaryDirectory(prefix="ferrum-vllm-") as name:
        folder = Path(name)
        env.setdefault("VLLM_RPC_BASE_PATH", name)
        request, result = folder / "in.json", folder / "out.json"
        request.write_text(
            json.dumps(
                {
                    "model": spec.model_dir,
                    "dtype": spec.dtype,
                    "prompts": spec.prompts,
                    "max_new_tokens": spec.max_new_tokens,
                    "arrivals_s": spec.arrivals_s,
                    "progress": spec.progress,
                    "prefix_caching": spec.prefix_caching,
                }
            )
        )
        process = subprocess.Popen(
            [spec.vllm_python, str(worker), str(request), str(result)], env=env
        )
        code = process.wait()
        if code != 0 or not result.is_file():
            raise RuntimeError(f"the vLLM worker exited with code {code}")
        data = json.loads(result.read_text())
    traces = [RequestTrace(**r) for r in data["requests"]]
    notes = {**data.get("notes", {}), "ld_preload": ld_preload, "preloads_found": preloads}
    return RunOutput("vllm", data["wall_s"], traces, data.get("peak_rss_bytes", {}), [], notes)


RUNNERS: dict[str, Callable[[RunSpec], RunOutput]] = {
    "ferrum-grpc": run_ferrum_grpc,
    "ferrum-inproc": run_ferrum_inproc,
    "hf-static": run_hf_static,
    "hf-cb": run_hf_cb,
    "vllm": run_vllm,
}


def main(argv: list[str] | None = None) -> int:
    """Worker entry point: ``python -m ferrum_server.tools.bench.runners SPEC.json OUT.json``."""
    args = sys.argv[1:] if argv is None else argv
    spec = RunSpec(**json.loads(Path(args[0]).read_text()))
    output = RUNNERS[spec.system](spec)
    Path(args[1]).write_text(json.dumps(output.to_json()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
