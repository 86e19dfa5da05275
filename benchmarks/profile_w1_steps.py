"""Where a W1 step's time goes: torch.profiler over in-process steps of the W1 model.

Builds (or reuses) the W1 weights, prefills 64 prompts of 256 tokens in steps of two, then
profiles prefill steps (2 x 256 tokens from position 0) and decode steps (64 decodes), and
prints each kind's wall time per step and the ops taking the most self time. Run it alone on a
quiet machine. The steps run on the engine thread, as in a server (see ``steps`` in ``main``).

The native kernels and the packed GEMMs are not torch ops, so torch.profiler cannot see them.
With ``--kernels`` the steps are timed per call of each native kernel and of each packed linear
(by its N x K) instead, and whatever no call claims (torch ops, Python) is printed as the rest.
Steps then run each layer's own native calls (the model's one-call ``decode_layers`` and
``prefill_layers`` are set aside: their kernels, the same ones, would be out of the clock's
sight).

``--fold-ab`` instead times decode steps with the LM head folding the greedy choice (the
default for plain greedy steps) against the same steps sampling written logits (the model's
``greedy_tokens`` answering None), in alternate pairs of steps, and prints each one's median.
``--layers-ab`` does the same for the model's layers in one native call (``decode_layers``, the
default) against each layer's own calls, and ``--prefill-ab`` for prompt steps (2 x 256 tokens
from position 0, their caches released after each) with every layer but the last in one native
call (``prefill_layers``, the default) against each layer's own calls. Under ``--kernels`` both
kinds of step run layer by layer.

    python benchmarks/profile_w1_steps.py [--dtype float32] [--reps 3] [--top 12] [--kernels]
        [--fold-ab] [--layers-ab] [--prefill-ab]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
from ferrum_kernels import cpu_linear, native
from ferrum_server.config import EngineConfig
from ferrum_server.domain import ItemKind, Step, StepItem
from ferrum_server.engine import Engine
from ferrum_server.models.llama import LlamaForCausalLM
from ferrum_server.tools.bench.runners import minor_faults
from ferrum_server.tools.bench.workloads import WORKLOADS, ensure_model
from torch.profiler import ProfilerActivity, profile

PROMPTS, PROMPT_TOKENS = 64, 256


class KernelClock:
    """Wall time and calls per native kernel and per packed linear shape, taken by wrapping
    ``native.load()``'s functions, ``PackedWeight.__call__``, ``PackedWeight.swiglu`` (the
    gate/up GEMM with its SwiGLU: "+ SwiGLU") and ``PackedWeight.widened`` (an LM head's GEMM
    storing float32: "-> float32"); ``install``, and ``remove`` puts them back. The native
    GEMM's entry points that a layer may call directly (``packed_gemm``, and
    ``packed_gemm_halves``: the native decode layer's linears) are timed under the same names
    ("linear N x K", "+ SwiGLU") when no clocked PackedWeight method is calling them, so a
    decode step's GEMMs are not left in the rest and a linear is never counted twice."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.calls: defaultdict[str, int] = defaultdict(int)
        self._depth = 0  # clocked calls in progress (a linear's GEMM is not counted again)
        self._load = native.load
        self._linear = cpu_linear.PackedWeight.__call__
        self._swiglu = cpu_linear.PackedWeight.swiglu
        self._widened = cpu_linear.PackedWeight.widened
        self._greedy = cpu_linear.PackedWeight.greedy

    def timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                self.seconds[name] += time.perf_counter() - started
                self.calls[name] += 1

        return call

    def _timed_gemm(self, fn: Callable[..., Any], halves: bool) -> Callable[..., Any]:
        """A native GEMM entry point (x, packed, bias, n[, swiglu]) timed as "linear N x K"
        (plus " + SwiGLU" for a fused gate/up) unless a clocked call is already timing it."""

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            x, n = args[0], args[3]
            swiglu = halves and len(args) > 4 and bool(args[4])
            name = f"linear {n} x {x.shape[-1]}" + (" + SwiGLU" if swiglu else "")
            return self.timed(name, fn)(*args, **kwargs)

        return call

    def install(self) -> None:
        module = self._load()
        if module is not None:
            wrapped = SimpleNamespace(
                **{
                    name: getattr(module, name)
                    if name.startswith(("pack", "gemm"))
                    else self.timed(name, getattr(module, name))
                    for name in dir(module)
                    if not name.startswith("_") and callable(getattr(module, name))
                }
            )
            for name, halves in (("packed_gemm", False), ("packed_gemm_halves", True)):
                if hasattr(module, name):
                    setattr(wrapped, name, self._timed_gemm(getattr(module, name), halves))
            native.load = lambda: wrapped
        packed = cpu_linear.PackedWeight
        packed.__call__ = self._timed_method(self._linear, "")  # type: ignore[method-assign]
        packed.swiglu = self._timed_method(self._swiglu, " + SwiGLU")  # type: ignore[method-assign]
        packed.widened = self._timed_method(self._widened, " -> float32")  # type: ignore[method-assign]
        packed.greedy = self._timed_method(self._greedy, " -> greedy")  # type: ignore[method-assign]

    def _timed_method(
        self, method: Callable[..., Any], suffix: str
    ) -> Callable[[cpu_linear.PackedWeight, torch.Tensor], Any]:
        """A PackedWeight method timed under "linear N x K" plus `suffix`."""

        def call(pack: cpu_linear.PackedWeight, x: torch.Tensor) -> Any:
            name = f"linear {pack.out_features} x {pack.in_features}{suffix}"
            return self.timed(name, method)(pack, x)

        return call

    def remove(self) -> None:
        native.load = self._load
        cpu_linear.PackedWeight.__call__ = self._linear  # type: ignore[method-assign]
        cpu_linear.PackedWeight.swiglu = self._swiglu  # type: ignore[method-assign]
        cpu_linear.PackedWeight.widened = self._widened  # type: ignore[method-assign]
        cpu_linear.PackedWeight.greedy = self._greedy  # type: ignore[method-assign]

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def report(self, label: str, wall_ms: float, reps: int, faults: float) -> str:
        lines = [f"== {label}: {wall_ms:.1f} ms per step, {faults:.0f} minor page faults"]
        claimed = 0.0
        for name, seconds in sorted(self.seconds.items(), key=lambda kv: -kv[1]):
            ms = seconds * 1e3 / reps
            claimed += ms
            lines.append(f"  {ms:8.1f} ms  {self.calls[name] // reps:4d} calls  {name}")
        lines.append(f"  {wall_ms - claimed:8.1f} ms  the rest (torch ops, Python)")
        return "\n".join(lines) + "\n"


