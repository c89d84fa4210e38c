"""Records signed by who may write the bus: an HMAC over each record, checked by readers.

Kafka's own authentication (SASL) and ACLs keep tenants off the bus in production; the
embedded broker (Tansu) cannot enforce either (docs/architecture.md, "Tenants"). So every
record a MARLaaS process produces carries a header `marlaas-sig`: the hex HMAC-SHA256, under
the bus key, of `topic NUL key NUL value` (`RecordSigner.signature`). With a bus key
configured
(`MARLAAS_BUS_KEY`; `marlaas up` makes one per stack) every service drops a record whose
signature is missing or wrong: dead-lettered with the reason, never handled. Whoever lacks
the key cannot inject a job, command, prompt, result, trajectory or adapter update, nor
alter one in flight (the topic and key are signed with the value). Replaying a signed record
changes nothing: every consumer de-duplicates (docs/architecture.md, "Delivery").

Automation producing job records itself signs them the same way (README: "Producing jobs
from any Kafka client").
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

HEADER = "marlaas-sig"
NUL = b"\0"

Headers = Sequence[tuple[str, bytes]]


class RecordSigner:
    """Signs records and checks them, with one deployment's bus key."""

    def __init__(self, key: str) -> None:
        if not key:
            raise ValueError("an empty bus key signs nothing")
        self._key = key.encode()

    def signature(self, topic: str, key: bytes | None, value: bytes) -> bytes:
        # NUL-separated, and a shell can make the same bytes (`printf 'topic\0key\0%s'
        # "$value"`). The split is unambiguous because neither topic nor key may hold a NUL
        # (Kafka's topic names cannot; `problem` refuses such a key): else a record re-split
        # across key and value (key + NUL + the value's head) would keep its signature.
        if NUL in topic.encode() or NUL in (key or b""):
            raise ValueError("a topic or key holding a NUL byte cannot be signed unambiguously")
        message = b"\0".join((topic.encode(), key or b"", value))
        return hmac.new(self._key, message, hashlib.sha256).hexdigest().encode()

    def token(self, purpose: str) -> str:
        """A credential for `purpose` (e.g. the rollout replicas' chat endpoint) that every
        holder of the bus key can derive and nobody else can."""
        return hmac.new(self._key, f"marlaas-token:{purpose}".encode(), hashlib.sha256).hexdigest()

    def headers(self, topic: str, key: bytes | None, value: bytes) -> list[tuple[str, bytes]]:
        return [(HEADER, self.signature(topic, key, value))]

    def problem(
        self, topic: str, key: bytes | None, value: bytes | None, headers: Headers | None
    ) -> str | None:
        """Why the record is not to be trusted (None: signed with this key)."""
        if NUL in (key or b""):
            return "a key holding a NUL byte: its signature could belong to another record"
        given = [v for name, v in headers or () if name == HEADER]
        if not given:
            return f"unsigned record (no {HEADER} header): not produced by a holder of the bus key"
        if not hmac.compare_digest(given[-1], self.signature(topic, key, value or b"")):
            return "bad signature: not produced by a holder of the bus key, or altered"
        return None


def signer(key: str) -> RecordSigner | None:
    """The signer of a configured bus key; None when the deployment signs nothing."""
    return RecordSigner(key) if key else None
