# syntax=docker/dockerfile:1
# Guard's services image (`guard streams|sink|orchestrator`; it runs `guard agent` too, but
# GPU nodes get the slim deploy/images/Containerfile.agent, and sweeps
# deploy/images/Containerfile.sweep: docs/operations.md#images-by-role).
# Build from the repository root:  docker build -t guard:local .
#                                  deploy/images/build.sh services  (buildah, Debian base)
# NVML (the agent's GPU source) comes from the host driver through the NVIDIA container
# runtime (runtimeClassName: nvidia in Kubernetes, `--gpus all` / `runtime: nvidia` in Docker);
# the image ships no driver library of its own.

# any Debian-like base with python3 (>= 3.11) and its venv module
ARG BASE=docker.io/library/python:3.11-slim-bookworm

# --- build: a virtual environment with Guard and its dependencies ----------------------------
FROM ${BASE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# a compiler for any dependency without a wheel for this platform; it stays in this stage
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/guard
WORKDIR /src
COPY pyproject.toml README.md ./
COPY guard/ guard/
COPY schemas/ schemas/
COPY detectors/ detectors/
COPY agents/ agents/
COPY streams/ streams/
COPY sweeps/ sweeps/
COPY evaluation/ evaluation/
COPY planning/ planning/
# the services extra (chDB, faust, ...) and the kubernetes one: the orchestrator's cordon +
# taint adapter
RUN /opt/guard/bin/pip install --upgrade pip \
 && /opt/guard/bin/pip install '.[services,kubernetes]' \
 && /opt/guard/bin/guard --version

# --- runtime: the environment only, as an unprivileged user ----------------------------------
FROM ${BASE} AS runtime
LABEL org.opencontainers.image.title="guard" \
      org.opencontainers.image.description="Grey-node and straggler detection for GPU training fleets" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 guard \
 && useradd --system --uid 10001 --gid guard --home-dir /var/lib/guard --shell /usr/sbin/nologin guard \
 && install -d -o guard -g guard -m 0750 /var/lib/guard /var/lib/guard/shared /run/guard
COPY --from=build /opt/guard /opt/guard
ENV PATH=/opt/guard/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    GUARD_HOME=/var/lib/guard \
    NVIDIA_DRIVER_CAPABILITIES=utility
USER 10001:10001
WORKDIR /var/lib/guard
# streams.web_port (metrics and /healthz of `guard streams`)
EXPOSE 6066
ENTRYPOINT ["guard"]
CMD ["--help"]
