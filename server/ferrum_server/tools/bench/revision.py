"""Another git revision's executor for `bench --against REV`: the revision checked out in a
temporary worktree, whose server then runs beside the working tree's in the same rounds.

Comparing two builds served end to end used to take a hand-made worktree on `PYTHONPATH` and
alternating invocations; in one invocation the rounds rotate both rows through the same
spells of a shared machine, and the greedy outputs of the two are compared as well. Only the
server comes from the revision: the scheduler, the client and the bench are the working tree's,
so the revision must speak the contract they use (the contract only grows: docs/protocol.md).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# This checkout's root: the package runs from server/ferrum_server/tools/bench/.
CHECKOUT = Path(__file__).resolve().parents[4]
# The folders of a checkout that hold the packages a server imports.
_PACKAGE_DIRS = ("server", "kernels", "client")


@dataclass(frozen=True, slots=True)
class RevisionCheckout:
    revision: str  # as the caller named it
    commit: str  # the full hash it resolved to
    root: Path  # the worktree

    @property
    def label(self) -> str:
        """The bench row's name."""
        return f"ferrum-grpc@{self.commit[:10]}"

    @property
    def python_path(self) -> str:
        """PYTHONPATH for a process that must import this checkout's packages."""
        return os.pathsep.join(str(self.root / part) for part in _PACKAGE_DIRS)


def _git(repository: Path, *args: str, strict: bool = True) -> str:
    """git's output; a failure raises ValueError with its message, or with `strict` False
    (clean-up that must not raise) gives ""."""
    done = subprocess.run(
        ["git", "-C", str(repository), *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        if not strict:
            return ""
        raise ValueError(done.stderr.strip() or f"git {' '.join(args)} failed")
    return done.stdout.strip()


def server_package(python_path: str) -> Path:
    """Where `ferrum_server` is imported from with `python_path` first on the path (what a
    server process started with it runs)."""
    done = subprocess.run(
        [sys.executable, "-c", "import ferrum_server; print(ferrum_server.__file__)"],
        env={**os.environ, "PYTHONPATH": python_path},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise ValueError(f"the checkout's server does not import: {done.stderr.strip()[-500:]}")
    return Path(done.stdout.strip()).resolve()


@contextlib.contextmanager
def revision_checkout(revision: str, repository: Path = CHECKOUT) -> Iterator[RevisionCheckout]:
    """`revision` checked out (detached) in a temporary worktree of `repository`, removed on
    exit. ValueError, before anything is created, when git is missing, `repository` is not a
    git checkout or `revision` names no commit; and, the worktree removed again, when a process
    given its `python_path` would not import the worktree's server (the comparison would
    otherwise time this checkout's twice)."""
    if shutil.which("git") is None:
        raise ValueError("git is not installed")
    try:
        _git(repository, "rev-parse", "--git-dir")
    except ValueError as exc:
        raise ValueError(f"{repository} is not a git checkout: {exc}") from None
    try:
        commit = _git(repository, "rev-parse", "--verify", "--quiet", f"{revision}^{{commit}}")
    except ValueError:
        raise ValueError(f"{revision!r} names no commit in {repository}") from None
    parent = Path(tempfile.mkdtemp(prefix="ferrum-against-"))
    root = parent / "checkout"
    try:
        _git(repository, "worktree", "add", "--detach", "--quiet", str(root), commit)
        checkout = RevisionCheckout(revision, commit, root)
        imported = server_package(checkout.python_path)
        if not imported.is_relative_to(root.resolve()):
            raise ValueError(
                f"a server given the worktree's path imports {imported} instead: "
                "the comparison would time this checkout twice"
            )
        yield checkout
    finally:
        _git(repository, "worktree", "remove", "--force", str(root), strict=False)
        shutil.rmtree(parent, ignore_errors=True)
        # A worktree whose folder went some other way leaves its record behind: drop it.
        _git(repository, "worktree", "prune", strict=False)
