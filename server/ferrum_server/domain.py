"""Transport-neutral request and result types of the engine.

The servicer converts protobuf to these and back; the engine and the validator never see
protobuf. Each enum's members are named after, and valued as, their proto twins (the twin of
`ShortfallKind.PREFIX_PENDING` is `SHORTFALL_KIND_PREFIX_PENDING`); `convert` checks every
member against the generated code at import, so conversion is a checked cast.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ferrum_server.errors import ExecutorError, public_message
from ferrum_server.kv.epochs import Epochs, SourceKey


class ItemKind(enum.IntEnum):
    PREFILL_CHUNK = 1
    DECODE = 2
    # ForwardVerify: N+1 tokens of one sequence with an output at every position (internal).
    VERIFY = 3


class OutputPolicy(enum.IntEnum):
    TOKEN = 1
    LOGITS = 2


class ItemStatus(enum.IntEnum):
    INTERMEDIATE = 1
    TOKEN = 2
    LOGITS = 3
    DEFERRED = 4
    FAILED = 5


class DeferralMode(enum.Enum):
    """How a step treats items that cannot get KV blocks."""

    PER_ITEM = "per_item"  # UnifiedBatch: defer those items, run the rest
    ALL_OR_NOTHING = "all_or_nothing"  # Batch*/single calls: run everything or nothing


class PenaltyScope(enum.IntEnum):
    """Which context tokens a repetition penalty covers (proto RepetitionPenaltyScope)."""

    PROMPT_AND_OUTPUTS = 1  # HF / vLLM convention (the default)
    OUTPUTS_ONLY = 2  # ferrum's engine convention: tokens after the product prompt


@dataclass(frozen=True, slots=True)
class Sampling:
    policy: OutputPolicy = OutputPolicy.TOKEN
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    repetition_penalty: float = 1.0
    num_logprobs: int = 0
    token_mask: bytes = b""
    penalty_scope: PenaltyScope = PenaltyScope.PROMPT_AND_OUTPUTS


GREEDY = Sampling()


@dataclass(frozen=True, slots=True)
class PromptIdentity:
    """The token identity of a chunk whose call carried the whole prompt (Prefill): checked
    against the cache by hash, never token by token."""

    digest: bytes  # kv.manager.context_digest of the whole prompt
    prefix_digest: bytes  # chained hash of the full blocks before the chunk
    prefix_tail: list[int]  # the prompt's tokens after those blocks, up to the chunk


# Not frozen: one is made per item per step when a request is converted, and again for each
# continuation decode once validation knows its token; a frozen dataclass's __init__ (one
# object.__setattr__ a field) took 0.91 us for these eleven fields against 0.19. Nothing
# mutates an item: validation and narrowing build new ones (`with_tokens`).
@dataclass(slots=True)
class StepItem:
    kind: ItemKind
    request_id: str
    cache_id: str  # "" opens a new cache (prefill chunk at position 0 only)
    token_ids: list[int]
    position: int
    total_prompt_tokens: int = 0  # prefill chunks only
    max_sequence_tokens: int = 0  # 0 = model maximum
    sampling: Sampling = GREEDY
    # A prefill chunk that does not fit may run the prefix that does (CapacityManager).
    allow_narrowing: bool = False
    prompt: PromptIdentity | None = None  # set when the call carried the whole prompt
    # A decode whose input is the token its cache's last item selected (continue_decode):
    # token_ids is empty on the wire and filled from the cache by validation.
    continuation: bool = False

    @property
    def end(self) -> int:
        return self.position + len(self.token_ids)

    @property
    def is_final(self) -> bool:
        return self.kind != ItemKind.PREFILL_CHUNK or self.end == self.total_prompt_tokens

    def with_tokens(self, token_ids: list[int]) -> StepItem:
        """This item carrying `token_ids` instead: a continuation decode once validation knows
        its token, or a chunk narrowed to the prefix that fits. Built field by field, once for
        every continuation decode of every step: ``dataclasses.replace`` took 2.6 us against 1.2
        while the class was frozen (its cost unfrozen: the note above the class)."""
        return StepItem(
            self.kind,
            self.request_id,
            self.cache_id,
            token_ids,
            self.position,
            self.total_prompt_tokens,
            self.max_sequence_tokens,
            self.sampling,
            self.allow_narrowing,
            self.prompt,
            self.continuation,
        )

    @property
    def num_outputs(self) -> int:
        # Read several times per item per step: the common decode answers first, and the
        # chunk's end is computed inline rather than through `is_final` and `end`.
        kind = self.kind
        if kind == ItemKind.DECODE:
            return 1
        if kind == ItemKind.VERIFY:
            return len(self.token_ids)
        return 1 if self.position + len(self.token_ids) == self.total_prompt_tokens else 0


@dataclass(frozen=True, slots=True)
class Step:
    items: list[StepItem]
    mode: DeferralMode = DeferralMode.PER_ITEM
    executor_instance_id: int = 0


class CompletionOutcome(enum.IntEnum):
    """What a CompleteCache found (proto CompletionOutcome)."""

    COMPLETED = 1
    ALREADY_COMPLETED = 2
    ALREADY_RELEASED = 3
    CANCELLED = 4
    PREEMPTED = 5
    EXPIRED = 6


@dataclass(frozen=True, slots=True)
class Completion:
    """The answer to a CompleteCache."""

    outcome: CompletionOutcome
    blocks_freed: int

    @property
    def released(self) -> bool:
        return self.outcome == CompletionOutcome.COMPLETED


class DeferralStage(enum.IntEnum):
    """Where a step item lacked capacity (proto ExecutionCapacityStage)."""

    SEQUENCE_EXTENSION = 1  # an existing cache could not grow
    STEP_ADMISSION = 2  # a new cache could not open


class ShortfallKind(enum.IntEnum):
    """Why capacity fell short (proto ShortfallKind)."""

    IMMEDIATE_AVAILABILITY = 1
    FIT_AVAILABILITY = 2
    ACTIVE_SEQUENCE_CEILING = 4
    PERMANENT_DOMAIN_MAXIMUM = 5
    PREFIX_PENDING = 6
    SEQUENCE_LENGTH_MAXIMUM = 7


class CapacityUnit(enum.IntEnum):
    """What a shortfall counts (proto CapacityUnit)."""

    BLOCKS = 1
    SEQUENCES = 2
    TOKENS = 3


@dataclass(frozen=True, slots=True)
class Shortfall:
    kind: ShortfallKind
    unit: CapacityUnit
    requested: int
    available: int
    current_total: int
    maximum_total: int

    @classmethod
    def blocks(
        cls, kind: ShortfallKind, *, requested: int, available: int, total: int
    ) -> Shortfall:
        """KV blocks short of a pool of `total` blocks (the pool never grows)."""
        return cls(kind, CapacityUnit.BLOCKS, requested, available, total, total)

    @classmethod
    def sequence_slots(cls, ceiling: int) -> Shortfall:
        """Every one of the `ceiling` sequence slots is taken; one more is needed."""
        return cls(
            ShortfallKind.ACTIVE_SEQUENCE_CEILING, CapacityUnit.SEQUENCES, 1, 0, ceiling, ceiling
        )

    @classmethod
    def sequence_length(cls, *, requested: int, maximum: int) -> Shortfall:
        """`requested` tokens exceed the model's `maximum` sequence length."""
        return cls(
            ShortfallKind.SEQUENCE_LENGTH_MAXIMUM,
            CapacityUnit.TOKENS,
            requested,
            maximum,
            maximum,
            maximum,
        )