def _clock_steps(
    clock: KernelClock, label: str, fn: Callable[[], None], reps: int, top: int
) -> None:
    del top  # every kernel is listed
    fn()  # the first call of a shape may allocate
    clock.reset()
    faults = minor_faults()
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    wall_ms = (time.perf_counter() - started) * 1e3 / reps
    sys.stdout.write(clock.report(label, wall_ms, reps, (minor_faults() - faults) / reps))


def _profile(label: str, fn: Callable[[], None], reps: int, top: int) -> None:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        faults = minor_faults()
        started = time.perf_counter()
        for _ in range(reps):
            fn()
        wall_ms = (time.perf_counter() - started) * 1e3 / reps
        faults_per_step = (minor_faults() - faults) / reps
    by_op: defaultdict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        by_op[event.key] += event.self_cpu_time_total / 1e3 / reps
    lines = [f"== {label}: {wall_ms:.1f} ms per step, {faults_per_step:.0f} minor page faults"]
    for name, ms in sorted(by_op.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {ms:8.1f} ms  {name}")
    sys.stdout.write("\n".join(lines) + "\n")


def _no_fold(model: LlamaForCausalLM, hidden: torch.Tensor) -> None:
    """greedy_tokens declining: the runner samples the logits instead."""
    del model, hidden


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument(
        "--kernels", action="store_true", help="time each native kernel and packed linear"
    )
    parser.add_argument(
        "--fold-ab",
        action="store_true",
        help="decode steps with the LM head folding the greedy choice against sampling logits",
    )
    parser.add_argument(
        "--layers-ab",
        action="store_true",
        help="decode steps with the layers in one native call against each layer's own calls",
    )
    parser.add_argument(
        "--prefill-ab",
        action="store_true",
        help="prompt steps with the layers but the last in one native call against each "
        "layer's own calls",
    )
    args = parser.parse_args()
    clock = KernelClock() if args.kernels else None
    measure = _profile if clock is None else partial(_clock_steps, clock)
    folder = ensure_model(WORKLOADS["w1"])
    engine = Engine(
        EngineConfig(
            model=str(folder),
            dtype=args.dtype,
            kv_cache_bytes=1 << 30,
            max_batch_tokens=1024,
            max_batch_size=256,
        )
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(32000) for _ in range(PROMPT_TOKENS)] for _ in range(PROMPTS)]
    caches: list[str] = []
    last: list[int] = []
    position: list[int] = []

    def prefill() -> None:
        first = len(caches)
        items = [
            StepItem(ItemKind.PREFILL_CHUNK, f"r{i}", "", prompts[i], 0, PROMPT_TOKENS)
            for i in (first, first + 1)
        ]
        for result in engine.execute(Step(items), time.perf_counter_ns()).results:
            caches.append(result.cache_id)
            last.append(result.token_ids[0])
            position.append(PROMPT_TOKENS)

    def decode() -> None:
        items = [
            StepItem(ItemKind.DECODE, f"r{i}", caches[i], [last[i]], position[i])
            for i in range(len(caches))
        ]
        for i, result in enumerate(engine.execute(Step(items), time.perf_counter_ns()).results):
            last[i] = result.token_ids[0]
            position[i] += 1

    def prompt_step() -> None:
        """A prefill step as `prefill` runs one, its caches released after it."""
        items = [
            StepItem(ItemKind.PREFILL_CHUNK, f"p{i}", "", prompts[i], 0, PROMPT_TOKENS)
            for i in (0, 1)
        ]
        results = engine.execute(Step(items), time.perf_counter_ns()).results
        engine.release_caches([result.cache_id for result in results])

    def alternate(
        label: str,
        ways: dict[str, Callable[[], None]],
        step: Callable[[], None] = decode,
        kind: str = f"decode step, {PROMPTS} decodes",
    ) -> None:
        # Pairs of steps each way (`ways`: name -> what sets it up), alternating, so drift in
        # the machine's speed falls on all alike.
        times: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(args.reps):
            for way, setup in ways.items():
                setup()
                for _ in range(2):
                    started = time.perf_counter()
                    step()
                    times[way].append((time.perf_counter() - started) * 1e3)
        for way, ms in times.items():
            sys.stdout.write(
                f"== {kind}, {label} {way}: {statistics.median(ms):.2f} ms median of {len(ms)}\n"
            )

    def fold_ab() -> None:
        fold = LlamaForCausalLM.greedy_tokens

        def use(greedy: Callable[..., Any]) -> Callable[[], None]:
            def setup() -> None:
                LlamaForCausalLM.greedy_tokens = greedy  # type: ignore[method-assign]

            return setup

        try:
            alternate("greedy choice", {"folded": use(fold), "logits": use(_no_fold)})
        finally:
            LlamaForCausalLM.greedy_tokens = fold  # type: ignore[method-assign]

    def one_call_ab(
        attribute: str, what: str, label: str, step: Callable[[], None], kind: str
    ) -> None:
        """`step` with the model's one-call path `attribute` (decode_layers, prefill_layers)
        in use against each layer's own calls, alternating (see `alternate`)."""
        model = engine.model
        fused = getattr(model, attribute)
        if fused is None:
            sys.stdout.write(f"no one-call {what} layers for this model here\n")
            return

        def use(fn: Any) -> Callable[[], None]:
            def setup() -> None:
                setattr(model, attribute, fn)

            return setup

        step()  # the first step of the shape may allocate
        try:
            alternate(label, {"in one call": use(fused), "one by one": use(None)}, step, kind)
        finally:
            setattr(model, attribute, fused)

    def steps() -> None:
        engine.warmup(64)
        if args.prefill_ab:
            one_call_ab(
                "prefill_layers",
                "prompt",
                "layers but the last",
                prompt_step,
                f"prefill step, 2 x {PROMPT_TOKENS} tokens",
            )
        if args.fold_ab or args.layers_ab:
            while len(caches) < PROMPTS:
                prefill()
            decode()  # the first decode step of the shape may allocate
            if args.fold_ab:
                fold_ab()
            if args.layers_ab:
                one_call_ab(
                    "decode_layers", "decode", "layers", decode, f"decode step, {PROMPTS} decodes"
                )
            return
        if args.prefill_ab:
            return
        if clock is not None:
            # Each layer's own calls, so the clock sees every kernel of a step (the one-call
            # paths run the same kernels from C++, out of the clock's sight).
            engine.model.decode_layers = None
            engine.model.prefill_layers = None
            sys.stdout.write("(every step: the layers one by one, not in one native call)\n")
            clock.install()
        measure("prefill step, 2 x 256 tokens from position 0", prefill, args.reps, args.top)
        while len(caches) < PROMPTS:
            prefill()
        measure(f"decode step, {PROMPTS} decodes at ~256 context", decode, args.reps, args.top)

    try:
        # Everything on the engine thread, as a server runs it: torch.profiler records only
        # the thread it runs on, and a torch call on this thread would open a second OpenMP
        # team, after which libgomp throttles every team's spin-waits (each parallel region
        # then pays a futex wake, which doubled the short kernels after each GEMM).
        engine.call_sync(steps)
    finally:
        if clock is not None:
            clock.remove()
        engine.shutdown()


if __name__ == "__main__":
    main()
