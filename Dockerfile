# syntax=docker/dockerfile:1.7
#
# ferrum-executor image, one container per GPU.
#
#   docker build -t ferrum-executor:0.1.0-cuda .                        # CUDA (default)
#   docker build -t ferrum-executor:0.1.0-cpu --build-arg VARIANT=cpu .  # CPU only
#
# The builder installs the package and its torch build into /opt/venv; the runtime stage
# (picked by VARIANT through the `base-${VARIANT}` stages) copies only that venv, plus, for
# CUDA, the standalone CPython the venv was made with: Ubuntu 22.04's own Python is 3.10 and
# the project needs 3.11.
#
# The runtime stage does carry a C/C++ compiler (gcc, g++, libc headers), because two things
# compile on the machine that runs them and cannot be built here ahead of time:
# - Triton (CUDA) compiles a small C launcher, against Python.h and the host driver's
#   libcuda.so.1 (mounted at run time), the first time a process runs a kernel;
# - the native CPU kernels (ferrum_kernels.native) are built with g++ -march=native for the CPU
#   they run on; without a compiler they fall back to the slower torch path.
# Both cache what they build under $HOME (Triton ~/.triton, torch ~/.cache/torch_extensions).
# tests/unit/test_deploy.py runs this stage's entrypoint in a scratch environment holding only
# the tools installed here.

ARG VARIANT=cuda
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.4.1-runtime-ubuntu22.04

# ---------------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder
ARG VARIANT
ARG TORCH_VERSION=2.13.0
# torch's CUDA wheels carry their own CUDA libraries and need only the host driver; pick the
# index whose CUDA major matches the runtime base (12.x) and your drivers.
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu126
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG UV_VERSION=0.13.9
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_NO_CACHE=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# The venv's interpreter must exist at the same path in the runtime stage: python:3.11-slim
# has it at /usr/local/bin; the CUDA base gets a relocatable standalone CPython in /opt/python.
RUN if [ "${VARIANT}" = "cuda" ]; then \
        pip install "uv==${UV_VERSION}" \
        && uv python install --install-dir /opt/python 3.11 \
        && python_bin="$(uv python find --no-project --python-preference only-managed 3.11)" \
        && pip uninstall -y uv; \
    elif [ "${VARIANT}" = "cpu" ]; then \
        mkdir -p /opt/python && python_bin=/usr/local/bin/python3.11; \
    else \
        echo "VARIANT must be cuda or cpu, not '${VARIANT}'" >&2 && exit 1; \
    fi \
    && "${python_bin}" -m venv /opt/venv \
    && /opt/venv/bin/pip install --upgrade "pip==26.3"

ENV PATH=/opt/venv/bin:${PATH}

# torch first, from the index that matches the variant, so `.[server]` (torch>=2.4) keeps it.
RUN if [ "${VARIANT}" = "cuda" ]; then index="${TORCH_CUDA_INDEX}"; \
    else index="${TORCH_CPU_INDEX}"; fi \
    && pip install "torch==${TORCH_VERSION}" --index-url "${index}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY server/ server/
COPY client/ client/
COPY kernels/ kernels/
COPY scripts/ scripts/
# The project itself, not a registry package: its dependency ranges live in pyproject.toml.
# hadolint ignore=DL3013
RUN pip install ".[server]" \
    && pip check \
    && ferrum-executor --help >/dev/null

# ---------------------------------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS base-cuda
COPY --from=builder /opt/python /opt/python
ENV FERRUM_DEVICE=cuda \
    FERRUM_DTYPE=bfloat16

FROM ${PYTHON_IMAGE} AS base-cpu
ENV FERRUM_DEVICE=cpu \
    FERRUM_DTYPE=float32

# ---------------------------------------------------------------------------------------------
# base-${VARIANT} is a stage above, not a registry image (hadolint cannot resolve the arg).
# hadolint ignore=DL3006
FROM base-${VARIANT} AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="ferrum-executor" \
      org.opencontainers.image.description="gRPC executor running an LLM's forward passes on one device" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.ferrum.variant="${VARIANT}"

# Versions follow the base image's distribution (Debian 12 or Ubuntu 22.04), so none is pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN groupadd --system --gid 10001 ferrum \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/ferrum --create-home \
       --shell /usr/sbin/nologin ferrum

COPY --from=builder /opt/venv /opt/venv
COPY deploy/healthcheck.py /opt/ferrum/healthcheck.py

ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    FERRUM_HOST=0.0.0.0 \
    FERRUM_PORT=50051 \
    FERRUM_METRICS_PORT=9400 \
    FERRUM_PROBE_FILE=/tmp/ferrum-executor-probe.json \
    HOME=/home/ferrum

USER 10001:10001
WORKDIR /home/ferrum
EXPOSE 50051 9400

# Model load plus warmup can take minutes: failures during start-period do not count. The check
# connects where the server's probe file (FERRUM_PROBE_FILE) says, so `serve --port N` moves it.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["/opt/venv/bin/python", "/opt/ferrum/healthcheck.py"]

# The executor drains on SIGTERM (health flips to NOT_SERVING, in-flight calls finish within
# --grace-s); give `docker stop` a --time larger than --grace-s.
STOPSIGNAL SIGTERM
ENTRYPOINT ["ferrum-executor"]
CMD ["serve", "--host", "0.0.0.0"]
