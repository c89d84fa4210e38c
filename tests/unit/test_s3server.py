"""The embedded S3 server's scoped listings return exactly what localbucket's full walk
does, for prefixes, delimiters, markers and page sizes as Tansu's s3 engine uses them."""

from __future__ import annotations

import random
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
