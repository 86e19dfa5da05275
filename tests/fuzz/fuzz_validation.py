"""Coverage-guided fuzz target (atheris) for request conversion + validation + the engine.

Run (time-boxed):  python tests/fuzz/fuzz_validation.py -max_total_time=60 [corpus_dir]

Without a corpus folder the run keeps its corpus in $FERRUM_FUZZ_CORPUS, by default
~/.cache/ferrum-executor/fuzz-corpus, seeded with SEEDS: one folder that every run reuses and
grows. (A fresh temporary folder per run was left behind each time: libFuzzer ends the process
without running Python's exit handlers.)

Input format: byte 0 picks the request type, the rest is that protobuf message's wire bytes
(undecodable bytes are skipped: the transport refuses them before any handler). Cache ids of
the form "@k" name the k-th live cache, so the fuzzer can reach state-dependent checks. Every
input must run or raise a documented ExecutorError, and the KV invariants must hold after it;
anything else is a crash. `decode` and `run_one` work without atheris (CI smoke).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError, Message


def _imports() -> tuple[Any, ...]:
    from ferrum_client.pb import executor_pb2 as pb
    from ferrum_server import convert, errors
    from ferrum_server.config import EngineConfig
    from ferrum_server.domain import DeferralMode, ItemKind
    from ferrum_server.engine import Engine

    return pb, convert, errors, EngineConfig, DeferralMode, ItemKind, Engine


try:  # instrument our own code only (torch is large and not the target)
    import atheris

    with atheris.instrument_imports(include=["ferrum_server", "ferrum_client"]):
        pb, convert, errors, EngineConfig, DeferralMode, ItemKind, Engine = _imports()
except ImportError:
    atheris = None
    pb, convert, errors, EngineConfig, DeferralMode, ItemKind, Engine = _imports()

DOCUMENTED = (
    errors.InvalidArgument,
    errors.NotFound,
    errors.AlreadyExists,
    errors.CapacityExhausted,
    errors.StaleInstance,
    errors.PositionMismatch,
    errors.DeviceOutOfMemory,
)
MESSAGES: list[type[Message]] = [
    pb.UnifiedBatchRequest,
    pb.BatchPrefillRequest,
    pb.BatchDecodeRequest,
    pb.PrefillRequest,
    pb.DecodeRequest,
    pb.ForwardVerifyRequest,
    pb.TruncateKvRequest,
    pb.ReleaseCacheRequest,
    pb.TryAdmitPrefillRequest,
]
_ENGINE: Any = None


def engine() -> Any:
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = Engine(
            EngineConfig(
                block_size=4,
                kv_cache_bytes=64 * 4 * 512,
                max_batch_tokens=32,
                max_batch_size=4,
                max_sequence_length=64,
            )
        )
    return _ENGINE


def decode(data: bytes) -> Message | None:
    """The request an input stands for, or None when its bytes do not parse."""
    if not data:
        return None
    kind = MESSAGES[data[0] % len(MESSAGES)]
    try:
        return kind.FromString(data[1:])
    except (DecodeError, RecursionError):
        return None


def _bind_caches(request: Message, live: list[str]) -> None:
    def resolve(value: str) -> str:
        if value.startswith("@") and value[1:].isdigit() and live:
            return live[int(value[1:]) % len(live)]
        return value

    if hasattr(request, "cache_id"):
        request.cache_id = resolve(request.cache_id)  # type: ignore[attr-defined]
    items = getattr(request, "items", None)
    if items is not None:
        resolved = [resolve(c) for c in items.cache_ids]
        del items.cache_ids[:]
        items.cache_ids.extend(resolved)


def run_one(data: bytes) -> None:
    request = decode(data)
    if request is None:
        return
    eng = engine()
    _bind_caches(request, list(eng.kv.caches))
    handlers: dict[type[Message], Callable[[Any], Any]] = {
        pb.UnifiedBatchRequest: lambda r: eng.execute(
            convert.step_from_pb(r.items, DeferralMode.PER_ITEM, r.executor_instance_id)
        ),
        pb.BatchPrefillRequest: lambda r: eng.execute(
            convert.step_from_pb(
                r.items, DeferralMode.ALL_OR_NOTHING, r.executor_instance_id, ItemKind.PREFILL_CHUNK
            )
        ),
        pb.BatchDecodeRequest: lambda r: eng.execute(
            convert.step_from_pb(
                r.items, DeferralMode.ALL_OR_NOTHING, r.executor_instance_id, ItemKind.DECODE
            )
        ),
        pb.PrefillRequest: lambda r: eng.execute(
            convert.prefill_step_from_pb(r, eng.kv.block_size)
        ),
        pb.DecodeRequest: lambda r: eng.execute(convert.decode_step_from_pb(r)),
        pb.ForwardVerifyRequest: lambda r: eng.execute(convert.verify_step_from_pb(r)),
        pb.TruncateKvRequest: lambda r: eng.truncate(
            r.cache_id, r.new_length, r.executor_instance_id
        ),
        pb.ReleaseCacheRequest: lambda r: eng.release(r.cache_id, r.executor_instance_id),
        pb.TryAdmitPrefillRequest: lambda r: eng.try_admit(
            r.request_id,
            list(r.input_tokens),
            r.maximum_sequence_tokens,
            r.product_prompt_tokens,
            r.replayed_output_tokens,
            r.executor_instance_id,
        ),
    }
    with contextlib.suppress(DOCUMENTED):
        handlers[type(request)](request)
    eng.kv.check()
    if len(eng.kv.caches) > 3:
        eng.release_all()


SEEDS: list[bytes] = [
    bytes([3]) + pb.PrefillRequest(request_id="a", input_tokens=[1, 2, 3]).SerializeToString(),
    bytes([4]) + pb.DecodeRequest(cache_id="@0", input_token=5, position=3).SerializeToString(),
    bytes([0])
    + pb.UnifiedBatchRequest(
        items=pb.BatchItems(
            request_ids=["b"], kinds=[1], num_tokens=[2], token_ids=[7, 8], total_prompt_tokens=[2]
        )
    ).SerializeToString(),
    bytes([5])
    + pb.ForwardVerifyRequest(cache_id="@0", token_ids=[1, 2], position=3).SerializeToString(),
    bytes([6]) + pb.TruncateKvRequest(cache_id="@0", new_length=1).SerializeToString(),
    bytes([8])
    + pb.TryAdmitPrefillRequest(
        request_id="q", input_tokens=[4, 4, 4], product_prompt_tokens=3
    ).SerializeToString(),
    bytes([7]) + pb.ReleaseCacheRequest(cache_id="@0").SerializeToString(),
    b"\x00\xff\xff",
    b"",
]


def write_seeds(corpus: Path) -> None:
    """Put SEEDS into the corpus folder (created if missing); the same names every time."""
    corpus.mkdir(parents=True, exist_ok=True)
    for index, seed in enumerate(SEEDS):
        (corpus / f"seed-{index}").write_bytes(seed)


def main() -> None:
    if atheris is None:
        sys.exit("atheris is not installed: pip install atheris")
    argv = list(sys.argv)
    if not any(not arg.startswith("-") for arg in argv[1:]):
        # No corpus folder given: the reused one, with the seeds, instead of nothing.
        default = Path.home() / ".cache" / "ferrum-executor" / "fuzz-corpus"
        corpus = Path(os.environ.get("FERRUM_FUZZ_CORPUS") or default)
        write_seeds(corpus)
        print(f"fuzz corpus: {corpus}", file=sys.stderr)
        argv.append(str(corpus))
    atheris.Setup(argv, run_one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
