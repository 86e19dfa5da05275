"""How the device's memory is divided at start-up: pure arithmetic, no torch.

On CUDA the engine measures what the model needs before it sizes the KV pool:

    kv = total * utilisation - weights - peak activations - CUDA graph pool

(and never more than the memory actually free, minus the activation and graph reservations, so
another process on the device cannot push it into an out-of-memory at the first big step). An
explicit KV size wins over the formula but must fit in what the formula leaves. On CPU the pool
keeps its fixed default size and only has to fit in host memory beside the weights.

Kept free of torch so the arithmetic and its error messages are unit-tested with made-up numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 1024**3
# The keys of MemoryPlan.parts(), in order.
MEMORY_PLAN_PARTS = (
    "total",
    "budget",
    "weights",
    "activation_peak",
    "cuda_graphs_reserved",
    "cuda_graphs",
    "kv_cache",
)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """The start-up division of device (CUDA) or host (CPU) memory, in bytes."""

    total_bytes: int  # device memory (CUDA) or physical host memory (CPU)
    utilization: float  # fraction of total the plan stays within (1.0 on CPU)
    weights_bytes: int
    activation_peak_bytes: int  # measured peak of the largest forward (0 on CPU)
    cuda_graph_reserved_bytes: int  # set aside for CUDA graphs when the KV pool was sized
    cuda_graph_bytes: int  # measured after capture (0 when graphs are off or not captured yet)
    kv_cache_bytes: int  # the KV pool as allocated, reserved blocks included
    block_bytes: int
    num_blocks: int  # blocks sequences may use
    reserved_blocks: int  # blocks in the pool that no sequence uses (the CUDA graph scratch block)
    explicit_kv: bool  # the KV size came from --kv-cache-bytes (or the CPU default)

    @property
    def budget_bytes(self) -> int:
        """What the plan may use: total x utilisation."""
        return int(self.total_bytes * self.utilization)

    @property
    def planned_bytes(self) -> int:
        """Everything the plan accounts for (the larger of the graph reservation and use)."""
        graphs = max(self.cuda_graph_reserved_bytes, self.cuda_graph_bytes)
        return self.weights_bytes + self.activation_peak_bytes + graphs + self.kv_cache_bytes

    @property
    def graphs_within_reservation(self) -> bool:
        return self.cuda_graph_bytes <= self.cuda_graph_reserved_bytes

    def with_num_blocks(self, num_blocks: int) -> MemoryPlan:
        """The same plan with fewer blocks (every tensor-parallel rank holds the smallest
        count any of them can); the pool's bytes follow."""
        if num_blocks == self.num_blocks:
            return self
        if num_blocks > self.num_blocks:
            raise ValueError(f"cannot grow a plan of {self.num_blocks} blocks to {num_blocks}")
        total = num_blocks + self.reserved_blocks
        return replace(self, num_blocks=num_blocks, kv_cache_bytes=total * self.block_bytes)

    def with_weights_bytes(self, resident: int) -> MemoryPlan:
        """The same plan with the weights' bytes as held once serving (on CPU: packed copies
        in, released plain copies out); the pool is already sized, this is the report."""
        return replace(self, weights_bytes=max(0, resident))

    def with_cuda_graph_bytes(self, measured: int) -> MemoryPlan:
        """The same plan with the graph memory measured after capture."""
        return replace(self, cuda_graph_bytes=max(0, measured))

    def parts(self) -> dict[str, int]:
        """Named byte counts, for metrics and logs (keys match METRIC_DOCS' `part` label)."""
        return {
            "total": self.total_bytes,
            "budget": self.budget_bytes,
            "weights": self.weights_bytes,
            "activation_peak": self.activation_peak_bytes,
            "cuda_graphs_reserved": self.cuda_graph_reserved_bytes,
            "cuda_graphs": self.cuda_graph_bytes,
            "kv_cache": self.kv_cache_bytes,
        }


