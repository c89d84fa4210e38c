"""The embedded S3 server: its scoped listings return exactly what localbucket's full walk
does, for prefixes, delimiters, markers and page sizes as Tansu's s3 engine uses them, and
its conditional writes are compare-and-swap."""

from __future__ import annotations

import http.client
import random
import threading
from http.server import ThreadingHTTPServer
from pathlib import Path

import localbucket

from console.stack.s3server import ScopedListingHandler


def test_scoped_listings_equal_localbuckets(tmp_path: Path) -> None:
    rng = random.Random(5)
    bucket = tmp_path / "bucket"
    keys = []
    for topic in ("marlaas.jobs", "marlaas.prompts", "marlaas.prompts-x"):
        for partition in range(3):
            for offset in range(rng.randrange(0, 12)):
                keys.append(
                    f"clusters/c/topics/{topic}/partitions/{partition:010}/records/"
                    f"{offset * 7:020}.batch"
                )
    keys += ["clusters/c/meta.json", "clusters/c/topics/marlaas.jobs/watermark.json", "top"]
    for key in keys:
        path = bucket / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(key.encode())
    (bucket / "clusters/c" / f"{localbucket.TEMP_PREFIX}upload").write_bytes(b"partial")

    prefixes = [
        "",
        "c",
        "clusters/",
        "clusters/c/topics/marlaas.prompts",
        "clusters/c/topics/marlaas.prompts/",
        "clusters/c/topics/marlaas.jobs/partitions/",
        "clusters/c/topics/marlaas.prompts/partitions/0000000001/records/",
        "clusters/c/topics/marlaas.prompts/partitions/0000000001/records/0000",
        "clusters/nowhere/",
        "top",
    ]
    scoped, full = object.__new__(ScopedListingHandler), object.__new__(localbucket.S3Handler)
    compared = 0
    for prefix in prefixes:
        for delimiter in ("", "/"):
            listed = [k for k in sorted(keys) if k.startswith(prefix)]
            for marker in ["", *rng.sample(listed, min(2, len(listed)))]:
                for max_keys in (0, 1, 3, 1000):
                    args = (bucket, prefix, delimiter, marker, False, max_keys)
                    assert scoped._list_entries(*args) == full._list_entries(*args), args
                    compared += 1
    assert compared > 200


def test_compare_and_swap_holds_under_contention(tmp_path: Path) -> None:
    """Tansu's s3 engine moves each partition's watermark by GET, then PUT `If-Match: <etag>`
    (again on 412): under contention every increment must land exactly once."""
    (tmp_path / "bucket").mkdir()
    ScopedListingHandler.data_root = tmp_path
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScopedListingHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]

    def request(method: str, body: bytes = b"", **headers: str) -> tuple[int, str, bytes]:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            connection.request(method, "/bucket/watermark.json", body=body, headers=headers)
            response = connection.getresponse()
            return response.status, response.getheader("ETag", ""), response.read()
        finally:
            connection.close()

    def increment(times: int) -> None:
        for _ in range(times):
            while True:
                status, etag, body = request("GET")
                assert status == 200, status
                status, _, _ = request("PUT", str(int(body) + 1).encode(), **{"If-Match": etag})
                if status == 200:
                    break
                assert status == 412, status

    try:
        assert request("PUT", b"0", **{"If-Match": '"nothing"'})[0] == 412  # no such object
        assert request("PUT", b"0", **{"If-None-Match": "*"})[0] == 200
        assert request("PUT", b"9", **{"If-None-Match": "*"})[0] == 412  # exists
        _, etag, _ = request("GET")
        assert request("PUT", b"0", **{"If-Match": '"stale"'})[0] == 412
        assert request("PUT", b"0", **{"If-Match": etag})[0] == 200  # same content, same ETag
        threads = [threading.Thread(target=increment, args=(40,)) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert request("GET")[2] == b"320"
    finally:
        server.shutdown()
        server.server_close()
