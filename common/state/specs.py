"""Registered job specs, decoded once per process.

A job's spec is admitted once (env_svc registers it; a spec re-sent under a registered id
does not replace it), so the bytes under `job:{job}`'s `spec` never change while the record
lives. Every reader of a job record in a process (a service's handlers, its sweeps) takes the
decoded spec from here: the bytes are compared, not decoded again. An id that comes back
with other bytes (an unkept job's record expired and the id reused) is decoded anew.
Bounded: the least recently read specs leave past `capacity`.
"""

from __future__ import annotations

from collections import OrderedDict

from common.runtime.metrics import JOB_SPEC_DECODES
from common.wire.codec import decode
from common.wire.messages import JobSpec, Topic

CAPACITY = 4096
"""Specs kept per process: more than the jobs a replica serves at once."""


class DecodedSpecs:
    """The decoded spec per job id, with the bytes it was decoded from."""

    def __init__(self, capacity: int = CAPACITY) -> None:
        self.capacity = capacity
        self._specs: OrderedDict[str, tuple[bytes, JobSpec]] = OrderedDict()

    def spec(self, job_id: str, raw: bytes | str) -> JobSpec:
        """`raw` (a record's `spec` field) decoded, or the spec decoded from it before."""
        raw = raw.encode() if isinstance(raw, str) else raw
        known = self._specs.get(job_id)
        if known is not None and known[0] == raw:
            self._specs.move_to_end(job_id)
            return known[1]
        spec = decode(Topic.JOBS, raw)
        if not isinstance(spec, JobSpec):
            raise TypeError(f"a job record holds a {type(spec).__name__}, not a JobSpec")
        JOB_SPEC_DECODES.inc()
        self._specs[job_id] = (raw, spec)
        self._specs.move_to_end(job_id)
        while len(self._specs) > self.capacity:
            self._specs.popitem(last=False)
        return spec
