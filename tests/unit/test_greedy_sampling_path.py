"""The runner's plain-greedy path: a step whose every row is a plain argmax samples with
``SamplingTensors.greedy`` instead of building per-row tensors, with the same results."""

from __future__ import annotations

import random

import pytest
import torch
from ferrum_kernels.sampling import (
    GREEDY_TEMPERATURE_FLOOR,
    SamplingTensors,
    build_sampling_tensors,
    sample,
)
from ferrum_server.config import EngineConfig
from ferrum_server.domain import GREEDY, Sampling
from ferrum_server.engine import Engine
from ferrum_server.runner import plain_greedy
from helpers_engine import decode_with


@pytest.mark.parametrize(
    ("settings", "plain"),
    [
        ([GREEDY, GREEDY], True),
        ([Sampling(temperature=GREEDY_TEMPERATURE_FLOOR / 2)], True),
        ([Sampling(top_k=5, top_p=0.5, seed=7)], True),  # ignored by a greedy row
        ([Sampling(repetition_penalty=0.0)], True),  # 0 means off, as 1.0
        ([GREEDY, Sampling(temperature=0.7)], False),
        ([Sampling(temperature=GREEDY_TEMPERATURE_FLOOR)], False),
        ([Sampling(repetition_penalty=1.2)], False),
        ([Sampling(token_mask=b"\x01")], False),
        ([GREEDY, Sampling(num_logprobs=2)], False),
    ],
)
def test_which_steps_are_plain_greedy(settings: list[Sampling], plain: bool) -> None:
    assert plain_greedy(settings) is plain


def test_greedy_tensors_sample_as_the_general_builder_does() -> None:
    """The path's premise: for greedy rows without penalty, mask or top-n, the general builder's
    tensors (whatever top-k, top-p, seeds and offsets say) and ``SamplingTensors.greedy`` give
    identical tokens and log-probs, ties included."""
    gen = torch.Generator().manual_seed(0)
    n, vocab = 9, 301
    logits = torch.randn(n, vocab, generator=gen)
    logits[3, 10] = logits[3, 200] = logits[3].max() + 1.0  # a tie: the lower id wins
    rng = random.Random(1)
    built = build_sampling_tensors(
        temperature=[0.0] * n,
        top_k=[rng.randrange(0, 50) for _ in range(n)],
        top_p=[rng.random() for _ in range(n)],
        seeds=[rng.randrange(2**63) for _ in range(n)],
        offsets=[rng.randrange(1000) for _ in range(n)],
        repetition_penalty=[1.0] * n,
        penalty_ids=None,
        token_mask_bits=None,
        num_logprobs=0,
        vocab_size=vocab,
        device="cpu",
    )
    general = sample(logits, built)
    fast = sample(logits, SamplingTensors.greedy(n, "cpu"))
    assert torch.equal(fast.token_ids, general.token_ids)
    assert torch.equal(fast.logprobs, general.logprobs)
    assert fast.token_ids[3].item() == 10
    assert fast.top_ids.shape == general.top_ids.shape == (n, 0)


def _decode_results(settings: list[Sampling]) -> list[tuple[list[int], list[float]]]:
    """Four prompts prefilled on a fresh tiny engine, then three decode steps with the given
    sampling per item: each item's tokens and log-probs over the steps."""
    engine = Engine(EngineConfig(model="tiny", kv_cache_bytes=16 * 1024**2))
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 200) for _ in range(5 + 3 * i)] for i in range(4)]
    try:
        return decode_with(engine, prompts, settings, 3)
    finally:
        engine.shutdown()


def test_a_plain_greedy_step_answers_as_the_general_path() -> None:
    """Through the engine: a step of plain greedy rows (the fast path) and the same step with
    one row asking for top log-probs (the general builder) choose the same tokens with the same
    log-probs."""
    fast = _decode_results([GREEDY] * 4)
    general = _decode_results([GREEDY, GREEDY, Sampling(num_logprobs=2), GREEDY])
    assert fast == general
