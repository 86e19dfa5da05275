"""Load a model from a HF folder (config.json + safetensors) or the built-in tiny model.

Every tensor name and shape is checked against the config *before* any weight is read, so a
wrong or truncated checkpoint fails fast with a message naming the problem instead of part-way
through a multi-gigabyte load.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ferrum_server.models.causal_lm import CausalLM
from ferrum_server.models.config import ModelConfig
from ferrum_server.models.llama import LlamaForCausalLM
from ferrum_server.models.registry import hf_tensor_shapes, model_class
from ferrum_server.models.tiny import build_tiny, tiny_config
from ferrum_server.models.weight_shards import load_shards
from ferrum_server.parallel.group import SINGLE_RANK, TensorParallel
from ferrum_server.parallel.sharding import check_tensor_parallel

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_LISTED = 5  # names quoted in an error before "and N more"


def load_model(
    source: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    tp: TensorParallel = SINGLE_RANK,
) -> tuple[CausalLM, ModelConfig]:
    """``source`` is ``"tiny"`` or a path to a HF model folder. ``tp``: this process's rank of a
    tensor-parallel group, which builds and reads only its shard (``weight_shards``); a model
    that cannot be split over ``tp.world_size`` ranks is refused before any weight is read."""
    if source == "tiny":
        if tp.is_parallel:
            raise ValueError("the built-in tiny model runs on one rank (no tensor parallelism)")
        return build_tiny(dtype, device), tiny_config()
    folder = Path(source)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {str(folder)!r} does not exist (or is not a folder)")
    config = read_config(folder)
    check_tensor_parallel(config, tp.world_size)
    name_to_file = _index_tensors(folder)
    expected = hf_tensor_shapes(config)
    with ExitStack() as stack:
        handles = {
            f: stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
            for f in sorted(set(name_to_file.values()))
        }
        _check_tensors(folder, expected, name_to_file, handles)
        # Build without initialising (meta), then allocate straight on the target device.
        model = model_class(config)(config, dtype=dtype, device=torch.device("meta"), tp=tp)
        model = model.to_empty(device=device)
        model.reset_rope_cache(device)
        if tp.is_parallel:
            assert isinstance(model, LlamaForCausalLM)  # every family (Gemma builds on it)

            def read_slice(name: str, dim: int, start: int, length: int | None) -> torch.Tensor:
                # A safetensors slice reads only the rows/columns asked for from the file.
                part = handles[name_to_file[name]].get_slice(name)
                if length is None:
                    return part[:]  # type: ignore[no-any-return]
                if dim == 0:
                    return part[start : start + length]  # type: ignore[no-any-return]
                return part[:, start : start + length]  # type: ignore[no-any-return]

            load_shards(model, read_slice)
        else:
            model.load_hf_weights(lambda name: handles[name_to_file[name]].get_tensor(name))
    return model.requires_grad_(False).eval(), config


def read_config(folder: Path) -> ModelConfig:
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no {CONFIG_FILE}")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    return ModelConfig.from_hf(raw)


def _index_tensors(folder: Path) -> dict[str, Path]:
    """Map every stored tensor name to the safetensors file holding it."""
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text()).get("weight_map", {})
        if not weight_map:
            raise ValueError(f"{index} has an empty or missing 'weight_map'")
        shards = {name: folder / shard for name, shard in weight_map.items()}
        missing = sorted({str(p.name) for p in shards.values() if not p.is_file()})
        if missing:
            raise FileNotFoundError(
                f"{index.name} in {str(folder)!r} refers to missing shard(s): {_listed(missing)}"
            )
        return shards
    files = [folder / SINGLE_FILE] if (folder / SINGLE_FILE).is_file() else []
    files = files or sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no safetensors weights in {str(folder)!r} (expected {SINGLE_FILE} or {INDEX_FILE})"
        )
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            out.update((name, f) for name in handle.keys())  # noqa: SIM118 (not a dict)
    return out


def _check_tensors(
    folder: Path,
    expected: dict[str, tuple[int, ...]],
    name_to_file: dict[str, Path],
    handles: dict[Path, Any],
) -> None:
    missing = sorted(n for n in expected if n not in name_to_file)
    if missing:
        raise ValueError(
            f"checkpoint in {str(folder)!r} is missing {len(missing)} tensor(s) the config "
            f"needs: {_listed(missing)}"
        )
    bad = []
    for name, shape in expected.items():
        got = tuple(handles[name_to_file[name]].get_slice(name).get_shape())
        if got != shape:
            bad.append(f"{name}: expected {list(shape)}, found {list(got)}")
    if bad:
        raise ValueError(
            f"checkpoint in {str(folder)!r} has {len(bad)} tensor(s) with the wrong shape "
            f"for its config.json: {_listed(bad)}"
        )


def _listed(items: list[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    extra = len(items) - _MAX_LISTED
    return f"{shown} and {extra} more" if extra > 0 else shown


def save_hf_folder(
    model: CausalLM,
    config: ModelConfig,
    path: str | Path,
    *,
    max_shard_bytes: int | None = None,
) -> None:
    """Write config.json + safetensors under HF names (sharded with an index if asked)."""
    # Own contiguous CPU copies: safetensors refuses views that share storage (fused splits).
    # Taken before anything is written, so a model that cannot be exported (a served one keeps
    # only packed weights) leaves no file behind.
    tensors = {
        n: t.detach().to("cpu").contiguous().clone() for n, t in model.hf_state_dict().items()
    }
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    hf_config = config.to_hf()
    hf_config["torch_dtype"] = str(model.embed_tokens.weight.dtype).removeprefix("torch.")
    (folder / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2) + "\n")
    metadata = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(tensors, str(folder / SINGLE_FILE), metadata=metadata)
        return
    shards = list(_shard(tensors, max_shard_bytes))
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards, start=1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata=metadata)
        weight_map.update((name, fname) for name in shard)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def _shard(tensors: dict[str, torch.Tensor], max_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """Greedy in-order packing; a tensor larger than max_bytes gets a shard of its own."""
    if max_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_bytes}")
    current: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_bytes:
            yield current
            current, size = {}, 0
        current[name] = t
        size += nbytes
    if current:
        yield current


__all__ = ["load_model", "read_config", "save_hf_folder"]
