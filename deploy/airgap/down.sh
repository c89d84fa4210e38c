#!/usr/bin/env bash
# Tears down what up.sh started (`make compose-down`): the stack's containers, networks and
# volumes (`compose down -v`), then the dockerd up.sh started, if it did. Images and the
# build cache stay (`docker system df`); KEEP_VOLUMES=1 keeps the volumes.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=deploy/airgap/lib.sh
source deploy/airgap/lib.sh

if docker info >/dev/null 2>&1; then
    step "compose down"
    if [ ! -f "$ENV_FILE" ]; then
        # compose reads the secrets to parse its files even to take a stack down; without
        # the stack's own file (lost, or never written), placeholders do.
        ENV_FILE=$(mktemp)
        trap 'rm -f "$ENV_FILE"' EXIT
        env_lines echo placeholder >"$ENV_FILE"
    fi
    if [ "${KEEP_VOLUMES:-0}" = 1 ]; then
        compose --profile cli down --remove-orphans
    else
        compose --profile cli down --volumes --remove-orphans
    fi
fi
if [ "${STOP_ENGINE:-0}" = 1 ] && [ -f "$STATE_DIR/dockerd.pid" ]; then
    step "stopping the dockerd up.sh started"
    kill "$(cat "$STATE_DIR/dockerd.pid")" 2>/dev/null || true
    rm -f "$STATE_DIR/dockerd.pid"
fi
