"""The MARLaaS client library: what a program does with RL fine-tuning jobs.

    from marlaas import Client, load_job_file

    async with Client(load(SharedSettings)) as client:
        spec = load_job_file(path, base_model=client.settings.base_model)
        await client.submit([spec])
        async for event in client.follow(spec.job_id):
            ...
        model, answer = await client.sample(spec.job_id, "What is 7 + 5?")
        await client.export(spec.job_id, Path("adapter"))

`Client` talks to Kafka and Redis (one long-lived producer, a few pooled event readers);
`TenantClient` does the same through the tenant API with an API key. Job files are TOML
(`load_job_file`); `JobProgress` and `watch_jobs` fold a job's events into where it stands;
`chat_completion` asks a rollout replica's OpenAI-compatible chat endpoint directly.

The library speaks the wire format of `common` and nothing else of the deployment: the tenant
API (`api_svc`) and the `marlaas` CLI (`console`) are its users.
"""

from common.state.registry import UnknownJobError
from common.wire.messages import Event, JobSpec
from marlaas.api_client import ApiError, TenantClient
from marlaas.chat import ChatFailed, chat_completion
from marlaas.client import Client, JobStateError
from marlaas.eventfeed import EventFeed, ReadersBusy
from marlaas.export import ExportedAdapter, ExportError
from marlaas.jobfile import JobFileError, load_job_file
from marlaas.jobwatch import JobProgress, submit_jobs, watch_jobs

__all__ = [
    "ApiError",
    "ChatFailed",
    "Client",
    "Event",
    "EventFeed",
    "ExportError",
    "ExportedAdapter",
    "JobFileError",
    "JobProgress",
    "JobSpec",
    "JobStateError",
    "ReadersBusy",
    "TenantClient",
    "UnknownJobError",
    "chat_completion",
    "load_job_file",
    "submit_jobs",
    "watch_jobs",
]
