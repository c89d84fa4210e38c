"""The one error of the room: a job's data that cannot become tasks, named by its param."""

from __future__ import annotations


class DatasetError(ValueError):
    """`param`'s data is refused or unusable; the text names the job's own path and the row,
    never the data's content."""

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(reason)
        self.param = param