def plan_memory(
    *,
    total_bytes: int,
    utilization: float,
    weights_bytes: int,
    activation_peak_bytes: int,
    cuda_graph_bytes: int,
    block_bytes: int,
    requested_kv_bytes: int,
    free_bytes: int | None = None,
    reserved_blocks: int = 0,
) -> MemoryPlan:
    """Size the KV pool; raise ValueError with a one-line reason when nothing fits.

    requested_kv_bytes: 0 sizes the pool from the budget; > 0 is an explicit size that must fit
    in what the budget leaves. free_bytes: memory free on the device right now (after the
    weights are loaded), or None where it is not measured (CPU). reserved_blocks: blocks taken
    from the pool for internal use; the pool must still hold at least one block beyond them.
    """
    if block_bytes < 1:
        raise ValueError(f"a KV block must take at least one byte, got {block_bytes}")
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"memory utilisation must be in (0, 1], got {utilization}")
    fixed = weights_bytes + activation_peak_bytes + cuda_graph_bytes
    budget = int(total_bytes * utilization)
    left = budget - fixed
    what = (
        f"weights {_gib(weights_bytes)} + peak activations {_gib(activation_peak_bytes)} + "
        f"CUDA graphs {_gib(cuda_graph_bytes)}"
    )
    if left <= 0:
        raise ValueError(
            f"{what} exceed {utilization:.0%} of the device's {_gib(total_bytes)} "
            f"({_gib(budget)}); raise --gpu-memory-utilization, lower --max-batch-tokens or "
            f"--cuda-graph-max-batch, or use a smaller model"
        )
    limit = f"the {_gib(left)} left of {utilization:.0%} of {_gib(total_bytes)} after {what}"
    if free_bytes is not None:
        free_left = free_bytes - activation_peak_bytes - cuda_graph_bytes
        if free_left < left:
            left = free_left
            limit = (
                f"the {_gib(max(0, left))} free on the device after peak activations and CUDA "
                f"graphs (another process may hold memory)"
            )
    explicit = requested_kv_bytes > 0
    if explicit:
        if requested_kv_bytes > left:
            raise ValueError(
                f"--kv-cache-bytes {requested_kv_bytes} ({_gib(requested_kv_bytes)}) exceeds "
                f"{limit}"
            )
        kv_bytes = requested_kv_bytes
    else:
        kv_bytes = max(0, left)
    num_blocks = kv_bytes // block_bytes - reserved_blocks
    if num_blocks < 1:
        reserved = f", {reserved_blocks} of them reserved" if reserved_blocks else ""
        raise ValueError(
            f"a KV pool of {kv_bytes} bytes holds no usable block of {block_bytes} bytes"
            f"{reserved}" + ("" if explicit else f"; it gets {limit}")
        )
    return MemoryPlan(
        total_bytes=total_bytes,
        utilization=utilization,
        weights_bytes=weights_bytes,
        activation_peak_bytes=activation_peak_bytes,
        cuda_graph_reserved_bytes=cuda_graph_bytes,
        cuda_graph_bytes=0,
        kv_cache_bytes=(num_blocks + reserved_blocks) * block_bytes,
        block_bytes=block_bytes,
        num_blocks=num_blocks,
        reserved_blocks=reserved_blocks,
        explicit_kv=explicit,
    )


def estimate_graph_bytes(first_graph: int, next_graph: int, num_graphs: int) -> int:
    """Memory for num_graphs graphs from a trial capture of the two largest.

    The graphs share one memory pool and are captured largest first, so the largest one's
    activations serve all of them; each further graph adds roughly what the second one did
    (its executable and any segment it could not reuse). A floor per graph covers the
    driver's allocation granularity hiding small increments, and a margin covers the caching
    allocator carving segments differently in the real capture than in the trial.
    """
    if num_graphs < 1:
        return 0
    first = max(0, first_graph)
    per_graph = max(next_graph, _MIN_GRAPH_BYTES)
    margin = max(_MIN_MARGIN_BYTES, first // 10)
    return first + (num_graphs - 1) * per_graph + margin


_MIN_GRAPH_BYTES = 2 * 1024**2
_MIN_MARGIN_BYTES = 64 * 1024**2
