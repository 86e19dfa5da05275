"""Phi-3 (Phi3ForCausalLM) against transformers: fused checkpoint tensors, the sliding window,
LongRoPE (which factor list, the attention factor), config parsing and what is refused."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from ferrum_kernels.backend import select_backend
from ferrum_server.config import EngineConfig
from ferrum_server.engine import Engine
from ferrum_server.models import LongRopeScaling, ModelConfig, load_model
from ferrum_server.models.llama import rope_attention_scaling, rope_inv_freq
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers_engine import greedy_decode
from helpers_models import (
    PagedRunner,
    check_chunking_and_batching_invariance,
    check_greedy_against_transformers,
    hf_greedy,
    longrope_scaling,
    phi3_config,
    save_phi3,
)

PARITY_ATOL = 1e-3
BLOCK_SIZE = 4
DECODE_STEPS = 32
PROMPT_LEN = 20
WINDOW = 6  # well inside the 20-token prompt
ORIGINAL = 16  # LongRoPE's original length: the 20-token prompt is past it
HEAD_DIM = 32

# Phi-3-mini-4k's shape (a window, no scaling), Phi-3-mini-128k / 3.5-mini's (LongRoPE, no
# window), and both together.
CASES: dict[str, dict[str, Any]] = {
    "window": {"sliding_window": WINDOW},
    "longrope": {
        "original_max_position_embeddings": ORIGINAL,
        "rope_scaling": longrope_scaling(HEAD_DIM),
    },
    "longrope_window": {
        "sliding_window": WINDOW,
        "original_max_position_embeddings": ORIGINAL,
        "rope_scaling": longrope_scaling(HEAD_DIM),
    },
}


def _check_flags(case: str, config: ModelConfig) -> None:
    # Guards against a case silently testing a plainer model than intended.
    assert config.model_type == "phi3" and config.head_dim == HEAD_DIM
    windowed = "window" in case
    assert config.sliding_windows == ((WINDOW, WINDOW) if windowed else ())
    assert isinstance(config.rope_scaling, LongRopeScaling) == ("longrope" in case)


def _runner(
    folder: Path,
    backend: str = "torch",
    *,
    dtype: torch.dtype = torch.float32,
    shuffle: bool = True,
    seed: int = 0,
    max_sequence_length: int | None = None,
) -> PagedRunner:
    model, config = load_model(str(folder), dtype=dtype, device=torch.device("cpu"))
    if max_sequence_length is not None:
        model.reset_rope_cache(max_sequence_length=max_sequence_length)
    model.bind_backend(select_backend("cpu", backend))
    return PagedRunner(
        model, config, num_blocks=64, block_size=BLOCK_SIZE, shuffle=shuffle, seed=seed
    )


@torch.no_grad()
def _greedy_parity(
    hf: torch.nn.Module, runner: PagedRunner, prompt: list[int], steps: int
) -> float:
    """Prefill `prompt` in one piece, then `steps` greedy decodes: logits within PARITY_ATOL
    and the same token at every step. Returns the largest logit difference seen."""
    ours = runner.step([(0, prompt)])[0][-1]
    out = hf(input_ids=torch.tensor([prompt]), use_cache=True)
    ref, past = out.logits[0, -1].float(), out.past_key_values
    worst = 0.0
    for step in range(steps + 1):
        diff = (ours - ref).abs().max().item()
        worst = max(worst, diff)
        assert diff <= PARITY_ATOL, f"step {step}: max abs logit diff {diff}"
        token = int(ref.argmax())
        assert int(ours.argmax()) == token, f"greedy token differs at step {step}"
        if step == steps:
            break
        ours = runner.step([(0, [token])])[0][-1]
        out = hf(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
        ref, past = out.logits[0, -1].float(), out.past_key_values
    return worst


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_parity_with_transformers(case: str, tmp_path: Path) -> None:
    """A 20-token prompt (past the window and past LongRoPE's original length, where
    transformers uses the long factors as we do), then 32 greedy steps."""
    hf = save_phi3(tmp_path, **CASES[case])
    runner = _runner(tmp_path)
    _check_flags(case, runner.config)
    torch.manual_seed(1)
    prompt = torch.randint(0, 256, (PROMPT_LEN,)).tolist()
    _greedy_parity(hf, runner, prompt, DECODE_STEPS)


@pytest.mark.parametrize("case", ["window", "longrope_window"])
@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_parity_on_the_cpu_fast_paths(case: str, tmp_path: Path) -> None:
    """The CPU backend (windowed decode kernel, chunk path) with a prompt in chunks that cross
    the window edge and LongRoPE's original length, then 32 greedy steps."""
    torch.manual_seed(3)
    config = check_greedy_against_transformers(
        tmp_path,
        phi3_config(**CASES[case]),
        prompt_len=PROMPT_LEN,
        chunk_ends=[4, 11, 17, PROMPT_LEN],
        steps=DECODE_STEPS,
        num_blocks=32,
        block_size=BLOCK_SIZE,
    )
    _check_flags(case, config)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_short_factors_when_the_server_admits_no_more_than_the_original_length(
    tmp_path: Path,
) -> None:
    """A server capped at LongRoPE's original length rotates with the short factors, and then
    agrees with transformers on sequences that never leave it. Uncapped (the model's 256
    positions), it uses the long factors for every position: there transformers, which picks
    the list per call from the call's own length, differs on such short sequences."""
    hf = save_phi3(tmp_path, **CASES["longrope_window"])
    torch.manual_seed(4)
    prompt = torch.randint(0, 256, (6,)).tolist()
    steps = ORIGINAL - len(prompt)  # the last decode is at position 15
    _greedy_parity(hf, _runner(tmp_path, max_sequence_length=ORIGINAL), prompt, steps)
    with torch.no_grad():
        uncapped = _runner(tmp_path).step([(0, prompt)])[0][-1]
        ref = hf(input_ids=torch.tensor([prompt])).logits[0, -1]
    assert (uncapped - ref).abs().max().item() > 100 * PARITY_ATOL


