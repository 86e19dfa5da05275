"""The CPU backend's whole-layer decode step (``cpu_decode_layer.NativeDecodeLayer``) and every
layer's in one call (``NativeDecodeLayers``, and its ``prefill`` for every layer but the last of
a prompt step): bit for bit the generic path's logits and KV, on the steps they serve; the
generic path on every other step and for every layer it does not serve; and greedy tokens as
transformers picks them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from ferrum_kernels import native
from ferrum_kernels.backend import cpu_backend
from ferrum_server.models import load_model
from ferrum_server.models.llama import DecoderLayer
from helpers_models import PagedRunner, build_meta, check_greedy_against_transformers
from transformers import AutoModelForCausalLM, LlamaConfig

# head_dim 64 (the decode kernel's sizes), grouped query heads.
CONFIG = dict(
    vocab_size=300,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.08,
)


def _model(tmp_path: Path, dtype: torch.dtype, **overrides: Any) -> Any:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**{**CONFIG, **overrides}))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model, config = load_model(str(tmp_path), dtype=dtype, device=torch.device("cpu"))
    model.bind_backend(cpu_backend())
    return model, config


def _layers(model: Any) -> list[DecoderLayer]:
    return [layer for layer in model.layers if isinstance(layer, DecoderLayer)]


class _Spy:
    """Wraps a layer's decode_layer and records whether each call served the step."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self.served = fn, []

    def __call__(self, *args: Any) -> Any:
        out = self.fn(*args)
        self.served.append(out is not None)
        return out


