"""The executor's prefix-cache keys, computed in the client (no torch): the chained content hash
of every full block of a prompt. It must stay byte-for-byte the chain of
``ferrum_server.kv.manager.chain_hashes`` (tests/unit/test_fleet_spec.py checks both agree), so that
the fleet places a prompt where its prefix is cached."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

_ROOT_HASH = b"ferrum-prefix-root"


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Content key of a full block: its tokens and (through `parent`) every token before it."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return digest.digest()


def chain_hashes(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hash of every full block of `tokens`, in order (block i's covers tokens
    [0, (i + 1) * block_size))."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    hashes: list[bytes] = []
    parent = _ROOT_HASH
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes
