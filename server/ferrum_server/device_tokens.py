"""Input tokens that are still on the device: what a step launched ahead reads.

A continuation decode launched before the step that selected its input has finished
(Engine.launch) cannot have that token on the host without waiting for the device. Its input is
instead the selecting step's sampled token tensor at one row, copied into the forward's input
ids on the device, in stream order after the step that writes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from ferrum_kernels.transfer import ints_to_device


# Not frozen: one is made per decode per step, and a frozen dataclass's __init__ costs about
# 0.4 us against 0.2.
@dataclass(slots=True, eq=False)
class DeviceToken:
    """A token still on the device: row `row` of `source`, a launched step's sampled token ids
    ([N] int64). A cache holds one for its selected token while that step is in flight."""

    source: torch.Tensor
    row: int

    def is_row(self, source: torch.Tensor | None, row: int) -> bool:
        """Whether it is row `row` of that very tensor."""
        return self.source is source and self.row == row


def place_device_tokens(target: torch.Tensor, tokens: dict[int, DeviceToken]) -> None:
    """target[r] = tokens[r].source[tokens[r].row] for every row r, on the device with no host
    sync: one gather and one scatter per source tensor (a step's tokens come from one or two)."""
    groups: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    for row, token in tokens.items():
        _, targets, sources = groups.setdefault(id(token.source), (token.source, [], []))
        targets.append(row)
        sources.append(token.row)
    for source, targets, sources in groups.values():
        indices = ints_to_device([*sources, *targets], target.device).view(2, -1)
        picked = source.index_select(0, indices[0])
        target.index_copy_(0, indices[1], picked.to(target.dtype))
