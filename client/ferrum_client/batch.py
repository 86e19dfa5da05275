"""Builds columnar BatchItems one item at a time, and reads BatchResults back per item."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ferrum_client.pb import executor_pb2 as pb


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """Per-item sampling; the defaults are greedy with token selection on the executor."""

    full_logits: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int = 0
    repetition_penalty: float = 0.0
    num_logprobs: int = 0
    token_mask: bytes = b""

    def to_pb(self) -> pb.SamplingParams:
        return pb.SamplingParams(
            logits_return_policy=(
                pb.LOGITS_RETURN_POLICY_FULL_LOGITS
                if self.full_logits
                else pb.LOGITS_RETURN_POLICY_SELECTED_TOKEN
            ),
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            seed=self.seed,
            repetition_penalty=self.repetition_penalty,
            num_logprobs=self.num_logprobs,
            token_mask=self.token_mask,
        )


GREEDY = SamplingOptions()


def fill_sampling_columns(columns: pb.SamplingColumns, options: Sequence[SamplingOptions]) -> None:
    """Write per-item sampling as parallel columns; nothing at all when every item is greedy
    (the executor's default), so an all-greedy step sends no sampling bytes."""
    if all(o == GREEDY for o in options):
        return
    columns.logits_return_policies.extend([o.to_pb().logits_return_policy for o in options])
    columns.temperatures.extend([o.temperature for o in options])
    columns.top_ks.extend([o.top_k for o in options])
    columns.top_ps.extend([o.top_p for o in options])
    columns.seeds.extend([o.seed for o in options])
    columns.repetition_penalties.extend([o.repetition_penalty for o in options])
    columns.num_logprobs.extend([o.num_logprobs for o in options])
    columns.token_masks.extend([o.token_mask for o in options])


class BatchBuilder:
    """Accumulates items column by column; sampling columns are sent only if some item
    deviates from greedy."""

    def __init__(self) -> None:
        self.items = pb.BatchItems()
        self._sampling: list[SamplingOptions] = []
        self._narrowing: list[bool] = []
        self._continuations: list[bool] = []

    def __len__(self) -> int:
        return len(self.items.kinds)

    def add_prefill_chunk(
        self,
        request_id: str,
        cache_id: str,
        tokens: Sequence[int],
        position: int,
        total_prompt_tokens: int,
        *,
        maximum_sequence_tokens: int = 0,
        sampling: SamplingOptions = GREEDY,
        allow_narrowing: bool = False,
    ) -> int:
        """Add tokens [position, position + len(tokens)) of a prompt; cache_id "" opens one.
        With allow_narrowing the executor may run only the prefix that fits (the result's
        completed_num_tokens says how much)."""
        index = self._add(
            pb.ITEM_KIND_PREFILL_CHUNK,
            request_id,
            cache_id,
            tokens,
            position,
            total_prompt_tokens,
            maximum_sequence_tokens,
            sampling,
        )
        self._narrowing[index] = allow_narrowing
        return index

    def add_decode(
        self,
        request_id: str,
        cache_id: str,
        token: int,
        position: int,
        *,
        sampling: SamplingOptions = GREEDY,
    ) -> int:
        """Add one decode step feeding `token` at `position` (the cache's committed length)."""
        return self._add(
            pb.ITEM_KIND_DECODE, request_id, cache_id, [token], position, 0, 0, sampling
        )

    def add_continuation(
        self,
        request_id: str,
        cache_id: str,
        position: int,
        *,
        sampling: SamplingOptions = GREEDY,
    ) -> int:
        """Add one decode step at `position` (the cache's committed length) fed the token the
        cache's last item selected, which the executor holds (continue_decode; needs
        supports_decode_continuation). It carries no token, so it can be sent before the
        answer that names that token arrives."""
        index = self._add(pb.ITEM_KIND_DECODE, request_id, cache_id, [], position, 0, 0, sampling)
        self._continuations[index] = True
        return index

    def _add(
        self,
        kind: pb.ItemKind.ValueType,
        request_id: str,
        cache_id: str,
        tokens: Sequence[int],
        position: int,
        total: int,
        max_tokens: int,
        sampling: SamplingOptions,
    ) -> int:
        items = self.items
        items.kinds.append(kind)
        items.request_ids.append(request_id)
        items.cache_ids.append(cache_id)
        items.num_tokens.append(len(tokens))
        items.token_ids.extend(tokens)
        items.positions.append(position)
        items.total_prompt_tokens.append(total)
        items.maximum_sequence_tokens.append(max_tokens)
        self._sampling.append(sampling)
        self._narrowing.append(False)
        self._continuations.append(False)
        return len(items.kinds) - 1

    def build(self) -> pb.BatchItems:
        items = pb.BatchItems()
        items.CopyFrom(self.items)
        fill_sampling_columns(items.sampling, self._sampling)
        if any(self._narrowing):  # the column stays empty (false for all) otherwise
            items.allow_narrowing.extend(self._narrowing)
        if any(self._continuations):  # likewise
            items.continue_decode.extend(self._continuations)
        return items


@dataclass(frozen=True, slots=True)
class ItemView:
    """One item's result, read out of the columnar BatchResults."""

    status: int
    cache_id: str
    committed_tokens: int
    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    logits: bytes
    deferral: pb.ExecutionDeferral | None
    error: pb.ItemError | None = None
    # Tokens of the item that ran: fewer than it carried for a narrowed prefill chunk.
    completed_num_tokens: int = 0
    # Failed capacity probes before it ran (1 for a narrowed chunk).
    capacity_probe_count: int = 0

    @property
    def deferred(self) -> bool:
        return self.status == pb.ITEM_STATUS_DEFERRED

    @property
    def failed(self) -> bool:
        """The item failed in the forward (see `error`); nothing was committed for it."""
        return self.status == pb.ITEM_STATUS_FAILED

    @property
    def has_token(self) -> bool:
        return self.status == pb.ITEM_STATUS_TOKEN


def item_views(results: pb.BatchResults) -> list[ItemView]:
    """Split columnar results into per-item views (input order)."""
    deferrals = {d.item_index: d for d in results.deferrals}
    errors = {e.item_index: e for e in results.errors}
    views: list[ItemView] = []
    top_start = 0
    for i, status in enumerate(results.statuses):
        num_top = results.num_top_logprobs[i] if results.num_top_logprobs else 0
        views.append(
            ItemView(
                status=status,
                cache_id=results.cache_ids[i],
                committed_tokens=results.committed_tokens[i],
                token_id=results.token_ids[i],
                logprob=results.token_logprobs[i],
                top_token_ids=list(results.top_token_ids[top_start : top_start + num_top]),
                top_logprobs=list(results.top_logprobs[top_start : top_start + num_top]),
                logits=results.logits[i] if results.logits else b"",
                deferral=deferrals.get(i),
                error=errors.get(i),
                completed_num_tokens=_entry(results.completed_num_tokens, i),
                capacity_probe_count=_entry(results.capacity_probe_counts, i),
            )
        )
        top_start += num_top
    return views


def _entry(column: Sequence[int], index: int) -> int:
    """A result column's entry; 0 when the executor did not send the column (older ones)."""
    return column[index] if column else 0
