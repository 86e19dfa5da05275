"""Tensor parallelism: one model split over several processes with torch.distributed.

``group.TensorParallel`` says which rank of how many a process is; ``sharding`` which heads,
MLP columns and vocabulary rows each rank holds (and refuses what cannot be split);
``layers`` the Megatron-style parallel linears, embedding and LM head. Nothing here imports the
models package, which builds on it.
"""

from ferrum_server.parallel.group import SINGLE_RANK, TensorParallel, collective_backend
from ferrum_server.parallel.sharding import check_tensor_parallel

__all__ = ["SINGLE_RANK", "TensorParallel", "check_tensor_parallel", "collective_backend"]
