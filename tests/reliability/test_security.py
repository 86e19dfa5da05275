"""Security: mutual TLS (certificates generated per run), token roles, the plaintext health
port, and error hygiene."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import grpc
import pytest
from ferrum_client import ExecutorClient, ExecutorError, pb, tls_credentials
from ferrum_server.security import SecurityConfig, TokenAuthInterceptor, load_tokens
from grpc_health.v1 import health_pb2, health_pb2_grpc

pytest.importorskip("cryptography")  # dev extra: certificates are generated per run

from reliability.certs import Pki, make_pki
from reliability.harness import InProcessServer, Tally, report, serve_in_process

READ_TOKEN = "r34d-t0ken-for-tests"
EXEC_TOKEN = "ex3c-t0ken-for-tests"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def server(pki: Pki) -> Iterator[InProcessServer]:
    tokens = pki.folder / "tokens"
    tokens.write_text(f"# roles\nread:{READ_TOKEN}\nexecute:{EXEC_TOKEN}\n")
    security = SecurityConfig(
        tls_cert=pki.path("server.pem"),
        tls_key=pki.path("server.key"),
        tls_client_ca=pki.path("ca.pem"),
        auth_token_file=str(tokens),
    )
    with serve_in_process(server={"security": security, "health_port": 0}) as live:
        yield live


def _target(server: InProcessServer) -> str:
    return f"localhost:{server.running.port}"


def _client(server: InProcessServer, pki: Pki, token: str | None = EXEC_TOKEN) -> ExecutorClient:
    creds = tls_credentials(pki.ca.cert, pki.client.cert, pki.client.key)
    return ExecutorClient(_target(server), credentials=creds, token=token, timeout_s=5)


def _code(call: object) -> grpc.StatusCode:
    try:
        call()  # type: ignore[operator]
    except ExecutorError as exc:
        return exc.code
    return grpc.StatusCode.OK


def test_mutual_tls_admits_only_certified_clients(server: InProcessServer, pki: Pki) -> None:
    tally = Tally("mtls")
    refused = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
    cases: dict[str, tuple[ExecutorClient, bool]] = {
        "valid-client-cert": (_client(server, pki), True),
        "plaintext": (ExecutorClient(_target(server), token=EXEC_TOKEN, timeout_s=2), False),
        "no-client-cert": (
            ExecutorClient(_target(server), credentials=tls_credentials(pki.ca.cert), timeout_s=2),
            False,
        ),
        "foreign-ca-client-cert": (
            ExecutorClient(
                _target(server),
                credentials=tls_credentials(
                    pki.ca.cert, pki.foreign_client.cert, pki.foreign_client.key
                ),
                timeout_s=2,
            ),
            False,
        ),
        "expired-client-cert": (
            ExecutorClient(
                _target(server),
                credentials=tls_credentials(
                    pki.ca.cert, pki.expired_client.cert, pki.expired_client.key
                ),
                timeout_s=2,
            ),
            False,
        ),
        "untrusted-server": (
            ExecutorClient(
                _target(server),
                credentials=tls_credentials(pki.foreign_ca.cert, pki.client.cert, pki.client.key),
                timeout_s=2,
            ),
            False,
        ),
    }
    for name, (client, allowed) in cases.items():
        tally.send(name)
        with client:
            code = _code(client.get_status)
        tally.resolve(name, code.name)
        assert (code == grpc.StatusCode.OK) if allowed else (code in refused), (name, code)
    report(tally)


def test_server_name_mismatch_is_refused(server: InProcessServer, pki: Pki) -> None:
    creds = tls_credentials(pki.ca.cert, pki.client.cert, pki.client.key)
    with ExecutorClient(f"127.0.0.2:{server.running.port}", credentials=creds, timeout_s=2) as c:
        assert _code(c.get_status) in {
            grpc.StatusCode.UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        }


def test_token_roles(server: InProcessServer, pki: Pki, capsys: pytest.CaptureFixture[str]) -> None:
    tally = Tally("token-auth")
    prefill = pb.PrefillRequest(request_id="auth", input_tokens=[1, 2])
    cases = [
        ("missing", None, "get_status", grpc.StatusCode.UNAUTHENTICATED),
        ("wrong", "not-a-token", "get_status", grpc.StatusCode.UNAUTHENTICATED),
        ("read-on-read", READ_TOKEN, "get_status", grpc.StatusCode.OK),
        ("read-on-execute", READ_TOKEN, "prefill", grpc.StatusCode.PERMISSION_DENIED),
        ("execute", EXEC_TOKEN, "prefill", grpc.StatusCode.OK),
    ]
    for name, token, method, expected in cases:
        tally.send(name)
        with _client(server, pki, token) as client:
            call = (
                client.get_status if method == "get_status" else lambda c=client: c.prefill(prefill)
            )
            code = _code(call)
            assert client.health() == 1  # health never needs a token
        tally.resolve(name, code.name)
        assert code == expected, name
    with _client(server, pki) as client:
        live = [s.cache_id for s in server.engine.kv.caches.values()]
        for cache_id in live:
            client.release_cache(pb.ReleaseCacheRequest(cache_id=cache_id))
    # Refused streams are refused too, before anything is read.
    with _client(server, pki, None) as client, pytest.raises(grpc.RpcError) as refused:
        stream = client._stub.StepStream(iter([pb.StepStreamRequest()]))  # type: ignore[attr-defined]
        next(stream)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    output = capsys.readouterr()
    assert READ_TOKEN not in output.out + output.err
    assert EXEC_TOKEN not in output.out + output.err
    tally.blocks_leaked = server.blocks_leaked()
    report(tally)


def test_refused_calls_are_logged_without_the_token(
    server: InProcessServer, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    wrong = "wr0ng-t0ken-for-tests"
    with _client(server, pki, wrong) as client:
        assert _code(client.get_status) == grpc.StatusCode.UNAUTHENTICATED
    with _client(server, pki, READ_TOKEN) as client:
        call = lambda: client.prefill(pb.PrefillRequest(request_id="log", input_tokens=[1]))  # noqa: E731
        assert _code(call) == grpc.StatusCode.PERMISSION_DENIED
    output = capsys.readouterr()
    text = output.out + output.err
    refusals = [line for line in text.splitlines() if "auth_refused" in line]
    assert len(refusals) == 2, text
    assert "GetStatus" in refusals[0] and "UNAUTHENTICATED" in refusals[0]
    assert "Prefill" in refusals[1] and "PERMISSION_DENIED" in refusals[1]
    for token in (wrong, READ_TOKEN, EXEC_TOKEN):
        assert token not in text


def test_token_comparison_prefers_execute_and_rejects_prefixes(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("read:shared\nexecute:shared\nread:abc\n")
    auth = TokenAuthInterceptor(load_tokens(str(path)))
    assert auth.role_of(b"shared") == "execute"
    assert auth.role_of(b"abc") == "read"
    assert auth.role_of(b"ab") is None and auth.role_of(b"abcd") is None
    path.write_text("admin:x\n")
    with pytest.raises(ValueError, match="line 1") as caught:
        load_tokens(str(path))
    assert "x" not in str(caught.value).split(":")[-1]


def test_plaintext_health_port_serves_only_health(server: InProcessServer) -> None:
    target = f"127.0.0.1:{server.running.health_port}"
    with grpc.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        answer = health.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING
    with ExecutorClient(target, timeout_s=5) as client:
        assert _code(client.get_status) == grpc.StatusCode.UNIMPLEMENTED


def test_internal_errors_carry_no_internals(server: InProcessServer, pki: Pki) -> None:
    engine = server.engine
    real = engine.execute

    def broken(*args: object) -> object:
        raise ValueError("/opt/secret/path.py line 12: tensor shape mismatch")

    engine.execute = broken
    try:
        with _client(server, pki) as client, pytest.raises(ExecutorError) as caught:
            client.prefill(pb.PrefillRequest(request_id="x", input_tokens=[1]))
    finally:
        engine.execute = real
    assert caught.value.code == grpc.StatusCode.INTERNAL
    assert str(caught.value) == "internal error"
    with _client(server, pki) as client, pytest.raises(ExecutorError) as caught:
        client.prefill(pb.PrefillRequest(request_id="y" * 300, input_tokens=[1]))
    assert len(str(caught.value)) < 1024
