"""A Phi-3 (fused checkpoint tensors, window 6 on every layer, LongRoPE with an original length
of 16) served over gRPC and driven by the reference scheduler: chunked prefills crossing the
window edge share steps with decodes far past it, and every request's greedy tokens equal
transformers' on the same weights. Every prompt is longer than the original length, where
transformers uses LongRoPE's long factors, as a server admitting the model's full 256 positions
does for every sequence."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers_models import longrope_scaling, save_phi3
from helpers_parity import check_scheduler_matches_transformers, random_prompts, serve_folder
from helpers_server import LiveServer

WINDOW = 6
ORIGINAL = 16
VOCAB = 256


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    folder = tmp_path_factory.mktemp("phi3_grpc")
    hf = save_phi3(
        folder,
        VOCAB,
        sliding_window=WINDOW,
        original_max_position_embeddings=ORIGINAL,
        rope_scaling=longrope_scaling(32),
    )
    return hf, folder


@pytest.fixture(scope="module")
def server(hf_model: tuple[torch.nn.Module, Path]) -> Iterator[LiveServer]:
    yield from serve_folder(str(hf_model[1]))


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_scheduler_over_grpc_matches_transformers(
    server: LiveServer, hf_model: tuple[torch.nn.Module, Path]
) -> None:
    prompts = random_prompts((17, 23, 40, 31, 19, 26), VOCAB)
    check_scheduler_matches_transformers(server, hf_model[0], prompts)
    config = server.engine.model_config  # type: ignore[attr-defined]
    assert config.model_type == "phi3" and config.sliding_windows == (WINDOW, WINDOW)
