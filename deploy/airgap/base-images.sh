#!/usr/bin/env bash
# The base images compose.yaml needs and a machine without a registry cannot pull, made
# here; each only if missing (`docker rmi` one to remake it):
#   marlaas-local/bookworm   Debian bookworm, minbase, from debootstrap (about 30 s)
#   python:3.11-slim         bookworm's Python 3.11, as the official image lays it out
#   marlaas-local/redis:7    bookworm's redis-server 7.0 (deploy/compose.airgap.yaml)
#   marlaas-local/kafka-client  Python with confluent-kafka: a plain Kafka client (README)
# The Debian mirror is the host's (apt sources), else deb.debian.org.
set -euo pipefail
cd "$(dirname "$0")/../.."
# shellcheck source=deploy/airgap/lib.sh
source deploy/airgap/lib.sh

have() { docker image inspect "$1" >/dev/null 2>&1; }

if ! have marlaas-local/bookworm:latest; then
    step "debootstrap: Debian bookworm -> marlaas-local/bookworm"
    mirror=$(sed -n 's/^URIs: *\(http[^ ]*debian\)$/\1/p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)
    rootfs=$(mktemp -d)
    debootstrap --variant=minbase bookworm "$rootfs" "${mirror:-http://deb.debian.org/debian}" >"$rootfs.log"
    tar -C "$rootfs" -c . | docker import - marlaas-local/bookworm:latest
    rm -rf "$rootfs" "$rootfs.log"
fi
if ! have python:3.11-slim; then
    step "python:3.11-slim from bookworm"
    docker build -q -t python:3.11-slim -f deploy/airgap/python.Dockerfile deploy/airgap
fi
if ! have marlaas-local/redis:7; then
    step "marlaas-local/redis:7 from bookworm"
    docker build -q -t marlaas-local/redis:7 -f deploy/airgap/redis.Dockerfile deploy/airgap
fi
if ! have marlaas-local/kafka-client:latest; then
    step "marlaas-local/kafka-client"
    docker build -q -t marlaas-local/kafka-client:latest -f deploy/airgap/kafka-client.Dockerfile \
        deploy/build-extras
fi
