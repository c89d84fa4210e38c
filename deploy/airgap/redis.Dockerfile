# Redis where no registry can be reached: Debian bookworm's redis-server (7.0), the Redis
# compose.yaml's `redis` service runs (its command, aclfile and healthcheck are unchanged).
# The user is uid 999, as in the official image, which redis-acl hands the aclfile to.
FROM marlaas-local/bookworm:latest
RUN groupadd --system --gid 999 redis \
    && useradd --system --uid 999 --gid redis --home-dir /data redis \
    && apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data \
    && chown redis:redis /data
WORKDIR /data
USER redis
CMD ["redis-server"]
