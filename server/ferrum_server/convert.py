"""Protobuf <-> domain conversion: every request is parsed here and every execution, KV and
capacity response is built here (descriptions.py builds the descriptive ones). Pure functions:
request conversions run on the servicer's parse thread, responses on the event loop; the engine
thread sees only the domain values they produce.

The domain enums are checked against their proto twins once, at import (`_check_twins`), so
every conversion between them below is a cast that cannot silently drift.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence as Seq
from typing import TypeVar

from ferrum_client.pb import executor_pb2 as pb
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from ferrum_server.capacity import (
    AdmissionProbe,
    Admitted,
    Decision,
    Demand,
    PreemptionMode,
    PreemptionReceipt,
    Rejected,
    ReleaseSource,
    SlotRequest,
    SlotReservation,
)
from ferrum_server.capacity_notifier import CapacityState, WaitResult, source_key
from ferrum_server.config import EngineConfig
from ferrum_server.domain import (
    GREEDY,
    CapacityDeferral,
    CapacityUnit,
    Completion,
    CompletionOutcome,
    CompletionWork,
    CompletionWorkKind,
    DeferralMode,
    DeferralStage,
    ItemKind,
    ItemResult,
    ItemStatus,
    OutputPolicy,
    PenaltyScope,
    PromptIdentity,
    RequestOrigin,
    Sampling,
    Shortfall,
    ShortfallKind,
    Step,
    StepItem,
    StepOutcome,
    Timings,
    WarmupOutcome,
)
from ferrum_server.errors import ErrorReason, InvalidArgument
from ferrum_server.execution_events import (
    CacheCompleted,
    CachePreempted,
    CacheReleased,
    Dropped,
    Event,
    StepCompleted,
)
from ferrum_server.kv.epochs import Epochs, Source, SourceKey
from ferrum_server.kv.manager import (
    Cache,
    KvManager,
    KvUsage,
    ReleaseResult,
    chain_hashes,
    context_digest,
    prefix_hash,
)
from ferrum_server.validate import MAX_ID_BYTES, Limits

V = TypeVar("V")


def _check_twins(
    domain: type[enum.IntEnum], proto: object, prefix: str, internal: tuple[enum.IntEnum, ...] = ()
) -> None:
    """Every member of `domain` but the internal ones must equal the proto value named
    prefix + its name."""
    for member in domain:
        if member in internal:
            continue
        twin = getattr(proto, prefix + member.name, None)
        if twin != member.value:
            raise ImportError(
                f"{domain.__name__}.{member.name} = {member.value} has proto twin "
                f"{prefix}{member.name} = {twin}"
            )


# The one table of domain enum <-> proto enum correspondences. VERIFY is internal (the items of
# ForwardVerify), never a kind on the wire.
_check_twins(ItemKind, pb.ItemKind, "ITEM_KIND_", internal=(ItemKind.VERIFY,))
_check_twins(ItemStatus, pb.ItemStatus, "ITEM_STATUS_")
_check_twins(DeferralStage, pb.ExecutionCapacityStage, "EXECUTION_CAPACITY_STAGE_")
_check_twins(ShortfallKind, pb.ShortfallKind, "SHORTFALL_KIND_")
_check_twins(CapacityUnit, pb.CapacityUnit, "CAPACITY_UNIT_")
_check_twins(Source, pb.CapacitySource, "CAPACITY_SOURCE_")
_check_twins(PreemptionMode, pb.PreemptionMode, "PREEMPTION_MODE_")
_check_twins(ErrorReason, pb.ErrorReason, "ERROR_REASON_")
_check_twins(PenaltyScope, pb.RepetitionPenaltyScope, "REPETITION_PENALTY_SCOPE_")
_check_twins(RequestOrigin, pb.RequestOrigin, "REQUEST_ORIGIN_")
_check_twins(CompletionWorkKind, pb.CompletionWorkKind, "COMPLETION_WORK_KIND_")
_check_twins(CompletionOutcome, pb.CompletionOutcome, "COMPLETION_OUTCOME_")

# KvManager release reasons -> their proto enum (completions and preemptions have events of
# their own and never reach it).
_RELEASE_REASONS = {
    "released": pb.CACHE_RELEASE_REASON_RELEASED,
    "expired": pb.CACHE_RELEASE_REASON_EXPIRED,
    "cancelled": pb.CACHE_RELEASE_REASON_CANCELLED,
    "abandoned": pb.CACHE_RELEASE_REASON_ABANDONED,
    "failed": pb.CACHE_RELEASE_REASON_FAILED,
    "drained": pb.CACHE_RELEASE_REASON_DRAINED,
}

# Most entries in one ListReleaseSources answer (ids are at most MAX_ID_BYTES, so a page stays
# near 0.6 MiB, under every message limit).
MAX_RELEASE_SOURCES_PAGE = 1024

# -- requests ---------------------------------------------------------------------------------

# The size checks below read only the lengths of a request's columns: constant time, so they run
# on the event loop and refuse an oversized request before any per-item conversion (which runs
# on the servicer's parse thread). Their messages match the full validation's (validate.py).


def check_batch_size(items: pb.BatchItems, limits: Limits) -> None:
    """Refuse a batch over the item or token limit from its columns' lengths alone (the
    per-item string columns too, so that the id check after this one stays short)."""
    count = max(len(items.kinds), len(items.request_ids), len(items.cache_ids))
    if count > limits.max_batch_size:
        raise InvalidArgument(f"{count} items exceed the batch limit {limits.max_batch_size}")
    check_token_count(len(items.token_ids), limits.max_batch_tokens)


# A batch this small converts on the event loop instead of the parse thread: 64 decodes take
# about 0.14 ms to convert, while the hops to the parse thread and back cost a served W1 step
# about 0.4 ms more (docs/benchmarks.md, forty-first session). Larger batches keep the parse
# thread, so the loop is never held up for longer than this.
INLINE_PARSE_ITEMS = 128
INLINE_PARSE_TOKENS = 2048


def converts_inline(items: pb.BatchItems) -> bool:
    """Whether a batch is small enough to convert on the event loop (see INLINE_PARSE_*)."""
    count = max(len(items.kinds), len(items.request_ids), len(items.cache_ids))
    return count <= INLINE_PARSE_ITEMS and len(items.token_ids) <= INLINE_PARSE_TOKENS


def check_token_count(count: int, maximum: int) -> None:
    if count > maximum:
        raise InvalidArgument(f"{count} tokens exceed the per-step limit {maximum}")


def check_prompt_size(count: int, maximum: int) -> None:
    if count > maximum:
        raise InvalidArgument(
            f"prompt of {count} tokens exceeds the maximum sequence length {maximum}"
        )


def check_ids(request: Message, path: str = "") -> None:
    """Every string field of a request is an id (request, cache, page token): at most
    MAX_ID_BYTES bytes of UTF-8 each, or INVALID_ARGUMENT naming the field. Checked before
    anything else looks at the request: ids are fingerprinted, logged, stored and echoed in
    answers (a 1.3 MB id once made every ListReleaseSources answer outgrow the message limit)."""
    for field, value in request.ListFields():
        name = path + field.name
        if field.type == FieldDescriptor.TYPE_STRING:
            texts = value if field.is_repeated else (value,)
            # Lengths first, at C speed: a column of a million short ids must not hold the
            # event loop (this runs before the batch size checks).
            if max(map(len, texts), default=0) * 4 <= MAX_ID_BYTES:
                continue
            for index, text in enumerate(texts):
                # A str of at most MAX_ID_BYTES / 4 characters fits whatever its characters.
                if len(text) * 4 > MAX_ID_BYTES and len(text.encode()) > MAX_ID_BYTES:
                    where = f"{name}[{index}]" if field.is_repeated else name
                    raise InvalidArgument(
                        f"{where} is {len(text.encode())} bytes; ids are limited to "
                        f"{MAX_ID_BYTES} bytes"
                    )
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            for child in value if field.is_repeated else (value,):
                check_ids(child, name + ".")


def _column(name: str, values: Seq[V], count: int, default: V) -> list[V]:
    """A column as a list: `count` defaults when the call left it empty."""
    if not values:
        return [default] * count
    if len(values) != count:
        raise InvalidArgument(f"column {name} has {len(values)} entries for {count} items")
    return list(values)


# The item kinds a BatchItems column may hold, by their wire values.
_ITEM_KINDS = {int(kind): kind for kind in (ItemKind.PREFILL_CHUNK, ItemKind.DECODE)}


def _policy(value: int) -> OutputPolicy:
    if value in (pb.LOGITS_RETURN_POLICY_UNSPECIFIED, pb.LOGITS_RETURN_POLICY_SELECTED_TOKEN):
        return OutputPolicy.TOKEN
    if value == pb.LOGITS_RETURN_POLICY_FULL_LOGITS:
        return OutputPolicy.LOGITS
    raise InvalidArgument(f"unknown logits return policy {value}")


def _penalty_scope(value: int) -> PenaltyScope:
    if value == pb.REPETITION_PENALTY_SCOPE_UNSPECIFIED:
        return PenaltyScope.PROMPT_AND_OUTPUTS
    try:
        return PenaltyScope(value)
    except ValueError:
        raise InvalidArgument(f"unknown repetition penalty scope {value}") from None


def request_origin_from_pb(value: int) -> RequestOrigin | None:
    """The origin of an admission probe; None when unspecified; unknown values are refused."""
    if value == pb.REQUEST_ORIGIN_UNSPECIFIED:
        return None
    try:
        return RequestOrigin(value)
    except ValueError:
        raise InvalidArgument(f"unknown request origin {value}") from None


def admission_probe_from_pb(request: pb.TryAdmitPrefillRequest) -> AdmissionProbe:
    """A TryAdmitPrefill request (or a probe of a batch) as the engine takes it."""
    return AdmissionProbe(
        request_id=request.request_id,
        tokens=list(request.input_tokens),
        max_tokens=request.maximum_sequence_tokens,
        prompt_tokens=request.product_prompt_tokens,
        replayed_tokens=request.replayed_output_tokens,
        instance_id=request.executor_instance_id,
        first_chunk_tokens=request.first_chunk_tokens,
        origin=request_origin_from_pb(request.request_origin),
    )


def admission_probes_from_pb(request: pb.TryAdmitPrefillBatchRequest) -> list[AdmissionProbe]:
    """A TryAdmitPrefillBatch's probes; a probe's own step_id is refused (the batch has one)."""
    for index, probe in enumerate(request.probes):
        if probe.step_id:
            raise InvalidArgument(
                f"probe {index} sets step_id; a batch's probes share the batch's step_id"
            )
    return [admission_probe_from_pb(probe) for probe in request.probes]


def sampling_from_pb(params: pb.SamplingParams) -> Sampling:
    return Sampling(
        policy=_policy(params.logits_return_policy),
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p or 1.0,
        seed=params.seed,
        repetition_penalty=params.repetition_penalty or 1.0,
        num_logprobs=params.num_logprobs,
        token_mask=params.token_mask,
        penalty_scope=_penalty_scope(params.repetition_penalty_scope),
    )


def _sampling_columns(columns: pb.SamplingColumns, count: int) -> list[Sampling]:
    if not columns.ByteSize():
        return [GREEDY] * count
    policies = _column("logits_return_policies", columns.logits_return_policies, count, 0)
    temperatures = _column("temperatures", columns.temperatures, count, 0.0)
    top_ks = _column("top_ks", columns.top_ks, count, 0)
    top_ps = _column("top_ps", columns.top_ps, count, 0.0)
    seeds = _column("seeds", columns.seeds, count, 0)
    penalties = _column("repetition_penalties", columns.repetition_penalties, count, 0.0)
    logprobs = _column("num_logprobs", columns.num_logprobs, count, 0)
    masks = _column("token_masks", columns.token_masks, count, b"")
    scopes = _column("repetition_penalty_scopes", columns.repetition_penalty_scopes, count, 0)
    # Items with equal settings share one Sampling (built and validated once per call).
    made: dict[tuple[object, ...], Sampling] = {}
    samplings: list[Sampling] = []
    for i in range(count):
        key = (
            policies[i],
            temperatures[i],
            top_ks[i],
            top_ps[i],
            seeds[i],
            penalties[i],
            logprobs[i],
            masks[i],
            scopes[i],
        )
        sampling = made.get(key)
        if sampling is None:
            sampling = made[key] = Sampling(
                policy=_policy(policies[i]),
                temperature=temperatures[i],
                top_k=top_ks[i],
                top_p=top_ps[i] or 1.0,
                seed=seeds[i],
                repetition_penalty=penalties[i] or 1.0,
                num_logprobs=logprobs[i],
                token_mask=masks[i],
                penalty_scope=_penalty_scope(scopes[i]),
            )
        samplings.append(sampling)
    return samplings


def step_from_pb(
    items: pb.BatchItems, mode: DeferralMode, instance_id: int, only: ItemKind | None = None
) -> Step:
    # Each column is read into a list once (an indexed read of a protobuf container costs
    # more than a list's): a step of hundreds of decodes is converted on every call.
    kinds = list(items.kinds)
    count = len(kinds)
    allowed = _ITEM_KINDS if only is None else {int(only): only}
    if not allowed.keys() >= set(kinds):
        i, kind = next((i, k) for i, k in enumerate(kinds) if k not in allowed)
        if kind not in _ITEM_KINDS:
            raise InvalidArgument(f"item {i}: unknown item kind {kind}")
        assert only is not None
        raise InvalidArgument(f"item {i}: this call takes only {only.name} items")
    request_ids = _column("request_ids", items.request_ids, count, "")
    cache_ids = _column("cache_ids", items.cache_ids, count, "")
    num_tokens = _column("num_tokens", items.num_tokens, count, 0)
    positions = _column("positions", items.positions, count, 0)
    totals = _column("total_prompt_tokens", items.total_prompt_tokens, count, 0)
    max_tokens = _column("maximum_sequence_tokens", items.maximum_sequence_tokens, count, 0)
    narrowing = _column("allow_narrowing", items.allow_narrowing, count, False)
    continues = _column("continue_decode", items.continue_decode, count, False)
    if any(continues):
        for i in range(count):
            # A continuation's token is the one its cache selected: the columns stay
            # unambiguous only if it carries none.
            if continues[i] and (int(kinds[i]) != ItemKind.DECODE or num_tokens[i] != 0):
                raise InvalidArgument(
                    f"item {i}: a continue_decode item is a decode with num_tokens 0 (its token "
                    "is the one its cache selected)"
                )
    flat = list(items.token_ids)
    if sum(num_tokens) != len(flat):
        raise InvalidArgument(
            f"num_tokens adds up to {sum(num_tokens)} but token_ids has {len(flat)} entries"
        )
    samplings = _sampling_columns(items.sampling, count)
    step_items: list[StepItem] = []
    start = 0
    for i in range(count):
        end = start + num_tokens[i]
        step_items.append(
            StepItem(
                kind=_ITEM_KINDS[kinds[i]],
                request_id=request_ids[i],
                cache_id=cache_ids[i],
                token_ids=flat[start:end],
                position=positions[i],
                total_prompt_tokens=totals[i],
                max_sequence_tokens=max_tokens[i],
                sampling=samplings[i],
                allow_narrowing=narrowing[i],
                continuation=continues[i],
            )
        )
        start = end
    return Step(step_items, mode, instance_id)


def prompt_identity(tokens: list[int], position: int, block_size: int) -> PromptIdentity:
    """The whole prompt's token identity, as block hashes (computed here, on the event loop,
    so the engine thread only compares digests)."""
    hashes = chain_hashes(tokens, block_size)
    num_blocks = position // block_size
    return PromptIdentity(
        digest=context_digest(tokens, block_size, hashes),
        prefix_digest=prefix_hash(hashes, num_blocks),
        prefix_tail=tokens[num_blocks * block_size : position],
    )


def prefill_step_from_pb(request: pb.PrefillRequest, block_size: int) -> Step:
    """One chunk of a prompt carried whole: besides the chunk, the item holds the prompt's
    identity, checked against (or, for a cache it opens, declared to) the cache."""
    tokens = list(request.input_tokens)
    if not tokens:
        raise InvalidArgument("input_tokens is empty")
    if request.HasField("chunk"):
        chunk = request.chunk
        if chunk.tokens_to_process == 0:
            raise InvalidArgument("chunk.tokens_to_process must be > 0")
        if chunk.total_prompt_tokens != len(tokens):
            raise InvalidArgument(
                f"chunk.total_prompt_tokens {chunk.total_prompt_tokens} != "
                f"{len(tokens)} input tokens"
            )
        begin, count = chunk.tokens_processed, chunk.tokens_to_process
        if begin + count > len(tokens):
            raise InvalidArgument(
                f"chunk [{begin}, {begin + count}) lies outside the prompt of {len(tokens)} tokens"
            )
    else:
        begin, count = 0, len(tokens)
    item = StepItem(
        kind=ItemKind.PREFILL_CHUNK,
        request_id=request.request_id,
        cache_id=request.cache_id,
        token_ids=tokens[begin : begin + count],
        position=begin,
        total_prompt_tokens=len(tokens),
        max_sequence_tokens=request.maximum_sequence_tokens,
        sampling=sampling_from_pb(request.sampling),
        allow_narrowing=request.allow_narrowing,
        prompt=prompt_identity(tokens, begin, block_size),
    )
    return Step([item], DeferralMode.ALL_OR_NOTHING, request.executor_instance_id)


def decode_step_from_pb(request: pb.DecodeRequest) -> Step:
    if not request.cache_id:
        raise InvalidArgument("cache_id is required")
    item = StepItem(
        kind=ItemKind.DECODE,
        request_id=request.request_id,
        cache_id=request.cache_id,
        token_ids=[request.input_token],
        position=request.position,
        sampling=sampling_from_pb(request.sampling),
    )
    return Step([item], DeferralMode.ALL_OR_NOTHING, request.executor_instance_id)


def verify_step_from_pb(request: pb.ForwardVerifyRequest) -> Step:
    if not request.cache_id:
        raise InvalidArgument("cache_id is required")
    item = StepItem(
        kind=ItemKind.VERIFY,
        request_id=request.request_id,
        cache_id=request.cache_id,
        token_ids=list(request.token_ids),
        position=request.position,
        sampling=sampling_from_pb(request.sampling),
    )
    return Step([item], DeferralMode.ALL_OR_NOTHING, request.executor_instance_id)


def slot_requests_from_pb(request: pb.ReserveKvSlotsRequest) -> list[SlotRequest]:
    count = len(request.target_lens)
    cache_ids = _column("cache_ids", request.cache_ids, count, "")
    request_ids = _column("request_ids", request.request_ids, count, "")
    admission = _column("admission_target_lens", request.admission_target_lens, count, 0)
    return [
        SlotRequest(cache_ids[i], request_ids[i], request.target_lens[i], admission[i])
        for i in range(count)
    ]


def preemption_mode_from_pb(value: int) -> PreemptionMode:
    if value not in (
        pb.PREEMPTION_MODE_UNSPECIFIED,
        pb.PREEMPTION_MODE_RECOMPUTE,
        pb.PREEMPTION_MODE_SWAP,
    ):
        raise InvalidArgument(f"unknown preemption mode {value}")
    return PreemptionMode.SWAP if value == pb.PREEMPTION_MODE_SWAP else PreemptionMode.RECOMPUTE


# -- results ----------------------------------------------------------------------------------


def epochs_to_pb(epochs: Epochs) -> pb.AdmissionEpochs:
    return pb.AdmissionEpochs(
        coordinator_id=epochs.coordinator_id,
        release_epoch=epochs.release_epoch,
        capacity_epoch=epochs.capacity_epoch,
    )


def sources_to_pb(observed: Seq[tuple[SourceKey, int]]) -> list[pb.CapacityAvailabilityEpoch]:
    return [
        pb.CapacityAvailabilityEpoch(
            source=pb.CapacitySource.ValueType(source), domain=domain, epoch=generation
        )
        for (source, domain), generation in observed
    ]


def deferral_to_pb(deferral: CapacityDeferral) -> pb.ExecutionDeferral:
    shortfall = shortfall_to_pb(deferral.shortfall)
    epochs = epochs_to_pb(deferral.epochs)
    return pb.ExecutionDeferral(
        item_index=deferral.item_index,
        request_id=deferral.request_id,
        capacity=pb.ExecutionCapacityDeferral(
            observed=epochs,
            wait_condition=pb.CapacityWaitCondition(
                coordinator_id=epochs.coordinator_id, observed=sources_to_pb(deferral.observed)
            ),
            stage=pb.ExecutionCapacityStage.ValueType(deferral.stage),
            evidence=pb.ExecutionCapacityEvidence(
                logical=pb.LogicalCapacityEvidence(shortfalls=[shortfall])
            ),
            narrower_prefill_tokens=deferral.narrower_prefill_tokens,
        ),
    )


def timings_to_pb(timings: Timings) -> pb.StepTimings:
    return pb.StepTimings(
        queue_ns=timings.queue_ns,
        forward_ns=timings.forward_ns,
        sample_ns=timings.sample_ns,
        total_ns=timings.total_ns,
        collective_ns=timings.collective_ns,
    )


def results_to_pb(results: Seq[ItemResult]) -> pb.BatchResults:
    out = pb.BatchResults()
    out.statuses.extend(int(r.status) for r in results)  # type: ignore[misc]
    out.cache_ids.extend(r.cache_id for r in results)
    out.committed_tokens.extend(r.committed_tokens for r in results)
    out.token_ids.extend(r.token_ids[0] if r.token_ids else 0 for r in results)
    out.token_logprobs.extend(r.logprobs[0] if r.logprobs else 0.0 for r in results)
    out.num_top_logprobs.extend(len(r.top_ids[0]) if r.top_ids else 0 for r in results)
    for r in results:
        # A token result always holds one (often empty) top-n list: skip the empty ones.
        if r.top_ids and r.top_ids[0]:
            out.top_token_ids.extend(r.top_ids[0])
            out.top_logprobs.extend(r.top_logprobs[0])
    out.logits.extend(r.logits for r in results)
    out.completed_num_tokens.extend(r.completed_num_tokens for r in results)
    out.capacity_probe_counts.extend(r.capacity_probe_count for r in results)
    out.deferrals.extend(deferral_to_pb(r.deferral) for r in results if r.deferral is not None)
    out.errors.extend(
        pb.ItemError(
            item_index=index,
            request_id=r.failure.request_id,
            code=r.failure.code,
            message=r.failure.message,
        )
        for index, r in enumerate(results)
        if r.failure is not None
    )
    return out


def kv_ref(cache: Cache, block_size: int) -> pb.KvCacheRef:
    return pb.KvCacheRef(
        cache_id=cache.cache_id,
        num_tokens=cache.num_tokens,
        block_size=block_size,
        block_ids=cache.block_ids,
    )


def sampling_output_to_pb(result: ItemResult) -> pb.SamplingOutput:
    if result.status == ItemStatus.LOGITS:
        return pb.SamplingOutput(full_logits=result.logits)
    return pb.SamplingOutput(
        token=pb.SelectedToken(
            token_id=result.token_ids[0],
            logprob=result.logprobs[0],
            top_token_ids=result.top_ids[0],
            top_logprobs=result.top_logprobs[0],
        )
    )


def single_deferral(outcome: StepOutcome) -> pb.ExecutionDeferral | None:
    deferral = outcome.results[0].deferral
    return deferral_to_pb(deferral) if deferral is not None else None


def _cache_ref(result: ItemResult, block_size: int) -> pb.KvCacheRef:
    return pb.KvCacheRef(
        cache_id=result.cache_id, num_tokens=result.committed_tokens, block_size=block_size
    )


def prefill_response(step: Step, outcome: StepOutcome, block_size: int) -> pb.PrefillResponse:
    timings = timings_to_pb(outcome.timings)
    deferral = single_deferral(outcome)
    if deferral is not None:
        return pb.PrefillResponse(deferred=deferral, timings=timings)
    result, item = outcome.results[0], step.items[0]
    chunk = pb.PrefillChunk(
        tokens_processed=item.position,
        tokens_to_process=len(item.token_ids),
        total_prompt_tokens=item.total_prompt_tokens,
    )
    completed = pb.PrefillChunk(
        tokens_processed=item.position,
        tokens_to_process=result.completed_num_tokens,
        total_prompt_tokens=item.total_prompt_tokens,
    )
    completion = pb.PrefillCompletion(
        kv_cache=_cache_ref(result, block_size),
        planned_chunk=chunk,
        completed_chunk=completed,
        capacity_probe_count=result.capacity_probe_count,
        request_id=item.request_id,
    )
    if result.status != ItemStatus.INTERMEDIATE:
        completion.output.CopyFrom(sampling_output_to_pb(result))
    return pb.PrefillResponse(completed=completion, timings=timings)


def decode_response(outcome: StepOutcome, block_size: int) -> pb.DecodeResponse:
    timings = timings_to_pb(outcome.timings)
    deferral = single_deferral(outcome)
    if deferral is not None:
        return pb.DecodeResponse(deferred=deferral, timings=timings)
    result = outcome.results[0]
    output = pb.DecodeOutput(
        kv_cache=_cache_ref(result, block_size), output=sampling_output_to_pb(result)
    )
    return pb.DecodeResponse(completed=output, timings=timings)


def batch_prefill_response(outcome: StepOutcome) -> pb.BatchPrefillResponse:
    """A transactional step: deferred whole (nothing ran), or every item's result."""
    timings = timings_to_pb(outcome.timings)
    deferral = single_deferral(outcome)
    if deferral is not None:
        return pb.BatchPrefillResponse(not_submitted=deferral, timings=timings)
    return pb.BatchPrefillResponse(completed=results_to_pb(outcome.results), timings=timings)


