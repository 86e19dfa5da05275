"""Admission probes, preemption and swap: the executor's answers to "does this fit?".

Runs on the engine thread (called through Engine). Probes launch no device work; every answer
is a fact about the pool: admitted (with what is held), deferred (with the exact sources to wait
on), or rejected (can never fit).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from ferrum_server import logs
from ferrum_server.domain import Shortfall
from ferrum_server.errors import AlreadyExists, InvalidArgument, NotFound
from ferrum_server.kv.epochs import KV_BLOCKS, SEQUENCE_SLOTS, Epochs, SourceKey
from ferrum_server.kv.manager import Cache, KvManager
from ferrum_server.metrics import Metrics
from ferrum_server.validate import Limits, check_instance

_LOG = logs.get(__name__)

# proto enum values (the engine stays protobuf-free)
SHORTFALL_FIT = 2
SHORTFALL_SEQUENCE_CEILING = 4
SHORTFALL_PERMANENT = 5
SHORTFALL_PREFIX_PENDING = 6
SHORTFALL_SEQUENCE_LENGTH = 7
UNIT_BLOCKS = 1
UNIT_SEQUENCES = 2
UNIT_TOKENS = 3
ACTION_WAIT_FOR_RELEASE = 1


class PreemptionMode(enum.IntEnum):
    RECOMPUTE = 1
    SWAP = 2


@dataclass(frozen=True, slots=True)
class Demand:
    kv_blocks: int
    tokens: int
    sequences: int


@dataclass(frozen=True, slots=True)
class Admitted:
    request_id: str
    cache_id: str
    cached_prompt_tokens: int
    held_blocks: int
    epochs: Epochs


@dataclass(frozen=True, slots=True)
class Deferred:
    immediate: Demand
    fit: Demand
    shortfalls: list[Shortfall]
    epochs: Epochs
    observed: list[tuple[SourceKey, int]]


@dataclass(frozen=True, slots=True)
class Rejected:
    immediate: Demand
    fit: Demand
    shortfalls: list[Shortfall]
    reason: str


Decision = Admitted | Deferred | Rejected


@dataclass(frozen=True, slots=True)
class ReleaseSource:
    request_id: str
    cache_id: str
    pending_admission: bool
    sources: list[tuple[SourceKey, int]]
    releasable_blocks: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class PreemptionReceipt:
    request_id: str
    cache_id: str
    pending_admission: bool
    blocks_freed: int
    mode: PreemptionMode
    epochs: Epochs


@dataclass(slots=True)
class SwappedKv:
    """A preempted sequence's committed KV, parked in host memory."""

    token_ids: list[int]
    host_kv: torch.Tensor  # [L, 2, num_blocks, block_size, kv_heads, head_dim] on the CPU

    @property
    def num_bytes(self) -> int:
        return self.host_kv.numel() * self.host_kv.element_size()


@dataclass(slots=True)
class CapacityStats:
    probes: int = 0
    admitted: int = 0
    deferred: int = 0
    rejected: int = 0
    preemptions: int = 0
    swaps_out: int = 0
    swaps_in: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)


