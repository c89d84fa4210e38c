"""Parameter declaration: a job's `env.params` checked against its environment's `EnvParams`
subclass (bounds first, then types), every problem named by its param."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from common.wire.jobspec import bound_problems
from env_svc.protocol.data import EnvParams
from env_svc.protocol.errors import EnvParamsError

P = TypeVar("P", bound=EnvParams)


def checked_params(env: str, params: Mapping[str, Any] | None, params_type: type[P]) -> P:
    """`params` as `params_type`; `EnvParamsError` names the first param that does not fit."""
    for param, reason in bound_problems(dict(params or {}), params_type):
        raise EnvParamsError(env, param, reason)  # the first, in words
    try:
        return msgspec.convert(dict(params or {}), params_type)
    except msgspec.ValidationError as exc:
        raise EnvParamsError(env, *_param_and_reason(str(exc))) from None


def _param_and_reason(message: str) -> tuple[str, str]:
    """Pull the param name out of msgspec's "Expected `int`, got `str` - at `$.max_turns`"."""
    if " - at `$." in message:
        reason, _, where = message.rpartition(" - at `$.")
        return where.rstrip("`").split(".")[0].split("[")[0], reason
    if message.startswith("Object contains unknown field `"):
        return message.split("`")[1], "unknown param"
    if message.startswith("Object missing required field `"):
        return message.split("`")[1], "required"
    return "params", message
