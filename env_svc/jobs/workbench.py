"""What the parts of env_svc that run episodes work with, handed to each as one value."""

from __future__ import annotations

from dataclasses import dataclass

from common.runtime.service import Connections
from env_svc.calls import EnvCalls
from env_svc.chat_template import ChatTokenizer
from env_svc.jobs.environments import JobEnvironments


@dataclass(frozen=True)
class Workbench:
    """The replica's connections (bus, store) and its jobs' environments, with the worker
    pool their code runs in and the tokenizer that renders their chats."""

    io: Connections
    environments: JobEnvironments

    @property
    def calls(self) -> EnvCalls:
        return self.environments.calls

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self.environments.tokenizer


class EpisodePart:
    """A part of env_svc that runs episodes: reads the workbench's tools as its own."""

    def __init__(self, bench: Workbench) -> None:
        self.bench = bench

    @property
    def io(self) -> Connections:
        return self.bench.io

    @property
    def calls(self) -> EnvCalls:
        return self.bench.calls

    @property
    def tokenizer(self) -> ChatTokenizer:
        return self.bench.tokenizer

    @property
    def environments(self) -> JobEnvironments:
        return self.bench.environments