class CapacityManager:
    def __init__(
        self, kv: KvManager, kv_cache: torch.Tensor, limits: Limits, swap_space_bytes: int
    ) -> None:
        self.kv = kv
        self.kv_cache = kv_cache  # [L, 2, num_blocks, block_size, kv_heads, head_dim]
        self.limits = limits
        self.swap_space_bytes = swap_space_bytes
        self.swapped: OrderedDict[str, SwappedKv] = OrderedDict()  # by request id
        self.stats = CapacityStats()
        self.metrics: Metrics | None = None

    # -- admission ------------------------------------------------------------------------

    def try_admit(
        self,
        request_id: str,
        tokens: list[int],
        max_tokens: int,
        prompt_tokens: int,
        replayed_tokens: int,
        instance_id: int = 0,
    ) -> Decision:
        check_instance(instance_id, self.limits)
        self._validate(request_id, tokens, max_tokens, prompt_tokens, replayed_tokens)
        self.stats.probes += 1
        kv = self.kv
        model_max = self.limits.max_sequence_length
        bound = max_tokens or len(tokens)
        immediate = Demand(kv.blocks_for(len(tokens)), len(tokens), 1)
        fit = Demand(kv.blocks_for(bound), bound, 1)
        if len(tokens) > model_max or max_tokens > model_max:
            longest = max(len(tokens), max_tokens)
            return self._reject(
                immediate,
                fit,
                Shortfall(
                    SHORTFALL_SEQUENCE_LENGTH,
                    UNIT_TOKENS,
                    longest,
                    model_max,
                    model_max,
                    model_max,
                ),
                f"{longest} tokens exceed the maximum sequence length {model_max}",
            )
        if fit.kv_blocks > kv.pool.num_blocks:
            total = kv.pool.num_blocks
            return self._reject(
                immediate,
                fit,
                Shortfall(
                    SHORTFALL_PERMANENT,
                    UNIT_BLOCKS,
                    fit.kv_blocks,
                    total,
                    total,
                    total,
                ),
                f"{bound} tokens need {fit.kv_blocks} KV blocks; the pool has {total}",
            )
        if kv.num_free_sequence_slots < 1:
            return self._defer(
                immediate,
                fit,
                Shortfall(
                    SHORTFALL_SEQUENCE_CEILING,
                    UNIT_SEQUENCES,
                    1,
                    0,
                    kv.max_sequences,
                    kv.max_sequences,
                ),
                SEQUENCE_SLOTS,
                "sequence_slots",
            )
        swapped = self.swapped.get(request_id)
        if swapped is not None and tokens[: len(swapped.token_ids)] == swapped.token_ids:
            return self._swap_in(
                request_id, tokens, max_tokens or model_max, swapped, immediate, fit
            )
        match = kv.match_prefix(tokens)
        if match.num_pending:
            return self._defer(
                immediate,
                fit,
                Shortfall(
                    SHORTFALL_PREFIX_PENDING,
                    UNIT_BLOCKS,
                    match.num_pending,
                    0,
                    kv.pool.num_blocks,
                    kv.pool.num_blocks,
                ),
                KV_BLOCKS,
                "prefix_pending",
            )
        needed = immediate.kv_blocks - match.num_blocks + match.num_cached
        available = kv.pool.num_available
        if needed > available:
            return self._defer(
                immediate,
                fit,
                Shortfall(
                    SHORTFALL_FIT,
                    UNIT_BLOCKS,
                    needed,
                    available,
                    kv.pool.num_blocks,
                    kv.pool.num_blocks,
                ),
                KV_BLOCKS,
                "kv_blocks",
            )
        seq = kv.admit(request_id, tokens, max_tokens or model_max, match)
        cached = match.num_blocks * kv.block_size
        self.stats.admitted += 1
        self.stats.prefix_query_tokens += len(tokens)
        self.stats.prefix_hit_tokens += cached
        if self.metrics is not None:
            self.metrics.record_admission("admitted")
            self.metrics.record_prefix(len(tokens), cached)
        _LOG.info(
            "request_admitted",
            request_id=request_id,
            cache_id=seq.cache_id,
            cached_tokens=cached,
            blocks=len(seq.block_ids),
        )
        return Admitted(request_id, seq.cache_id, cached, len(seq.block_ids), kv.clock.snapshot())

    def _validate(
        self,
        request_id: str,
        tokens: list[int],
        max_tokens: int,
        prompt_tokens: int,
        replayed_tokens: int,
    ) -> None:
        if not request_id:
            raise InvalidArgument("request_id is required")
        if not tokens:
            raise InvalidArgument("input_tokens is empty")
        bad = [t for t in tokens if t >= self.limits.vocab_size]
        if bad:
            raise InvalidArgument(
                f"token id {bad[0]} outside the vocabulary [0, {self.limits.vocab_size})"
            )
        if prompt_tokens == 0:
            raise InvalidArgument("product_prompt_tokens must be > 0")
        if prompt_tokens + replayed_tokens != len(tokens):
            raise InvalidArgument(
                f"product_prompt_tokens + replayed_output_tokens = "
                f"{prompt_tokens + replayed_tokens} but input_tokens has {len(tokens)} entries"
            )
        if max_tokens and max_tokens < len(tokens):
            raise InvalidArgument(
                f"maximum_sequence_tokens {max_tokens} is below the {len(tokens)} input tokens"
            )
        for seq in self.kv.caches.values():
            if seq.request_id == request_id:
                raise AlreadyExists(
                    f"request {request_id!r} already holds cache {seq.cache_id!r}; release or "
                    f"preempt it before admitting it again"
                )

    def _reject(
        self, immediate: Demand, fit: Demand, shortfall: Shortfall, reason: str
    ) -> Rejected:
        self.stats.rejected += 1
        if self.metrics is not None:
            self.metrics.record_admission("rejected")
        return Rejected(immediate, fit, [shortfall], reason)

    def _defer(
        self, immediate: Demand, fit: Demand, shortfall: Shortfall, source: SourceKey, reason: str
    ) -> Deferred:
        self.stats.deferred += 1
        self.stats.by_reason[reason] = self.stats.by_reason.get(reason, 0) + 1
        if self.metrics is not None:
            self.metrics.record_admission("deferred")
        clock = self.kv.clock
        return Deferred(immediate, fit, [shortfall], clock.snapshot(), clock.observed({source}))

    def cancel_admission(self, request_id: str, instance_id: int = 0) -> bool:
        """Release an admitted request whose first chunk never ran."""
        check_instance(instance_id, self.limits)
        for seq in list(self.kv.caches.values()):
            if seq.request_id == request_id and seq.pending_admission:
                self.kv.release(seq.cache_id)
                return True
        return False

    # -- preemption -----------------------------------------------------------------------

    def release_sources(self) -> list[ReleaseSource]:
        kv = self.kv
        entries = []
        for seq in kv.caches.values():
            blocks = kv.releasable_blocks(seq)
            sources = {SEQUENCE_SLOTS} | ({KV_BLOCKS} if blocks else set())
            entries.append(
                ReleaseSource(
                    seq.request_id,
                    seq.cache_id,
                    seq.pending_admission,
                    kv.clock.observed(sources),
                    blocks,
                    seq.num_tokens,
                )
            )
        return entries

    def preempt(
        self, request_id: str, cache_id: str, mode: PreemptionMode, instance_id: int = 0
    ) -> PreemptionReceipt:
        check_instance(instance_id, self.limits)
        if not cache_id:
            raise InvalidArgument("cache_id is required")
        seq = self.kv.caches.get(cache_id)
        if seq is None:
            raise NotFound(f"cache {cache_id!r} is not live (released or unknown)")
        if request_id and seq.request_id != request_id:
            raise InvalidArgument(f"cache {cache_id!r} belongs to another request")
        used = mode
        if mode == PreemptionMode.SWAP and not self._swap_out(seq):
            used = PreemptionMode.RECOMPUTE
        pending = seq.pending_admission
        result = self.kv.release(cache_id)
        self.stats.preemptions += 1
        if self.metrics is not None:
            self.metrics.record_preemption(used.name.lower())
        _LOG.info(
            "cache_preempted",
            request_id=seq.request_id,
            cache_id=cache_id,
            mode=used.name.lower(),
            blocks_freed=result.blocks_freed,
        )
        return PreemptionReceipt(
            seq.request_id, cache_id, pending, result.blocks_freed, used, self.kv.clock.snapshot()
        )

    def _swap_out(self, seq: Cache) -> bool:
        """Copy the committed KV to host memory if the swap space allows; True on success."""
        if seq.num_tokens == 0 or not seq.request_id:
            return False
        blocks = seq.block_ids[: self.kv.blocks_for(seq.num_tokens)]
        per_block = self.kv_cache[:, :, 0].numel() * self.kv_cache.element_size()
        needed = per_block * len(blocks)
        while self.swapped and self._swap_bytes() + needed > self.swap_space_bytes:
            self.swapped.popitem(last=False)
        if needed > self.swap_space_bytes:
            return False
        index = torch.tensor(blocks, dtype=torch.int64, device=self.kv_cache.device)
        host = self.kv_cache.index_select(2, index).to("cpu")
        self.swapped[seq.request_id] = SwappedKv(list(seq.token_ids), host)
        self.stats.swaps_out += 1
        return True

    def _swap_bytes(self) -> int:
        return sum(s.num_bytes for s in self.swapped.values())

    def _swap_in(
        self,
        request_id: str,
        tokens: list[int],
        max_tokens: int,
        swapped: SwappedKv,
        immediate: Demand,
        fit: Demand,
    ) -> Decision:
        kv = self.kv
        if immediate.kv_blocks > kv.pool.num_available:
            return self._defer(
                immediate,
                fit,
                Shortfall(
                    SHORTFALL_FIT,
                    UNIT_BLOCKS,
                    immediate.kv_blocks,
                    kv.pool.num_available,
                    kv.pool.num_blocks,
                    kv.pool.num_blocks,
                ),
                KV_BLOCKS,
                "kv_blocks",
            )
        del self.swapped[request_id]
        seq = kv.open(request_id, max_tokens)
        seq.pending_admission = True
        seq.context_tokens = len(tokens)
        kv.grow(seq, len(tokens))
        # Keep at least one token to run, so the scheduler gets logits for the next position.
        restored = min(len(swapped.token_ids), len(tokens) - 1)
        num_blocks = swapped.host_kv.shape[2]
        index = torch.tensor(
            seq.block_ids[:num_blocks], dtype=torch.int64, device=self.kv_cache.device
        )
        self.kv_cache.index_copy_(2, index, swapped.host_kv.to(self.kv_cache.device))
        kv.commit(seq, tokens[:restored])
        seq.pending_admission = True
        self.stats.admitted += 1
        self.stats.swaps_in += 1
        if self.metrics is not None:
            self.metrics.record_admission("admitted")
        return Admitted(request_id, seq.cache_id, restored, len(seq.block_ids), kv.clock.snapshot())
