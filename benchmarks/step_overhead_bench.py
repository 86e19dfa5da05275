"""The executor's host time per step outside the model: what bounds a step on a GPU.

On a GPU a decode step of a large batch takes milliseconds, and the engine's own Python runs
serially with it: validation, capacity reservation, the forward plan, building the sampling
tensors, committing tokens and results, metrics. This bench measures that work directly. It
runs the smoke workload's tiny Llama with one layer in process, so that the model's own time is
small, opens N sequences, and times decode steps of all N at once (from the parsed or built
request to the answer, so the client's own work is not counted). Each phase is timed by
wrapping the engine's own functions:

- ``wire``: the servicer's part of a UnifiedBatch (``--wire``): parse the client's columnar
  request, convert it to a step, and encode and serialize the answer;
- ``validate``, ``reserve``: ``validate_step`` and ``CapacityManager.reserve_step``;
- ``plan``: ``ModelRunner._plan`` (the flat token, position and block-table tensors);
- ``model``: the forward itself, less the plan (on a GPU, a replayed CUDA graph);
- ``select``: ``ModelRunner._select`` (sampling tensors and the sampling kernel), or
  ``ModelRunner._greedy_output`` where the LM head folded a plain greedy step's choice (its
  GEMM is then part of ``model``);
- ``commit``: ``Engine._commit_inputs`` and ``Engine._fill_results`` (KV commits, results,
  continuation tokens);
- ``record``: metrics and gauges (``Recorder.step``, ``Engine.publish_gauges``);
- ``other``: what the step took beyond those.

``host`` is the step less ``model``, also given per item. The median of ``--rounds`` rounds of
``--steps`` steps is printed for each batch size. Run it alone on a quiet machine.

With ``--device cuda`` the engine runs on the GPU with its defaults there (Triton kernels, CUDA
graphs for decode steps), so the phases are the host work of a served GPU step on that
machine's CPU: ``model`` is then the time to launch the forward (a graph replay), and the
device's own time lands where the host first waits for it, the token copy in ``commit`` (tens
of microseconds for this one-layer model).

    python benchmarks/step_overhead_bench.py [--batches 64,256] [--steps 30] [--rounds 5]
        [--layers 1] [--dtype float32|bfloat16] [--wire] [--continuation] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ferrum_server.engine as engine_module
import torch
from ferrum_client.pb import executor_pb2 as pb
from ferrum_client.scheduler import ItemKind as WireKind
from ferrum_client.scheduler import PlannedItem, encode_items
from ferrum_server import convert
from ferrum_server.config import EngineConfig
from ferrum_server.domain import DeferralMode, ItemKind, Step, StepItem
from ferrum_server.engine import Engine
from ferrum_server.models.config import ModelConfig
from ferrum_server.models.loader import save_hf_folder
from ferrum_server.tools.bench.workloads import WORKLOADS, build_weights

PROMPT_TOKENS = 16
BLOCK_SIZE = 16
PHASES = ("wire", "validate", "reserve", "plan", "model", "select", "commit", "record", "other")


def tiny_config(layers: int) -> ModelConfig:
    """The smoke workload's Llama (hidden 128, 2 query heads over 1 KV head of 64, vocabulary
    512) with `layers` layers: small enough that a step's time is the engine's, with the native
    decode kernel's head size, so the step runs W1's code paths."""
    return dataclasses.replace(WORKLOADS["smoke"].model, num_layers=layers)


class PhaseClock:
    """Wall time per phase, summed over the steps run since the last ``reset``."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - started

        return timed

    def install(self, engine: Engine) -> Callable[[], None]:
        """Wrap the engine's phases; the returned function takes the wrappers off again."""
        # The engine calls validate_step by its module-level name.
        validate = getattr(engine_module, "validate_step")  # noqa: B009 (not re-exported)
        setattr(engine_module, "validate_step", self.wrap("validate", validate))  # noqa: B010
        runner, recorder = engine.runner, engine.recorder
        engine.capacity.reserve_step = self.wrap("reserve", engine.capacity.reserve_step)  # type: ignore[method-assign]
        runner._plan = self.wrap("plan", runner._plan)  # type: ignore[method-assign]
        runner._select = self.wrap("select", runner._select)  # type: ignore[method-assign]
        runner._greedy_output = self.wrap("select", runner._greedy_output)  # type: ignore[method-assign]
        engine._commit_inputs = self.wrap("commit", engine._commit_inputs)  # type: ignore[method-assign]
        engine._fill_results = self.wrap("commit", engine._fill_results)  # type: ignore[method-assign]
        recorder.step = self.wrap("record", recorder.step)  # type: ignore[method-assign]
        engine.publish_gauges = self.wrap("record", engine.publish_gauges)  # type: ignore[method-assign]

        def remove() -> None:
            setattr(engine_module, "validate_step", validate)  # noqa: B010
            for owner, name in (
                (engine.capacity, "reserve_step"),
                (runner, "_plan"),
                (runner, "_select"),
                (runner, "_greedy_output"),
                (engine, "_commit_inputs"),
                (engine, "_fill_results"),
                (recorder, "step"),
                (engine, "publish_gauges"),
            ):
                delattr(owner, name)  # the class's function shows through again

        return remove


