# A plain Kafka client where no registry can be reached: Python with confluent-kafka (its
# wheel bundles librdkafka 2.x; Debian's kcat has librdkafka 2.0, whose ApiVersions request
# Tansu does not answer). Runs examples/produce_job.py, the README's "jobs from any Kafka
# client" path, on the compose network. Build context: deploy/build-extras (its ca.crt, if
# any, for pip behind a proxy that intercepts TLS).
FROM python:3.11-slim
RUN --mount=type=bind,target=/extras \
    if [ -f /extras/ca.crt ]; then export PIP_CERT=/extras/ca.crt; fi \
    && pip install --no-cache-dir confluent-kafka==2.16.1
ENTRYPOINT ["python"]
