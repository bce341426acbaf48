# mmserve: one image for the encoder service, the decoder service and the `mmserve` CLI
# (the compose services differ only by command). See docs/docker.md.
#
# CPU (default):  docker build -t mmserve:cpu .
# Offline:        docker/wheelhouse.sh && docker build --build-arg OFFLINE=1 -t mmserve:cpu .
# No registry:    docker/make-base-image.sh && docker build --build-arg BASE_IMAGE=mmserve-base:bookworm ...
# GPU:            docker build -t mmserve:gpu \
#                   --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#                   --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                   --build-arg EXTRAS=gpu .
# NIXL (embeddings across hosts, `mmserve encoder --nixl`): add the extra, e.g.
#                 docker build -t mmserve:cpu-nixl --build-arg EXTRAS=nixl .   (GPU: EXTRAS=gpu,nixl)
#                 Off by default; docker-compose.nixl.yml builds this tag.
#
# The base needs python3 >= 3.10 with venv; one without python3 (the CUDA images) gets it from apt
# (online builds only: an offline GPU build needs a base that already has python3 and python3-venv).
# Works with the classic builder and with BuildKit.

ARG BASE_IMAGE=python:3.11-slim

# ---------------------------------------------------------------------------------------------
# deps: a venv with torch and the project's dependencies (changes only with pyproject.toml).
FROM ${BASE_IMAGE} AS deps
# OFFLINE=1: install only from docker/wheelhouse (pip --no-index); 0: the wheelhouse first, then indexes.
ARG OFFLINE=0
# Pin torch: a bare `torch` from PyPI is the multi-GB CUDA build.
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# pyproject extras, comma-separated: "gpu" adds cupy-cuda12x and fla-core (Qwen3.5's linear-attention kernels), "nixl" nixl-cu12 (the NIXL transport; CUDA 13:
# "nixl-cu13"). EXTRA_PIP: more requirements, e.g. "cupy-cuda13x" for a
# CUDA 13 build (with EXTRAS empty).
ARG EXTRAS=
ARG EXTRA_PIP=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore \
    DEBIAN_FRONTEND=noninteractive

# A base without python3, or without a working venv (Debian/Ubuntu split it into python3-venv),
# gets them from apt.
RUN set -eu; \
    if ! python3 -m venv /opt/mmserve >/dev/null 2>&1; then \
        rm -rf /opt/mmserve; \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
        python3 -m venv /opt/mmserve; \
    fi

COPY docker/wheelhouse/ /wheelhouse/
RUN set -eu; \
    if [ "$OFFLINE" = 1 ]; then \
        ls /wheelhouse/torch-*.whl >/dev/null 2>&1 || { echo "OFFLINE=1 but docker/wheelhouse has no torch wheel: run docker/wheelhouse.sh" >&2; exit 1; }; \
        /opt/mmserve/bin/pip install --no-index --find-links /wheelhouse "$TORCH_SPEC"; \
    else \
        /opt/mmserve/bin/pip install --find-links /wheelhouse --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC"; \
    fi

COPY pyproject.toml /src/
RUN set -eu; \
    if [ "$OFFLINE" = 1 ]; then set -- --no-index --find-links /wheelhouse; else set -- --find-links /wheelhouse; fi; \
    /opt/mmserve/bin/python -c 'import sys, tomllib; \
p = tomllib.load(open("/src/pyproject.toml", "rb"))["project"]; \
extras = [e for e in sys.argv[1].split(",") if e]; \
print("\n".join(p["dependencies"] + [r for e in extras for r in p["optional-dependencies"][e]]))' \
        "$EXTRAS" > /tmp/reqs.txt; \
    for r in $EXTRA_PIP; do echo "$r" >> /tmp/reqs.txt; done; \
    /opt/mmserve/bin/pip install "$@" -r /tmp/reqs.txt; \
    /opt/mmserve/bin/pip uninstall -y setuptools wheel >/dev/null 2>&1 || true

# Drop what a server never runs (~190 MB): torch's C++ test binaries, headers (no JIT C++ builds
# here), protoc. Keep bin/torch_shm_manager (torch's shared-memory tensor sharing). TRIM=0 keeps all.
ARG TRIM=1
RUN set -eu; \
    site=$(/opt/mmserve/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
    if [ "$TRIM" = 1 ]; then \
        rm -rf "$site/torch/test" "$site/torch/include"; \
        find "$site/torch/bin" -mindepth 1 ! -name torch_shm_manager -exec rm -rf {} +; \
        /opt/mmserve/bin/python -c 'import torch; torch.ones(2) @ torch.ones(2)'; \
    fi; \
    echo /opt/mmserve-app > "$site/mmserve-app.pth"

# ---------------------------------------------------------------------------------------------
# app: the mmserve package itself, in its own small directory (its own small image layer, so a code
# change rebuilds in seconds and does not copy the 1 GB of dependencies again).
FROM deps AS app
ARG OFFLINE=0
COPY pyproject.toml README.md /src/
COPY common/ /src/common/
COPY encoder_svc/ /src/encoder_svc/
COPY decoder_svc/ /src/decoder_svc/
COPY bench/ /src/bench/
COPY gateway/ /src/gateway/
RUN set -eu; \
    if [ "$OFFLINE" = 1 ]; then set -- --no-index --find-links /wheelhouse; else set -- --find-links /wheelhouse; fi; \
    /opt/mmserve/bin/pip wheel "$@" --no-deps --wheel-dir /tmp/dist /src; \
    /opt/mmserve/bin/pip install --no-deps --target /opt/mmserve-app /tmp/dist/mmserve-*.whl; \
    cp -r /src/bench /opt/mmserve-app/bench; \
    /opt/mmserve-app/bin/mmserve --help >/dev/null

# ---------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN set -eu; \
    if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 \
        && rm -rf /var/lib/apt/lists/*; \
    fi; \
    useradd --uid 10001 --user-group --create-home --home-dir /home/mmserve --shell /bin/sh mmserve; \
    mkdir -p /models && chown mmserve:mmserve /models

COPY --from=deps /opt/mmserve /opt/mmserve
COPY --from=app /opt/mmserve-app /opt/mmserve-app

# Checkpoints are local directories (--model DIR): never reach for a model hub at run time.
ENV PATH=/opt/mmserve-app/bin:/opt/mmserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    HF_HUB_DISABLE_TELEMETRY=1
USER mmserve
WORKDIR /home/mmserve
# /models: the compose file mounts the model volume (or a checkpoint dir) here.
VOLUME ["/models"]
EXPOSE 50051 50052 8000
CMD ["mmserve", "--help"]
