"""One logging format for every MARLaaS process."""

from __future__ import annotations

import logging


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    # aiokafka.client logs each failed connection attempt at ERROR with the same text the
    # back-off in common.backoff already reports once per retry, with the address.
    logging.getLogger("aiokafka.client").setLevel(logging.CRITICAL)