def batch_decode_response(outcome: StepOutcome) -> pb.BatchDecodeResponse:
    """A transactional step: deferred whole (nothing ran), or every item's result."""
    timings = timings_to_pb(outcome.timings)
    deferral = single_deferral(outcome)
    if deferral is not None:
        return pb.BatchDecodeResponse(deferred=deferral, timings=timings)
    return pb.BatchDecodeResponse(completed=results_to_pb(outcome.results), timings=timings)


def unified_response(outcome: StepOutcome) -> pb.UnifiedBatchResponse:
    """Per-item deferral: deferred items are among the results."""
    return pb.UnifiedBatchResponse(
        results=results_to_pb(outcome.results), timings=timings_to_pb(outcome.timings)
    )


def verify_response(step: Step, outcome: StepOutcome, block_size: int) -> pb.ForwardVerifyResponse:
    timings = timings_to_pb(outcome.timings)
    deferral = single_deferral(outcome)
    if deferral is not None:
        return pb.ForwardVerifyResponse(deferred=deferral, timings=timings)
    result = outcome.results[0]
    # token_ids is [last selected token, draft_1, ...]: a draft is accepted while it equals the
    # token chosen at the position before it.
    drafts = step.items[0].token_ids[1:]
    accepted = 0
    for draft, chosen in zip(drafts, result.token_ids, strict=False):
        if draft != chosen:
            break
        accepted += 1
    output = pb.ForwardVerifyOutput(
        kv_cache=_cache_ref(result, block_size),
        token_ids=result.token_ids,
        token_logprobs=result.logprobs,
        logits=result.logits,
        num_accepted_greedy=accepted if result.token_ids else 0,
    )
    return pb.ForwardVerifyResponse(completed=output, timings=timings)


