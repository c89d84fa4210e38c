"""Produce a job to `marlaas.jobs` with a plain Kafka client: confluent-kafka (librdkafka),
no MARLaaS code. The README's "Jobs from any Kafka client" path, as automation would run it.

    MARLAAS_BUS_KEY=... python produce_job.py BOOTSTRAP < job.json

`job.json` is one JSON object shaped like a job file, with "kind": "job_spec" and a "job_id"
(`marlaas schema` prints the JSON Schema). The record is keyed by the job id and signed as
every service checks: header `marlaas-sig` = hex HMAC-SHA256 of `topic NUL key NUL value`
with the deployment's bus key. Extra librdkafka settings (e.g. SASL for Apache Kafka) come
from KAFKA_* variables: KAFKA_SECURITY_PROTOCOL=SASL_PLAINTEXT -> security.protocol.
"""

from __future__ import annotations

import hmac
import json
import os
import sys

from confluent_kafka import Producer

TOPIC = "marlaas.jobs"


def main() -> None:
    bootstrap = sys.argv[1]
    value = sys.stdin.read().strip().encode()
    key = json.loads(value)["job_id"].encode()
    signature = hmac.new(
        os.environ["MARLAAS_BUS_KEY"].encode(), b"\0".join((TOPIC.encode(), key, value)), "sha256"
    ).hexdigest()
    config = {"bootstrap.servers": bootstrap, "acks": "all"}
    for name, setting in os.environ.items():
        if name.startswith("KAFKA_"):
            config[name.removeprefix("KAFKA_").lower().replace("_", ".")] = setting
    producer = Producer(config)
    producer.produce(TOPIC, value=value, key=key, headers=[("marlaas-sig", signature.encode())])
    if producer.flush(30) != 0:
        sys.exit(f"{TOPIC}: the record was not delivered in 30 s")
    print(f"produced {key.decode()} to {TOPIC}")


if __name__ == "__main__":
    main()
