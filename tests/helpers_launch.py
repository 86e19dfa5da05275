"""Driving an Engine step by step with steps launched ahead (Engine.launch before the previous
step's finish) and, for reference, one step at a time with explicit tokens (Engine.execute)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from ferrum_server.domain import GREEDY, ItemKind, ItemResult, ItemStatus, Sampling, Step, StepItem
from ferrum_server.engine import Engine, LaunchedStep
from ferrum_server.models import tiny_config

BLOCK = 4
VOCAB = tiny_config().vocab_size


@dataclass
class Request:
    rid: str
    prompt: list[int]
    out_len: int
    sampling: Sampling = GREEDY
    cache_id: str = ""
    prefilled: int = 0  # prompt tokens in launched steps
    launched_outputs: int = 0  # outputs of launched steps
    tokens: list[int] = field(default_factory=list)  # outputs answered so far

    @property
    def done_launching(self) -> bool:
        return self.prefilled == len(self.prompt) and self.launched_outputs == self.out_len


def make_requests(count: int, seed: int = 0) -> list[Request]:
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, VOCAB, (2 * BLOCK,), generator=gen).tolist()
    requests = []
    for r in range(count):
        length = 3 + (7 * r) % 19
        own = torch.randint(0, VOCAB, (length,), generator=gen).tolist()
        # Every third prompt starts with the same two blocks (prefix caching registers them).
        prompt = shared + own if r % 3 == 0 else own
        sampling = Sampling(temperature=0.9, top_p=0.9, seed=100 + r) if r % 2 else GREEDY
        requests.append(Request(f"r{r}", prompt, 2 + (5 * r) % 9, sampling))
    return requests


def _build(
    requests: list[Request], budget: int, explicit: bool
) -> tuple[list[StepItem], list[Request]]:
    """The next step: every decoding request decodes, then prompt chunks fill the budget.
    `explicit`: decodes carry their input token (all earlier steps finished), else they
    continue from the token their cache selected."""
    items: list[StepItem] = []
    owners: list[Request] = []
    for req in requests:
        if req.done_launching or req.prefilled < len(req.prompt):
            continue
        position = len(req.prompt) + req.launched_outputs - 1
        if explicit:
            item = StepItem(
                ItemKind.DECODE,
                req.rid,
                req.cache_id,
                [req.tokens[-1]],
                position,
                sampling=req.sampling,
            )
        else:
            item = StepItem(
                ItemKind.DECODE,
                req.rid,
                req.cache_id,
                [],
                position,
                sampling=req.sampling,
                continuation=True,
            )
        items.append(item)
        owners.append(req)
        req.launched_outputs += 1
        budget -= 1
    for req in requests:
        if budget <= 0:
            break
        if req.prefilled == len(req.prompt):
            continue
        chunk = req.prompt[req.prefilled : req.prefilled + budget]
        items.append(
            StepItem(
                ItemKind.PREFILL_CHUNK,
                req.rid,
                req.cache_id,
                chunk,
                req.prefilled,
                len(req.prompt),
                sampling=req.sampling,
            )
        )
        owners.append(req)
        req.prefilled += len(chunk)
        req.launched_outputs += int(req.prefilled == len(req.prompt))
        budget -= len(chunk)
    return items, owners


def _answer(owners: list[Request], results: list[ItemResult]) -> None:
    for req, result in zip(owners, results, strict=True):
        assert result.status in (ItemStatus.TOKEN, ItemStatus.INTERMEDIATE), result
        req.cache_id = result.cache_id
        req.tokens.extend(result.token_ids)


def _finish_done(engine: Engine, requests: list[Request], ended: dict[str, tuple]) -> None:
    """Record and release the caches of requests whose every output is answered."""
    for req in requests:
        if req.rid not in ended and len(req.tokens) == req.out_len:
            cache = engine.kv.caches[req.cache_id]
            assert cache.unresolved_position == -1
            ended[req.rid] = (list(cache.token_ids), list(cache.block_hashes))
            engine.release(req.cache_id)


def run_sequential(engine: Engine, requests: list[Request], budget: int) -> dict[str, tuple]:
    """One step at a time with explicit tokens; per request (outputs, tokens, block hashes)."""
    ended: dict[str, tuple] = {}
    while len(ended) < len(requests):
        items, owners = _build(requests, budget, explicit=True)
        _answer(owners, engine.execute(Step(items)).results)
        _finish_done(engine, requests, ended)
    return {r.rid: (r.tokens, *ended[r.rid]) for r in requests}


def run_ahead(
    engine: Engine, requests: list[Request], budget: int, in_flight_seen: list[int]
) -> dict[str, tuple]:
    """Each step launched before the previous one is finished (continuation decodes)."""
    ended: dict[str, tuple] = {}
    flight: deque[tuple[LaunchedStep, list[Request]]] = deque()
    while len(ended) < len(requests):
        items, owners = _build(requests, budget, explicit=False)
        if items:
            launched = engine.launch(Step(items))
            for index, req in enumerate(owners):
                req.cache_id = launched.cache_id(index)  # opened at launch
            flight.append((launched, owners))
            in_flight_seen.append(len(engine._launched))
        if flight and (len(flight) > 1 or not items):
            launched, done_owners = flight.popleft()
            _answer(done_owners, engine.finish(launched).results)
            _finish_done(engine, requests, ended)
    return {r.rid: (r.tokens, *ended[r.rid]) for r in requests}


class Decoding:
    """Prompts prefilled in one step (`Engine.execute`), then decoded together by continuation
    steps: `step(k)` is every prompt's decode at its k-th output after the first."""

    def __init__(self, engine: Engine, prompts: list[list[int]]) -> None:
        self.prompts = prompts
        opened = engine.execute(
            Step(
                [
                    StepItem(ItemKind.PREFILL_CHUNK, f"q{r}", "", p, 0, len(p))
                    for r, p in enumerate(prompts)
                ]
            )
        )
        self.caches = [result.cache_id for result in opened.results]

    def step(self, offset: int) -> Step:
        return Step(
            [
                StepItem(
                    ItemKind.DECODE, f"q{r}", self.caches[r], [], len(p) + offset, continuation=True
                )
                for r, p in enumerate(self.prompts)
            ]
        )
