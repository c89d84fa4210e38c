"""The console's files (`static/`: the page, its style sheet and its script) and the headers
every one of them is served with."""

from __future__ import annotations

from pathlib import Path

STATIC = Path(__file__).with_name("static")
PAGE = "console.html"
MEDIA_TYPES = {
    PAGE: "text/html; charset=utf-8",
    "console.css": "text/css; charset=utf-8",
    "console.js": "text/javascript; charset=utf-8",
}
"""Every file the console serves, by name: nothing else under `static/` is reachable."""

CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "form-action 'none'",  # the key form never submits: the script reads it
        "frame-ancestors 'none'",
        "base-uri 'none'",
    )
)
"""Only the console's own script and styles run, it talks to this server only, and no other
site may frame it (its buttons act with the key)."""

HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def asset(name: str) -> tuple[bytes, str] | None:
    """A console file's bytes and media type; None for any name not in `MEDIA_TYPES`."""
    media_type = MEDIA_TYPES.get(name)
    if media_type is None:
        return None
    return (STATIC / name).read_bytes(), media_type
