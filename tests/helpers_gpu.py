"""The gate every tests/gpu module passes before it imports the CUDA paths."""

from __future__ import annotations

import os

import pytest
import torch


def require_cuda_and_triton() -> None:
    """Skip the calling module unless a CUDA device and Triton are here, and the process is not
    in Triton's interpreter mode (the interpreter-mode unit tests set TRITON_INTERPRET=1 for the
    whole process, so tests/gpu runs in its own pytest invocation)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device", allow_module_level=True)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        pytest.skip(
            "TRITON_INTERPRET=1 in this process (interpreter unit tests were collected); run "
            "tests/gpu in its own pytest invocation",
            allow_module_level=True,
        )
    pytest.importorskip("triton", reason="triton is not installed")