def truncate_response(cache: Cache, blocks_freed: int, block_size: int) -> pb.TruncateKvResponse:
    return pb.TruncateKvResponse(kv_cache=kv_ref(cache, block_size), blocks_freed=blocks_freed)


def release_response(result: ReleaseResult, epochs: Epochs) -> pb.ReleaseCacheResponse:
    return pb.ReleaseCacheResponse(
        released=result.released, blocks_freed=result.blocks_freed, epochs=epochs_to_pb(epochs)
    )


def completion_work_to_pb(work: CompletionWork) -> pb.CompletionWork:
    return pb.CompletionWork(
        kind=pb.CompletionWorkKind.ValueType(work.kind),
        submission_indeterminate=work.submission_indeterminate,
    )


def complete_response(
    result: Completion, epochs: Epochs, work: CompletionWork
) -> pb.CompleteCacheResponse:
    return pb.CompleteCacheResponse(
        released=result.released,
        blocks_freed=result.blocks_freed,
        epochs=epochs_to_pb(epochs),
        work=completion_work_to_pb(work),
        outcome=pb.CompletionOutcome.ValueType(result.outcome),
    )


def cancel_response(released: bool, work: CompletionWork) -> pb.CancelPrefillAdmissionResponse:
    return pb.CancelPrefillAdmissionResponse(released=released, work=completion_work_to_pb(work))


