"""The `marlaas` command line."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import typer
from rich.table import Table

from common.runtime.config import SharedSettings, load
from common.runtime.logs import setup_logging
from common.security.access import redacted
from common.wire.lifecycle import SERVICES
from console.cli import access, envs, jobs, sample, tenants, track, usage
from console.cli.support import (
    USER_ERRORS,
    console,
    err_console,
    one_line_errors,
    options,
    quiet_logging,
)
from console.stack.local import LocalStack

app = typer.Typer(
    help="MARLaaS: multi-tenant asynchronous RL fine-tuning on one shared base model.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
topics_app = typer.Typer(help="Kafka topics of MARLaaS.", no_args_is_help=True)
app.add_typer(topics_app, name="topics")

for commands in (jobs, envs, sample, track, usage, tenants, access):
    commands.register(app)


@app.callback()
def _global_options(
    connect_timeout_s: float = typer.Option(
        options.connect_timeout_s,
        "--connect-timeout",
        min=0.1,
        help="Seconds to wait for an unreachable Kafka or Redis before giving up.",
    ),
    api_url: str = typer.Option(
        "", "--api-url", help="The tenant API (default: MARLAAS_API_URL); empty: operator mode."
    ),
    api_key: str = typer.Option("", "--api-key", help="Your API key (default: MARLAAS_API_KEY)."),
) -> None:
    """MARLaaS: multi-tenant asynchronous RL fine-tuning on one shared base model.

    Connection settings come from MARLAAS_KAFKA_BOOTSTRAP / MARLAAS_REDIS_URL, else from the
    embedded stack's stack.env (`marlaas up`), else localhost defaults. A tenant sets
    MARLAAS_API_URL and MARLAAS_API_KEY instead, and the job commands go through the API.
    """
    options.connect_timeout_s = connect_timeout_s
    options.api_url, options.api_key = api_url, api_key


def _stack_table(stack: LocalStack) -> Table:
    table = Table(title="MARLaaS local stack", show_header=False)
    table.add_row("Kafka bootstrap", stack.kafka_bootstrap)
    table.add_row("Redis", redacted(stack.redis_url))
    table.add_row(
        "topics", ", ".join(f"{t} ({n})" for t, n in sorted(stack.topic_partitions.items()))
    )
    if stack.api_url:
        table.add_row("tenant API", f"{stack.api_url}/v1 (schema: {stack.api_url}/docs)")
        table.add_row("web console", f"{stack.api_url}/console (sign in with a tenant's API key)")
    table.add_row("hardware", stack.hardware.describe())
    for service, precision in stack.precisions.items():
        table.add_row(f"{service} precision", precision.describe())
    table.add_row("state dir", str(stack.state_dir))
    table.add_row("connection file", str(stack.env_file))
    for child in stack.children:
        where = f"pid {child.process.pid}, log {child.log_path}"
        if child.metrics_url is not None:
            where += f", metrics/health {child.metrics_url}"
        table.add_row(child.name, where)
    return table


async def _serve_until_signalled(stack: LocalStack) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with stack:
        console.print(_stack_table(stack))
        console.print("Ready. Crashed services are restarted; Ctrl-C stops everything.")
        if stack.services:
            console.print(
                "In another terminal: marlaas submit examples/jobs/arithmetic.toml, "
                "then marlaas status (README: Using it)."
            )
        stopped = asyncio.create_task(stop.wait(), name="wait-for-signal")
        watch = asyncio.create_task(stack.watch(), name="watch-children")
        done, pending = await asyncio.wait({stopped, watch}, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        for task in done:
            task.result()
        console.print("Stopping the stack...")


@app.command()
@one_line_errors
def up(
    infra_only: bool = typer.Option(
        False, "--infra-only", help="Start broker and Redis only, not the three services."
    ),
    replicas: str = typer.Option(
        "", help="Replicas per service, e.g. env=2,rollout=2,trainer=2 (default: 1 each)."
    ),
) -> None:
    """Start the embedded stack (broker, Redis, topics, services) and keep it up until Ctrl-C."""
    from common.files.artifacts import PRIVATE_UMASK
    from common.files.models import resolve_base_model
    from console.stack.services import replicated

    os.umask(PRIVATE_UMASK)  # the state dir's lock, logs and credentials: the operator's alone
    settings = load(SharedSettings)
    setup_logging(settings.log_level)
    services: tuple[str, ...] = ()
    if not infra_only:
        counts = {}
        for part in filter(None, replicas.split(",")):
            name, _, count = part.partition("=")
            if not count.strip().isdigit():
                raise typer.BadParameter(
                    f"{part!r}: expected service=count", param_hint="--replicas"
                )
            counts[name.strip()] = int(count)
        try:
            services = replicated(SERVICES, counts)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
        resolve_base_model(settings.base_model, settings.cache_dir)  # convert once, up front
    asyncio.run(_serve_until_signalled(LocalStack(settings, services=services)))
    console.print("Stack stopped; no child process left.")


@topics_app.command("create")
@one_line_errors
def topics_create(
    partitions: int = typer.Option(
        None, help="Partitions per topic (default: MARLAAS_TOPIC_PARTITIONS, 12)."
    ),
) -> None:
    """Create every marlaas.* topic that does not exist yet (idempotent)."""
    from console.stack.topics import ensure_topics

    settings = load(SharedSettings)
    quiet_logging()
    counts = asyncio.run(
        ensure_topics(
            settings.kafka_bootstrap,
            partitions or settings.topic_partitions,
            timeout_s=settings.connect_timeout_s,
        )
    )
    for topic, count in sorted(counts.items()):
        console.print(f"{topic}: {count} partitions")


@app.command()
@one_line_errors
def schema(
    topic: str = typer.Argument(
        "marlaas.jobs", help="The topic whose records to describe (default: the jobs topic)."
    ),
) -> None:
    """Print the JSON Schema of a topic's records, for producing jobs from any Kafka client."""
    import json

    from common.wire.codec import json_schema
    from common.wire.messages import Topic

    known = {t.value: t for t in Topic} | {t.value.removeprefix("marlaas."): t for t in Topic}
    if topic not in known:
        raise typer.BadParameter(f"{topic!r}: one of {', '.join(t.value for t in Topic)}")
    print(json.dumps(json_schema(known[topic]), indent=2, sort_keys=True))


