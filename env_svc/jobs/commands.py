"""The lifecycle commands (pause, resume, cancel): applied once per command id, each sending
its event; a resumed job issues again at once."""

from __future__ import annotations

import dataclasses
import logging

from common.runtime.logs import job_logger
from common.runtime.service import Connections
from common.state.dedup import COMMANDS
from common.wire.lifecycle import COMMAND_EVENT, STATE_AFTER
from common.wire.messages import JobCommand, job_event
from env_svc.jobs import SERVICE
from env_svc.jobs.issuing import GroupIssuer

log = logging.getLogger(__name__)


class LifecycleCommands:
    """Applies a job's commands to its registered status."""

    def __init__(self, io: Connections, issuer: GroupIssuer) -> None:
        self.io = io
        self.issuer = issuer

    async def on_command(self, command: JobCommand) -> None:
        store = self.io.require_store()
        seen, record = await store.admitted.get_unless_seen(
            COMMANDS, command.job_id, command.command_id
        )
        if seen:
            return  # applied before: a redelivered or replayed command changes nothing
        if record is None:
            job_logger(log, command.job_id).warning(
                "command %s for an unknown job ignored", command.action
            )
            return
        kind = COMMAND_EVENT[command.action]
        changed = await store.jobs.set_status(command.job_id, STATE_AFTER[kind])
        # Marked once applied: a crash before this applies it again, which changes nothing.
        await store.dedup.mark_seen(COMMANDS, command.job_id, command.command_id)
        if not changed:
            return  # already finished: a late command changes nothing
        await self.io.send(job_event(command.job_id, kind, SERVICE, tenant=record.spec.tenant))
        job_logger(log, command.job_id, record.spec.tenant).info("job %s", kind)
        if command.action == "resume":
            await self.issuer.issue_groups(dataclasses.replace(record, status=STATE_AFTER[kind]))
