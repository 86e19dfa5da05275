"""A sliding-window model (Mistral, window 6) served over gRPC and driven by the reference
scheduler: chunked prefills crossing the window edge share steps with decodes far past it, and
every request's greedy tokens equal transformers' on the same weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers_models import save_windowed_mistral
from helpers_parity import check_scheduler_matches_transformers, random_prompts, serve_folder
from helpers_server import LiveServer

WINDOW = 6
VOCAB = 256


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    folder = tmp_path_factory.mktemp("mistral_window_grpc")
    hf = save_windowed_mistral(folder, WINDOW, VOCAB, head_dim=32)
    return hf, folder


@pytest.fixture(scope="module")
def server(hf_model: tuple[torch.nn.Module, Path]) -> Iterator[LiveServer]:
    yield from serve_folder(str(hf_model[1]))


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_scheduler_over_grpc_matches_transformers(
    server: LiveServer, hf_model: tuple[torch.nn.Module, Path]
) -> None:
    prompts = random_prompts((9, 23, 4, 31, 14, 17), VOCAB)
    check_scheduler_matches_transformers(server, hf_model[0], prompts)
    engine = server.engine
    assert engine.model_config.sliding_windows == (WINDOW, WINDOW)  # type: ignore[attr-defined]
