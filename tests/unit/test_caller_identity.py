"""Who is calling: the key under which the executor keeps per-caller state."""

from __future__ import annotations

import pytest
from ferrum_server.security import ANONYMOUS, MAX_SESSION_BYTES, caller_identity


def test_token_callers_are_told_apart_without_keeping_the_token() -> None:
    one = caller_identity([("authorization", "Bearer secret-one")])
    two = caller_identity([("authorization", "Bearer secret-two")])
    assert one != two and one.startswith("token:") and "secret" not in one
    assert one == caller_identity((("authorization", b"Bearer secret-one"),))


def test_session_header_names_a_caller_without_a_token() -> None:
    assert caller_identity([("ferrum-session", "a")]) != caller_identity([("ferrum-session", "b")])
    assert caller_identity([]) == caller_identity(None) == ANONYMOUS
    # A token wins over a session header: sessions cannot impersonate an authenticated caller.
    token = caller_identity([("authorization", "Bearer t")])
    assert caller_identity([("ferrum-session", "x"), ("authorization", "Bearer t")]) == token


def test_overlong_session_header_is_refused() -> None:
    with pytest.raises(ValueError, match="longer than"):
        caller_identity([("ferrum-session", "x" * (MAX_SESSION_BYTES + 1))])
