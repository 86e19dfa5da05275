"""Host-to-device copies that never wait for the device.

A blocking copy to a GPU (`tensor.to("cuda")`, `torch.tensor(values, device="cuda")`) ends
with a stream synchronize: the host waits for every kernel already queued, which defeats a
step launched while the one before it still runs (Engine.launch). From pinned memory the copy
is asynchronous and ordered on the stream like a kernel; the caching host allocator keeps the
pinned buffer until the copy has read it.
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`, without a stream synchronize on CUDA."""
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def ints_to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of `values` on `device` (see `to_device`)."""
    return to_device(torch.tensor(values, dtype=torch.int64), device)
