"""Frozen configuration, built once at start-up from the CLI and passed down explicitly."""

from __future__ import annotations

from dataclasses import dataclass, field

from ferrum_server.security import SecurityConfig

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the engine needs: model source, placement and KV sizing."""

    model: str = "tiny"
    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    # Explicit KV pool size in bytes; 0 = size from free device memory (CUDA) or a default (CPU).
    kv_cache_bytes: int = 0
    # Fraction of the device's total memory the executor plans within: weights, the measured
    # peak activations, CUDA graphs and the KV pool (CUDA only).
    gpu_memory_utilization: float = 0.9
    max_batch_tokens: int = 4096
    max_batch_size: int = 256
    # 0 = the model's max_position_embeddings.
    max_sequence_length: int = 0
    max_num_logprobs: int = 20
    seed: int = 0
    # CPU intra-op threads for torch; 0 = leave torch's default.
    torch_threads: int = 0
    # Attention/KV-write/sampling kernels: "auto" (Triton on CUDA when installed, else the torch
    # reference), "torch", or "triton".
    kernel_backend: str = "auto"
    # Reuse full KV blocks across requests that share a prompt prefix.
    prefix_caching: bool = True
    # Host memory for swapped-out KV of preempted sequences; 0 = recompute only.
    swap_space_bytes: int = 1024**3
    # Refuse mutating calls whose executor_instance_id is 0 (unfenced) with FAILED_PRECONDITION.
    require_fencing: bool = False
    # Capture decode-only forwards as CUDA graphs at start-up (CUDA with graph-safe kernels only;
    # ignored on CPU).
    cuda_graphs: bool = True
    # Largest decode batch run from a graph (capped at max_batch_size); larger ones run eagerly.
    cuda_graph_max_batch: int = 256

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

    @property
    def graph_max_batch(self) -> int:
        """The largest captured decode batch: no step holds more than max_batch_size items."""
        return min(self.cuda_graph_max_batch, self.max_batch_size)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Network settings of the gRPC server."""

    host: str = "127.0.0.1"
    port: int = 50051
    grace_s: float = 30.0
    # Largest message received / sent, bytes; derived from the batch limits when 0.
    max_message_bytes: int = 0
    # Concurrent RPCs (streams included) before new ones get RESOURCE_EXHAUSTED; 0 = unlimited.
    max_concurrent_rpcs: int = 1024
    # HTTP/2 streams per connection (SETTINGS_MAX_CONCURRENT_STREAMS).
    max_concurrent_streams: int = 256
    # Request metadata (headers) per call, bytes.
    max_metadata_bytes: int = 16 * 1024
    # Plaintext port serving only grpc.health.v1 (for probes when TLS is on); -1 = off.
    health_port: int = -1
    # Release every cache a StepStream opened or touched when the stream ends abnormally.
    release_on_disconnect: bool = True
    # Step ids remembered for deduplication (most recent first).
    step_ledger_size: int = 4096
    security: SecurityConfig = field(default_factory=SecurityConfig)
    # Prometheus /metrics over HTTP: -1 = off, 0 = any free port.
    metrics_port: int = -1
    metrics_host: str = "0.0.0.0"
    # gRPC server reflection (debug only; needs the 'debug' extra).
    reflection: bool = False
    # The engine thread must answer a heartbeat within liveness_timeout_s, checked every
    # liveness_interval_s; otherwise the liveness health service reports NOT_SERVING.
    liveness_interval_s: float = 5.0
    liveness_timeout_s: float = 120.0

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
        if self.max_concurrent_rpcs < 0:
            raise ValueError("max concurrent RPCs must be >= 0")
        if self.max_concurrent_streams < 1 or self.max_metadata_bytes < 1024:
            raise ValueError("max concurrent streams must be >= 1 and max metadata >= 1024 bytes")
        if self.step_ledger_size < 1:
            raise ValueError("step ledger size must be >= 1")
