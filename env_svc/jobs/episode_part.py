"""What the parts of env_svc that run episodes share: the replica's connections and its jobs'
environments, whose worker pool and tokenizer they use as well."""

from __future__ import annotations

from common.runtime.service import Connections
from env_svc.calls import EnvCalls
from env_svc.chat_template import ChatTokenizer
from env_svc.jobs.environments import JobEnvironments


class EpisodePart:
    """A part of env_svc that runs episodes (admission's probe, issuing, evaluations,
    scoring)."""

    def __init__(self, io: Connections, environments: JobEnvironments) -> None:
        self.io = io
        self.environments = environments

    @property
    def calls(self) -> EnvCalls:
        """The worker pool environment code runs in (the environments' own)."""
        return self.environments.calls

    @property
    def tokenizer(self) -> ChatTokenizer:
        """The tokenizer that renders the environments' chats."""
        return self.environments.tokenizer
