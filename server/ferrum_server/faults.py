"""Test-only fault injection (device OOM, slow step, crash, refusal) and out-of-memory recognition.

Off and unreachable in production: `from_environment` returns None unless the process was
started with FERRUM_ENABLE_FAULT_INJECTION=1, and production images never set it. When on, the
plan is a JSON file named by FERRUM_FAULT_PLAN, re-read whenever it changes (checked before
every forward), so a test steers a running server without any RPC:

    {"rules": [
        {"kind": "oom", "request_ids": ["r3"], "times": 1},
        {"kind": "slow", "delay_s": 0.5},
        {"kind": "crash"},
        {"kind": "fault"},
        {"kind": "unavailable", "times": 2}
    ]}

`kind` is "oom" (raise torch.OutOfMemoryError before the forward), "slow" (sleep delay_s before
the forward), "crash" (SIGKILL the process mid-step), "fault" (raise the RuntimeError a sticky
CUDA error raises, which the engine treats as an unrecoverable device fault) or "unavailable"
(the step answers UNAVAILABLE with nothing run or committed, as an executor that went away
mid-call does: the process stays up and healthy). A rule fires for
a forward holding any of its `request_ids` (all forwards when absent), at most `times` times
(unlimited when absent); the counts restart when the file changes (its mtime or size), and a plan
read while it is being rewritten is read again until it stands still. A missing or unreadable
plan injects nothing.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ferrum_server import logs
from ferrum_server.errors import Unavailable

_LOG = logs.get(__name__)
ENABLE_ENV = "FERRUM_ENABLE_FAULT_INJECTION"
PLAN_ENV = "FERRUM_FAULT_PLAN"
_KINDS = ("oom", "slow", "crash", "fault", "unavailable")
_READ_TRIES = 5  # reads of a plan that keeps changing under them before the last one is kept
INJECTED_FAULT = "CUDA error: an illegal memory access was encountered (injected)"
INJECTED_UNAVAILABLE = "the executor is unavailable (injected)"


def is_out_of_memory(exc: BaseException) -> bool:
    """A device allocation failure: torch's OOM type, or a RuntimeError that says so."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


@dataclass(slots=True)
class Rule:
    kind: str
    request_ids: frozenset[str] | None = None
    times: int | None = None
    delay_s: float = 0.0
    fired: int = 0

    def matches(self, request_ids: Sequence[str]) -> bool:
        if self.times is not None and self.fired >= self.times:
            return False
        return self.request_ids is None or any(r in self.request_ids for r in request_ids)


def _rule(raw: Any) -> Rule:
    if not isinstance(raw, dict) or raw.get("kind") not in _KINDS:
        raise ValueError(f"each rule needs a kind out of {', '.join(_KINDS)}")
    ids = raw.get("request_ids")
    times = raw.get("times")
    return Rule(
        kind=raw["kind"],
        request_ids=frozenset(str(r) for r in ids) if ids is not None else None,
        times=int(times) if times is not None else None,
        delay_s=float(raw.get("delay_s", 0.0)),
    )


@dataclass(slots=True)
class FaultInjector:
    plan_path: str
    rules: list[Rule] = field(default_factory=list)
    _stamp: tuple[int, int] | None = None

    def _reload(self) -> None:
        stamp = _stamp_of(self.plan_path)
        if stamp == self._stamp:
            return
        # The stamp kept must be the one of the text parsed. A plan read while a test rewrites
        # it (truncated, then written) could otherwise be parsed whole under the truncated
        # file's stamp, and the next forward would take the same plan for a new one and
        # restart its counts: a rule meant to fire once fired twice. So the file is read until
        # it stands still across the read.
        text: str | None = None
        error: OSError | None = None
        for _ in range(_READ_TRIES):
            text, error = None, None
            if stamp is not None:
                try:
                    with open(self.plan_path, encoding="utf-8") as handle:
                        text = handle.read()
                except OSError as exc:
                    error = exc
            after = _stamp_of(self.plan_path)
            if after == stamp:
                break
            stamp = after
        self._stamp = stamp
        self.rules = []  # no file, or (logged) one that cannot be read or parsed
        if error is not None:
            _LOG.warning("fault_plan_unreadable", error=type(error).__name__)
            return
        if text is None:
            return
        try:
            self.rules = [_rule(r) for r in json.loads(text).get("rules", [])]
        except (ValueError, AttributeError) as exc:
            # A broken plan must not take the server down: it just injects nothing.
            _LOG.warning("fault_plan_unreadable", error=type(exc).__name__)

    def before_forward(self, request_ids: Sequence[str]) -> None:
        """Engine thread, right before a forward of these items: apply matching rules."""
        self._reload()
        for rule in self.rules:
            if not rule.matches(request_ids):
                continue
            rule.fired += 1
            if rule.kind == "slow":
                time.sleep(rule.delay_s)
            elif rule.kind == "oom":
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            elif rule.kind == "fault":
                raise RuntimeError(INJECTED_FAULT)
            elif rule.kind == "unavailable":
                raise Unavailable(INJECTED_UNAVAILABLE)
            else:
                _LOG.warning("fault_injected_crash")
                os.kill(os.getpid(), signal.SIGKILL)


def _stamp_of(path: str) -> tuple[int, int] | None:
    """What tells one version of the plan from the next: its mtime and size (None: no file)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_mtime_ns, info.st_size


def from_environment() -> FaultInjector | None:
    """The injector when FERRUM_ENABLE_FAULT_INJECTION=1 (tests only); None otherwise."""
    if os.environ.get(ENABLE_ENV) != "1":
        return None
    path = os.environ.get(PLAN_ENV, "")
    _LOG.warning("fault_injection_enabled", plan=path)
    return FaultInjector(path)
