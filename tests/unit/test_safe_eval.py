"""env_svc.safe_eval: exact arithmetic on model text, and everything else refused unevaluated."""

from __future__ import annotations

import builtins
from fractions import Fraction

import pytest

from env_svc.safe_eval import (
    ArithmeticFailure,
    DisallowedExpressionError,
    ExpressionLimitError,
    ExpressionSyntaxError,
    SafeEvalError,
    evaluate,
    format_number,
    safe_eval,
)


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 + 2", 3),
        ("47 * 86", 4042),
        ("7 / 2", Fraction(7, 2)),
        ("(8 / 3) * 3", 8),
        ("2 ** 10", 1024),
        ("2 ** -3", Fraction(1, 8)),
        ("-5 // 2", -3),
        ("17 % 5", 2),
        ("-(3 - 10)", 7),
        ("+4", 4),
        ("0.1 + 0.2", Fraction(3, 10)),
        ("  12 - 3 * (4 + 1)  ", -3),
        ("1_000 + 1", 1001),
    ],
)
def test_arithmetic_is_exact(expression: str, expected: int | Fraction) -> None:
    value = safe_eval(expression)
    assert value == expected
    # Integral results come back as int, so "8" and "(8/3)*3" compare and print alike.
    assert type(value) is type(expected)


@pytest.mark.parametrize(
    ("expression", "error", "says"),
    [
        ("__import__('os')", DisallowedExpressionError, "function calls"),
        ("__import__('os').system('echo hi')", DisallowedExpressionError, "not allowed"),
        ("(1).real", DisallowedExpressionError, "attribute access"),
        ("().__class__", DisallowedExpressionError, "attribute access"),
        ("x + 1", DisallowedExpressionError, "names are not allowed: 'x'"),
        ("abs(-3)", DisallowedExpressionError, "function calls"),
        ("lambda: 1", DisallowedExpressionError, "lambda"),
        ("[i for i in (1, 2)]", DisallowedExpressionError, "comprehensions"),
        ("{i: i for i in (1,)}", DisallowedExpressionError, "comprehensions"),
        ("sum(i for i in (1,))", DisallowedExpressionError, "function calls"),
        ("'ab' * 3", DisallowedExpressionError, "only numbers"),
        ("True + 1", DisallowedExpressionError, "only numbers"),
        ("1j * 2", DisallowedExpressionError, "only numbers"),
        ("[1, 2]", DisallowedExpressionError, "List"),
        ("1 if 1 else 2", DisallowedExpressionError, "IfExp"),
        ("1 < 2", DisallowedExpressionError, "Compare"),
        ("2 ^ 3", DisallowedExpressionError, "write powers with `**`"),
        ("1 << 40", DisallowedExpressionError, "LShift"),
        ("2 ** 0.5", DisallowedExpressionError, "whole numbers"),
        ("9**9**9", ExpressionLimitError, "exponent 387420489"),
        ("10 ** 65", ExpressionLimitError, "exponent 65"),
        ("10 ** 16", ExpressionLimitError, "exceeds the limit"),
        ("99999999 * 99999999", ExpressionLimitError, "exceeds the limit"),
        ("1e400", ExpressionLimitError, "out of range"),
        ("1" + " + 1" * 60, ExpressionLimitError, "241 characters"),
        ("1 / 0", ArithmeticFailure, "division by zero"),
        ("5 % 0", ArithmeticFailure, "division by zero"),
        ("0 ** -1", ArithmeticFailure, "division by zero"),
        ("3 +", ExpressionSyntaxError, "not an arithmetic expression"),
        ("import os", ExpressionSyntaxError, "not an arithmetic expression"),
        ("x = 1", ExpressionSyntaxError, "not an arithmetic expression"),
        ("", ExpressionSyntaxError, "empty"),
    ],
)
def test_refuses_with_a_clear_error(expression: str, error: type[SafeEvalError], says: str) -> None:
    with pytest.raises(error) as caught:
        safe_eval(expression)
    assert says in str(caught.value)
    assert isinstance(caught.value, ValueError)  # callers may catch one family


def test_never_calls_eval_or_exec(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("eval/exec/compile-to-code must not be used")

    monkeypatch.setattr(builtins, "eval", forbidden)
    monkeypatch.setattr(builtins, "exec", forbidden)
    assert safe_eval("(47 * 86) // 3 - 2 ** 4") == 1331
    with pytest.raises(DisallowedExpressionError):
        safe_eval("__import__('os').system('echo pwned')")


def test_limits_are_adjustable() -> None:
    assert safe_eval("2 ** 100", max_exponent=100, max_magnitude=2**100) == 2**100
    with pytest.raises(ExpressionLimitError, match="at most 5"):
        safe_eval("1 + 23", max_length=5)


def test_operators_can_be_restricted() -> None:
    assert safe_eval("(6 - 2) * 3 / 4", operators={"+", "-", "*", "/"}) == 3
    with pytest.raises(DisallowedExpressionError, match=r"'\*\*' is not allowed here"):
        safe_eval("2 ** 3", operators={"+", "-", "*", "/"})
    with pytest.raises(DisallowedExpressionError, match="'unary-' is not allowed"):
        safe_eval("-3 + 5", operators={"+", "-"})
    with pytest.raises(ValueError, match="unknown operators"):
        safe_eval("1", operators={"@"})


def test_deep_nesting_within_the_length_limit_evaluates() -> None:
    assert safe_eval("(" * 99 + "7" + ")" * 99) == 7
    assert safe_eval("-" * 199 + "1") == -1


def test_evaluate_reports_literals_in_order() -> None:
    result = evaluate("(3 + 5) * 3 - 2.0")
    assert result.value == 22
    assert result.literals == [3, 5, 3, 2]


@pytest.mark.parametrize(
    ("value", "shown"),
    [(42, "42"), (-7, "-7"), (Fraction(5, 2), "2.5"), (Fraction(1, 3), "0.333333333333")],
)
def test_format_number(value: int | Fraction, shown: str) -> None:
    assert format_number(value) == shown
