"""Loading what a setting names as `module:attribute` (an environment class, an engine)."""

from __future__ import annotations

import importlib
from typing import Any


def load_object(target: str) -> Any:
    """`package.module:Name.attr` -> that object; raises what the import or lookup raised."""
    module_name, _, attr = target.partition(":")
    found: object = importlib.import_module(module_name)
    for part in attr.split(".") if attr else []:
        found = getattr(found, part)
    return found
