"""The single owner of torch state: model, KV pool, sampling.

Every method that touches state runs on one worker thread, so the KV manager needs no locks
and a step always sees the state its predecessors left. RPC handlers await `Engine.call` (in
submission order) or `Engine.run` with the caller's ticket (in fair turns between callers, each
caller's work in its order; see fair_queue.py).

The engine owns the thread and `execute`; the rest is delegated: start-up to
`startup.build_parts`, "does it fit" to `capacity`, the forward to `runner`, accounting to the
`recorder` it is given. docs/architecture.md follows one step through them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar, cast

import torch
from ferrum_kernels.sampling import SampleOutput

from ferrum_server import faults, host_memory, logs
from ferrum_server.capacity import (
    AdmissionProbe,
    Admitted,
    CapacityManager,
    Decision,
    Deferred,
    PreemptionMode,
    PreemptionReceipt,
    admission_batch_tokens,
)
from ferrum_server.config import EngineConfig
from ferrum_server.device_tokens import DeviceToken
from ferrum_server.domain import (
    CapacityDeferral,
    Completion,
    CompletionOutcome,
    CompletionWork,
    DeferralMode,
    DeferralStage,
    ItemFailure,
    ItemKind,
    ItemResult,
    ItemStatus,
    OutputPolicy,
    RequestOrigin,
    Step,
    StepItem,
    StepOutcome,
    Timings,
    WarmupOutcome,
)
from ferrum_server.errors import (
    DRAINING_NEW_WORK,
    DeviceOutOfMemory,
    Draining,
    ExecutionFailed,
    ExecutorError,
    ExecutorFaulted,
    InvalidArgument,
    Unavailable,
)
from ferrum_server.execution_events import (
    CacheCompleted,
    CachePreempted,
    CacheReleased,
    ExecutionEvents,
    StepCompleted,
)
from ferrum_server.fair_queue import FairQueue, Job
from ferrum_server.kv.epochs import Epochs, SourceKey
from ferrum_server.kv.manager import Cache, ReleaseResult, Retirement
from ferrum_server.kv.storage import KvStorage
from ferrum_server.models import ModelConfig
from ferrum_server.parallel.launch import FOLLOWER_EXIT_S, leave_group, open_group
from ferrum_server.parallel.plan import PlanSender
from ferrum_server.recorder import Recorder
from ferrum_server.runner import ForwardOutput
from ferrum_server.startup import BuiltParts, build_parts, check_split
from ferrum_server.tickets import Ticket
from ferrum_server.validate import Validated, check_instance, validate_step

is_out_of_memory = faults.is_out_of_memory
_LOG = logs.get(__name__)

T = TypeVar("T")

_OOM_MESSAGE = "device out of memory in the forward; nothing was committed"


@dataclasses.dataclass(slots=True, eq=False)
class LaunchedStep:
    """A step whose forward is launched (`Engine.launch`): its input tokens are committed, its
    outputs are on their way to the host, and `Engine.finish` answers it."""

    step: Step  # as it ran: continuation tokens filled in, narrowed chunks cut
    caches: list[Cache | None]
    results: list[ItemResult | None]  # filled at launch for the items that did not run
    groups: list[tuple[list[int], ForwardOutput]]  # item indices and the forward they ran in
    host: list[SampleOutput | None]  # per group: its sampled outputs, copied to the host
    copied: torch.cuda.Event | None  # recorded after those copies (CUDA)
    ran: list[tuple[StepItem, Cache]]
    lengths: list[int]  # per item: its cache's committed length after it (0: did not run)
    narrowed: dict[int, StepItem]
    deferrals: dict[int, CapacityDeferral]
    failed: list[int]
    started: int  # perf_counter_ns
    submitted_ns: int
    outcome: StepOutcome | None = None
    error: BaseException | None = None

    def cache_id(self, index: int) -> str:
        """The cache item `index` ran on (opened at launch for an opening item); "" if none."""
        cache = self.caches[index]
        return cache.cache_id if cache is not None else ""

    def holds(self, cache_id: str) -> bool:
        """Whether one of its items is on that cache (a release of it finishes the step first)."""
        return any(cache is not None and cache.cache_id == cache_id for cache in self.caches)


class Engine:
    def __init__(self, config: EngineConfig, recorder: Recorder | None = None) -> None:
        self.config = config
        self.instance_id = secrets.randbits(63) | 1
        # Every torch call runs on this one thread, construction included: on CPU, an OpenMP
        # team opened by any second thread (the asyncio thread here) makes libgomp throttle
        # its spin-waits for all teams, which costs about a quarter of every forward.
        if config.device.split(":")[0] == "cpu":
            # Before the engine thread starts, so it and its OpenMP workers allocate from the
            # main arena (host_memory: page faults).
            host_memory.share_main_arena()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ferrum-engine")
        self._turns = FairQueue()
        # Under tensor parallelism: this rank's configuration (and, in spawn mode, the
        # follower processes started for it); the engine is rank 0. A model that cannot be
        # split is refused here, before any process starts or any weight is read.
        check_split(config)
        self.group = open_group(config)
        config = self.config = self.group.config
        try:
            parts = self._thread.submit(self._build_parts).result()
        except BaseException:
            self._thread.submit(leave_group).result()
            self._thread.shutdown(wait=True)
            self.group.stop_followers(timeout_s=0)
            raise
        self.tp = parts.tp
        self.rank_plans = parts.rank_plans
        # Rank 0 sends the followers every forward and every block move, in order.
        followers = (
            PlanSender(parts.tp, parts.device, self._fault) if parts.tp.is_parallel else None
        )
        parts.runner.followers = followers
        self.storage = KvStorage(parts.kv_cache, followers)
        self.device, self.dtype = parts.device, parts.dtype
        self.model, self.model_config = parts.model, parts.model_config
        self.max_sequence_length = parts.max_sequence_length
        self.memory_plan = parts.memory_plan
        self.kv_cache, self.kv, self.runner = parts.kv_cache, parts.kv, parts.runner
        self.limits = parts.limits
        self.recorder = recorder if recorder is not None else Recorder()
        self.stats = self.recorder.stats
        self.capacity = CapacityManager(
            self.kv,
            self.storage,
            self.limits,
            config.swap_space_bytes,
            self.recorder,
            config.prefix_pending_s,
        )
        # Releases, truncations and prefix publications move the gauges too.
        self.kv.clock.listeners.append(self.publish_gauges)
        self.warmed_up = False
        # None in production: set only when FERRUM_ENABLE_FAULT_INJECTION=1 (tests).
        self.faults = faults.from_environment()
        # Set once a forward failed after it may have been submitted (not an out-of-memory):
        # the error's type name. The executor then runs nothing more (see `_fault`).
        self.fault: str | None = None
        # When a drain began (perf_counter_ns; 0 = not draining): from then on the requests held
        # run to their end and nothing new opens a cache; a step submitted before it still may.
        self.drain_began_ns = 0
        self.events = ExecutionEvents(
            self._event_stamp, on_drop=self.recorder.metrics.record_events_dropped
        )
        self.kv.release_listeners.append(self._on_release)
        # Steps launched and not finished, oldest first (at most two; see `launch`).
        self._launched: deque[LaunchedStep] = deque()

    def _build_parts(self) -> BuiltParts:
        return build_parts(self.config, self.instance_id, self.group.join())

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        """Decode batch sizes replayed from CUDA graphs (empty when graphs are off)."""
        graphs = self.runner.graphs
        return graphs.batch_sizes if graphs is not None else ()

    @property
    def admission_batch_tokens(self) -> int:
        """Most input tokens one admission batch may carry (`try_admit_batch`)."""
        return admission_batch_tokens(self.limits.max_batch_tokens, self.limits.max_sequence_length)

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
        return await loop.run_in_executor(self._thread, self._settled(fn), *args)

    def call_sync(self, fn: Callable[..., T], *args: object) -> T:
        """Blocking form of `call`, for callers outside an event loop (tools, tests)."""
        return self._thread.submit(self._settled(fn), *args).result()

    def _settled(self, fn: Callable[..., T]) -> Callable[..., T]:
        """fn, run only once every launched step has finished, unless fn is one of the calls
        that keep launched steps in flight (`launch`, `finish`, `release`), so that everything
        else sees committed tokens on the host."""
        if getattr(fn, "__self__", None) is self and getattr(fn, "__func__", None) in _IN_FLIGHT:
            return fn

        def settled(*args: object) -> T:
            self._settle()
            return fn(*args)

        return settled

    async def run(
        self,
        ticket: Ticket[T],
        fn: Callable[..., T],
        *args: object,
        on_orphan: Callable[[T], object] | None = None,
    ) -> T:
        """Like `call`, but in the ticket's caller's fair turn, dropped unstarted when the
        ticket's callers are gone, and on_orphan(result) runs on the engine thread when they
        left while it ran."""
        ticket.on_orphan = on_orphan
        future: Future[T] = Future()
        settled = self._settled(fn)
        self._turns.put(ticket.caller, Job(future, lambda: ticket.execute(settled, args)))
        self._thread.submit(self._turns.run_next)
        return await asyncio.wrap_future(future)

    async def run_step(self, ticket: Ticket[Any], step: Step, submitted_ns: int) -> StepOutcome:
        """Run a step in the ticket's caller's turn: whole (`execute`), or with --launch-ahead
        launched in that turn and finished by a later job on the engine thread, so that a step
        queued meanwhile (a continuation sent before this answer) launches first and its host
        work overlaps this one's device time (docs/architecture.md, "Launching ahead")."""
        if not self.config.launch_ahead:
            return await self.run(
                ticket,
                self.execute,
                step,
                submitted_ns,
                on_orphan=functools.partial(self.release_opened, step),
            )
        launched = await self.run(
            ticket,
            self.launch,
            step,
            submitted_ns,
            on_orphan=self.finish_orphan,
        )
        return await self.call(self.finish, launched)

    @property
    def queued_runs(self) -> int:
        """Ticketed work waiting for its turn on the engine thread."""
        return len(self._turns)

    def shutdown(self) -> None:
        if self.tp.is_parallel:
            # After everything queued: the followers stop (cleanly unless the group failed).
            closing = self._thread.submit(self._close_group)
            with contextlib.suppress(Exception):  # a hung engine thread: the followers time out
                closing.result(timeout=FOLLOWER_EXIT_S)
        self._thread.shutdown(wait=True, cancel_futures=True)
        self._turns.abandon(Unavailable("the executor stopped before this call ran"))
        if self.tp.is_parallel:
            codes = self.group.stop_followers(timeout_s=0 if self.fault else FOLLOWER_EXIT_S)
            _LOG.info("tensor_parallel_stopped", follower_exit_codes=codes)

    def _close_group(self) -> None:
        sender = self.runner.followers
        if self.fault is None and sender is not None:
            # A failure is recorded as the fault; the followers then exit on their own.
            with contextlib.suppress(Exception):
                sender.stop()
        if self.fault is None:
            leave_group()

    def ping_group(self) -> None:
        """Prove every rank of a split model is alive (a collective with all of them); a
        failure faults the executor. Also keeps idle followers within their collective
        timeout."""
        self._check_healthy()
        sender = self.runner.followers
        if sender is not None:
            sender.heartbeat()

    # -- steps ----------------------------------------------------------------------------

    def execute(self, step: Step, submitted_ns: int = 0) -> StepOutcome:
        """validate → reserve → forward → commit → record: `launch`, then `finish`.

        A refused step changes nothing, a deferred item runs nothing, and an item whose forward
        failed commits nothing.
        """
        self._settle()
        return self.finish(self.launch(step, submitted_ns))

    def launch(self, step: Step, submitted_ns: int = 0) -> LaunchedStep:
        """Validate, reserve, launch the forward and commit the step's input tokens; its
        outputs stay on the device until `finish`.

        On a GPU the host returns while the device still runs the forward, so a caller that
        knows its next step (continuation decodes) launches it before finishing this one, and
        the host's work for one step overlaps the device's for the other. A continuation decode
        whose cache's token was selected by a step still in flight reads that token on the
        device (its KV commit is resolved when that step finishes). At most one step stays in
        flight behind the one launched: an older one is finished first. Under tensor
        parallelism every earlier step is finished first (the other ranks take their input
        tokens from the host). Every other engine call first finishes what is in flight, except
        `release` of a cache no launched step holds.
        """
        started = time.perf_counter_ns()
        self._check_healthy()
        self._settle(keep=0 if self.tp.is_parallel else 1)
        validated = validate_step(step, self.kv, self.limits)
        if self._launched and not _may_run_ahead(validated):
            # A penalised continuation needs its cache's tokens on the host.
            self._settle()
            validated = validate_step(step, self.kv, self.limits)
        # Continuation decodes now carry the token their cache selected (or a placeholder).
        step = dataclasses.replace(step, items=validated.items)
        if self.drain_began_ns and not 0 < submitted_ns < self.drain_began_ns:
            _refuse_openers(step, validated.caches, validated.refused)
        self.recorder.begin(len(step.items))
        try:
            launched = self._launch(
                step, validated.caches, validated.refused, started, submitted_ns
            )
        except BaseException:
            self.recorder.end(len(step.items))
            raise
        if self._launched:
            self.recorder.launched_ahead()
        self._launched.append(launched)
        return launched

    def finish_orphan(self, launched: LaunchedStep) -> None:
        """A launched step whose caller went away: finish it and release the caches it
        opened (the caller will never learn them)."""
        self.release_opened(launched.step, self.finish(launched))

    def finish(self, launched: LaunchedStep) -> StepOutcome:
        """Wait for a launched step's outputs and answer it, finishing every step launched
        before it first (in launch order). Finishing it again answers the same outcome."""
        while launched.outcome is None and launched.error is None:
            if not self._launched:
                raise InvalidArgument("finish() of a step this engine did not launch")
            self._finish_next()
        if launched.error is not None:
            raise launched.error
        assert launched.outcome is not None
        return launched.outcome

    def _settle(self, keep: int = 0) -> None:
        """Finish launched steps, oldest first, until at most `keep` are in flight."""
        while len(self._launched) > keep:
            self._finish_next()

    def _finish_next(self) -> None:
        launched = self._launched.popleft()
        try:
            launched.outcome = self._finish(launched)
        except BaseException as exc:
            launched.error = exc
            raise
        finally:
            self.recorder.end(len(launched.step.items))

    def _launch(
        self,
        step: Step,
        caches: list[Cache | None],
        refused: dict[int, ExecutorError],
        started: int,
        submitted_ns: int,
    ) -> LaunchedStep:
        held = [len(cache.block_ids) if cache is not None else 0 for cache in caches]
        reservation = self.capacity.reserve_step(step, caches, skip=refused)
        deferrals, narrowed = reservation.deferrals, reservation.narrowed
        if narrowed:  # those chunks run (and commit) only the prefix that fits
            items = [narrowed.get(i, item) for i, item in enumerate(step.items)]
            step = dataclasses.replace(step, items=items)
        results: list[ItemResult | None] = [None] * len(step.items)
        for index, error in refused.items():
            item = step.items[index]
            failure = ItemFailure.from_error(error, item.request_id)
            results[index] = _unrun(item, caches[index], failure=failure)
        for index, deferral in deferrals.items():
            results[index] = _unrun(step.items[index], caches[index], deferral=deferral)
        runnable = [i for i in range(len(step.items)) if i not in deferrals and i not in refused]
        # Continuation decodes whose token is still on the device (a step in flight chose it;
        # none when no step is in flight).
        on_device = {
            i: source
            for i in (runnable if self._launched else ())
            if step.items[i].continuation and (source := _selected_on_device(caches[i])) is not None
        }
        groups, failed = (
            self._forward(step, caches, runnable, held, on_device) if runnable else ([], [])
        )
        ran: list[tuple[StepItem, Cache]] = []
        lengths = [0] * len(step.items)
        for indices, forward in groups:
            ran += self._commit_inputs(step, caches, indices, forward, on_device, lengths)
        return LaunchedStep(
            step=step,
            caches=caches,
            results=results,
            groups=groups,
            host=[_copy_to_host(forward.sampled) for _, forward in groups],
            copied=_record_copies(self.device),
            ran=ran,
            lengths=lengths,
            narrowed=narrowed,
            deferrals=deferrals,
            failed=failed,
            started=started,
            submitted_ns=submitted_ns,
        )

    def _finish(self, launched: LaunchedStep) -> StepOutcome:
        step, caches, results = launched.step, launched.caches, launched.results
        groups, failed, narrowed = launched.groups, launched.failed, launched.narrowed
        try:
            if launched.copied is not None:
                launched.copied.synchronize()
        except Exception as exc:  # the device failed while running the step
            self._fault(exc)
            raise ExecutionFailed("the forward pass failed") from exc
        for (indices, forward), host in zip(groups, launched.host, strict=True):
            self._fill_results(step, caches, indices, forward, host, launched.lengths, results)
        for index in narrowed:
            narrowed_result = results[index]
            if narrowed_result is not None and narrowed_result.completed_num_tokens:
                narrowed_result.capacity_probe_count = 1  # the whole chunk did not fit
        for index in failed:
            item = step.items[index]
            failure = ItemFailure.from_error(DeviceOutOfMemory(_OOM_MESSAGE), item.request_id)
            results[index] = _unrun(item, caches[index], failure=failure)
        forward_ns = sum(forward.forward_ns for _, forward in groups)
        sample_ns = sum(forward.sample_ns for _, forward in groups)
        collective_ns = sum(forward.collective_ns for _, forward in groups)
        if collective_ns:
            self.recorder.metrics.record_collective(collective_ns / 1e9)
        graphed = any(forward.graphed for _, forward in groups)
        ran, deferrals = launched.ran, launched.deferrals
        self.recorder.step(deferrals.values(), ran, forward_ns + sample_ns, graphed)
        self.publish_gauges()
        if ran and self.events.active:
            elapsed_ns = forward_ns + sample_ns
            self.events.publish(_step_event(step, ran, len(deferrals), len(failed), elapsed_ns))
        submitted_ns, started = launched.submitted_ns, launched.started
        timings = Timings(
            queue_ns=max(0, started - submitted_ns) if submitted_ns else 0,
            forward_ns=forward_ns,
            sample_ns=sample_ns,
            total_ns=time.perf_counter_ns() - started,
            collective_ns=collective_ns,
        )
        return StepOutcome(results=[r for r in results if r is not None], timings=timings)

    def _forward(
        self,
        step: Step,
        caches: list[Cache | None],
        runnable: list[int],
        held: list[int],
        on_device: dict[int, DeviceToken],
    ) -> tuple[list[tuple[list[int], ForwardOutput]], list[int]]:
        """Run the runnable items; return (item groups that ran, items that ran out of memory).

        Nothing is committed here, so a failure leaves committed KV as it was: the failed
        items' caches give back the blocks reserved for this step, and caches they opened are
        released.
        """
        try:
            groups, failed = self._isolate(step, caches, runnable, on_device)
        except Exception as exc:
            self._undo(step, caches, runnable, held)
            if is_out_of_memory(exc):
                raise DeviceOutOfMemory(_OOM_MESSAGE) from exc
            if isinstance(exc, Unavailable):  # refused before the forward (fault injection)
                raise
            self._fault(exc)
            raise ExecutionFailed("the forward pass failed") from exc
        self._undo(step, caches, failed, held)
        return groups, failed

    def _isolate(
        self,
        step: Step,
        caches: list[Cache | None],
        indices: list[int],
        on_device: dict[int, DeviceToken],
    ) -> tuple[list[tuple[list[int], ForwardOutput]], list[int]]:
        """One forward of `indices`; on device OOM in a per-item step, bisect so that only the
        items that cannot run fail and the others still complete."""
        items = [step.items[i] for i in indices]
        tokens = {k: on_device[i] for k, i in enumerate(indices) if i in on_device}
        try:
            if self.faults is not None:
                self.faults.before_forward([item.request_id for item in items])
            forward = self.runner.run(items, [caches[i] for i in indices], tokens)  # type: ignore[misc]
            return [(indices, forward)], []
        except Exception as exc:
            if not is_out_of_memory(exc) or step.mode == DeferralMode.ALL_OR_NOTHING:
                raise
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            if len(indices) == 1:
                return [], indices
        middle = len(indices) // 2
        first_ran, first_failed = self._isolate(step, caches, indices[:middle], on_device)
        second_ran, second_failed = self._isolate(step, caches, indices[middle:], on_device)
        return first_ran + second_ran, first_failed + second_failed

    def _undo(
        self, step: Step, caches: list[Cache | None], indices: list[int], held: list[int]
    ) -> None:
        for index in indices:
            cache = caches[index]
            if cache is None:
                continue
            if not step.items[index].cache_id:
                self.kv.release(cache.cache_id, reason=Retirement.FAILED)
            else:
                self.kv.unreserve(cache, held[index])

    def release_opened(self, step: Step, outcome: StepOutcome) -> None:
        """Release the caches a step opened (its caller went away and will never learn them)."""
        for item, result in zip(step.items, outcome.results, strict=True):
            if not item.cache_id and result.cache_id in self.kv.caches:
                self.kv.release(result.cache_id, reason=Retirement.ABANDONED)

    def release_caches(self, cache_ids: list[str]) -> int:
        """Release the live caches among cache_ids (their caller went away); return how many
        were live."""
        live = [c for c in dict.fromkeys(cache_ids) if c in self.kv.caches]
        for cache_id in live:
            self.kv.release(cache_id, reason=Retirement.ABANDONED)
        return len(live)

    def _commit_inputs(
        self,
        step: Step,
        caches: list[Cache | None],
        indices: list[int],
        forward: ForwardOutput,
        on_device: dict[int, DeviceToken],
        lengths: list[int],
    ) -> list[tuple[StepItem, Cache]]:
        """Commit the input tokens of the items one forward ran (their KV is written in stream
        order), note each cache's length, and point each cache that selected a token at it
        on the device until `_fill_results` brings it to the host."""
        sampled = forward.sampled
        position_of_row = _position_of_row(forward)
        kv, now = self.kv, time.monotonic()
        ran: list[tuple[StepItem, Cache]] = []
        row = 0
        for index in indices:
            item, cache = step.items[index], caches[index]
            assert cache is not None  # reserve_step opened it
            if item.kind == ItemKind.PREFILL_CHUNK:
                digest = item.prompt.digest if item.prompt is not None else b""
                kv.declare_prompt(cache, item.total_prompt_tokens, digest)
            kv.commit(cache, item.token_ids, now, unresolved=index in on_device)
            lengths[index] = cache.num_tokens
            ran.append((item, cache))
            num_outputs = item.num_outputs
            row += num_outputs
            if (
                num_outputs
                and sampled is not None
                and item.kind != ItemKind.VERIFY
                and item.sampling.policy != OutputPolicy.LOGITS
            ):
                last = row - 1 if position_of_row is None else position_of_row[row - 1]
                cache.selected_on_device = DeviceToken(sampled.token_ids, last)
        return ran

    def _fill_results(
        self,
        step: Step,
        caches: list[Cache | None],
        indices: list[int],
        forward: ForwardOutput,
        host: SampleOutput | None,
        lengths: list[int],
        results: list[ItemResult | None],
    ) -> None:
        """Fill in the results of the items one forward ran, from its outputs on the host; the
        token each selected becomes its cache's selected token, or resolves the placeholder a
        continuation decode launched since committed for it."""
        token_ids: list[int] = []
        logprobs: list[float] = []
        top_ids: list[list[int]] = []
        top_lps: list[list[float]] = []
        if host is not None:
            token_ids, logprobs = host.token_ids.tolist(), host.logprobs.tolist()
            if host.top_ids.shape[-1]:  # else every row's top-n is empty
                top_ids, top_lps = host.top_ids.tolist(), host.top_logprobs.tolist()
        position_of_row = _position_of_row(forward)
        kv = self.kv
        sampled_on_device = forward.sampled.token_ids if forward.sampled is not None else None
        row = 0
        for index in indices:
            item, cache = step.items[index], caches[index]
            assert cache is not None  # reserve_step opened it
            length = lengths[index]
            # Each result is built whole, in one call: a default one filled in field by field
            # and list by list took about 1.8 us an item against 1.2 (256 items in a loop).
            num_outputs = item.num_outputs
            if not num_outputs:
                results[index] = ItemResult(
                    ItemStatus.INTERMEDIATE,
                    cache.cache_id,
                    length,
                    completed_num_tokens=len(item.token_ids),
                )
                continue
            rows = range(row, row + num_outputs)
            row += num_outputs
            if item.sampling.policy == OutputPolicy.LOGITS:
                results[index] = ItemResult(
                    ItemStatus.LOGITS,
                    cache.cache_id,
                    length,
                    logits=b"".join(forward.logits_rows[r] for r in rows),
                    completed_num_tokens=len(item.token_ids),
                )
                continue
            num_top = item.sampling.num_logprobs
            if num_outputs == 1:  # a decode or a final chunk: the common case, no loops
                k = rows[0] if position_of_row is None else position_of_row[rows[0]]
                chosen = [token_ids[k]]
                picked_lps = [logprobs[k]]
                picked_top = [top_ids[k][:num_top] if top_ids else []]
                picked_top_lps = [top_lps[k][:num_top] if top_lps else []]
            else:  # a verify item: one output per token
                ks = [r if position_of_row is None else position_of_row[r] for r in rows]
                chosen = [token_ids[k] for k in ks]
                picked_lps = [logprobs[k] for k in ks]
                picked_top = [top_ids[k][:num_top] if top_ids else [] for k in ks]
                picked_top_lps = [top_lps[k][:num_top] if top_lps else [] for k in ks]
            results[index] = ItemResult(
                ItemStatus.TOKEN,
                cache.cache_id,
                length,
                chosen,
                picked_lps,
                picked_top,
                picked_top_lps,
                completed_num_tokens=len(item.token_ids),
            )
            if item.kind != ItemKind.VERIFY:
                # What a continuation decode on this cache feeds next. Already on the host
                # (the answer carries it), so continuing costs no device sync.
                if cache.unresolved_position == length:  # one launched since fed it
                    kv.resolve(cache, length, chosen[-1])
                elif (token := _selected_on_device(cache)) and token.is_row(sampled_on_device, k):
                    # Still this step's choice: no item committed on the cache since.
                    cache.selected_token = chosen[-1]
                    cache.selected_on_device = None
        items = [step.items[index] for index in indices]
        self.recorder.forward(items, forward.forward_ns + forward.sample_ns, forward.graphed)

    def publish_gauges(self) -> None:
        """Refresh the KV and cache gauges (engine thread)."""
        self.recorder.gauges(self.kv)

    # -- cache operations -----------------------------------------------------------------

    def release(self, cache_id: str, instance_id: int = 0) -> ReleaseResult:
        check_instance(instance_id, self.limits)
        if any(launched.holds(cache_id) for launched in self._launched):
            self._settle()  # its blocks may still be written, or its tokens resolved
        return self.kv.release(cache_id)

    def complete(
        self,
        request_id: str,
        cache_id: str,
        input_tokens: int,
        output_tokens: int,
        instance_id: int = 0,
    ) -> Completion:
        """Record a successful completion (KvManager.complete checks it against the cache) and
        count it; a completion of an incarnation that already ended answers how it ended."""
        check_instance(instance_id, self.limits)
        result = self.kv.complete(request_id, cache_id, input_tokens, output_tokens)
        outcome = _COMPLETION_OUTCOMES[result.previously]
        self.recorder.metrics.record_completion(outcome.name.lower(), input_tokens, output_tokens)
        return Completion(outcome, result.blocks_freed)

    def complete_observed(
        self,
        request_id: str,
        cache_id: str,
        input_tokens: int,
        output_tokens: int,
        instance_id: int = 0,
    ) -> tuple[Completion, CompletionWork]:
        """`complete`, plus whether work on the cache may follow it (recorded and published)."""
        cache = self.kv.caches.get(cache_id)
        result = self.complete(request_id, cache_id, input_tokens, output_tokens, instance_id)
        work = CompletionWork.observe(self.fault is not None)
        self.recorder.metrics.record_completion_work("complete", work.label)
        if result.released and cache is not None:
            _LOG.info(
                "cache_completed",
                request_id=cache.request_id,
                cache_id=cache_id,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                work=work.label,
            )
            self.events.publish(
                CacheCompleted(
                    cache.request_id,
                    cache_id,
                    input_tokens,
                    output_tokens,
                    result.blocks_freed,
                    cache.num_tokens,
                    work,
                )
            )
        return result, work

    def cancel_admission_observed(
        self, request_id: str, instance_id: int = 0
    ) -> tuple[bool, CompletionWork]:
        """CapacityManager.cancel_admission, plus whether work may follow it (recorded)."""
        released = self.capacity.cancel_admission(request_id, instance_id)
        work = CompletionWork.observe(self.fault is not None)
        self.recorder.metrics.record_completion_work("cancel", work.label)
        _LOG.info("admission_cancelled", request_id=request_id, released=released, work=work.label)
        return released, work

    def preempt(
        self, request_id: str, cache_id: str, mode: PreemptionMode, instance_id: int = 0
    ) -> PreemptionReceipt:
        """CapacityManager.preempt, published as an execution event."""
        cache = self.kv.caches.get(cache_id)
        receipt = self.capacity.preempt(request_id, cache_id, mode, instance_id)
        if cache is not None:
            self.events.publish(
                CachePreempted(
                    receipt.request_id,
                    cache_id,
                    receipt.pending_admission,
                    int(receipt.mode),
                    receipt.blocks_freed,
                    cache.num_tokens,
                )
            )
        return receipt

    def truncate(self, cache_id: str, new_length: int, instance_id: int = 0) -> tuple[Cache, int]:
        check_instance(instance_id, self.limits)
        cache = self.kv.lookup(cache_id)
        if new_length > cache.num_tokens:
            raise InvalidArgument(
                f"cannot truncate cache {cache_id!r} of {cache.num_tokens} tokens to {new_length}"
            )
        released, copies = self.kv.truncate(cache, new_length)
        self.storage.copy_blocks(copies)
        return cache, released

    def try_admit(
        self,
        request_id: str,
        tokens: list[int],
        max_tokens: int,
        prompt_tokens: int,
        replayed_tokens: int,
        instance_id: int = 0,
        first_chunk_tokens: int = 0,
        origin: RequestOrigin | None = None,
    ) -> Decision:
        """CapacityManager.try_admit for a request of `origin` (None: unspecified), counted by
        origin; then refresh the gauges (an admission holds blocks)."""
        self._check_healthy()
        decision = self.capacity.try_admit(
            request_id,
            tokens,
            max_tokens,
            prompt_tokens,
            replayed_tokens,
            instance_id,
            first_chunk_tokens,
        )
        self._record_probe(request_id, origin, prompt_tokens, decision)
        self.publish_gauges()
        return decision

    def try_admit_batch(
        self, probes: Sequence[AdmissionProbe], instance_id: int = 0
    ) -> list[Decision]:
        """CapacityManager.try_admit_batch (the probes decided in order until one is deferred,
        nothing between them), each decision counted and logged as `try_admit` does."""
        self._check_healthy()
        decisions = self.capacity.try_admit_batch(probes, instance_id)
        for probe, decision in zip(probes, decisions, strict=False):
            self._record_probe(probe.request_id, probe.origin, probe.prompt_tokens, decision)
        self.publish_gauges()
        return decisions

    def _record_probe(
        self,
        request_id: str,
        origin: RequestOrigin | None,
        prompt_tokens: int,
        decision: Decision,
    ) -> None:
        label = origin.name.lower() if origin is not None else "unspecified"
        self.recorder.metrics.record_admission_probe(label)
        outcome = _outcome(decision)
        # Start-up and diagnostic probes are rare and worth seeing; product ones are counted.
        log = _LOG.debug if origin in (None, RequestOrigin.PRODUCT) else _LOG.info
        log("admission_probe", request_id=request_id, origin=label, outcome=outcome)
        if isinstance(decision, Admitted):
            cache = self.kv.caches[decision.cache_id]
            # Replayed outputs stay outputs (a penalty scoped to outputs covers them).
            cache.prompt_tokens = prompt_tokens

    def begin_drain(self, began_ns: int) -> None:
        """A drain began at `began_ns` (perf_counter_ns, stamped on the event loop as it flips
        health): steps submitted later may not open a cache; the caches held run on. Admissions
        and slot reservations are refused at the RPC edge."""
        self.drain_began_ns = began_ns

    def release_all(self) -> int:
        """Release every cache (drain); return how many were live."""
        cache_ids = list(self.kv.caches)
        for cache_id in cache_ids:
            self.kv.release(cache_id, reason=Retirement.DRAINED)
        return len(cache_ids)

    # -- faults and events ----------------------------------------------------------------

    def _fault(self, exc: BaseException) -> None:
        """A forward failed after it may have been submitted, and not for lack of memory: what
        the device holds is unknown (a sticky CUDA error leaves the context unusable), so fail
        closed: report ERROR, poison the capacity coordinator, refuse new work."""
        if self.fault is None:
            self.fault = type(exc).__name__
            self.recorder.metrics.set_faulted(True)
            _LOG.error("executor_faulted", error=self.fault, detail=str(exc)[:200])

    def _check_healthy(self) -> None:
        if self.fault is not None:
            raise ExecutorFaulted(
                f"the executor faulted ({self.fault}) and runs nothing more; restart it"
            )

    def _event_stamp(self) -> tuple[Epochs, list[tuple[SourceKey, int]]]:
        clock = self.kv.clock
        return clock.snapshot(), sorted(clock.generations.items())

    def _on_release(self, cache: Cache, reason: str, blocks_freed: int) -> None:
        # Completions and preemptions publish events of their own, with what they know more.
        if self.events.active and reason not in ("completed", "preempted"):
            self.events.publish(
                CacheReleased(
                    cache.request_id, cache.cache_id, reason, blocks_freed, cache.num_tokens
                )
            )

    # -- leases ---------------------------------------------------------------------------

    def sweep(self, now: float | None = None) -> int:
        """Release every cache no call has named for the cache lease, drop swapped-out KV as
        old, and expire stale prefix marks; return how many caches expired. The server calls
        it every `config.sweep_interval_s`; releases wake capacity waiters like any release."""
        now = time.monotonic() if now is None else now
        self.capacity.expire_prefix_marks(now)
        lease_s = self.config.cache_lease_s
        if not lease_s:
            return 0
        expired = self.kv.idle_caches(lease_s, now)
        for cache in expired:
            result = self.kv.release(cache.cache_id, reason=Retirement.EXPIRED)  # an event
            _LOG.warning(
                "cache_lease_expired",
                request_id=cache.request_id,
                cache_id=cache.cache_id,
                idle_s=round(now - cache.touched_s, 3),
                tokens=cache.num_tokens,
                pending_admission=cache.pending_admission,
                blocks_freed=result.blocks_freed,
            )
        if expired:
            self.recorder.metrics.record_caches_expired(len(expired))
        self.capacity.expire_swapped(lease_s, now)
        return len(expired)

    def renew_leases(self, cache_ids: list[str], instance_id: int = 0) -> list[str]:
        """Renew the lease of each live cache named; return the ids that are not live."""
        check_instance(instance_id, self.limits)
        return self.kv.renew(cache_ids)

    def renew_request(self, request_id: str, instance_id: int = 0) -> int:
        """Renew the leases of a request's live caches (MaintainPrefillBacking names only the
        request); return how many there are."""
        check_instance(instance_id, self.limits)
        return self.kv.renew_request(request_id)

    def heartbeat(self) -> float:
        """A no-op on the engine thread: answering proves the thread is not stuck."""
        return time.monotonic()

    def warmup(self, num_tokens: int = 0) -> WarmupOutcome:
        """Run one real forward of up to num_tokens prompt tokens (0 = max_batch_tokens).

        It takes no sequence slot and opens no cache, so it runs while every slot is held: the
        forward writes into scratch blocks taken from the pool's available ones (free blocks
        first, then least recently used prefix-cache blocks, as any allocation does) and given
        back before it returns. With fewer available blocks than num_tokens needs it runs the
        tokens they hold; with none (every block held by a live sequence) it runs nothing and
        answers the deferral.
        """
        self._check_healthy()
        kv = self.kv
        wanted = min(num_tokens or self.config.max_batch_tokens, self.max_sequence_length)
        count = min(wanted, kv.pool.num_available * kv.block_size)
        if count < 1:
            return WarmupOutcome(0, 0.0, self._warmup_deferral(kv.blocks_for(wanted)))
        generator = torch.Generator().manual_seed(self.config.seed)
        tokens = torch.randint(0, self.model_config.vocab_size, (count,), generator=generator)
        item = StepItem(ItemKind.PREFILL_CHUNK, "warmup", "", tokens.tolist(), 0, count)
        scratch = Cache("", "warmup", count, block_ids=kv.pool.allocate(kv.blocks_for(count)))
        self.recorder.begin(1)
        started = time.perf_counter()
        try:
            forward = self.runner.run([item], [scratch])
        except Exception as exc:
            if is_out_of_memory(exc):
                raise DeviceOutOfMemory(_OOM_MESSAGE) from exc
            self._fault(exc)
            raise ExecutionFailed("the warmup forward failed") from exc
        finally:
            # Never registered or hashed: the blocks go back to the free list as they came.
            kv.pool.free(scratch.block_ids)
            self.recorder.end(1)
        elapsed_ms = (time.perf_counter() - started) * 1e3
        self.recorder.forward([item], forward.forward_ns + forward.sample_ns, forward.graphed)
        self.warmed_up = True
        return WarmupOutcome(count, elapsed_ms)

    def _warmup_deferral(self, blocks: int) -> CapacityDeferral:
        """Every block is held by a live sequence: wait for the KV source to advance."""
        pool = self.kv.pool
        return self.capacity.blocks_deferral(
            "warmup", DeferralStage.STEP_ADMISSION, blocks, pool.num_available
        )


