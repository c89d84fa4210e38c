"""How a reply is checked against a task's reference answer (the `match` param)."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Literal

from env_svc.envs.arithmetic import last_number
from env_svc.taskdata import mathcheck

Match = Literal["auto", "number", "exact", "contains", "math"]
NUMERIC = re.compile(r"\s*-?\d+(?:\.\d+)?(?:/\d+)?\s*")
_EDGE_PUNCTUATION = " \t\n.!?\"'`*"


def resolved(match: Match, answer: str) -> Match:
    """`auto`: `number` for a numeric answer, else `exact`."""
    if match != "auto":
        return match
    return "number" if NUMERIC.fullmatch(answer) else "exact"


def score(match: Match, answer: str, reply: str) -> float:
    """1.0 when `reply` answers `answer` as `match` says, else 0.0:
    - `number`: its last number equals the answer;
    - `exact`: equal ignoring case, surrounding whitespace and punctuation;
    - `contains`: the answer appears in it, ignoring case;
    - `math`: its final answer (`\\boxed{}`, LaTeX or a plain expression) equals the answer's
      by `math-verify` (`2/4` is `\\frac{1}{2}`), in a worker process (`mathcheck`)."""
    kind = resolved(match, answer)
    if kind == "number":
        return float(last_number(reply) == Fraction(answer.strip()))
    if kind == "contains":
        return float(answer.strip().casefold() in reply.casefold())
    if kind == "math":
        return float(mathcheck.equivalent(answer, reply))
    return float(normal(reply) == normal(answer))


def normal(text: str) -> str:
    return " ".join(text.strip(_EDGE_PUNCTUATION).casefold().split())
