"""`math-verify`'s answer check (Hugging Face's: LaTeX and plain expressions compared by
sympy), run where its time limits work.

math-verify bounds its parsing and comparison with `signal.alarm`, which only the main thread
may set; env_svc scores synchronous environments in worker threads, where it raises instead.
So each check runs in a child process's main thread (env_svc/taskdata/workers.py), with
math-verify's own limits (`PARSE_S`, `VERIFY_S`: `9^{9^{9^9}}` takes them whole) and a
deadline above them that kills a child stuck where an alarm cannot reach (C code): such a
reply scores as wrong and costs one call. `MATH_CHECK_WORKERS` children serve a process.
"""

from __future__ import annotations

import functools
import logging
import os

from env_svc.taskdata.workers import ChildFailedError, ChildTimeoutError, Pool

log = logging.getLogger(__name__)

PARSE_S = 2
"""math-verify's limit on parsing each side (whole seconds: `signal.alarm`)."""
VERIFY_S = 2
"""math-verify's limit on each comparison."""
DEADLINE_S = 3 * PARSE_S + VERIFY_S
"""A check still running after this is killed: both parses and the comparison timed out
already, or the child is stuck in C code."""
MAX_REPLY_CHARS = 4_000
"""Only the reply's end is parsed (a final answer is there); a long chain of thought would
only cost time."""
MEMORY_BYTES = 2 << 30
WORKERS_VAR = "MATH_CHECK_WORKERS"


def equivalent(answer: str, reply: str) -> bool:
    """Whether `reply`'s final answer equals the reference `answer` as math-verify reads both;
    False when either cannot be parsed or the check ran out of time."""
    try:
        return bool(_pool().call(_verify, answer, reply[-MAX_REPLY_CHARS:], deadline_s=DEADLINE_S))
    except ChildTimeoutError:
        log.warning("math check of a reply passed %g s: scored as wrong", DEADLINE_S)
        return False
    except ChildFailedError as exc:
        log.warning("math check failed (%s): scored as wrong", exc)
        return False


@functools.cache
def _pool() -> Pool:
    workers = int(os.environ.get(WORKERS_VAR) or 2)
    return Pool("math-check", max(1, workers), MEMORY_BYTES)


def _verify(answer: str, reply: str) -> bool:
    """In the child's main thread: math-verify with its alarms."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # a timeout is a wrong answer
    # A reference answer is the expression itself ("x + 1", "\\frac{1}{2}"): read as LaTeX
    # math first (plain, "x + 1" would be read as its last number), as written if that fails.
    written_as_math = "$" in answer or "\\boxed" in answer
    gold = [] if written_as_math else parse(f"${answer}$", parsing_timeout=PARSE_S)
    gold = gold or parse(answer, parsing_timeout=PARSE_S)
    guess = parse(reply, parsing_timeout=PARSE_S)
    return bool(gold and guess and verify(gold, guess, timeout_seconds=VERIFY_S))
