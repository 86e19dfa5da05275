"""Id limits at the protobuf edge (every string field of every request), bounded
ListReleaseSources pages, and the client's typed reasons and session metadata."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from ferrum_client import StaleExecutorError, StepResultEvictedError
from ferrum_client.channel import call_metadata
from ferrum_client.errors import from_status, from_step_error
from ferrum_client.pb import executor_pb2 as pb
from ferrum_server import convert
from ferrum_server.capacity import ReleaseSource
from ferrum_server.errors import InvalidArgument
from ferrum_server.service import _ids
from ferrum_server.validate import MAX_ID_BYTES
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

_SERVICE = pb.DESCRIPTOR.services_by_name["ExecutorService"]


def _string_fields(
    descriptor: Descriptor, path: tuple[FieldDescriptor, ...] = ()
) -> Iterator[tuple[FieldDescriptor, ...]]:
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_STRING:
            yield (*path, field)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            assert not field.message_type.GetOptions().map_entry, (
                f"{field.full_name}: check_ids does not look into maps; decide their limit"
            )
            yield from _string_fields(field.message_type, (*path, field))


def _with(request: Message, path: tuple[FieldDescriptor, ...], text: str) -> Message:
    message = request
    for field in path[:-1]:
        message = getattr(message, field.name)
        if field.is_repeated:
            message = message.add()
    last = path[-1]
    if last.is_repeated:
        getattr(message, last.name).extend(["ok", text])
    else:
        setattr(message, last.name, text)
    return request


CASES = [
    (method.input_type, path)
    for method in _SERVICE.methods
    for path in _string_fields(method.input_type)
]


def test_the_walk_sees_every_id_field() -> None:
    names = {f"{d.name}.{'.'.join(f.name for f in p)}" for d, p in CASES}
    assert {
        "PrefillRequest.request_id",
        "UnifiedBatchRequest.items.cache_ids",
        "StepStreamRequest.batch.items.request_ids",
        "ReserveKvSlotsRequest.request_ids",
        "CancelPrefillAdmissionRequest.request_id",
        "ListReleaseSourcesRequest.page_token",
        "PreemptExecutionCapacityRequest.cache_id",
    } <= names


@pytest.mark.parametrize(
    ("descriptor", "path"), CASES, ids=[f"{d.name}.{p[-1].name}" for d, p in CASES]
)
def test_every_string_field_of_every_request_is_an_id_of_at_most_256_bytes(
    descriptor: Descriptor, path: tuple[FieldDescriptor, ...]
) -> None:
    cls = pb.__dict__[descriptor.name]
    convert.check_ids(_with(cls(), path, "x" * MAX_ID_BYTES))
    convert.check_ids(_with(cls(), path, "€" * (MAX_ID_BYTES // 3)))  # 255 bytes
    for overlong in ("x" * (MAX_ID_BYTES + 1), "€" * 86, "x" * 1_300_000):
        with pytest.raises(InvalidArgument) as caught:
            convert.check_ids(_with(cls(), path, overlong))
        message = caught.value.message
        assert path[-1].name in message and f"{MAX_ID_BYTES} bytes" in message
        assert len(message) < 200
        if path[-1].is_repeated:
            assert f"{path[-1].name}[1]" in message


def test_logged_ids_are_clipped() -> None:
    request = pb.UnifiedBatchRequest()
    request.items.kinds.append(pb.ITEM_KIND_DECODE)
    request.items.cache_ids.append("c" * 1_300_000)
    logged = _ids(pb.PrefillRequest(request_id="r" * 1_300_000)) | _ids(request)
    assert sum(len(str(v)) for v in logged.values()) < 300


def _sources(count: int) -> list[ReleaseSource]:
    return [
        ReleaseSource(
            request_id=f"r{i}",
            cache_id=f"c{i:05d}",
            pending_admission=False,
            sources=[],
            releasable_blocks=1,
            num_tokens=1,
        )
        for i in range(count)
    ]


def test_release_source_pages_are_bounded() -> None:
    assert convert.release_sources_page_size(0) == convert.MAX_RELEASE_SOURCES_PAGE == 1024
    assert convert.release_sources_page_size(5) == 5
    assert convert.release_sources_page_size(10**6) == 1024
    # The servicer asks the engine for one entry more than a page, to know whether more follow.
    full = convert.release_sources_to_pb(_sources(1025), 1024)
    assert len(full.entries) == 1024 and full.next_page_token == "c01023"
    last = convert.release_sources_to_pb(_sources(1024), 1024)
    assert len(last.entries) == 1024 and last.next_page_token == ""
    assert convert.release_sources_to_pb([], 1024) == pb.ListReleaseSourcesResponse()


def test_the_client_maps_the_evicted_reason_to_a_typed_error() -> None:
    precondition = grpc.StatusCode.FAILED_PRECONDITION
    assert type(from_status(precondition, "m", "STEP_RESULT_EVICTED")) is StepResultEvictedError
    assert type(from_status(precondition, "m")) is StaleExecutorError
    assert type(from_status(precondition, "m", "SOMETHING_NEWER")) is StaleExecutorError
    evicted = pb.ERROR_REASON_STEP_RESULT_EVICTED
    assert type(from_step_error(9, "m", evicted)) is StepResultEvictedError
    assert type(from_step_error(9, "m", 0)) is StaleExecutorError
    assert type(from_step_error(9, "m", 99)) is StaleExecutorError  # unknown reason value


def test_call_metadata_carries_token_and_session() -> None:
    assert call_metadata() is None
    assert call_metadata("t") == (("authorization", "Bearer t"),)
    assert call_metadata(session_id="s") == (("ferrum-session", "s"),)
    assert call_metadata("t", "s") == (("authorization", "Bearer t"), ("ferrum-session", "s"))
    for bad in ("", "s" * 257):
        with pytest.raises(ValueError, match="session_id"):
            call_metadata(session_id=bad)
