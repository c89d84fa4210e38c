"""Whether a secret reached a text (a log): the secret itself or an obvious encoding of it."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from urllib.parse import quote, quote_plus


def encodings(secret: str) -> set[str]:
    """`secret` as a log line might carry it: itself, base64 (padded or not, standard or
    URL-safe), hex, URL-quoted, JSON-escaped."""
    raw = secret.encode()
    forms = {secret, raw.hex(), quote(secret, safe=""), quote_plus(secret), json.dumps(secret)}
    for encoded in (base64.b64encode(raw), base64.urlsafe_b64encode(raw)):
        forms |= {encoded.decode(), encoded.decode().rstrip("=")}
    return forms


def leaks(texts: Mapping[str, str], secrets: Mapping[str, str]) -> list[str]:
    """Which secret (by its name, never its value: the answer may be printed) appears in
    which text, in any of its encodings."""
    if empty := [name for name, secret in secrets.items() if not secret]:
        raise ValueError(f"empty secrets would be found in every text: {empty}")
    return [
        f"{name} in {where}"
        for where, text in texts.items()
        for name, secret in secrets.items()
        if any(form in text for form in encodings(secret))
    ]
