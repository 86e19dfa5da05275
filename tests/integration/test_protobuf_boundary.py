"""Protobuf stays on the event loop: nothing the engine thread is handed or returns is a message.

Requests are parsed (convert.py) and responses built (convert.py, descriptions.py) on the event
loop; the engine thread works on domain values only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import pytest
from ferrum_client import BatchBuilder, ExecutorClient, pb
from google.protobuf.message import Message
from helpers_server import LiveServer


def _messages(value: object, depth: int = 0) -> list[str]:
    """Type names of the protobuf messages in value (containers, partials, dataclasses)."""
    if isinstance(value, Message):
        return [type(value).__name__]
    if depth > 3:
        return []
    if isinstance(value, functools.partial):
        inner: list[object] = [value.func, *value.args, *value.keywords.values()]
    elif isinstance(value, (tuple, list, set, frozenset)):
        inner = list(value)
    elif isinstance(value, dict):
        inner = list(value.values())
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        inner = [getattr(value, f.name) for f in dataclasses.fields(value)]
    else:
        return []
    return [name for item in inner for name in _messages(item, depth + 1)]


class _Watched(Executor):
    """The engine's thread, recording every protobuf message that crosses into or out of it."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.crossings: list[str] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        name = getattr(fn, "__qualname__", repr(fn))
        self.crossings += [f"{name} <- {m}" for m in _messages((fn, args, kwargs))]

        def watched(*a: Any, **k: Any) -> Any:
            result = fn(*a, **k)
            self.crossings += [f"{name} -> {m}" for m in _messages(result)]
            return result

        return self.inner.submit(watched, *args, **kwargs)


def test_no_protobuf_reaches_the_engine_thread(
    live_server: LiveServer, client: ExecutorClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine: Any = live_server.engine
    watched = _Watched(engine._thread)
    monkeypatch.setattr(engine, "_thread", watched)

    client.get_info()
    client.get_status()
    client.get_metrics()
    client.get_kv_slot_capacity()
    client.get_capacity_snapshot()
    client.list_release_sources()
    reserved = client.reserve_kv_slots(
        pb.ReserveKvSlotsRequest(request_ids=["b"], target_lens=[6])
    ).reserved
    client.release_cache(pb.ReleaseCacheRequest(cache_id=reserved.cache_ids[0]))
    admitted = client.try_admit_prefill(
        pb.TryAdmitPrefillRequest(request_id="a", input_tokens=[1, 2, 3], product_prompt_tokens=3)
    ).admitted
    first = client.prefill(
        pb.PrefillRequest(request_id="a", input_tokens=[1, 2, 3], cache_id=admitted.cache_id)
    ).completed
    token = first.output.token.token_id
    cache_id = first.kv_cache.cache_id
    client.decode(pb.DecodeRequest(cache_id=cache_id, input_token=token, position=3))
    client.forward_verify(
        pb.ForwardVerifyRequest(cache_id=cache_id, token_ids=[token, 5, 6], position=4)
    )
    client.truncate_kv(pb.TruncateKvRequest(cache_id=cache_id, new_length=4))
    builder = BatchBuilder()
    builder.add_decode("a", cache_id, token, 4)
    client.unified_batch(pb.UnifiedBatchRequest(items=builder.build(), step_id=9_100_001))
    client.preempt_execution_capacity(
        pb.PreemptExecutionCapacityRequest(request_id="a", cache_id=cache_id)
    )
    client.complete_cache(pb.CompleteCacheRequest(request_id="a", cache_id=cache_id))

    assert watched.crossings == []
