"""Gemma 2 and Gemma 3 through the engine (CPU backend, prefix caching on): batched greedy
decoding and a prefix-cache hit past the sliding window give transformers' greedy tokens."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ferrum_server.capacity import Admitted
from ferrum_server.config import EngineConfig
from ferrum_server.domain import ItemKind, Step, StepItem
from ferrum_server.engine import Engine
from ferrum_server.models import GemmaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers_engine import greedy_decode
from helpers_models import GEMMA_FAMILIES, GEMMA_WINDOW, hf_greedy, save_gemma

VOCAB = 256


@pytest.fixture(scope="module", params=GEMMA_FAMILIES)
def served(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[torch.nn.Module, Engine]]:
    folder = tmp_path_factory.mktemp(request.param)
    hf = save_gemma(folder, request.param, VOCAB)
    engine = Engine(
        EngineConfig(
            model=str(folder),
            block_size=4,
            kv_cache_bytes=2 * 1024**2,
            max_batch_tokens=64,
            max_batch_size=8,
            prefix_caching=True,
        )
    )
    assert isinstance(engine.model, GemmaForCausalLM)
    assert GEMMA_WINDOW in engine.model_config.sliding_windows
    assert 0 in engine.model_config.sliding_windows  # global layers too
    yield hf, engine
    engine.shutdown()


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_batched_greedy_matches_transformers(served: tuple[torch.nn.Module, Engine]) -> None:
    hf, engine = served
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (22, 5, 13)]
    got = greedy_decode(engine, prompts, 11)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(hf, prompt, 12)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_prefix_cache_hit_past_the_window(served: tuple[torch.nn.Module, Engine]) -> None:
    hf, engine = served
    prompt = torch.randint(0, VOCAB, (22,), generator=torch.Generator().manual_seed(2)).tolist()
    greedy_decode(engine, [prompt], 1)  # leaves the prompt's 5 full blocks in the prefix cache
    other = [*prompt[:20], 7, 9, 11]
    admitted = engine.try_admit("b", other, 0, len(other), 0)
    assert isinstance(admitted, Admitted) and admitted.cached_prompt_tokens == 20
    first = StepItem(ItemKind.PREFILL_CHUNK, "b", admitted.cache_id, other[20:], 20, len(other))
    tokens = engine.execute(Step([first])).results[0].token_ids
    for k in range(7):
        item = StepItem(ItemKind.DECODE, "b", admitted.cache_id, [tokens[-1]], len(other) + k)
        tokens.append(engine.execute(Step([item])).results[0].token_ids[0])
    engine.release(admitted.cache_id)
    assert tokens == hf_greedy(hf, other, 8)