@dataclass(frozen=True, slots=True)
class CapacityDeferral:
    """Evidence that an item was not submitted for lack of capacity."""

    item_index: int
    request_id: str
    stage: DeferralStage
    shortfall: Shortfall
    epochs: Epochs
    observed: list[tuple[SourceKey, int]]
    narrower_prefill_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ItemFailure:
    """Why one item failed in the forward (nothing was committed for it)."""

    code: int  # gRPC status code number a single-item call would have returned
    message: str
    request_id: str = ""

    @classmethod
    def from_error(cls, error: ExecutorError, request_id: str) -> ItemFailure:
        """The failure a single-item call would have raised as `error`."""
        return cls(error.code.value[0], public_message(error), request_id)


@dataclass(slots=True)
class ItemResult:
    status: ItemStatus
    cache_id: str
    committed_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    logits: bytes = b""
    deferral: CapacityDeferral | None = None
    failure: ItemFailure | None = None
    # Tokens of the item that ran (fewer than planned for a narrowed chunk; 0 if it did not).
    completed_num_tokens: int = 0
    # Capacity probes that failed before it ran (1 for a narrowed chunk).
    capacity_probe_count: int = 0


@dataclass(frozen=True, slots=True)
class Timings:
    queue_ns: int = 0
    forward_ns: int = 0
    sample_ns: int = 0
    total_ns: int = 0
    collective_ns: int = 0  # within forward_ns: tensor-parallel collectives on rank 0


@dataclass(frozen=True, slots=True)
class StepOutcome:
    results: list[ItemResult]
    timings: Timings


class RequestOrigin(enum.IntEnum):
    """Who a request lifecycle is for (proto RequestOrigin); 0 (unspecified) is not a member."""

    PRODUCT = 1
    STARTUP = 2
    DIAGNOSTIC = 3


class CompletionWorkKind(enum.IntEnum):
    """Whether work may follow a completion or cancellation (proto CompletionWorkKind)."""

    NO_ADDITIONAL_WORK = 1
    ADDITIONAL_OR_UNPROVEN = 2


@dataclass(frozen=True, slots=True)
class CompletionWork:
    """What a CompleteCache or CancelPrefillAdmission call leaves behind (the seed's
    ExecutorCompletionWork): nothing, or work that may follow (or cannot be proven absent)."""

    kind: CompletionWorkKind
    # A forward failed after it may have been submitted (the executor faulted).
    submission_indeterminate: bool = False

    @classmethod
    def observe(cls, faulted: bool) -> CompletionWork:
        """Steps run one at a time on the engine thread and finish before a completion or
        cancellation runs there, so none is left behind, unless a forward failed after it may
        have been submitted: then nothing about the device can be proven."""
        if faulted:
            return cls(CompletionWorkKind.ADDITIONAL_OR_UNPROVEN, submission_indeterminate=True)
        return cls(CompletionWorkKind.NO_ADDITIONAL_WORK)

    @property
    def label(self) -> str:
        """The metric label: none or additional_or_unproven."""
        return (
            "none"
            if self.kind == CompletionWorkKind.NO_ADDITIONAL_WORK
            else ("additional_or_unproven")
        )


@dataclass(frozen=True, slots=True)
class WarmupOutcome:
    """What a warmup forward did: the tokens it ran and its time, or why it could not run."""

    num_tokens: int
    forward_ms: float
    # Set when no KV block was available to run in (nothing ran).
    deferral: CapacityDeferral | None = None
