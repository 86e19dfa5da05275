"""Runs one benchmark on vLLM (CPU build) inside vLLM's own virtual environment.

Standalone on purpose: it is executed by that venv's interpreter and imports nothing from
ferrum. Reads a JSON request (model folder, dtype, prompts as token ids, new tokens, optional
arrival offsets), streams every request through ``AsyncLLM`` so each token gets a timestamp,
and writes per-request traces as JSON. Prefix caching as the workload says (off unless it
shares a prefix), tokenizer skipped, EOS ignored.

    python vllm_worker.py IN.json OUT.json
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any


def _peak_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _descendants_peak_rss() -> int:
    """Sum of VmHWM over our descendant processes (vLLM's engine core and its workers)."""
    parents: dict[str, str] = {}
    peaks: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        parents[entry.name] = fields.get("PPid", "").strip()
        peaks[entry.name] = int(fields.get("VmHWM", "0 kB").split()[0]) * 1024
    me = str(Path("/proc/self").resolve().name)
    total = 0
    for pid in peaks:
        walk = pid
        while walk in parents and walk != me:
            walk = parents[walk]
        if walk == me and pid != me:
            total += peaks[pid]
    return total


async def _run(spec: dict[str, Any]) -> dict[str, Any]:
    # Only importable inside vLLM's venv, hence typed loosely.
    vllm: Any = importlib.import_module("vllm")
    RequestOutputKind: Any = importlib.import_module("vllm.sampling_params").RequestOutputKind
    AsyncLLM: Any = importlib.import_module("vllm.v1.engine.async_llm").AsyncLLM
    AsyncEngineArgs, SamplingParams = vllm.AsyncEngineArgs, vllm.SamplingParams

    args = AsyncEngineArgs(
        model=spec["model"],
        dtype=spec["dtype"],
        skip_tokenizer_init=True,
        enable_prefix_caching=bool(spec.get("prefix_caching", False)),
        max_model_len=2048,
        seed=0,
    )
    engine = AsyncLLM.from_engine_args(args)
    params = SamplingParams(
        max_tokens=spec["max_new_tokens"],
        min_tokens=spec["max_new_tokens"],
        ignore_eos=True,
        temperature=0.0,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
    )
    prompts: list[list[int]] = spec["prompts"]
    arrivals: list[float] = spec.get("arrivals_s") or [0.0] * len(prompts)

    async def one(tag: str, index: int, start: float, trace: dict[str, Any]) -> None:
        delay = start + arrivals[index] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        trace["arrival_s"] = max(arrivals[index], time.perf_counter() - start)
        prompt = {"prompt_token_ids": prompts[index]}
        async for out in engine.generate(prompt, params, f"{tag}-{index}"):
            now = time.perf_counter() - start
            new = list(out.outputs[0].token_ids)
            trace["token_times_s"].extend([now] * len(new))
            trace["output_ids"].extend(new)

    # warm-up
    warm: list[dict[str, Any]] = [
        {"arrival_s": 0.0, "token_times_s": [], "output_ids": []} for _ in range(2)
    ]
    saved = arrivals
    arrivals = [0.0] * len(prompts)
    await asyncio.gather(*(one("warm", i, time.perf_counter(), warm[i]) for i in range(2)))
    arrivals = saved
    traces: list[dict[str, Any]] = [
        {"arrival_s": 0.0, "token_times_s": [], "output_ids": []} for _ in prompts
    ]
    start = time.perf_counter()
    await asyncio.gather(*(one("run", i, start, traces[i]) for i in range(len(prompts))))
    wall = max(t["token_times_s"][-1] for t in traces if t["token_times_s"])
    peaks = {"client": _peak_rss(), "engine": _descendants_peak_rss()}
    try:
        engine.shutdown()
    except Exception as exc:  # results are in hand; a shutdown hiccup changes nothing
        sys.stderr.write(f"vllm shutdown: {exc}\n")
    return {
        "wall_s": wall,
        "requests": traces,
        "peak_rss_bytes": peaks,
        "notes": {
            "vllm": vllm.__version__,
            "max_num_batched_tokens": "vLLM default",
            "prefix_caching": bool(spec.get("prefix_caching", False)),
        },
    }


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    result = asyncio.run(_run(spec))
    Path(sys.argv[2]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
