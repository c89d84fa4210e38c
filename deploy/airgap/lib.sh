# Shared by deploy/airgap/*.sh (sourced, not run): the engine, the compose command and the
# build inputs of a machine without a container registry.

STATE_DIR=${MARLAAS_COMPOSE_STATE:-runs/compose}
# compose.yaml and the air-gapped override; MARLAAS_COMPOSE_FILES replaces the list.
COMPOSE_FILES=${MARLAAS_COMPOSE_FILES:-compose.yaml deploy/compose.airgap.yaml}
# The secrets file (deploy/env.example) and the project name (compose.yaml's `name`): a
# second stack beside the first (the compose test's) sets both.
ENV_FILE=${MARLAAS_COMPOSE_ENV_FILE:-.env}
PROJECT=${MARLAAS_COMPOSE_PROJECT:-marlaas}

step() { printf '\n== %s\n' "$*"; }

# Debian's docker client (20.10) builds with BuildKit itself; a newer client on PATH without
# the buildx plugin refuses DOCKER_BUILDKIT=1, so Debian's comes first when it is there.
if [ -x /usr/bin/docker ]; then
    PATH="/usr/bin:$PATH"
fi
export DOCKER_BUILDKIT=1 COMPOSE_DOCKER_CLI_BUILD=1

ensure_engine() {
    if ! command -v dockerd >/dev/null || ! { docker compose version || command -v docker-compose; } >/dev/null 2>&1; then
        step "installing Debian's Docker engine and compose"
        if [ "$(id -u)" != 0 ]; then
            echo "no Docker engine or compose here, and installing them needs root" >&2
            exit 1
        fi
        apt-get install -y --no-install-recommends docker.io docker-compose debootstrap iptables
        PATH="/usr/bin:$PATH"
    fi
    if docker info >/dev/null 2>&1; then
        return
    fi
    step "starting dockerd (log: $STATE_DIR/dockerd.log)"
    mkdir -p "$STATE_DIR"
    # Its own iptables rules stay on: without them user networks get no outbound traffic.
    nohup dockerd --storage-driver=overlay2 >"$STATE_DIR/dockerd.log" 2>&1 &
    echo $! >"$STATE_DIR/dockerd.pid"
    for _ in $(seq 60); do
        if docker info >/dev/null 2>&1; then
            return
        fi
        sleep 1
    done
    echo "dockerd did not answer in 60 s; see $STATE_DIR/dockerd.log" >&2
    exit 1
}

compose_cmd() {
    if docker compose version >/dev/null 2>&1; then
        echo "docker compose"
    else
        echo "docker-compose"
    fi
}

compose() {
    local files=()
    for file in $COMPOSE_FILES; do
        files+=(-f "$file")
    done
    # shellcheck disable=SC2046
    $(compose_cmd) --project-directory . --project-name "$PROJECT" --env-file "$ENV_FILE" \
        "${files[@]}" "$@"
}

fill_build_extras() {
    local extras=deploy/build-extras dir wheel bundle
    mkdir -p "$extras/wheels"
    # torch's CPU wheel from the host pip's wheelhouse (find-links), when it has one.
    for dir in $(pip config list 2>/dev/null | sed -n "s/.*find-links='\(.*\)'/\1/p" | sort -u); do
        for wheel in "$dir"/torch-2.13.0+cpu-*.whl; do
            if [ -f "$wheel" ] && [ ! -f "$extras/wheels/$(basename "$wheel")" ]; then
                cp "$wheel" "$extras/wheels/"
            fi
        done
    done
    bundle=/etc/ssl/certs/ca-certificates.crt
    if [ -f "$bundle" ] && ! cmp -s "$bundle" "$extras/ca.crt"; then
        cp "$bundle" "$extras/ca.crt"
    fi
    # deploy/compose.airgap.yaml builds with no PyTorch index: the wheel must be here.
    if [ -z "$(find "$extras/wheels" -name 'torch-2.13.0+cpu-*.whl')" ]; then
        echo "no torch 2.13.0 CPU wheel in $extras/wheels (and none in pip's find-links):" \
            "put torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl there" >&2
        exit 1
    fi
}

# Every variable of deploy/env.example as NAME=VALUE, each VALUE what the command given
# prints (run once per variable).
env_lines() {
    grep -o '^MARLAAS_[A-Z_]*=' deploy/env.example | while read -r name; do
        echo "${name}$("$@")"
    done
}

random_secret() {
    head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n'
}

ensure_env_file() {
    if [ -f "$ENV_FILE" ]; then
        return
    fi
    step "writing $ENV_FILE: a fresh random secret for every variable of deploy/env.example"
    (
        umask 077
        env_lines random_secret >"$ENV_FILE"
    )
}