@dataclass
class Sequences:
    """The open sequences of one batch size: cache ids, next input tokens and positions."""

    caches: list[str]
    tokens: list[int]
    positions: list[int]


def open_sequences(engine: Engine, count: int, vocab: int) -> Sequences:
    generator = torch.Generator().manual_seed(count)
    seqs = Sequences([], [], [])
    per_step = max(1, engine.limits.max_batch_tokens // PROMPT_TOKENS)
    for first in range(0, count, per_step):
        items = []
        for i in range(first, min(count, first + per_step)):
            prompt = torch.randint(0, vocab, (PROMPT_TOKENS,), generator=generator).tolist()
            items.append(
                StepItem(ItemKind.PREFILL_CHUNK, f"n{count}-r{i}", "", prompt, 0, PROMPT_TOKENS)
            )
        for result in engine.execute(Step(items), time.perf_counter_ns()).results:
            seqs.caches.append(result.cache_id)
            seqs.tokens.append(result.token_ids[0])
            seqs.positions.append(PROMPT_TOKENS)
    return seqs


def decode_step(
    engine: Engine, seqs: Sequences, clock: PhaseClock, wire: bool, continuation: bool = False
) -> tuple[float, int]:
    """One decode step of every sequence: its seconds from the request (serialized, with
    `wire`) to the answer, and the model's nanoseconds (the forward less the plan). With
    `continuation` each decode carries no token: it continues from the one its cache selected,
    as the reference scheduler's decodes do by default."""
    count = len(seqs.caches)
    tokens = [[] if continuation else [seqs.tokens[i]] for i in range(count)]
    if wire:
        planned = [
            PlannedItem(
                WireKind.DECODE,
                "",
                seqs.caches[i],
                tokens[i],
                seqs.positions[i],
                continuation=continuation,
            )
            for i in range(count)
        ]
        payload = pb.UnifiedBatchRequest(items=encode_items(planned)).SerializeToString()
        began = started = time.perf_counter()
        request = pb.UnifiedBatchRequest.FromString(payload)
        convert.check_batch_size(request.items, engine.limits)
        step = convert.step_from_pb(request.items, DeferralMode.PER_ITEM, 0)
        clock.seconds["wire"] += time.perf_counter() - started
    else:
        step = Step(
            [
                StepItem(
                    ItemKind.DECODE,
                    "",
                    seqs.caches[i],
                    tokens[i],
                    seqs.positions[i],
                    continuation=continuation,
                )
                for i in range(count)
            ]
        )
        began = time.perf_counter()
    plan_before = clock.seconds["plan"]
    outcome = engine.execute(step, time.perf_counter_ns())
    if wire:
        started = time.perf_counter()
        convert.unified_response(outcome).SerializeToString()
        clock.seconds["wire"] += time.perf_counter() - started
    seconds = time.perf_counter() - began
    for i, result in enumerate(outcome.results):
        seqs.tokens[i] = result.token_ids[0]
        seqs.positions[i] += 1
    model_ns = outcome.timings.forward_ns - round((clock.seconds["plan"] - plan_before) * 1e9)
    return seconds, model_ns


def measure(
    engine: Engine,
    seqs: Sequences,
    clock: PhaseClock,
    steps: int,
    wire: bool,
    continuation: bool = False,
) -> dict[str, float]:
    """Milliseconds per step of each phase (and the step itself) over `steps` decode steps."""
    clock.seconds.clear()
    model_ns, total = 0, 0.0
    for _ in range(steps):
        seconds, nanoseconds = decode_step(engine, seqs, clock, wire, continuation)
        total += seconds
        model_ns += nanoseconds
    clock.seconds["model"] = model_ns / 1e9
    timed = {phase: clock.seconds.get(phase, 0.0) for phase in PHASES if phase != "other"}
    timed["other"] = total - sum(timed.values())
    per_step = {phase: seconds * 1e3 / steps for phase, seconds in timed.items()}
    per_step["step"] = total * 1e3 / steps
    per_step["host"] = per_step["step"] - per_step["model"]
    return per_step


def run(args: argparse.Namespace) -> dict[int, dict[str, float]]:
    """Median milliseconds per step of every phase, by batch size."""
    batches = [int(b) for b in args.batches.split(",")]
    config = tiny_config(args.layers)
    # Room for the largest batch at its longest: the prompt, then every step's token.
    blocks = -(-(PROMPT_TOKENS + 3 + args.steps * args.rounds) // BLOCK_SIZE) * max(batches)
    token_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    with tempfile.TemporaryDirectory() as folder:
        # Built on a thread that ends here: a torch call on this thread would open an OpenMP
        # team beside the engine thread's, and libgomp then throttles every team's spin-waits.
        builder = threading.Thread(
            target=lambda: save_hf_folder(build_weights(config, seed=0), config, Path(folder))
        )
        builder.start()
        builder.join()
        engine = Engine(
            EngineConfig(
                model=folder,
                device=args.device,
                dtype=args.dtype,
                block_size=BLOCK_SIZE,
                kv_cache_bytes=(blocks + 64) * BLOCK_SIZE * token_bytes,
                max_batch_tokens=max(4096, max(batches)),
                max_batch_size=max(256, max(batches)),
            )
        )
    clock = PhaseClock()
    medians: dict[int, dict[str, float]] = {}

    def steps() -> None:
        engine.warmup(max(batches))
        remove = clock.install(engine)
        try:
            for batch in batches:
                seqs = open_sequences(engine, batch, config.vocab_size)
                # The first calls of a shape allocate (and the first decode of a sequence
                # carries its token: nothing selected one yet when its prompt's answer came).
                measure(engine, seqs, clock, 3, args.wire)
                rounds = [
                    measure(engine, seqs, clock, args.steps, args.wire, args.continuation)
                    for _ in range(args.rounds)
                ]
                medians[batch] = {
                    key: statistics.median(r[key] for r in rounds) for key in rounds[0]
                }
                engine.release_caches(seqs.caches)
        finally:
            remove()

    try:
        engine.call_sync(steps)  # on the engine thread, as a server runs its steps
    finally:
        engine.shutdown()
    return medians


def report(medians: dict[int, dict[str, float]], wire: bool) -> str:
    phases = [p for p in PHASES if wire or p != "wire"]
    header = "| items | step ms | host ms | host us/item | " + " | ".join(phases) + " |"
    lines = [header, "|" + "---|" * (4 + len(phases))]
    for batch, row in medians.items():
        cells = [f"{row[p]:.2f}" for p in phases]
        lines.append(
            f"| {batch} | {row['step']:.2f} | {row['host']:.2f} | "
            f"{row['host'] * 1e3 / batch:.1f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="64,256", help="decodes per step, comma-separated")
    parser.add_argument("--steps", type=int, default=30, help="decode steps per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="bfloat16 runs the native bfloat16 GEMM where the CPU has one",
    )
    parser.add_argument(
        "--wire", action="store_true", help="include the servicer's request and answer conversion"
    )
    parser.add_argument(
        "--continuation",
        action="store_true",
        help="decodes continue from the token their cache selected (the reference scheduler's "
        "default) instead of carrying it",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        parser.error(f"--batches takes comma-separated counts, got {args.batches!r}")
    if min([*batches, args.steps, args.rounds, args.layers]) < 1:
        parser.error("--batches, --steps, --rounds and --layers must be at least 1")
    medians = run(args)
    sys.stdout.write(report(medians, args.wire))
    return medians


if __name__ == "__main__":
    from ferrum_server import logs

    # As a served executor logs: info and up. At the default (debug) every cache open and
    # release writes a line, which the bench would time along with the step.
    logs.configure(level="info", stream=sys.stderr)
    main()