def warmup_response(
    outcome: WarmupOutcome, kv: KvManager, peak_activation_bytes: int
) -> pb.WarmupResponse:
    return pb.WarmupResponse(
        num_tokens=outcome.num_tokens,
        forward_ms=outcome.forward_ms,
        total_blocks=kv.pool.num_blocks,
        block_size=kv.block_size,
        max_supported_total_tokens=kv.pool.num_blocks * kv.block_size,
        peak_activation_bytes=peak_activation_bytes,
        deferred=deferral_to_pb(outcome.deferral) if outcome.deferral is not None else None,
    )


def renewal_from_pb(request: pb.RenewCacheLeaseRequest, max_ids: int) -> list[str]:
    """The cache ids to renew, once each, in request order (bounded like a step's items)."""
    cache_ids = list(dict.fromkeys(request.cache_ids))
    if len(cache_ids) > max_ids:
        raise InvalidArgument(f"{len(cache_ids)} cache ids exceed the limit {max_ids}")
    for index, cache_id in enumerate(cache_ids):
        if not cache_id or len(cache_id) > MAX_ID_BYTES:
            raise InvalidArgument(
                f"cache id {index}: empty or longer than {MAX_ID_BYTES} characters"
            )
    return cache_ids


def renew_response(
    cache_ids: list[str], not_live: list[str], lease_s: float
) -> pb.RenewCacheLeaseResponse:
    return pb.RenewCacheLeaseResponse(
        renewed=len(cache_ids) - len(not_live),
        not_live_cache_ids=not_live,
        cache_lease_ms=round(lease_s * 1000),
    )


