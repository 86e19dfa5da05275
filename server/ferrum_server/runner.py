"""Turns a validated, capacity-checked batch into one forward pass and sampled outputs.

All items are flattened into one token dimension T; only attention sees the per-item split.
Only rows that produce output (final chunks, decodes, verify positions) go through the LM head.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
from ferrum_kernels.backend import KernelBackend, select_backend
from ferrum_kernels.sampling import (
    GREEDY_TEMPERATURE_FLOOR,
    SampleOutput,
    SamplingTensors,
    build_sampling_tensors,
)
from ferrum_kernels.transfer import ints_to_device, to_device

from ferrum_server.cuda_graphs import DecodeGraphs
from ferrum_server.device_tokens import DeviceToken, place_device_tokens
from ferrum_server.domain import ItemKind, OutputPolicy, PenaltyScope, Sampling, StepItem
from ferrum_server.kv.block_table import padded_block_table
from ferrum_server.kv.manager import Cache
from ferrum_server.models import CausalLM
from ferrum_server.parallel.plan import ForwardPlan, PlanSender


@dataclass(frozen=True, slots=True)
class ForwardOutput:
    """Per output row (in item order): either sampled tokens or raw logits."""

    sampled: SampleOutput | None  # rows of TOKEN-policy outputs
    token_rows: list[int]  # output row index -> position in `sampled`
    logits_rows: dict[int, bytes]  # output row index -> float32 logits bytes
    forward_ns: int
    sample_ns: int
    graphed: bool = False  # the forward replayed a CUDA graph
    collective_ns: int = 0  # in tensor-parallel collectives (0 on one rank)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        vocab_size: int,
        device: torch.device,
        kernels: KernelBackend | None = None,  # None: what select_backend(device) picks
    ) -> None:
        self.model = model
        self.kernels = kernels if kernels is not None else select_backend(device)
        # The model runs every forward with these kernels, its weights prepared for them (on
        # CPU: pre-packed oneDNN linears); binding again (another runner) changes nothing.
        model.bind_backend(self.kernels)
        self.kv_cache = kv_cache  # [L, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        # Captured decode forwards (set by the engine after capture); None = always eager.
        self.graphs: DecodeGraphs | None = None
        # On rank 0 of a tensor-parallel group: where each forward's plan is sent first.
        self.followers: PlanSender | None = None

    @torch.inference_mode()
    def run(
        self,
        items: list[StepItem],
        caches: list[Cache],
        device_tokens: dict[int, DeviceToken] | None = None,
    ) -> ForwardOutput:
        """Run one forward over `items` whose caches already hold blocks for the new tokens.

        `device_tokens`: index into `items` -> the input token of that decode, still on the
        device (its token_ids hold a placeholder)."""
        started = time.perf_counter_ns()
        if self._graphable(items, caches):
            return self._run_graph(items, caches, started, device_tokens or {})
        plan = self._plan(items, caches)
        if device_tokens:  # a decode's one token is its item's first row
            rows = {plan.query_start[index]: token for index, token in device_tokens.items()}
            place_device_tokens(plan.token_ids, rows)
        if self.followers is not None:
            self.followers.forward(plan)  # the other ranks run the same forward on their shard
        hidden = self._output_hidden(plan)  # [R, hidden]
        if hidden is None:
            elapsed = time.perf_counter_ns() - started
            return ForwardOutput(None, [], {}, elapsed, 0, collective_ns=self.model.tp.clock.take())
        if _greedy_only(items):
            # Every output row takes its plain argmax: where the LM head's GEMM folds the choice
            # as it stores, the [R, vocab] logits are never written (None: sample them).
            greedy = self.model.greedy_tokens(hidden)
            if greedy is not None:
                return self._greedy_output(*greedy, started)
        logits = self.model.compute_logits(hidden)  # [R, vocab] float32
        forwarded = time.perf_counter_ns()
        sampled, token_rows, logits_rows = self._select(items, caches, logits)
        finished = time.perf_counter_ns()
        return ForwardOutput(
            sampled,
            token_rows,
            logits_rows,
            forwarded - started,
            finished - forwarded,
            collective_ns=self.model.tp.clock.take(),
        )

    def run_plan(self, plan: ForwardPlan) -> torch.Tensor | None:
        """The forward itself, as every rank runs it: the logits [R, vocab] (float32) of the
        plan's output rows, or None when it has none."""
        hidden = self._output_hidden(plan)
        return None if hidden is None else self.model.compute_logits(hidden)

    def _output_hidden(self, plan: ForwardPlan) -> torch.Tensor | None:
        """The forward up to the LM head: the final hidden states [R, hidden] of the plan's
        output rows, or None when it has none."""
        input_ids, positions, meta = plan.inputs(self.block_size)
        # The model finishes only the output rows (its last layer past the KV write): [R, hidden]
        hidden = self.model(input_ids, positions, self.kv_cache, meta, plan.outputs(meta))
        return hidden if plan.output_rows.numel() else None

    def _greedy_output(
        self, token_ids: torch.Tensor, logprobs: torch.Tensor, started: int
    ) -> ForwardOutput:
        """The step's output from the LM head's folded greedy choice: every output row a token
        row, in order, as ``_select`` lays them out; no top-n (plain greedy rows ask none)."""
        forwarded = time.perf_counter_ns()
        rows = int(token_ids.shape[0])
        none = torch.empty(rows, 0, dtype=torch.int64, device=token_ids.device)
        sampled = SampleOutput(
            token_ids=token_ids,
            logprobs=logprobs,
            top_ids=none,
            top_logprobs=none.to(torch.float32),
        )
        finished = time.perf_counter_ns()
        return ForwardOutput(
            sampled,
            list(range(rows)),
            {},
            forwarded - started,
            finished - forwarded,
            collective_ns=self.model.tp.clock.take(),
        )

    def _plan(self, items: list[StepItem], caches: list[Cache]) -> ForwardPlan:
        """The step flattened into one token dimension, with the rows whose logits it needs."""
        counts = [len(item.token_ids) for item in items]
        query_start = [0, *itertools.accumulate(counts)]
        device = self.device
        flat_tokens = list(itertools.chain.from_iterable(item.token_ids for item in items))
        block_ids = [cache.block_ids for cache in caches]
        table = padded_block_table(block_ids, max(map(len, block_ids)))
        output_rows: list[int] = []  # flat token rows that go through the LM head
        output_counts: list[int] = []  # per item: its last rows among them
        for index, item in enumerate(items):
            n = item.num_outputs
            output_counts.append(n)
            output_rows.extend(range(query_start[index + 1] - n, query_start[index + 1]))
        # Token ids and output rows in one copy; none waits for the device (`to_device`).
        flat = ints_to_device([*flat_tokens, *output_rows], device)
        return ForwardPlan(
            token_ids=flat[: len(flat_tokens)],
            query_start=query_start,
            offsets=[item.position for item in items],
            context_lens=[item.end for item in items],
            block_tables=to_device(table, device),
            output_rows=flat[len(flat_tokens) :],
            output_counts=output_counts,
        )

    def _graphable(self, items: list[StepItem], caches: list[Cache]) -> bool:
        """Decode-only steps within the captured buckets replay a graph; the rest run eagerly."""
        graphs = self.graphs
        if graphs is None or not all(
            item.kind == ItemKind.DECODE and len(item.token_ids) == 1 for item in items
        ):
            return False
        return graphs.accepts(len(items), max(len(cache.block_ids) for cache in caches))

    def _run_graph(
        self,
        items: list[StepItem],
        caches: list[Cache],
        started: int,
        device_tokens: dict[int, DeviceToken],
    ) -> ForwardOutput:
        assert self.graphs is not None
        logits = self.graphs.run(
            [item.token_ids[0] for item in items],
            [item.position for item in items],
            [cache.block_ids for cache in caches],
            device_tokens,
        )  # [B, vocab] float32: every decode item has exactly one output row
        forwarded = time.perf_counter_ns()
        sampled, token_rows, logits_rows = self._select(items, caches, logits)
        finished = time.perf_counter_ns()
        return ForwardOutput(
            sampled, token_rows, logits_rows, forwarded - started, finished - forwarded, True
        )

    def _select(
        self, items: list[StepItem], caches: list[Cache], logits: torch.Tensor
    ) -> tuple[SampleOutput | None, list[int], dict[int, bytes]]:
        token_rows: list[int] = []
        logits_rows: dict[int, bytes] = {}
        row_items: list[tuple[StepItem, Cache, int]] = []  # (item, cache, position sampled)
        row = 0
        for item, cache in zip(items, caches, strict=True):
            num_outputs = item.num_outputs
            if not num_outputs:
                continue
            # The token chosen at output k sits at position end - num_outputs + k + 1.
            first = item.end - num_outputs + 1
            if item.sampling.policy == OutputPolicy.LOGITS:
                for r in range(row, row + num_outputs):
                    logits_rows[r] = logits[r].to("cpu").numpy().astype("<f4").tobytes()
            elif num_outputs == 1:  # a decode or a final chunk: the common case
                token_rows.append(row)
                row_items.append((item, cache, first))
            else:
                token_rows.extend(range(row, row + num_outputs))
                row_items.extend((item, cache, first + k) for k in range(num_outputs))
            row += num_outputs
        if not token_rows:
            return None, token_rows, logits_rows
        selected = logits if len(token_rows) == row else logits[token_rows]
        params = [item.sampling for item, _, _ in row_items]
        if plain_greedy(params):
            # Every row takes its argmax with no penalty, mask or top-n: the per-row lists and
            # the host->device copies of the general builder would all be discarded.
            greedy = SamplingTensors.greedy(len(params), self.device)
            return self.kernels.sample(selected, greedy), token_rows, logits_rows
        penalised = any(p.repetition_penalty not in (0.0, 1.0) for p in params)
        masked = any(p.token_mask for p in params)
        tensors = build_sampling_tensors(
            temperature=[p.temperature for p in params],
            top_k=[p.top_k for p in params],
            top_p=[p.top_p or 1.0 for p in params],
            seeds=[p.seed for p in params],
            offsets=[position for _, _, position in row_items],
            repetition_penalty=[p.repetition_penalty or 1.0 for p in params],
            penalty_ids=_penalty_context(row_items) if penalised else None,
            penalty_start=_penalty_start(row_items) if penalised else None,
            token_mask_bits=[p.token_mask or None for p in params] if masked else None,
            num_logprobs=max(p.num_logprobs for p in params),
            vocab_size=self.vocab_size,
            device=self.device,
        )
        return self.kernels.sample(selected, tensors), token_rows, logits_rows


