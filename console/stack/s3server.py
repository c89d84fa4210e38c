"""The embedded durable broker's S3 server: `localbucket`, with listings that scale.

    python -m console.stack.s3server --host 127.0.0.1 --port PORT DATA_ROOT

localbucket (PyPI, stdlib only) walks the whole bucket for every object listing, and
Tansu's s3 engine lists a partition's batch objects on every fetch and produce: the broker
slowed down with every record stored (measured in a chaos run: 3,446 objects, localbucket
at 100% of a core, fetches timing out after ~10 minutes). Every key that starts with a
prefix lies in the prefix's directory, so this handler walks only that directory; the
listing is otherwise localbucket's (tests/unit/test_s3server.py compares them). Requests
are logged only when they fail.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from http.server import ThreadingHTTPServer
from pathlib import Path

import localbucket

Entries = tuple[list[tuple[str, Path]], list[str], bool, str]


class ScopedListingHandler(localbucket.S3Handler):
    """localbucket's S3 handler, listing only under the prefix's directory."""

    def _list_entries(
        self,
        bucket_dir: Path,
        prefix: str,
        delimiter: str,
        marker: str,
        marker_is_prefix: bool,
        max_keys: int,
    ) -> Entries:
        keys = sorted(_keys_under(bucket_dir, prefix), key=lambda item: item[0].encode())
        contents: list[tuple[str, Path]] = []
        common_prefixes: list[str] = []
        last_entry, truncated = "", False
        for key, path in keys:
            if not key.startswith(prefix):
                continue
            if marker and (
                key.encode() <= marker.encode() or (marker_is_prefix and key.startswith(marker))
            ):
                continue
            common = ""
            if delimiter and (index := key.find(delimiter, len(prefix))) >= 0:
                common = key[: index + len(delimiter)]
            if common and common_prefixes and common_prefixes[-1] == common:
                continue
            if len(contents) + len(common_prefixes) >= max_keys:
                truncated = max_keys > 0
                break
            if common:
                common_prefixes.append(common)
                last_entry = "P:" + common
            else:
                contents.append((key, path))
                last_entry = "K:" + key
        return contents, common_prefixes, truncated, last_entry

    def log_message(self, format: str, *args: object) -> None:
        if len(args) >= 2 and str(args[1]).startswith(("2", "3")):
            return  # a successful request: the broker makes thousands a minute
        super().log_message(format, *args)


def _keys_under(bucket_dir: Path, prefix: str) -> list[tuple[str, Path]]:
    """(key, file) of every object whose key could start with `prefix`."""
    root = bucket_dir.joinpath(*prefix.split("/")[:-1])
    found = []
    for directory, _, files in os.walk(root):
        for name in files:
            if not name.startswith(localbucket.TEMP_PREFIX):
                path = Path(directory, name)
                found.append((path.relative_to(bucket_dir).as_posix(), path))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_root", type=Path)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s [%(levelname)s]: %(message)s", stream=sys.stderr
    )
    data_root = args.data_root.resolve()
    data_root.mkdir(parents=True, exist_ok=True)
    ScopedListingHandler.data_root = data_root
    server = ThreadingHTTPServer((args.host, args.port), ScopedListingHandler)
    logging.info(
        "S3 (localbucket %s) serving %s on %s:%d",
        localbucket.__version__,
        data_root,
        args.host,
        args.port,
    )
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