# -- KV slots ---------------------------------------------------------------------------------


def kv_usage_to_pb(usage: KvUsage) -> pb.KvSlotCapacitySnapshot:
    return pb.KvSlotCapacitySnapshot(
        block_size=usage.block_size,
        total_blocks=usage.total_blocks,
        free_blocks=usage.free_blocks,
        cached_blocks=usage.cached_blocks,
        used_blocks=usage.used_blocks,
        reserved_blocks=usage.reserved_blocks,
    )


def reservation_to_pb(outcome: SlotReservation | CapacityDeferral) -> pb.ReserveKvSlotsResponse:
    if not isinstance(outcome, SlotReservation):
        return pb.ReserveKvSlotsResponse(deferred=deferral_to_pb(outcome))
    return pb.ReserveKvSlotsResponse(
        reserved=pb.KvSlotReservation(
            block_size=outcome.block_size,
            total_blocks=outcome.total_blocks,
            free_blocks_before=outcome.free_blocks_before,
            free_blocks_after=outcome.free_blocks_after,
            cache_ids=[a[0] for a in outcome.allocations],
            blocks_before=[a[1] for a in outcome.allocations],
            blocks_after=[a[2] for a in outcome.allocations],
            new_blocks=[a[2] - a[1] for a in outcome.allocations],
        )
    )


