#!/usr/bin/env bash
# The compose stack on a machine that reaches no container registry (`make compose-up`):
#   1. a Docker engine: Debian's docker.io and docker-compose installed (as root) if missing,
#      dockerd started if none answers (its pid in runs/compose/dockerd.pid, its log beside);
#   2. deploy/build-extras/ filled from the host: torch's CPU wheel from pip's wheelhouse and
#      the host's CA bundle (a proxy that intercepts TLS);
#   3. the base images compose.yaml's build and images need and nothing can pull, made
#      locally (base-images.sh): Debian bookworm from debootstrap, python:3.11-slim, Redis,
#      and a plain Kafka client;
#   4. .env with a fresh random secret for every variable of deploy/env.example, if missing;
#   5. `compose build` (every image, the cli's too) and `compose up -d` with compose.yaml and
#      deploy/compose.airgap.yaml, and any arguments given (e.g. --scale env_svc=2).
# Stop it with `make compose-down` (deploy/airgap/down.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=deploy/airgap/lib.sh
source deploy/airgap/lib.sh

ensure_engine
fill_build_extras
deploy/airgap/base-images.sh
ensure_env_file
# The CLI's container (uid 1000) writes exports to ./exports; env_svc and the CLI read ./data.
mkdir -p exports data
if [ "$(id -u)" = 0 ]; then
    chown 1000:1000 exports
fi
step "compose build; compose up -d $*"
started=$SECONDS
# Every image, the cli's too: `up --build` skips services of profiles not started (cli), so
# `compose run cli` would keep running an image of older code.
compose --profile cli build
compose up -d "$@"
echo "stack up in $((SECONDS - started)) s: $(compose_cmd) ps"
compose ps