@app.command()
@one_line_errors
def demo(
    seed: int = typer.Option(0, help="Other task streams (training and evaluation), same jobs."),
) -> None:
    """The main job: 4 jobs of 2 tenants learning at once on the embedded stack.

    Writes runs/<run-id>/demo-summary.json with each job's reward at start and end and its
    held-out accuracy, base model vs final adapter.
    """
    from common.files.models import resolve_base_model
    from console.demo import run

    settings = load(SharedSettings)
    setup_logging(settings.log_level)
    console.print(f"base model {settings.base_model}: {resolve_base_model(settings.base_model)}")
    summary = run(settings, console, seed)
    console.print(f"summary: {summary}")


GLOBAL_OPTIONS = ("--connect-timeout", "--api-url", "--api-key")
"""`marlaas`'s own options (each with a value): click takes them before the subcommand only."""


def hoist_global_options(argv: list[str]) -> list[str]:
    """`argv` with the global options given after the subcommand moved before it, so that
    `marlaas status --connect-timeout 5` works as `marlaas --connect-timeout 5 status` does
    (nothing after `--` is touched)."""
    hoisted: list[str] = []
    rest: list[str] = []
    index = 0
    while index < len(argv):
        word = argv[index]
        if word == "--":
            rest += argv[index:]
            break
        if word in GLOBAL_OPTIONS and index + 1 < len(argv):
            hoisted += argv[index : index + 2]
            index += 2
            continue
        if word.startswith(tuple(f"{option}=" for option in GLOBAL_OPTIONS)):
            hoisted.append(word)
        else:
            rest.append(word)
        index += 1
    return hoisted + rest


def main() -> None:
    try:
        app(args=hoist_global_options(sys.argv[1:]))
    except USER_ERRORS as exc:  # raised outside a command (e.g. while loading settings)
        err_console.print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)