# -- capacity protocol ------------------------------------------------------------------------


def shortfall_to_pb(s: Shortfall) -> pb.CapacityShortfall:
    return pb.CapacityShortfall(
        domain=0,
        kind=pb.ShortfallKind.ValueType(s.kind),
        requested=s.requested,
        available=s.available,
        current_total=s.current_total,
        maximum_total=s.maximum_total,
        unit=pb.CapacityUnit.ValueType(s.unit),
    )


def demand_to_pb(d: Demand) -> pb.CapacityVector:
    return pb.CapacityVector(kv_blocks=d.kv_blocks, tokens=d.tokens, sequences=d.sequences)


def capacity_snapshot_to_pb(
    state: CapacityState, kv: KvManager, poisoned: bool = False
) -> pb.CapacitySnapshot:
    pool_available = state.free_blocks + state.cached_blocks
    return pb.CapacitySnapshot(
        coordinator_id=state.epochs.coordinator_id,
        domains=[
            pb.CapacityDomain(
                domain=0,
                total=state.total_blocks,
                maximum_total=state.total_blocks,
                used=state.used_blocks,
                available=pool_available,
            )
        ],
        active_requests=len(kv.caches),
        active_sequences=len(kv.caches),
        maximum_active_sequences=kv.max_sequences,
        release_epoch=state.epochs.release_epoch,
        capacity_epoch=state.epochs.capacity_epoch,
        poisoned=poisoned,
    )


