"""The durable embedded broker's cost: the same jobs on Tansu in memory and on the local S3 server.

    .venv/bin/python bench/broker.py [--jobs 4 --steps 3]   # or make bench-broker

For each storage (`memory`, then `s3`) one embedded stack with the three services runs the
same N arithmetic jobs at once (after a one-step warm-up job), and a raw round trip: 2,000
1-KiB records produced with acks=all, then read back. Reported per storage: the jobs' wall
time and the records per second each way; then each figure's ratio s3 / memory. Writes
`results/broker-<date>-<machine>.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from machine import machine_fields, result_path  # bench/machine.py
from multitask import bench_jobs, run_jobs  # bench/multitask.py
from rich.console import Console

from common.runtime.config import SharedSettings, load
from common.wire.lifecycle import SERVICES
from console.demo import demo_jobs
from console.stack.local import LocalStack
from marlaas import Client

console = Console()
RECORDS, RECORD_BYTES = 2000, 1024


async def round_trip(bootstrap: str, topic: str) -> dict[str, float]:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    started = time.perf_counter()
    try:
        sends = [producer.send(topic, b"x" * RECORD_BYTES) for _ in range(RECORDS)]
        await asyncio.gather(*[await send for send in sends])
    finally:
        await producer.stop()
    produce_s = time.perf_counter() - started
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    started, read = time.perf_counter(), 0
    try:
        while read < RECORDS:
            for records in (await consumer.getmany(timeout_ms=1000)).values():
                read += len(records)
    finally:
        await consumer.stop()
    return {
        "produce_per_s": round(RECORDS / produce_s, 1),
        "consume_per_s": round(RECORDS / (time.perf_counter() - started), 1),
    }


async def one_storage(storage: str, args: argparse.Namespace) -> dict[str, Any]:
    settings = load(SharedSettings).model_copy(
        update={"state_dir": args.run_dir / storage, "broker_storage": storage}
    )
    base = [s for s in demo_jobs(settings.base_model, args.run_id) if s.env.name == "arithmetic"]
    warmup = bench_jobs(base, 1, 1, f"warm-{storage}-{args.run_id}")
    jobs = bench_jobs(base, args.jobs, args.steps, f"{storage}-{args.run_id}")
    async with LocalStack(settings, services=SERVICES, use_existing_from_env=False) as stack:
        connected = stack.client_settings
        async with Client(connected) as client:
            await run_jobs(client, stack.kafka_bootstrap, warmup, args.timeout_s)
            started = time.time()
            await run_jobs(client, stack.kafka_bootstrap, jobs, args.timeout_s)
            wall = time.time() - started
        raw = await round_trip(stack.kafka_bootstrap, f"bench-{storage}")
    console.print(f"{storage}: jobs {wall:.1f} s, {raw}")
    return {"storage": storage, "jobs_wall_s": round(wall, 1), **raw}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    runs = [await one_storage(storage, args) for storage in ("memory", "s3")]
    memory, s3 = runs
    return {
        "runs": runs,
        "ratios_s3_to_memory": {
            key: round(s3[key] / memory[key], 3)
            for key in ("jobs_wall_s", "produce_per_s", "consume_per_s")
        },
        "jobs": args.jobs,
        "steps_per_job": args.steps,
        "records": RECORDS,
        "record_bytes": RECORD_BYTES,
        "machine": machine_fields(),
        "run_id": args.run_id,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.run_id = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    args.run_dir = Path("runs").resolve() / f"broker-{args.run_id}"
    result = asyncio.run(bench(args))
    out = args.out or result_path("broker", date=args.run_id.split("-")[0])
    out.write_text(json.dumps(result, indent=2) + "\n")
    console.print_json(json.dumps(result["ratios_s3_to_memory"]))


if __name__ == "__main__":
    main()
