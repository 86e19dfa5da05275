"""Frozen configuration, built once at start-up from the CLI and passed down explicitly.

Each field's default lives here (and in security.py) only; its metadata says whether, and as
which `serve` flag, the CLI exposes it (see config_flags.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrum_server.config_flags import NOT_A_FLAG, flag
from ferrum_server.security import SecurityConfig

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")
KERNEL_BACKENDS = ("auto", "cpu", "torch", "triton")
LOG_FORMATS = ("auto", "json", "console")
# A lease longer than a day would keep a dead client's slots for a day: surely a typo.
MAX_CACHE_LEASE_S = 86400.0
MAX_PREFIX_PENDING_S = 600.0
# The sweep for idle caches and stale prefix marks runs at least this often.
LEASE_SWEEP_MAX_S = 5.0


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the engine needs: model source, placement and KV sizing."""

    model: str = field(
        default="tiny", metadata=flag("'tiny' (built-in random weights) or a Hugging Face folder")
    )
    device: str = field(default="cpu", metadata=flag("cpu or cuda[:N]"))
    dtype: str = field(default="float32", metadata=flag("compute dtype", choices=DTYPES))
    block_size: int = field(default=16, metadata=flag("KV block size in tokens"))
    # Explicit KV pool size in bytes; 0 = size from free device memory (CUDA) or a default (CPU).
    kv_cache_bytes: int = field(
        default=0,
        metadata=flag(
            "KV pool bytes; 0 = what GPU memory x utilisation leaves after weights, activations "
            "and graphs (CUDA) or 256 MiB (CPU)"
        ),
    )
    # Fraction of the device's total memory the executor plans within: weights, the measured
    # peak activations, CUDA graphs and the KV pool (CUDA only).
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=flag(
            "fraction of total GPU memory for weights, peak activations, CUDA graphs and the "
            "KV pool"
        ),
    )
    max_batch_tokens: int = field(default=4096, metadata=flag("most tokens in one forward"))
    max_batch_size: int = field(
        default=256, metadata=flag("most items in one forward, and most live sequences")
    )
    max_sequence_length: int = field(
        default=0, metadata=flag("longest sequence; 0 = the model's positions")
    )
    max_num_logprobs: int = field(default=20, metadata=NOT_A_FLAG)
    seed: int = field(default=0, metadata=NOT_A_FLAG)
    torch_threads: int = field(
        default=0, metadata=flag("CPU intra-op threads; 0 = torch's default")
    )
    # "auto" means Triton on CUDA when installed, else the torch reference.
    kernel_backend: str = field(
        default="auto",
        metadata=flag(
            "kernels: auto (the CPU fast path on CPU, Triton on CUDA), cpu, torch (the "
            "reference), triton",
            choices=KERNEL_BACKENDS,
        ),
    )
    prefix_caching: bool = field(
        default=True, metadata=flag("reuse KV blocks of shared prompt prefixes")
    )
    # On CPU the KV pool is advised transparent huge pages before its first write
    # (host_memory.advise_huge_pages): decode attention over scattered blocks runs 4-12% faster,
    # and start-up zeroes the pool about 0.5-1 s a GiB slower (docs/operations.md).
    kv_huge_pages: bool = field(
        default=True,
        metadata=flag(
            "CPU: advise transparent huge pages for the KV pool (faster decode attention over "
            "scattered blocks, slower start-up)"
        ),
    )
    # Host memory for swapped-out KV of preempted sequences.
    swap_space_bytes: int = field(
        default=1024**3,
        metadata=flag("host memory for KV swapped out by preemption; 0 = recompute only"),
    )
    # A cache that no call names for this long is released (a client that died holding it would
    # otherwise keep its slot and blocks forever); see docs/capacity.md#cache-leases.
    cache_lease_s: float = field(
        default=300.0,
        metadata=flag(
            "seconds a cache may go untouched by any call before it is released; 0 = never"
        ),
    )
    # An admitted request's not-yet-computed prefix blocks make others with that prefix wait
    # (PREFIX_PENDING); the wait ends at its first chunk, its release, or after this long.
    prefix_pending_s: float = field(
        default=2.0,
        metadata=flag(
            "seconds others may wait for an admitted request's first chunk to compute a shared "
            "prefix"
        ),
    )
    require_fencing: bool = field(
        default=False,
        metadata=flag("refuse mutating calls with executor_instance_id 0 (FAILED_PRECONDITION)"),
    )
    # CUDA with graph-safe kernels only; ignored on CPU.
    cuda_graphs: bool = field(
        default=True,
        metadata=flag("replay decode-only steps from CUDA graphs captured at start-up (CUDA only)"),
    )
    # docs/architecture.md, "Launching ahead". Off until measured on a GPU (docs/gpu.md).
    launch_ahead: bool = field(
        default=False,
        metadata=flag(
            "launch a step before the one in flight is answered, so the host's work overlaps "
            "the device's (steps queued back to back, e.g. decode continuation)"
        ),
    )
    # Capped at max_batch_size (see graph_max_batch).
    cuda_graph_max_batch: int = field(
        default=256,
        metadata=flag("largest decode batch captured as a CUDA graph; larger steps run eagerly"),
    )

    # Tensor parallelism (docs/parallelism.md). Spawn mode: this process is rank 0 of
    # tensor_parallel_size and starts ranks 1..N-1 itself on this host.
    tensor_parallel_size: int = field(
        default=1,
        metadata=flag(
            "split the model over N ranks; this process is rank 0 and starts ranks 1..N-1 "
            "itself (cuda:0..N-1, or N CPU processes sharing the cores)"
        ),
    )
    # One process per rank (one container per GPU): every rank is started by the orchestrator
    # with the same flags plus its --rank; they meet at --dist-init.
    rank: int = field(
        default=0,
        metadata=flag("this process's rank with --world-size (0 serves gRPC; others follow)"),
    )
    world_size: int = field(
        default=0,
        metadata=flag("ranks started one per process (container); 0 = not this launch mode"),
    )
    dist_init: str = field(
        default="",
        metadata=flag("where the ranks meet: tcp://HOST:PORT (rank 0's address) with --world-size"),
    )
    # Every collective (each step's plan broadcast, the all-reduces) fails after this long, so a
    # rank that hangs or dies never hangs the others; idle rank 0 sends a heartbeat well within.
    collective_timeout_s: float = field(
        default=120.0,
        metadata=flag("seconds a tensor-parallel collective may wait before the executor fails"),
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device.split(":")[0] not in DEVICES:
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block size must be in [1, 1024], got {self.block_size}")
        if self.kv_cache_bytes < 0:
            raise ValueError("KV cache bytes must be >= 0")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("GPU memory utilisation must be in (0, 1]")
        if self.max_batch_tokens < 1 or self.max_batch_size < 1:
            raise ValueError("max batch tokens and max batch size must be >= 1")
        if self.swap_space_bytes < 0:
            raise ValueError("swap space bytes must be >= 0")
        if self.max_sequence_length < 0 or self.max_num_logprobs < 0:
            raise ValueError("max sequence length and max logprobs must be >= 0")
        if self.cuda_graph_max_batch < 1:
            raise ValueError("the largest CUDA graph batch must be >= 1")
        if not 0 <= self.cache_lease_s <= MAX_CACHE_LEASE_S:
            raise ValueError(f"cache lease must be in [0, {MAX_CACHE_LEASE_S:g}] s (0 = off)")
        if not 0 < self.prefix_pending_s <= MAX_PREFIX_PENDING_S:
            raise ValueError(f"prefix pending bound must be in (0, {MAX_PREFIX_PENDING_S:g}] s")
        _check_parallel(self)

    @property
    def sweep_interval_s(self) -> float:
        """How often idle caches and stale prefix marks are looked for: a quarter of the
        shortest bound, at most LEASE_SWEEP_MAX_S, so each bound is kept within 25% (or 5 s)."""
        bounds = [self.prefix_pending_s] + ([self.cache_lease_s] if self.cache_lease_s else [])
        return min(LEASE_SWEEP_MAX_S, min(bounds) / 4)

    @property
    def parallel_size(self) -> int:
        """How many ranks the model is split over (1: not split)."""
        return self.world_size or self.tensor_parallel_size

    @property
    def spawns_followers(self) -> bool:
        """This process starts the other ranks itself (--tensor-parallel-size N > 1)."""
        return self.tensor_parallel_size > 1 and not self.world_size

    @property
    def graph_max_batch(self) -> int:
        """The largest captured decode batch: no step holds more than max_batch_size items."""
        return min(self.cuda_graph_max_batch, self.max_batch_size)


def _check_parallel(config: EngineConfig) -> None:
    """The two launch modes exclude each other; each one's numbers must make sense."""
    if config.tensor_parallel_size < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {config.tensor_parallel_size}")
    if config.world_size < 0:
        raise ValueError(f"world size must be >= 0, got {config.world_size}")
    if config.world_size and config.tensor_parallel_size not in (1, config.world_size):
        raise ValueError(
            f"--tensor-parallel-size {config.tensor_parallel_size} and --world-size "
            f"{config.world_size} disagree (with --world-size each rank is its own process)"
        )
    if config.world_size and not 0 <= config.rank < config.world_size:
        raise ValueError(f"rank must be in [0, {config.world_size}), got {config.rank}")
    # That --rank comes with --world-size and where the ranks meet is checked at launch
    # (parallel/launch.py), where the mode is chosen.
    if config.collective_timeout_s <= 0:
        raise ValueError(f"collective timeout must be > 0 s, got {config.collective_timeout_s:g}")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Network settings of the gRPC server."""

    host: str = field(default="127.0.0.1", metadata=flag("gRPC listen address"))
    port: int = field(default=50051, metadata=flag("gRPC port; 0 = any free port"))
    grace_s: float = field(
        default=30.0, metadata=flag("seconds in-flight calls may run after SIGTERM")
    )
    # Largest message received / sent, bytes.
    max_message_bytes: int = field(
        default=0, metadata=flag("max message size both ways; 0 = derived from limits")
    )
    # Concurrent RPCs (streams included) before new ones get RESOURCE_EXHAUSTED; grpc.health.v1
    # is never counted (call_limits.py).
    max_concurrent_rpcs: int = field(
        default=1024,
        metadata=flag("concurrent RPCs (health exempt) before RESOURCE_EXHAUSTED; 0 = off"),
    )
    # One caller's share of that total (security.caller_identity: token, session or anonymous).
    max_concurrent_rpcs_per_caller: int = field(
        default=512,
        metadata=flag("concurrent RPCs of one caller before RESOURCE_EXHAUSTED; 0 = off"),
    )
    # Steps a StepStream may have read but not answered; reading stops while it is full.
    step_stream_window: int = field(
        default=16,
        metadata=flag("StepStream steps read but not yet answered; reading waits while full"),
    )
    # SETTINGS_MAX_CONCURRENT_STREAMS.
    max_concurrent_streams: int = field(default=256, metadata=flag("HTTP/2 streams per connection"))
    max_metadata_bytes: int = field(
        default=16 * 1024, metadata=flag("request metadata (headers) per call")
    )
    # For probes when TLS is on.
    health_port: int = field(
        default=-1, metadata=flag("plaintext port serving only grpc.health.v1; -1 = off")
    )
    release_on_disconnect: bool = field(
        default=True,
        metadata=flag("release the caches a StepStream opened or touched when it ends abnormally"),
    )
    # The step ledger's bounds, each evicting the oldest first (see step_ledger.py).
    step_ledger_size: int = field(
        default=4096, metadata=flag("step ids whose results are held for exactly-once retries")
    )
    step_ledger_max_bytes: int = field(
        default=64 * 1024**2,
        metadata=flag(
            "bytes of stored responses (serialized size) the step ledger holds; a larger "
            "response is not kept"
        ),
    )
    # About 190 bytes each (measured): 12 MiB at the default.
    step_ledger_evicted_ids: int = field(
        default=65536,
        metadata=flag(
            "evicted step ids remembered, so that a retry answers FAILED_PRECONDITION "
            "(result no longer held) instead of running again"
        ),
    )
    # Built from SecurityConfig's own flags.
    security: SecurityConfig = field(default_factory=SecurityConfig, metadata=NOT_A_FLAG)
    # Prometheus /metrics over HTTP. 9400 is what `ferrum-executor serve` has always listened
    # on (the container and manifests set it explicitly too).
    metrics_port: int = field(
        default=9400,
        metadata=flag("Prometheus /metrics port; 0 = any free port, -1 = off"),
    )
    # Empty follows --host, so `--host 127.0.0.1` does not leave /metrics open on every
    # interface; give an address to split them (the container image sets 0.0.0.0 for both).
    metrics_host: str = field(
        default="", metadata=flag("Prometheus listen address; '' = the gRPC --host")
    )
    # For the container's HEALTHCHECK (probe_file.py); the image sets FERRUM_PROBE_FILE.
    probe_file: str = field(
        default="",
        metadata=flag("once SERVING, write where local health probes connect (JSON); '' = off"),
    )
    # Needs the 'debug' extra.
    reflection: bool = field(
        default=False,
        metadata=flag("gRPC server reflection (needs the 'debug' extra)", name="debug-reflection"),
    )
    # The engine thread must answer a heartbeat within liveness_timeout_s, checked every
    # liveness_interval_s; otherwise the liveness health service reports NOT_SERVING.
    liveness_interval_s: float = field(default=5.0, metadata=NOT_A_FLAG)
    liveness_timeout_s: float = field(
        default=120.0,
        metadata=flag(
            "engine heartbeat deadline before the liveness health service reports NOT_SERVING"
        ),
    )

    @property
    def metrics_bind_host(self) -> str:
        """Where /metrics listens: --metrics-host, else the gRPC --host (brackets dropped:
        the HTTP server takes a bare IPv6 address)."""
        return (self.metrics_host or self.host).removeprefix("[").removesuffix("]")

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not -1 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics port must be in [-1, 65535], got {self.metrics_port}")
        if self.metrics_port > 0 and self.metrics_port == self.port:
            raise ValueError("the metrics port must differ from the gRPC port")
        if self.grace_s < 0:
            raise ValueError("grace period must be >= 0")
        if self.liveness_interval_s <= 0 or self.liveness_timeout_s <= 0:
            raise ValueError("liveness interval and timeout must be > 0")
        if not -1 <= self.health_port <= 65535:
            raise ValueError(f"health port must be in [-1, 65535], got {self.health_port}")
        if self.health_port > 0 and self.health_port in (self.port, self.metrics_port):
            raise ValueError("the health port must differ from the gRPC and metrics ports")
        if self.max_message_bytes < 0 or self.max_message_bytes >= 2**31:
            raise ValueError("max message bytes must be in [0, 2^31)")
        if self.max_concurrent_rpcs < 0 or self.max_concurrent_rpcs_per_caller < 0:
            raise ValueError("max concurrent RPCs (total and per caller) must be >= 0")
        if self.step_stream_window < 1:
            raise ValueError(f"step stream window must be >= 1, got {self.step_stream_window}")
        if self.max_concurrent_streams < 1 or self.max_metadata_bytes < 1024:
            raise ValueError("max concurrent streams must be >= 1 and max metadata >= 1024 bytes")
        if self.step_ledger_size < 1 or self.step_ledger_evicted_ids < 1:
            raise ValueError("step ledger size and evicted step ids must be >= 1")
        if self.step_ledger_max_bytes < 0:
            raise ValueError("step ledger max bytes must be >= 0")


@dataclass(frozen=True, slots=True)
class LogConfig:
    """How the process logs (see `logs.configure`)."""

    level: str = field(
        default="info", metadata=flag("debug, info, warning, error", name="log-level")
    )
    format: str = field(
        default="auto",
        metadata=flag(
            "json, console, or auto (console on a terminal)",
            name="log-format",
            choices=LOG_FORMATS,
        ),
    )