def decisions_to_pb(
    decisions: list[Decision], state: CapacityState, kv: KvManager
) -> pb.TryAdmitPrefillBatchResponse:
    return pb.TryAdmitPrefillBatchResponse(
        decisions=[decision_to_pb(decision, state, kv) for decision in decisions]
    )


def decision_to_pb(
    decision: Decision, state: CapacityState, kv: KvManager
) -> pb.TryAdmitPrefillResponse:
    if isinstance(decision, Admitted):
        return pb.TryAdmitPrefillResponse(
            admitted=pb.AdmissionReceipt(
                request_id=decision.request_id,
                cache_id=decision.cache_id,
                cached_prompt_tokens=decision.cached_prompt_tokens,
                held_blocks=decision.held_blocks,
                epochs=epochs_to_pb(decision.epochs),
            )
        )
    if isinstance(decision, Rejected):
        return pb.TryAdmitPrefillResponse(
            rejected=pb.AdmissionRejected(
                immediate_requested=demand_to_pb(decision.immediate),
                fit_requested=demand_to_pb(decision.fit),
                maximum=capacity_snapshot_to_pb(state, kv),
                blockers=[shortfall_to_pb(s) for s in decision.shortfalls],
                reason=decision.reason,
            )
        )
    epochs = epochs_to_pb(decision.epochs)
    return pb.TryAdmitPrefillResponse(
        deferred=pb.AdmissionDeferred(
            immediate_requested=demand_to_pb(decision.immediate),
            fit_requested=demand_to_pb(decision.fit),
            available=capacity_snapshot_to_pb(state, kv),
            blockers=[shortfall_to_pb(s) for s in decision.shortfalls],
            action=pb.DEFERRAL_ACTION_WAIT_FOR_RELEASE,
            release_epoch=epochs.release_epoch,
            capacity_epoch=epochs.capacity_epoch,
            wait_condition=pb.CapacityWaitCondition(
                coordinator_id=epochs.coordinator_id, observed=sources_to_pb(decision.observed)
            ),
            narrower_prefill_tokens=decision.narrower_prefill_tokens,
        )
    )


def condition_from_pb(condition: pb.CapacityWaitCondition) -> list[tuple[SourceKey, int]]:
    return [(source_key(o.source, o.domain), o.epoch) for o in condition.observed]


def release_sources_page_size(requested: int) -> int:
    return min(requested, MAX_RELEASE_SOURCES_PAGE) or MAX_RELEASE_SOURCES_PAGE


def release_sources_to_pb(
    entries: Seq[ReleaseSource], page_size: int
) -> pb.ListReleaseSourcesResponse:
    """One page: the first page_size entries (ordered by cache id); a further entry means more
    follow, and the last cache id of the page is the next page's token."""
    page = entries[:page_size]
    more = len(entries) > page_size
    return pb.ListReleaseSourcesResponse(
        next_page_token=page[-1].cache_id if more and page else "",
        entries=[
            pb.ReleaseSourceEntry(
                request_id=e.request_id,
                cache_id=e.cache_id,
                authority=(
                    pb.PREEMPTION_AUTHORITY_RETAINED_PREFILL
                    if e.pending_admission
                    else pb.PREEMPTION_AUTHORITY_ACTIVE_SEQUENCE
                ),
                sources=sources_to_pb(e.sources),
                releasable_blocks=e.releasable_blocks,
                num_tokens=e.num_tokens,
            )
            for e in page
        ],
    )