def _may_run_ahead(validated: Validated) -> bool:
    """Whether a step may launch while another is in flight: a continuation decode that reads
    its token on the device must not need its cache's tokens on the host (a repetition
    penalty over them)."""
    for index, item in enumerate(validated.items):
        cache = validated.caches[index]
        if (
            item.continuation
            and index not in validated.refused
            and _selected_on_device(cache) is not None
            and item.sampling.repetition_penalty not in (0.0, 1.0)
        ):
            return False
    return True


def _selected_on_device(cache: Cache | None) -> DeviceToken | None:
    """The cache's selected token while the step that chose it is in flight (the KV manager
    holds it untyped: it imports no torch)."""
    return cast(DeviceToken | None, cache.selected_on_device) if cache is not None else None


def _position_of_row(forward: ForwardOutput) -> dict[int, int] | None:
    """Output row -> its row in `sampled`; None when no output returned logits (the same row)."""
    if not forward.logits_rows:
        return None
    return {row: k for k, row in enumerate(forward.token_rows)}


def _copy_to_host(sampled: SampleOutput | None) -> SampleOutput | None:
    """Start copying a forward's sampled outputs to the host (pinned, asynchronous on CUDA);
    the same tensors on CPU."""
    if sampled is None or sampled.token_ids.device.type == "cpu":
        return sampled
    return SampleOutput(
        *(
            getattr(sampled, field.name).to("cpu", non_blocking=True)
            for field in dataclasses.fields(sampled)
        )
    )


