"""ferrum-executor server: owns the model and the paged KV cache, serves the executor contract."""

__version__ = "0.1.0"
