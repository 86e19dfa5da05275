"""Test helpers for tensor parallelism: small checkpoints, one fixed step script, and ranks
started as spawned processes over gloo (CPU).

The script is the same for every model and every world size: two sequences prefilled together
(one of them in two chunks), then decode steps feeding fixed tokens, so the logits of a split
model can be compared row for row with the whole model's and transformers'. The ranks are
spawned once for several models (each costs seconds of start-up), with a deadline.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from helpers_models import PagedRunner, gemma_hf_config, phi3_config
from helpers_moe import mixtral_config, qwen3_moe_config

BLOCK_SIZE = 4
NUM_BLOCKS = 64
PROMPTS = ((3, 17, 42, 7, 99, 5, 23, 61, 8, 77, 14, 2), (250, 1, 64, 128, 9, 31, 200))
DECODE_TOKENS = ((11, 12), (240, 4), (5, 6), (250, 0))  # per step: (seq 0's, seq 1's)
GREEDY_STEPS = 32
RANK_DEADLINE_S = 240.0  # the spawned ranks, every model included

_SMALL: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.08,
}


def parallel_cases() -> dict[str, Any]:
    """name -> a transformers config; each one exercises a different way of splitting."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        # GQA (8 query heads, 2 KV heads: one each), biases on q/k/v and o (o's added after
        # the all-reduce), an untied head.
        "llama-gqa": LlamaConfig(
            **_SMALL,
            vocab_size=256,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
        ),
        # 6 query heads, 1 KV head: replicated on both ranks, 3 query heads each.
        "mistral-1kv": MistralConfig(
            **_SMALL,
            vocab_size=256,
            num_attention_heads=6,
            num_key_value_heads=1,
            head_dim=16,
            sliding_window=None,
        ),
        # An odd vocabulary (padded to 252) with the head tied to the embedding; q/k/v bias.
        "qwen2-odd-vocab": Qwen2Config(
            **_SMALL,
            vocab_size=251,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
        ),
        # Per-head q/k norms; an odd vocabulary on an untied head.
        "qwen3": Qwen3Config(
            **_SMALL,
            vocab_size=257,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=False,
        ),
        # Fused qkv / gate_up checkpoint tensors, 2 query heads and 1 (replicated) KV head.
        "phi3": phi3_config(vocab=256),
        # Gemma 2: attention and final soft-caps, q/k/v/o biases, sliding and global layers,
        # sqrt(hidden)-scaled embeddings and a head tied to them over an odd vocabulary.
        "gemma2-odd-vocab": gemma_hf_config("gemma2", vocab=251),
        # Gemma 3: per-head q/k norms, local and global RoPE, 1 KV head (replicated).
        "gemma3-1kv": gemma_hf_config("gemma3", num_key_value_heads=1),
        # Mixtral: 4 experts of intermediate 96 (48 columns per rank), top-2, window 6.
        "mixtral": mixtral_config(),
        # Qwen3-MoE: sparse layers of 6 experts of 48 (24 per rank) around a dense layer.
        "qwen3-moe": qwen3_moe_config(),
    }


@torch.no_grad()
def save_case(folder: Path, hf_config: Any) -> torch.nn.Module:
    """A random model of ``hf_config`` (seed 0) with norms and biases randomised too (HF's
    ones and zeros would hide a norm or bias loaded on the wrong rank), saved to ``folder``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    for name, p in hf.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn_like(p))
    hf.save_pretrained(folder, safe_serialization=True)
    return hf.eval()


@dataclass
class ScriptResult:
    logits: list[torch.Tensor]  # per sequence: [prompt + decode steps, vocab] float32
    greedy: list[int]  # a third sequence's greedy continuation of prompt 0


@torch.no_grad()
def run_script(folder: Path, tp: Any, greedy_steps: int) -> ScriptResult:
    """Load ``folder`` as rank ``tp.rank`` of ``tp.world_size`` with the CPU fast paths on and
    run the fixed step script through the paged runner."""
    from ferrum_kernels.backend import cpu_backend
    from ferrum_server.models import load_model

    model, config = load_model(str(folder), dtype=torch.float32, device=torch.device("cpu"), tp=tp)
    model.bind_backend(cpu_backend())
    runner = PagedRunner(model, config, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    p0, p1 = (list(p) for p in PROMPTS)
    rows: list[list[torch.Tensor]] = [[], []]
    # Step 1: seq 0's first chunk; step 2: its second chunk with seq 1's whole prompt.
    rows[0] += runner.step([(0, p0[:5])])
    out = runner.step([(0, p0[5:]), (1, p1)])
    rows[0].append(out[0])
    rows[1].append(out[1])
    for t0, t1 in DECODE_TOKENS:
        out = runner.step([(0, [t0]), (1, [t1])])
        rows[0].append(out[0])
        rows[1].append(out[1])
    greedy: list[int] = []
    if greedy_steps:
        token = int(runner.step([(2, p0)])[0][-1].argmax())
        for _ in range(greedy_steps):
            greedy.append(token)
            token = int(runner.step([(2, [token])])[0][-1].argmax())
    return ScriptResult([torch.cat(r) for r in rows], greedy)


def hf_logits(hf: torch.nn.Module) -> list[torch.Tensor]:
    """transformers' logits for the script's two sequences, every position ([n, vocab])."""
    out = []
    for seq, prompt in enumerate(PROMPTS):
        ids = list(prompt) + [step[seq] for step in DECODE_TOKENS]
        with torch.no_grad():
            out.append(hf(input_ids=torch.tensor([ids])).logits[0].float())
    return out


def _rank_main(
    rank: int, world_size: int, init_file: str, cases: list[tuple[str, str, int]], out_dir: str
) -> None:
    import torch.distributed as dist
    from ferrum_server.cli import exit_without_teardown
    from ferrum_server.parallel import TensorParallel, collective_backend

    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(
        collective_backend(torch.device("cpu")),
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        tp = TensorParallel.from_default_group()
        results = {name: run_script(Path(folder), tp, greedy) for name, folder, greedy in cases}
        torch.save(
            {n: (r.logits, r.greedy) for n, r in results.items()},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()
    # Saved and stopped: end without the interpreter's teardown, as a served rank does. gloo's
    # threads can still be alive then, and one destroyed at exit aborted the rank after its
    # results were written (SIGABRT, "terminate called without an active exception") in 2-3 of
    # 8 runs of this test on the development machine. An exception above still reaches spawn's
    # handler, which reports it.
    exit_without_teardown(0)


def run_ranks(
    world_size: int, cases: list[tuple[str, Path, int]], work: Path
) -> list[dict[str, ScriptResult]]:
    """Spawn ``world_size`` gloo ranks that each run the script on every (name, folder,
    greedy steps) case; per rank, name -> its result. Fails past ``RANK_DEADLINE_S``."""
    work.mkdir(parents=True, exist_ok=True)
    args = (world_size, str(work / "rendezvous"), [(n, str(f), g) for n, f, g in cases], str(work))
    # The ranks talk over the loopback interface (127.0.0.1); children inherit it at spawn.
    saved_ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        context = mp.start_processes(
            _rank_main, args, nprocs=world_size, join=False, start_method="spawn"
        )
    finally:
        if saved_ifname is None:
            del os.environ["GLOO_SOCKET_IFNAME"]
    deadline = time.monotonic() + RANK_DEADLINE_S
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"tensor-parallel ranks still running after {RANK_DEADLINE_S}s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
    out = []
    for rank in range(world_size):
        saved = torch.load(work / f"rank{rank}.pt")
        out.append({n: ScriptResult(list(lg), list(gr)) for n, (lg, gr) in saved.items()})
    return out