def _greedy_only(items: list[StepItem]) -> bool:
    """Whether every output row of the step is a token row taking its plain argmax (no row
    asks for its logits, ``plain_greedy`` holds for the rest): then no row needs the logits."""
    params = [item.sampling for item in items if item.num_outputs]
    return all(p.policy != OutputPolicy.LOGITS for p in params) and plain_greedy(params)


def plain_greedy(params: list[Sampling]) -> bool:
    """Whether every row's sampling is a plain argmax: greedy (temperature under the floor),
    no repetition penalty, no token mask, no top-n log-probs. Such rows sample exactly as
    ``SamplingTensors.greedy`` says (top-k, top-p and seed do not touch a greedy row). Rows
    converted from one call share one settings object, so each distinct one is checked once."""
    seen: set[int] = set()
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        if (
            p.temperature >= GREEDY_TEMPERATURE_FLOOR
            or p.repetition_penalty not in (0.0, 1.0)
            or p.token_mask
            or p.num_logprobs
        ):
            return False
    return True


def _penalty_context(row_items: list[tuple[StepItem, Cache, int]]) -> list[list[int]]:
    """Every context token up to the sampled position (HF convention); `_penalty_start` says
    where each row's scope begins within it."""
    context: list[list[int]] = []
    for item, cache, position in row_items:
        if item.sampling.repetition_penalty in (0.0, 1.0):
            context.append([])
            continue
        # cache.token_ids holds tokens before item.position; the item's own tokens follow.
        upto = position - item.position
        context.append(cache.token_ids + item.token_ids[:upto])
    return context


def _penalty_start(row_items: list[tuple[StepItem, Cache, int]]) -> list[int]:
    """Where each row's penalty scope starts in its context: 0 (prompt and outputs), or the end
    of the product prompt (outputs only; a cache's first chunk has not recorded it yet)."""
    return [
        (cache.prompt_tokens or item.total_prompt_tokens)
        if item.sampling.penalty_scope == PenaltyScope.OUTPUTS_ONLY
        else 0
        for item, cache, _ in row_items
    ]