def _check_decode_steps(
    runner: PagedRunner, tokens: list[int], spies: list[_Spy], use: Callable[[bool], None]
) -> None:
    """Four decode steps (the last with a prefill chunk beside them), each run with the fast
    path in use and again from the same state without it: logits and KV bit for bit, and every
    spy served the decode-only steps and not the last."""
    for step in range(4):
        decodes = [(i, [t]) for i, t in enumerate(tokens)]
        if step == 3:  # a prefill chunk beside the decodes: the whole step goes generic
            decodes.append((3, [1, 2, 3]))
        before = runner.snapshot()
        marks = [len(spy.served) for spy in spies]
        use(True)
        got = runner.step(decodes)
        kv_got = runner.kv_cache.clone()
        for spy, mark in zip(spies, marks, strict=True):
            if step < 3:
                assert spy.served[mark:] == [True]
            else:  # asked and declined, or not asked
                assert not any(spy.served[mark:])
        runner.restore(before)
        use(False)
        want = runner.step(decodes)
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
        assert torch.equal(kv_got, runner.kv_cache)
        tokens = [int(logits[-1].argmax()) for logits in got[:3]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_decode_steps_match_the_generic_path_bit_for_bit(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    assert native.load() is not None, "the native kernels must build here"
    model, config = _model(tmp_path, dtype)
    model.decode_layers = None  # each layer's own step (the one-call step: the next test)
    layers = _layers(model)
    fast = [layer.decode_layer for layer in layers]
    assert all(fn is not None for fn in fast)
    spies = [_Spy(fn) for fn in fast]  # type: ignore[arg-type]
    runner = PagedRunner(model, config, num_blocks=64, block_size=16, shuffle=True)
    rng = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=rng).tolist() for n in (5, 23, 40)]

    def use(on: bool) -> None:
        for layer, spy in zip(layers, spies, strict=True):
            layer.decode_layer = spy if on else None

    use(True)
    runner.step(list(enumerate(prompts)))  # prefill chunks: the generic path
    assert not any(s for spy in spies for s in spy.served)
    _check_decode_steps(runner, [7, 11, 13], spies, use)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_every_layer_in_one_call_matches_the_layers_calls_bit_for_bit(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """NativeDecodeLayers (the model's decode_layers): the logits and KV of the layers' own
    calls, bit for bit, on every decode-only step; a step with a prefill chunk runs the layers
    one by one."""
    assert native.load() is not None, "the native kernels must build here"
    model, config = _model(tmp_path, dtype)
    assert model.decode_layers is not None
    spy = _Spy(model.decode_layers)
    model.decode_layers = spy
    runner = PagedRunner(model, config, num_blocks=64, block_size=16, shuffle=True)
    rng = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 300, (n,), generator=rng).tolist() for n in (9, 17, 33)]
    runner.step(list(enumerate(prompts)))
    assert not any(spy.served)

    def use(on: bool) -> None:
        model.decode_layers = spy if on else None

    _check_decode_steps(runner, [5, 6, 7], [spy], use)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_a_prompt_steps_leading_layers_in_one_call_match_the_generic_path(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    """The model's prefill_layers (every layer but the last in one call): the final hidden
    states of the output rows and the whole KV pool bit for bit the layers' own, for first
    chunks, later chunks, a chunk that finishes nothing and a step that finishes no row; a step
    with a decode in it runs the layers one by one."""
    assert native.load() is not None, "the native kernels must build here"
    model, config = _model(tmp_path, dtype)
    assert model.prefill_layers is not None
    spy = _Spy(model.prefill_layers)
    runner = PagedRunner(model, config, num_blocks=64, block_size=16, shuffle=True)
    rng = torch.Generator().manual_seed(3)

    def prompt(n: int) -> list[int]:
        return torch.randint(0, 300, (n,), generator=rng).tolist()

    steps = [
        ([(0, prompt(5)), (1, prompt(23)), (2, prompt(40))], [1, 1, 1], True),
        ([(1, prompt(17)), (2, prompt(33))], [1, 0], True),  # later chunks; one finishes none
        ([(1, prompt(7)), (2, prompt(9))], [0, 0], True),  # no row finished: K/V alone
        ([(0, prompt(1)), (3, prompt(12))], [1, 1], False),  # a decode: the layers one by one
    ]
    for items, counts, served in steps:
        before = runner.snapshot()
        model.prefill_layers = spy
        mark = len(spy.served)
        got, _ = runner.forward(items, counts)
        kv_got = runner.kv_cache.clone()
        assert spy.served[mark:] == [served]
        runner.restore(before)
        model.prefill_layers = None
        want, _ = runner.forward(items, counts)
        assert got.shape[0] == sum(counts)
        assert torch.equal(got, want)
        assert torch.equal(kv_got, runner.kv_cache)
    one, _ = _model(tmp_path / "one", dtype, num_hidden_layers=1)
    layers_fn = one.prefill_layers
    assert layers_fn is not None  # built, but a one-layer model has no leading layers
    kv = torch.zeros(1, 2, 4, 16, 2, 64, dtype=dtype)
    hidden = torch.zeros(16, 256, dtype=dtype)
    meta = build_meta([[0]], [16], [16], 16)
    assert layers_fn(hidden, hidden[:, :32], hidden[:, :32], kv, meta) is None


def test_layers_it_cannot_serve_run_the_generic_path(tmp_path: Path) -> None:
    biased, _ = _model(tmp_path / "bias", torch.float32, attention_bias=True)
    assert all(layer.decode_layer is None for layer in _layers(biased))
    assert biased.decode_layers is None  # no layer of it has one
    narrow, _ = _model(tmp_path / "narrow", torch.float32, hidden_size=64)  # head_dim 16
    assert all(layer.decode_layer is None for layer in _layers(narrow))
    plain, _ = _model(tmp_path / "plain", torch.float32)
    layer = _layers(plain)[0]
    assert layer.dense_parts() is not None and layer.decode_layer is not None
    # Gradients wanted: the generic linears fall back to F.linear, and so does the step.
    hidden = torch.zeros(2, 256)
    kv = torch.zeros(2, 4, 16, 2, 64)
    with torch.enable_grad():
        assert layer.decode_layer(hidden, None, hidden[:, :32], hidden[:, :32], kv, None) is None


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@torch.no_grad()
def test_decodes_match_transformers_greedy(tmp_path: Path) -> None:
    torch.manual_seed(0)
    check_greedy_against_transformers(
        tmp_path,
        LlamaConfig(**CONFIG),
        prompt_len=21,
        chunk_ends=[21],
        steps=10,
        num_blocks=64,
        block_size=16,
    )