@pytest.mark.parametrize(
    "rope",
    [
        longrope_scaling(HEAD_DIM),
        # Phi3Config's other name for it ("su" too, which transformers 5 fails to load).
        longrope_scaling(HEAD_DIM) | {"rope_type": "yarn"},
        longrope_scaling(HEAD_DIM) | {"factor": 3.0},
        longrope_scaling(HEAD_DIM) | {"factor": 3.0, "attention_factor": 1.25},
    ],
)
def test_rope_tables_match_transformers(rope: dict[str, Any], tmp_path: Path) -> None:
    """Our cos/sin tables against transformers' Phi-3 rotary embedding, for both factor lists
    and every way the attention factor is given or derived."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    hf_config = phi3_config(original_max_position_embeddings=ORIGINAL, rope_scaling=rope)
    config = ModelConfig.from_hf(hf_config.to_dict())
    assert isinstance(config.rope_scaling, LongRopeScaling)
    rotary = Phi3RotaryEmbedding(hf_config)
    x = torch.zeros(1, dtype=torch.float32)
    for longest in (ORIGINAL, config.max_position_embeddings):
        # transformers picks the list from the longest position of the call.
        positions = torch.arange(longest)[None]
        cos, sin = rotary(x, positions)  # [1, longest, D]
        inv_freq = rope_inv_freq(config, longest)
        freqs = torch.arange(longest, dtype=torch.float32)[:, None] * inv_freq[None, :]
        scaling = rope_attention_scaling(config)
        assert scaling > 1.0
        half = HEAD_DIM // 2  # transformers repeats the table across both halves
        assert torch.equal(freqs.cos() * scaling, cos[0, :, :half])
        assert torch.equal(freqs.sin() * scaling, sin[0, :, :half])
    short = rope_inv_freq(config, ORIGINAL)
    assert not torch.equal(short, rope_inv_freq(config, ORIGINAL + 1))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@torch.no_grad()
def test_chunking_and_batching_invariance(backend: str, tmp_path: Path) -> None:
    """Chunked prefill across the window edge equals one piece, and a mixed batch (chunks on
    history, decodes far past the window) equals each item alone, on both CPU backends."""
    save_phi3(tmp_path, **CASES["longrope_window"])
    torch.manual_seed(2)
    check_chunking_and_batching_invariance(lambda **kw: _runner(tmp_path, backend, **kw))


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@torch.no_grad()
def test_bf16_error_is_no_worse_than_transformers(tmp_path: Path) -> None:
    """bfloat16 on the CPU fast paths against the float32 truth, beside transformers' own
    bfloat16 run on the same weights and tokens (teacher-forced with the float32 tokens)."""
    truth = save_phi3(tmp_path, **CASES["longrope_window"])
    hf16 = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    runner = _runner(tmp_path, "cpu", dtype=torch.bfloat16)
    torch.manual_seed(4)
    prompt = torch.randint(0, 256, (PROMPT_LEN,)).tolist()
    runner.step([(0, prompt[:9])])  # a chunked prefill across the window edge
    ours = [runner.step([(0, prompt[9:])])[0][-1].float()]
    ref, ref16 = truth(input_ids=torch.tensor([prompt])), hf16(input_ids=torch.tensor([prompt]))
    want, theirs = [ref.logits[0, -1].float()], [ref16.logits[0, -1].float()]
    past, past16 = ref.past_key_values, ref16.past_key_values
    for _ in range(16):
        token = torch.tensor([[int(want[-1].argmax())]])
        ours.append(runner.step([(0, [int(token)])])[0][-1].float())
        out = truth(input_ids=token, past_key_values=past, use_cache=True)
        out16 = hf16(input_ids=token, past_key_values=past16, use_cache=True)
        past, past16 = out.past_key_values, out16.past_key_values
        want.append(out.logits[0, -1].float())
        theirs.append(out16.logits[0, -1].float())
    ours_err = torch.stack([(o - w).abs().mean() for o, w in zip(ours, want, strict=True)])
    hf_err = torch.stack([(t - w).abs().mean() for t, w in zip(theirs, want, strict=True)])
    # The same 10% margin as the windowed Mistral's test: kernels differ by CPU.
    assert ours_err.mean() <= hf_err.mean() * 1.1, (ours_err.mean(), hf_err.mean())


# --- the engine ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def phi3_folder(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    folder = tmp_path_factory.mktemp("phi3")
    return save_phi3(folder, **CASES["longrope_window"]), folder


@contextmanager
def _engine(folder: Path, **over: Any) -> Iterator[Engine]:
    built = Engine(
        EngineConfig(
            model=str(folder),
            block_size=4,
            kv_cache_bytes=2 * 1024**2,
            max_batch_tokens=64,
            max_batch_size=8,
            **over,
        )
    )
    try:
        yield built
    finally:
        built.shutdown()


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("capped", [False, True])
def test_engine_greedy_matches_transformers(
    capped: bool, phi3_folder: tuple[torch.nn.Module, Path]
) -> None:
    """Batched prefills and decodes in the engine. Uncapped, prompts are past the original
    length (long factors on both sides); with ``max_sequence_length`` at the original length
    (short factors), whole sequences stay within it."""
    hf, folder = phi3_folder
    gen = torch.Generator().manual_seed(6)
    lengths, steps = ((5, 9, 7), 6) if capped else ((17, 25, 20), 9)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    over = {"max_sequence_length": ORIGINAL} if capped else {}
    with _engine(folder, **over) as engine:
        assert engine.model_config.sliding_windows == (WINDOW, WINDOW)
        got = greedy_decode(engine, prompts, steps)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(hf, prompt, steps + 1)


# --- config parsing and refusals -----------------------------------------------------------------


def _mini_128k(**over: Any) -> dict[str, Any]:
    """Phi-3-mini-128k-instruct's config.json (transformers 4.x layout), factor lists shortened
    to its own head_dim of 32 here."""
    d: dict[str, Any] = {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "vocab_size": 32064,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "longrope",
            "short_factor": [1.0] * 16,
            "long_factor": [1.5] * 16,
        },
        "sliding_window": 262144,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 32000,
        "pad_token_id": 32000,
        "tie_word_embeddings": False,
    }
    return d | over


def test_config_fields_follow_transformers() -> None:
    config = ModelConfig.from_hf(_mini_128k())
    s = config.rope_scaling
    assert isinstance(s, LongRopeScaling) and s.original_max_position_embeddings == 4096
    assert s.long_factors_for(131072) and not s.long_factors_for(4096)
    # A window past every position hides nothing: global layers (the 128k models' 262144).
    assert config.sliding_windows == () and not config.attention_bias
    # Phi-3-mini-4k: no scaling, window 2047 on every layer (keys in (p - 2047, p]).
    mini_4k = ModelConfig.from_hf(
        _mini_128k(max_position_embeddings=4096, rope_scaling=None, sliding_window=2047)
    )
    assert mini_4k.rope_scaling is None and mini_4k.sliding_windows == (2047, 2047)
    # Phi3Config has no window by default, and renames "su" and "yarn" to longrope.
    no_window = _mini_128k()
    del no_window["sliding_window"]
    assert ModelConfig.from_hf(no_window | {"max_position_embeddings": 4096}).sliding_windows == ()
    for name in ("su", "yarn"):
        rope = _mini_128k()["rope_scaling"] | {"type": name}
        parsed = ModelConfig.from_hf(_mini_128k(rope_scaling=rope)).rope_scaling
        assert isinstance(parsed, LongRopeScaling)
    # The top-level original length wins over the scaling dict's, and Phi3Config's 4096 is the
    # default (transformers' standardize_rope_params).
    rope = _mini_128k()["rope_scaling"] | {"original_max_position_embeddings": 64}
    top_less = _mini_128k(rope_scaling=rope)
    del top_less["original_max_position_embeddings"]
    parsed = ModelConfig.from_hf(top_less).rope_scaling
    assert isinstance(parsed, LongRopeScaling) and parsed.original_max_position_embeddings == 4096


@pytest.mark.parametrize("case", list(CASES))
def test_config_round_trip_through_transformers(case: str) -> None:
    """to_hf() writes a config that transformers loads back as the same model."""
    from transformers import Phi3Config

    config = ModelConfig.from_hf(phi3_config(**CASES[case]).to_dict())
    assert ModelConfig.from_hf(config.to_hf()) == config
    again = Phi3Config(**{k: v for k, v in config.to_hf().items() if k != "model_type"})
    assert ModelConfig.from_hf(again.to_dict()) == config


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75 is not supported"),
        (
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 16,
                              "long_factor": [1.0] * 16, "short_mscale": 1.1}},
            "short_mscale is not supported",
        ),
        (
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 15,
                              "long_factor": [1.0] * 16}},
            "short_factor must list 16 numbers",
        ),
        (
            {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 16}},
            "missing the 'long_factor' field",
        ),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "unsupported rope scaling"),
        ({"hidden_act": "gelu_new"}, "hidden_act"),
    ],
)  # fmt: skip
def test_config_rejections(over: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(_mini_128k(**over))


def test_loader_checks_the_fused_tensors(tmp_path: Path) -> None:
    """The fused checkpoint names are validated before any weight is read."""
    save_phi3(tmp_path, **CASES["window"])
    path = tmp_path / "model.safetensors"
    tensors = load_file(str(path))
    assert "model.layers.1.self_attn.qkv_proj.weight" in tensors
    assert not any("q_proj" in name or "gate_proj" in name for name in tensors)
    saved = dict(tensors)
    del tensors["model.layers.1.self_attn.qkv_proj.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing 1 tensor.*layers\.1\.self_attn\.qkv_proj"):
        load_model(str(tmp_path), dtype=torch.float32, device=torch.device("cpu"))
    save_file(saved, str(path), metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"wrong shape.*gate_up_proj.weight: expected \[192, 64\]"):
        load_model(str(tmp_path), dtype=torch.float32, device=torch.device("cpu"))
