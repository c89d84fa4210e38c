"""The embedded durable broker's S3 server: `localbucket`, with listings that scale.

    python -m console.stack.s3server --host 127.0.0.1 --port PORT DATA_ROOT

localbucket (PyPI, stdlib only) walks the whole bucket for every object listing, and
Tansu's s3 engine lists a partition's batch objects on every fetch and produce: the broker
slowed down with every record stored (measured in a chaos run: 3,446 objects, localbucket
at 100% of a core, fetches timing out after ~10 minutes). Every key that starts with a
prefix lies in the prefix's directory, so this handler walks only that directory; the
listing is otherwise localbucket's (tests/unit/test_s3server.py compares them). Requests
are logged only when they fail.

It also honours `If-Match` on PutObject, which localbucket ignores. Tansu's s3 engine keeps
each partition's high watermark in one object and moves it by compare-and-swap (PUT with
`If-Match: <etag>`, on 412 read it again and retry); two produces to one partition that
race (two clients, one broker) both won the swap, took the same offset, and the second's
batch then failed to be written while the watermark counted it: acknowledged records lost
and gaps in the offsets (tests/integration/test_durable_broker.py; CI's compose run stalled
on it). And a GET sends the ETag of what it sends: localbucket opens the file, then hashes
the path again, so a write in between paired old content with the new ETag, and the next
swap on that pair succeeded on stale data (the same lost records, rarer).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO

import localbucket

Entries = tuple[list[tuple[str, Path]], list[str], bool, str]

# Writes and reads of one key take its lock (striped: a key maps to one of these), so no
# write comes between a conditional write's check and its write, or a GET's content and ETag.
_KEY_LOCKS = tuple(threading.Lock() for _ in range(64))


def _key_lock(bucket: str, key: str) -> threading.Lock:
    return _KEY_LOCKS[hash((bucket, key)) % len(_KEY_LOCKS)]


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

    def _write_object(self, bucket: str, key: str, write: Callable[[BinaryIO], str]) -> str:
        """localbucket's write, `If-Match` honoured: 412 unless the object exists with one
        of the listed ETags (S3's conditional write; object_store reads 412 as Precondition)."""
        if_match = self.headers.get("If-Match")
        with _key_lock(bucket, key):
            if if_match is not None:
                target = self._object_path(bucket, key)
                if not target.is_file() or not localbucket.etag_matches(
                    if_match, localbucket.object_etag(target)
                ):
                    raise self._precondition_failed_error()
            etag: str = super()._write_object(bucket, key, write)
            return etag

    def _get(self, bucket: str, key: str, include_body: bool) -> None:
        """localbucket's GET/HEAD, with no write to the key between reading its content and
        its ETag."""
        with _key_lock(bucket, key):
            super()._get(bucket, key, include_body)

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