def receipt_to_pb(r: PreemptionReceipt) -> pb.PreemptExecutionCapacityResponse:
    return pb.PreemptExecutionCapacityResponse(
        receipt=pb.PreemptionReceipt(
            request_id=r.request_id,
            cache_id=r.cache_id,
            authority=(
                pb.PREEMPTION_AUTHORITY_RETAINED_PREFILL
                if r.pending_admission
                else pb.PREEMPTION_AUTHORITY_ACTIVE_SEQUENCE
            ),
            blocks_freed=r.blocks_freed,
            mode=pb.PreemptionMode.ValueType(int(r.mode)),
            epochs=epochs_to_pb(r.epochs),
        )
    )


def kv_state_to_pb(state: CapacityState, block_size: int) -> pb.KvSlotCapacitySnapshot:
    return pb.KvSlotCapacitySnapshot(
        block_size=block_size,
        total_blocks=state.total_blocks,
        free_blocks=state.free_blocks,
        cached_blocks=state.cached_blocks,
        used_blocks=state.used_blocks,
        reserved_blocks=state.reserved_blocks,
    )


def capacity_snapshot_response(
    state: CapacityState, usage: KvUsage, kv: KvManager, config: EngineConfig, poisoned: bool
) -> pb.GetCapacitySnapshotResponse:
    return pb.GetCapacitySnapshotResponse(
        epochs=epochs_to_pb(state.epochs),
        sources=sources_to_pb(sorted(state.generations.items())),
        kv=kv_usage_to_pb(usage),
        capacity=capacity_snapshot_to_pb(state, kv, poisoned),
        limits=pb.AdmissionLimits(
            maximum_active_sequences=config.max_batch_size,
            maximum_scheduled_tokens=config.max_batch_tokens,
        ),
    )


def wait_response(result: WaitResult) -> pb.WaitForCapacityChangeResponse:
    return pb.WaitForCapacityChangeResponse(
        changed=result.changed,
        current=epochs_to_pb(result.state.epochs),
        sources=sources_to_pb(result.sources),
    )


def watch_response(state: CapacityState, block_size: int) -> pb.WatchCapacityResponse:
    return pb.WatchCapacityResponse(
        epochs=epochs_to_pb(state.epochs),
        sources=sources_to_pb(sorted(state.generations.items())),
        kv=kv_state_to_pb(state, block_size),
    )


# -- execution events -------------------------------------------------------------------------


def subscribed_to_pb(
    next_sequence: int, ring_capacity: int, state: CapacityState
) -> pb.WatchExecutionEventsResponse:
    return pb.WatchExecutionEventsResponse(
        event=pb.ExecutionEvent(
            epochs=epochs_to_pb(state.epochs),
            sources=sources_to_pb(sorted(state.generations.items())),
            subscribed=pb.EventsSubscribed(
                next_sequence=next_sequence, ring_capacity=ring_capacity
            ),
        )
    )


def execution_event_to_pb(event: Event | Dropped) -> pb.WatchExecutionEventsResponse:
    if isinstance(event, Dropped):
        return pb.WatchExecutionEventsResponse(
            event=pb.ExecutionEvent(events_dropped=pb.EventsDropped(count=event.count))
        )
    out = pb.ExecutionEvent(
        sequence=event.sequence,
        unix_ns=event.unix_ns,
        epochs=epochs_to_pb(event.epochs),
        sources=sources_to_pb(event.sources),
    )
    payload = event.payload
    if isinstance(payload, StepCompleted):
        out.step_completed.CopyFrom(
            pb.StepCompletedEvent(
                num_items=payload.num_items,
                ran_items=payload.ran_items,
                deferred_items=payload.deferred_items,
                failed_items=payload.failed_items,
                prefill_tokens=payload.prefill_tokens,
                decode_tokens=payload.decode_tokens,
                elapsed_ns=payload.elapsed_ns,
            )
        )
    elif isinstance(payload, CachePreempted):
        out.preempted.CopyFrom(
            pb.CachePreemptedEvent(
                request_id=payload.request_id,
                cache_id=payload.cache_id,
                authority=(
                    pb.PREEMPTION_AUTHORITY_RETAINED_PREFILL
                    if payload.pending_admission
                    else pb.PREEMPTION_AUTHORITY_ACTIVE_SEQUENCE
                ),
                mode=pb.PreemptionMode.ValueType(payload.mode),
                blocks_freed=payload.blocks_freed,
                num_tokens=payload.num_tokens,
            )
        )
    elif isinstance(payload, CacheReleased):
        out.released.CopyFrom(
            pb.CacheReleasedEvent(
                request_id=payload.request_id,
                cache_id=payload.cache_id,
                reason=_RELEASE_REASONS.get(payload.reason, pb.CACHE_RELEASE_REASON_UNSPECIFIED),
                blocks_freed=payload.blocks_freed,
                num_tokens=payload.num_tokens,
            )
        )
    elif isinstance(payload, CacheCompleted):
        out.completed.CopyFrom(
            pb.CacheCompletedEvent(
                request_id=payload.request_id,
                cache_id=payload.cache_id,
                input_tokens=payload.input_tokens,
                output_tokens=payload.output_tokens,
                blocks_freed=payload.blocks_freed,
                num_tokens=payload.num_tokens,
                work=completion_work_to_pb(payload.work),
            )
        )
    return pb.WatchExecutionEventsResponse(event=out)
