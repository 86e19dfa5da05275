"""A sliding-window model (Mistral, window 6) through the engine: prefix-cache hits and
ForwardVerify + TruncateKv give transformers' greedy tokens, with prompts longer than the window.
The kernels never free KV that the window hides: every block stays allocated, so the capacity
accounting is the same as for a global model."""

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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers_engine import greedy_decode
from helpers_models import hf_greedy, save_windowed_mistral

WINDOW = 6
VOCAB = 256


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    folder = tmp_path_factory.mktemp("mistral_window")
    hf = save_windowed_mistral(folder, WINDOW, VOCAB)
    return hf, folder


@pytest.fixture(scope="module")
def engine(hf_folder: tuple[torch.nn.Module, Path]) -> Iterator[Engine]:
    built = Engine(
        EngineConfig(
            model=str(hf_folder[1]),
            block_size=4,
            kv_cache_bytes=2 * 1024**2,
            max_batch_tokens=64,
            max_batch_size=8,
            prefix_caching=True,
        )
    )
    assert built.model_config.sliding_windows == (WINDOW, WINDOW)
    yield built
    built.shutdown()


@torch.no_grad()
def _decode(engine: Engine, request_id: str, cache_id: str, token: int, position: int) -> int:
    item = StepItem(ItemKind.DECODE, request_id, cache_id, [token], position)
    return engine.execute(Step([item])).results[0].token_ids[0]


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_prefix_cache_hit_past_the_window(
    engine: Engine, hf_folder: tuple[torch.nn.Module, Path]
) -> None:
    hf = hf_folder[0]
    prompt = torch.randint(0, VOCAB, (22,), generator=torch.Generator().manual_seed(1)).tolist()
    assert greedy_decode(engine, [prompt], 9)[0] == hf_greedy(hf, prompt, 10)
    # A second prompt sharing the first 20 tokens (5 full blocks, now cached).
    other = [*prompt[:20], 7, 9, 11]
    admitted = engine.try_admit("b", other, 0, len(other), 0)
    assert isinstance(admitted, Admitted) and admitted.cached_prompt_tokens == 20
    first = StepItem(ItemKind.PREFILL_CHUNK, "b", admitted.cache_id, other[20:], 20, len(other))
    tokens = engine.execute(Step([first])).results[0].token_ids
    for k in range(7):
        tokens.append(_decode(engine, "b", admitted.cache_id, tokens[-1], len(other) + k))
    engine.release(admitted.cache_id)
    assert tokens == hf_greedy(hf, other, 8)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_forward_verify_then_truncate_past_the_window(
    engine: Engine, hf_folder: tuple[torch.nn.Module, Path]
) -> None:
    prompt = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(2)).tolist()
    want = hf_greedy(hf_folder[0], prompt, 10)  # t0 .. t9
    opened = StepItem(ItemKind.PREFILL_CHUNK, "v", "", prompt, 0, len(prompt))
    result = engine.execute(Step([opened])).results[0]
    cache_id, t0 = result.cache_id, result.token_ids[0]
    assert t0 == want[0]
    # Verify [t0, t1, t2, wrong, wrong]: two drafts accepted, then the rest is rejected.
    drafts = [want[1], want[2], (want[3] + 1) % VOCAB, 3]
    verify = StepItem(ItemKind.VERIFY, "v", cache_id, [t0, *drafts], len(prompt))
    outputs = engine.execute(Step([verify])).results[0].token_ids
    assert outputs[:3] == want[1:4]
    # Keep [prompt, t0, t1, t2] and go on decoding from t3, well past the window.
    cache, _ = engine.truncate(cache_id, len(prompt) + 3)
    assert cache.num_tokens == len(prompt) + 3
    tokens = [want[3]]
    for k in range(6):
        tokens.append(_decode(engine, "v", cache_id, tokens[-1], len(prompt) + 3 + k))
    engine.release(cache_id)
    assert tokens == want[3:10]
