"""`ferrum-executor bench`: fixed workloads run on this executor (over gRPC and in-process) and,
in the same invocation, on Hugging Face transformers and vLLM's CPU build for comparison."""
