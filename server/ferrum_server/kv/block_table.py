"""A step's block tables as one tensor: each sequence's block ids, padded to a common width.

Built for every forward (and every CUDA graph replay) from the caches' block id lists. A
nested-list ``torch.tensor`` converts element by element (about 80 ns each, 0.7 ms for 256
sequences of 33 blocks); here the ids are read once into numpy and placed with one masked
assignment, about three times faster.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch


def padded_block_table(rows: Sequence[Sequence[int]], width: int, fill: int = 0) -> torch.Tensor:
    """[len(rows), width] int64 on the host: row i holds rows[i], then `fill` to the width
    (every row must fit: len(rows[i]) <= width)."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    if lengths.size and int(lengths.max()) > width:
        raise ValueError(f"a block table of {int(lengths.max())} blocks is wider than {width}")
    ids = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
    table = np.full((len(rows), width), fill, dtype=np.int64)
    # Row-major: the mask's true entries are row 0's first lengths[0] columns, then row 1's...
    # the order of `ids`.
    table[np.arange(width) < lengths[:, None]] = ids
    return torch.from_numpy(table)