def _record_copies(device: torch.device) -> torch.cuda.Event | None:
    """An event after the copies `_copy_to_host` started (CUDA); None on CPU."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return event


# Engine calls that leave launched steps in flight (`Engine._settled`).
_IN_FLIGHT = frozenset({Engine.launch, Engine.finish, Engine.release})


def _refuse_openers(
    step: Step, caches: list[Cache | None], refused: dict[int, ExecutorError]
) -> None:
    """While draining, refuse the items that would open a cache: alone in a PER_ITEM step (the
    held requests beside them run on), the whole step otherwise, as the authority checks do."""
    for index, cache in enumerate(caches):
        if cache is None and index not in refused:
            error = Draining(f"item {index}: {DRAINING_NEW_WORK}")
            if step.mode != DeferralMode.PER_ITEM:
                raise error
            refused[index] = error


def _outcome(decision: Decision) -> str:
    if isinstance(decision, Admitted):
        return "admitted"
    return "deferred" if isinstance(decision, Deferred) else "rejected"


def _step_event(
    step: Step, ran: list[tuple[StepItem, Cache]], deferred: int, failed: int, elapsed_ns: int
) -> StepCompleted:
    prefill = sum(len(item.token_ids) for item, _ in ran if item.kind == ItemKind.PREFILL_CHUNK)
    decode = sum(len(item.token_ids) for item, _ in ran if item.kind != ItemKind.PREFILL_CHUNK)
    return StepCompleted(len(step.items), len(ran), deferred, failed, prefill, decode, elapsed_ns)


# CompleteCache's outcome by how the incarnation had ended (None: this call completed it).
_COMPLETION_OUTCOMES = {
    None: CompletionOutcome.COMPLETED,
    Retirement.COMPLETED: CompletionOutcome.ALREADY_COMPLETED,
    Retirement.RELEASED: CompletionOutcome.ALREADY_RELEASED,
    Retirement.CANCELLED: CompletionOutcome.CANCELLED,
    Retirement.PREEMPTED: CompletionOutcome.PREEMPTED,
    Retirement.EXPIRED: CompletionOutcome.EXPIRED,
}


def _unrun(
    item: StepItem,
    cache: Cache | None,
    *,
    deferral: CapacityDeferral | None = None,
    failure: ItemFailure | None = None,
) -> ItemResult:
    """The result of an item that did not run: deferred, or failed in the forward."""
    return ItemResult(
        status=ItemStatus.DEFERRED if deferral is not None else ItemStatus.FAILED,
        cache_id=item.cache_id,
        committed_tokens=cache.num_tokens if cache else 0,
        deferral=deferral,
        failure=failure,
    )
