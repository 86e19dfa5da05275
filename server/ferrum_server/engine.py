"""The single owner of torch state: model, KV pool, sampling.

Every method that touches state runs on one worker thread, in submission order, so the KV
manager needs no locks and a step always sees the state its predecessors left. RPC handlers
await `Engine.call`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from ferrum_kernels.backend import select_backend

from ferrum_server import faults, logs
from ferrum_server.capacity import CapacityManager, Decision
from ferrum_server.config import EngineConfig
from ferrum_server.cuda_graphs import (
    DecodeGraphLayout,
    DecodeGraphs,
    GraphCapturer,
    graph_batch_sizes,
    graph_capturer_for,
)
from ferrum_server.domain import (
    CapacityDeferral,
    DeferralMode,
    ItemFailure,
    ItemKind,
    ItemResult,
    ItemStatus,
    OutputPolicy,
    Shortfall,
    Step,
    StepItem,
    StepOutcome,
    Timings,
)
from ferrum_server.errors import DeviceOutOfMemory, ExecutionFailed, InvalidArgument
from ferrum_server.kv.epochs import KV_BLOCKS, SEQUENCE_SLOTS, SourceKey
from ferrum_server.kv.manager import Cache, KvManager, ReleaseResult
from ferrum_server.memory_plan import MemoryPlan, plan_memory
from ferrum_server.metrics import Metrics
from ferrum_server.models import ModelConfig, load_model
from ferrum_server.profiling import (
    ProfileShape,
    StartupProfile,
    device_free_bytes,
    device_total_bytes,
    device_used_bytes,
    model_bytes,
    profile_startup,
)
from ferrum_server.runner import ForwardOutput, ModelRunner
from ferrum_server.tickets import Ticket
from ferrum_server.validate import Limits, check_instance, validate_step

is_out_of_memory = faults.is_out_of_memory
_LOG = logs.get(__name__)

T = TypeVar("T")

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_DEFAULT_KV_BYTES = 256 * 1024**2

# proto enum values (kept numeric so the engine stays protobuf-free)
STAGE_SEQUENCE_EXTENSION = 1
STAGE_STEP_ADMISSION = 2
SHORTFALL_IMMEDIATE = 1
SHORTFALL_SEQUENCE_CEILING = 4
UNIT_BLOCKS = 1
UNIT_SEQUENCES = 2
RESOURCE_EXHAUSTED = 8  # gRPC status code number, for per-item failures
_OOM_MESSAGE = "device out of memory in the forward; nothing was committed"


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_time_ns: int = 0
    decode_time_ns: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    items: int = 0
    current_batch_size: int = 0
    graph_steps: int = 0  # decode steps replayed from a CUDA graph


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.instance_id = secrets.randbits(63) | 1
        self.device = torch.device(config.device)
        self.dtype = _TORCH_DTYPES[config.dtype]
        # Every torch call runs on this one thread, construction included: on CPU, an OpenMP
        # team opened by any second thread (the asyncio thread here) makes libgomp throttle
        # its spin-waits for all teams, which costs about a quarter of every forward.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ferrum-engine")
        try:
            self._thread.submit(self._build).result()
        except BaseException:
            self._thread.shutdown(wait=True)
            raise
        self.stats = EngineStats()
        self.metrics: Metrics | None = None
        # Releases, truncations and prefix publications move the gauges too.
        self.kv.clock.listeners.append(self.publish_gauges)
        self.warmed_up = False
        # None in production: set only when FERRUM_ENABLE_FAULT_INJECTION=1 (tests).
        self.faults = faults.from_environment()

    def _build(self) -> None:
        """Load the model and allocate the KV pool (on the engine thread)."""
        config = self.config
        if config.torch_threads:
            # Per thread under OpenMP: it must be set on the thread that runs the forwards.
            torch.set_num_threads(config.torch_threads)
        self.model, self.model_config = load_model(
            config.model, dtype=self.dtype, device=self.device
        )
        mc = self.model_config
        self.max_sequence_length = config.max_sequence_length or mc.max_position_embeddings
        if self.max_sequence_length > mc.max_position_embeddings:
            raise ValueError(
                f"max sequence length {self.max_sequence_length} exceeds the model's "
                f"{mc.max_position_embeddings} positions"
            )
        self.block_bytes = mc.kv_bytes_per_token(self.dtype) * config.block_size
        self.kernels = select_backend(self.device, config.kernel_backend)
        capturer = self._graph_capturer()
        graph_sizes = graph_batch_sizes(config.graph_max_batch) if capturer is not None else ()
        plan = self._plan_memory(capturer, graph_sizes)
        num_blocks = plan.num_blocks
        # Blocks past num_blocks (the graphs' scratch block) are never handed to a sequence.
        self.kv_cache = torch.zeros(
            (
                mc.num_layers,
                2,
                num_blocks + plan.reserved_blocks,
                config.block_size,
                mc.num_kv_heads,
                mc.head_dim,
            ),
            dtype=self.dtype,
            device=self.device,
        )
        self.kv = KvManager(
            num_blocks,
            config.block_size,
            config.max_batch_size,
            self.instance_id,
            prefix_caching=config.prefix_caching,
        )
        self.runner = ModelRunner(
            self.model,
            self.kv_cache,
            config.block_size,
            mc.vocab_size,
            self.device,
            self.kernels,
        )
        if capturer is not None:
            before = device_used_bytes(self.device)
            graphs = self._decode_graphs(capturer, self.kv_cache, num_blocks, graph_sizes)
            graphs.capture()
            self.runner.graphs = graphs
            plan = plan.with_cuda_graph_bytes(device_used_bytes(self.device) - before)
            if not plan.graphs_within_reservation:
                # The device keeps (1 - utilisation) spare, so this is a warning, not a failure.
                _LOG.warning(
                    "cuda_graphs_over_reservation",
                    measured_bytes=plan.cuda_graph_bytes,
                    reserved_bytes=plan.cuda_graph_reserved_bytes,
                )
        self.memory_plan: MemoryPlan = plan
        self.limits = Limits(
            vocab_size=mc.vocab_size,
            max_sequence_length=self.max_sequence_length,
            max_batch_tokens=config.max_batch_tokens,
            max_batch_size=config.max_batch_size,
            max_num_logprobs=config.max_num_logprobs,
            instance_id=self.instance_id,
            require_fencing=config.require_fencing,
        )
        self.capacity = CapacityManager(
            self.kv, self.kv_cache, self.limits, config.swap_space_bytes
        )

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        """Decode batch sizes replayed from CUDA graphs (empty when graphs are off)."""
        graphs = self.runner.graphs
        return graphs.batch_sizes if graphs is not None else ()

    def _graph_capturer(self) -> GraphCapturer | None:
        """How decode graphs get captured here, or None to run every step eagerly."""
        if not self.config.cuda_graphs:
            return None
        capturer = graph_capturer_for(self.device)
        if capturer is None:
            return None
        if self.kernels.decode_attention is None:
            _LOG.info(
                "cuda_graphs_off",
                reason=f"the {self.kernels.name} kernels have no graph-safe decode attention",
            )
            return None
        return capturer

    def _decode_graphs(
        self,
        capturer: GraphCapturer,
        kv_cache: torch.Tensor,
        scratch_block: int,
        sizes: tuple[int, ...],
    ) -> DecodeGraphs:
        layout = DecodeGraphLayout(
            block_size=self.config.block_size,
            max_blocks_per_sequence=math.ceil(self.max_sequence_length / self.config.block_size),
            scratch_block=scratch_block,
            batch_sizes=sizes,
        )
        return DecodeGraphs(self.model, kv_cache, layout, self.kernels, capturer)

    def _plan_memory(
        self, capturer: GraphCapturer | None, graph_sizes: tuple[int, ...]
    ) -> MemoryPlan:
        """Size the KV pool: on CUDA from measurements of the largest steps (see memory_plan)."""
        config = self.config
        reserved = 1 if capturer is not None else 0  # the graphs' scratch block
        common = {
            "total_bytes": device_total_bytes(self.device),
            "weights_bytes": model_bytes(self.model),
            "block_bytes": self.block_bytes,
            "reserved_blocks": reserved,
        }
        if self.device.type != "cuda":
            # Host memory: a fixed default pool that only has to fit beside the weights.
            return plan_memory(
                utilization=1.0,
                activation_peak_bytes=0,
                cuda_graph_bytes=0,
                requested_kv_bytes=config.kv_cache_bytes or _CPU_DEFAULT_KV_BYTES,
                **common,
            )
        profile = self._profile(capturer, graph_sizes)
        return plan_memory(
            utilization=config.gpu_memory_utilization,
            activation_peak_bytes=profile.activation_peak_bytes,
            cuda_graph_bytes=profile.cuda_graph_bytes,
            requested_kv_bytes=config.kv_cache_bytes,
            free_bytes=device_free_bytes(self.device),
            **common,
        )

    def _profile(
        self, capturer: GraphCapturer | None, graph_sizes: tuple[int, ...]
    ) -> StartupProfile:
        config = self.config
        shape = ProfileShape(
            block_size=config.block_size,
            max_batch_tokens=config.max_batch_tokens,
            max_batch_size=config.max_batch_size,
            max_sequence_length=self.max_sequence_length,
            max_num_logprobs=config.max_num_logprobs,
        )
        graphs = None
        if capturer is not None:

            def build(pool: torch.Tensor, scratch: int, sizes: tuple[int, ...]) -> DecodeGraphs:
                # A capturer (and memory pool) of its own, freed with the trial graphs.
                trial = graph_capturer_for(self.device)
                assert trial is not None
                return self._decode_graphs(trial, pool, scratch, sizes)

            graphs = (build, graph_sizes)
        return profile_startup(
            self.model,
            self.model_config,
            self.kernels,
            dtype=self.dtype,
            device=self.device,
            shape=shape,
            graphs=graphs,
        )

    def limit_responses(self, max_bytes: int) -> None:
        """Refuse steps whose results could not be sent in max_bytes (set by the server)."""
        self.limits = dataclasses.replace(self.limits, max_response_bytes=max_bytes)
        self.capacity.limits = self.limits

    @property
    def model_info(self) -> ModelConfig:
        return self.model_config

    # -- threading ------------------------------------------------------------------------

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run fn(*args) on the engine thread, after everything submitted before it."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, fn, *args)

    def call_sync(self, fn: Callable[..., T], *args: object) -> T:
        """Blocking form of `call`, for callers outside an event loop (tools, tests)."""
        return self._thread.submit(fn, *args).result()

    async def run(
        self,
        ticket: Ticket[T],
        fn: Callable[..., T],
        *args: object,
        on_orphan: Callable[[T], object] | None = None,
    ) -> T:
        """Like `call`, but dropped unstarted when the ticket's callers are gone, and
        on_orphan(result) runs on the engine thread when they left while it ran."""
        ticket.on_orphan = on_orphan
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._thread, ticket.execute, fn, args)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True, cancel_futures=True)

    # -- steps ----------------------------------------------------------------------------

    def execute(self, step: Step, submitted_ns: int = 0) -> StepOutcome:
        started = time.perf_counter_ns()
        sequences = validate_step(step, self.kv, self.limits)
        held = [len(seq.block_ids) if seq is not None else 0 for seq in sequences]
        deferrals = self._reserve(step, sequences)
        runnable = [i for i in range(len(step.items)) if i not in deferrals]
        results: list[ItemResult | None] = [None] * len(step.items)
        for index, deferral in deferrals.items():
            seq = sequences[index]
            results[index] = ItemResult(
                status=ItemStatus.DEFERRED,
                cache_id=step.items[index].cache_id,
                committed_tokens=seq.num_tokens if seq else 0,
                deferral=deferral,
            )
        ran_items: list[StepItem] = []
        ran_seqs: list[Cache | None] = []
        forward_ns = sample_ns = 0
        graphed = False
        if runnable:
            groups, failed = self._forward(step, sequences, runnable, held)
            for indices, forward in groups:
                items = [step.items[i] for i in indices]
                seqs: list[Cache] = [sequences[i] for i in indices]  # type: ignore[misc]
                self._commit(items, seqs, indices, forward, results)
                self._count(items, forward)
                ran_items += items
                ran_seqs += seqs
                forward_ns += forward.forward_ns
                sample_ns += forward.sample_ns
                graphed = graphed or forward.graphed
            for index in failed:
                seq = sequences[index]
                results[index] = ItemResult(
                    status=ItemStatus.FAILED,
                    cache_id=step.items[index].cache_id,
                    committed_tokens=seq.num_tokens if seq else 0,
                    failure=ItemFailure(
                        RESOURCE_EXHAUSTED, _OOM_MESSAGE, step.items[index].request_id
                    ),
                )
        if self.metrics is not None:
            total = ForwardOutput(None, [], {}, forward_ns, sample_ns, graphed)
            self._observe(step, deferrals, ran_items, ran_seqs, total)
        finished = time.perf_counter_ns()
        timings = Timings(
            queue_ns=max(0, started - submitted_ns) if submitted_ns else 0,
            forward_ns=forward_ns,
            sample_ns=sample_ns,
            total_ns=finished - started,
        )
        return StepOutcome(results=[r for r in results if r is not None], timings=timings)

    def _forward(
        self, step: Step, sequences: list[Cache | None], runnable: list[int], held: list[int]
    ) -> tuple[list[tuple[list[int], ForwardOutput]], list[int]]:
        """Run the runnable items; return (item groups that ran, items that ran out of memory).

        Nothing is committed here, so a failure leaves committed KV as it was: the failed
        items' caches give back the blocks reserved for this step, and caches they opened are
        released.
        """
        try:
            groups, failed = self._isolate(step, sequences, runnable)
        except Exception as exc:
            self._undo(step, sequences, runnable, held)
            if is_out_of_memory(exc):
                raise DeviceOutOfMemory(_OOM_MESSAGE) from exc
            raise ExecutionFailed("the forward pass failed") from exc
        self._undo(step, sequences, failed, held)
        return groups, failed

    def _isolate(
        self, step: Step, sequences: list[Cache | None], indices: list[int]
    ) -> tuple[list[tuple[list[int], ForwardOutput]], list[int]]:
        """One forward of `indices`; on device OOM in a per-item step, bisect so that only the
        items that cannot run fail and the others still complete."""
        items = [step.items[i] for i in indices]
        try:
            if self.faults is not None:
                self.faults.before_forward([item.request_id for item in items])
            forward = self.runner.run(items, [sequences[i] for i in indices])  # type: ignore[misc]
            return [(indices, forward)], []
        except Exception as exc:
            if not is_out_of_memory(exc) or step.mode == DeferralMode.ALL_OR_NOTHING:
                raise
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if len(indices) == 1:
                return [], indices
        middle = len(indices) // 2
        first_ran, first_failed = self._isolate(step, sequences, indices[:middle])
        second_ran, second_failed = self._isolate(step, sequences, indices[middle:])
        return first_ran + second_ran, first_failed + second_failed

    def _undo(
        self, step: Step, sequences: list[Cache | None], indices: list[int], held: list[int]
    ) -> None:
        for index in indices:
            seq = sequences[index]
            if seq is None:
                continue
            if not step.items[index].cache_id:
                self.kv.release(seq.cache_id)
            else:
                self.kv.unreserve(seq, held[index])

    def release_opened(self, step: Step, outcome: StepOutcome) -> None:
        """Release the caches a step opened (its caller went away and will never learn them)."""
        for item, result in zip(step.items, outcome.results, strict=True):
            if not item.cache_id and result.cache_id in self.kv.caches:
                self.kv.release(result.cache_id)

    def release_caches(self, cache_ids: list[str]) -> int:
        """Release the live caches among cache_ids; return how many were live."""
        live = [c for c in dict.fromkeys(cache_ids) if c in self.kv.caches]
        for cache_id in live:
            self.kv.release(cache_id)
        return len(live)

    def _reserve(self, step: Step, sequences: list[Cache | None]) -> dict[int, CapacityDeferral]:
        """Take the blocks every runnable item needs; return deferrals for the others."""
        kv = self.kv
        free_blocks = kv.pool.num_available
        free_slots = kv.num_free_sequence_slots
        plan: list[tuple[int, int]] = []  # (item index, blocks needed)
        deferrals: dict[int, CapacityDeferral] = {}
        for index, (item, seq) in enumerate(zip(step.items, sequences, strict=True)):
            needed = kv.blocks_needed(seq, item.end)
            opens = seq is None
            if opens and free_slots < 1:
                deferrals[index] = self._slots_deferral(index, item.request_id)
            elif needed > free_blocks:
                stage = STAGE_STEP_ADMISSION if opens else STAGE_SEQUENCE_EXTENSION
                deferrals[index] = self._blocks_deferral(
                    index, item.request_id, stage, needed, free_blocks, item, seq
                )
            else:
                plan.append((index, needed))
                free_blocks -= needed
                free_slots -= int(opens)
        if deferrals and step.mode == DeferralMode.ALL_OR_NOTHING:
            first = min(deferrals)
            return {i: deferrals[first] for i in range(len(step.items))}
        for index, _ in plan:
            item = step.items[index]
            seq = sequences[index]
            if seq is None:
                max_tokens = item.max_sequence_tokens or self.max_sequence_length
                seq = kv.open(item.request_id, max_tokens)
                sequences[index] = seq
            kv.grow(seq, item.end)
        return deferrals

    def _slots_deferral(self, index: int, request_id: str) -> CapacityDeferral:
        """No sequence slot is free for a new cache."""
        ceiling = self.kv.max_sequences
        shortfall = Shortfall(SHORTFALL_SEQUENCE_CEILING, UNIT_SEQUENCES, 1, 0, ceiling, ceiling)
        return self._capacity_deferral(
            index, request_id, STAGE_STEP_ADMISSION, shortfall, {SEQUENCE_SLOTS}
        )

    def _blocks_deferral(
        self,
        index: int,
        request_id: str,
        stage: int,
        requested: int,
        free_blocks: int,
        chunk: StepItem | None,
        seq: Cache | None,
    ) -> CapacityDeferral:
        """Not enough KV blocks; for a prefill chunk, hint a narrower width that fits now."""
        total = self.kv.pool.num_blocks
        shortfall = Shortfall(
            SHORTFALL_IMMEDIATE, UNIT_BLOCKS, requested, free_blocks, total, total
        )
        narrower = 0
        if chunk is not None and chunk.kind == ItemKind.PREFILL_CHUNK:
            count = len(chunk.token_ids)
            held = len(seq.block_ids) if seq else 0
            fits = (held + free_blocks) * self.kv.block_size - chunk.position
            if count > 1 and fits >= 1:
                # Shrink by at least a quarter each time, like the contract's narrowing rule.
                narrower = min(fits, count - -(-count // 4))
        return self._capacity_deferral(index, request_id, stage, shortfall, {KV_BLOCKS}, narrower)

    def _capacity_deferral(
        self,
        index: int,
        request_id: str,
        stage: int,
        shortfall: Shortfall,
        sources: set[SourceKey],
        narrower: int = 0,
    ) -> CapacityDeferral:
        return CapacityDeferral(
            item_index=index,
            request_id=request_id,
            stage=stage,
            shortfall=shortfall,
            epochs=self.kv.clock.snapshot(),
            observed=self.kv.clock.observed(sources),
            narrower_prefill_tokens=narrower,
        )

    def _commit(
        self,
        items: list[StepItem],
        sequences: list[Cache],
        indices: list[int],
        forward: ForwardOutput,
        results: list[ItemResult | None],
    ) -> None:
        sampled = forward.sampled
        token_ids: list[int] = sampled.token_ids.tolist() if sampled is not None else []
        logprobs: list[float] = sampled.logprobs.tolist() if sampled is not None else []
        top_ids: list[list[int]] = sampled.top_ids.tolist() if sampled is not None else []
        top_lps: list[list[float]] = sampled.top_logprobs.tolist() if sampled is not None else []
        position_of_row = {row: k for k, row in enumerate(forward.token_rows)}
        row = 0
        for index, item, seq in zip(indices, items, sequences, strict=True):
            self.kv.commit(seq, item.token_ids)
            result = ItemResult(
                status=ItemStatus.INTERMEDIATE,
                cache_id=seq.cache_id,
                committed_tokens=seq.num_tokens,
            )
            if item.num_outputs:
                if item.sampling.policy == OutputPolicy.LOGITS:
                    result.status = ItemStatus.LOGITS
                    result.logits = b"".join(
                        forward.logits_rows[r] for r in range(row, row + item.num_outputs)
                    )
                else:
                    result.status = ItemStatus.TOKEN
                    for r in range(row, row + item.num_outputs):
                        k = position_of_row[r]
                        result.token_ids.append(token_ids[k])
                        result.logprobs.append(logprobs[k])
                        num_top = item.sampling.num_logprobs
                        result.top_ids.append(top_ids[k][:num_top])
                        result.top_logprobs.append(top_lps[k][:num_top])
                row += item.num_outputs
            results[index] = result

    def _count(self, items: list[StepItem], forward: ForwardOutput) -> None:
        stats = self.stats
        stats.steps += 1
        stats.items += len(items)
        elapsed = forward.forward_ns + forward.sample_ns
        prefill = sum(len(i.token_ids) for i in items if i.kind != ItemKind.DECODE)
        stats.prefill_tokens += prefill
        stats.decode_tokens += sum(1 for i in items if i.kind == ItemKind.DECODE)
        if prefill:
            stats.prefill_steps += 1
            stats.prefill_time_ns += elapsed
        else:
            stats.decode_steps += 1
            stats.decode_time_ns += elapsed
        stats.graph_steps += int(forward.graphed)

    def _observe(
        self,
        step: Step,
        deferrals: dict[int, CapacityDeferral],
        items: list[StepItem],
        sequences: list[Cache | None],
        forward: ForwardOutput,
    ) -> None:
        metrics = self.metrics
        assert metrics is not None
        for deferral in deferrals.values():
            metrics.record_deferral(
                "sequence_slots" if deferral.shortfall.unit == UNIT_SEQUENCES else "kv_blocks"
            )
        if items:
            prefill = sum(len(i.token_ids) for i in items if i.kind == ItemKind.PREFILL_CHUNK)
            decode = sum(1 for i in items if i.kind == ItemKind.DECODE)
            verify = sum(len(i.token_ids) for i in items if i.kind == ItemKind.VERIFY)
            kind = "mixed" if prefill and (decode or verify) else "prefill" if prefill else "decode"
            metrics.record_step(
                kind,
                len(items),
                prefill + decode + verify,
                prefill,
                decode,
                verify,
                (forward.forward_ns + forward.sample_ns) / 1e9,
            )
            if forward.graphed:
                metrics.record_cuda_graph_replay()
            now = time.monotonic()
            for item, seq in zip(items, sequences, strict=True):
                if seq is None or not item.num_outputs:
                    continue
                if seq.last_token_s:
                    metrics.observe_itl(now - seq.last_token_s)
                else:
                    metrics.observe_ttft(now - seq.opened_s)
                seq.last_token_s = now
        self.publish_gauges()

    def publish_gauges(self) -> None:
        """Refresh the KV and sequence gauges (engine thread)."""
        if self.metrics is None:
            return
        pool = self.kv.pool
        self.metrics.set_kv(pool.num_blocks, pool.num_used, pool.num_cached)
        waiting = sum(1 for s in self.kv.caches.values() if s.pending_admission)
        self.metrics.set_sequences(len(self.kv.caches) - waiting, waiting)
        self.metrics.update_device_memory()

    # -- cache operations -----------------------------------------------------------------

    def release(self, cache_id: str, instance_id: int = 0) -> ReleaseResult:
        check_instance(instance_id, self.limits)
        return self.kv.release(cache_id)

    def complete(self, request_id: str, cache_id: str, instance_id: int = 0) -> ReleaseResult:
        check_instance(instance_id, self.limits)
        if not cache_id:
            raise InvalidArgument("cache_id is required")
        seq = self.kv.caches.get(cache_id)
        if seq is not None and request_id and seq.request_id != request_id:
            raise InvalidArgument(f"cache {cache_id!r} belongs to another request")
        return self.kv.release(cache_id)

    def truncate(self, cache_id: str, new_length: int, instance_id: int = 0) -> tuple[Cache, int]:
        check_instance(instance_id, self.limits)
        seq = self.kv.lookup(cache_id)
        if new_length > seq.num_tokens:
            raise InvalidArgument(
                f"cannot truncate cache {cache_id!r} of {seq.num_tokens} tokens to {new_length}"
            )
        released, copies = self.kv.truncate(seq, new_length)
        for source, target in copies:
            self.kv_cache[:, :, target].copy_(self.kv_cache[:, :, source])
        return seq, released

    def try_admit(self, *args: Any) -> Decision:
        """CapacityManager.try_admit, then refresh the gauges (an admission holds blocks)."""
        decision = self.capacity.try_admit(*args)
        self.publish_gauges()
        return decision

    def release_all(self) -> int:
        """Release every cache (drain); return how many were live."""
        cache_ids = list(self.kv.caches)
        for cache_id in cache_ids:
            self.kv.release(cache_id)
        return len(cache_ids)

    def heartbeat(self) -> float:
        """A no-op on the engine thread: answering proves the thread is not stuck."""
        return time.monotonic()

    def warmup(self, num_tokens: int = 0) -> tuple[int, float]:
        """Run one real forward of num_tokens prompt tokens through a scratch cache."""
        count = min(
            num_tokens or self.config.max_batch_tokens,
            self.max_sequence_length,
            self.kv.pool.num_blocks * self.kv.block_size,
        )
        generator = torch.Generator().manual_seed(self.config.seed)
        tokens = torch.randint(0, self.model_config.vocab_size, (count,), generator=generator)
        item = StepItem(ItemKind.PREFILL_CHUNK, "warmup", "", tokens.tolist(), 0, count)
        started = time.perf_counter()
        outcome = self.execute(Step([item], DeferralMode.ALL_OR_NOTHING, self.instance_id))
        elapsed_ms = (time.perf_counter() - started) * 1e3
        result = outcome.results[0]
        if result.status == ItemStatus.DEFERRED:
            raise RuntimeError("warmup could not get KV blocks")
        self.kv.release(result.cache_id)
        self.warmed_up = True
        return count, elapsed_ms

    def reserve_slots(
        self, requests: list[tuple[str, str, int, int]], instance_id: int = 0
    ) -> SlotReservation | CapacityDeferral:
        """Make (cache_id, request_id, target_len, admission_len) writable, all or nothing.

        An empty cache_id opens a new cache. admission_len is a fit check only: it must fit in
        the pool's free blocks but is never allocated.
        """
        check_instance(instance_id, self.limits)
        kv = self.kv
        seen: set[str] = set()
        sequences: list[Cache | None] = []
        for index, (cache_id, request_id, target, admission) in enumerate(requests):
            if target == 0 or target > self.max_sequence_length:
                raise InvalidArgument(
                    f"item {index}: target_len {target} outside [1, {self.max_sequence_length}]"
                )
            if admission > self.max_sequence_length:
                raise InvalidArgument(f"item {index}: admission_target_len {admission} too long")
            seq = None
            if cache_id:
                if cache_id in seen:
                    raise InvalidArgument(f"item {index}: cache {cache_id!r} appears twice")
                seen.add(cache_id)
                seq = kv.lookup(cache_id)
                if request_id and seq.request_id != request_id:
                    raise InvalidArgument(f"item {index}: cache belongs to another request")
                if target < seq.num_tokens:
                    raise InvalidArgument(f"item {index}: target_len below committed length")
            sequences.append(seq)
        free_before = kv.pool.num_available
        free, slots = free_before, kv.num_free_sequence_slots
        for index, ((_, request_id, target, admission), seq) in enumerate(
            zip(requests, sequences, strict=True)
        ):
            if seq is None and slots < 1:
                return self._slots_deferral(index, request_id)
            needed = kv.blocks_needed(seq, target)
            fit = max(needed, kv.blocks_needed(seq, max(admission, target)))
            if fit > free:
                return self._blocks_deferral(
                    index, request_id, STAGE_SEQUENCE_EXTENSION, fit, free, None, seq
                )
            free -= needed
            slots -= int(seq is None)
        allocations: list[tuple[str, int, int]] = []
        for (_, request_id, target, _), seq in zip(requests, sequences, strict=True):
            if seq is None:
                seq = kv.open(request_id, self.max_sequence_length)
            before = len(seq.block_ids)
            kv.grow(seq, target)
            allocations.append((seq.cache_id, before, len(seq.block_ids)))
        return SlotReservation(
            block_size=kv.block_size,
            total_blocks=kv.pool.num_blocks,
            free_blocks_before=free_before,
            free_blocks_after=kv.pool.num_available,
            allocations=allocations,
        )


@dataclass(frozen=True, slots=True)
class SlotReservation:
    block_size: int
    total_blocks: int
    free_blocks_before: int
    free_blocks_after: int
    allocations: list[tuple[str, int, int]]  # (cache id, blocks before, blocks after)
