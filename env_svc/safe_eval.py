"""A safe evaluator for arithmetic expressions written by the model.

The model's text is untrusted: it is parsed with `ast` and only numbers, + - * / // % **,
unary minus/plus and parentheses are evaluated; every other node (names, calls, attributes,
lambdas, comprehensions, strings, ...) is refused before anything runs. `eval`/`exec` are
never used. Arithmetic is exact (`int` and `fractions.Fraction`), so `(8 / 3) * 3 == 8`, and
limits on input length, exponent size and the size of every intermediate value keep one
expression from eating the CPU or memory of an env_svc replica.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, TypeVar

Number = int | Fraction
"""An exact value: `int` when integral, otherwise a `Fraction`."""

ALL_OPERATORS: frozenset[str] = frozenset({"+", "-", "*", "/", "//", "%", "**", "unary-", "unary+"})
"""Every operator the evaluator knows; callers may allow a subset."""

MAX_LENGTH = 200
"""Longest expression accepted, in characters."""
MAX_EXPONENT = 64
"""Largest |exponent| accepted for `**`."""
MAX_MAGNITUDE = 10**15
"""Largest |numerator| or denominator any literal, intermediate or result may have."""

_F = TypeVar("_F", bound=Callable[..., Number])

_BINARY: dict[type[ast.operator], tuple[str, Callable[[Number, Number], Number]]] = {
    ast.Add: ("+", operator.add),
    ast.Sub: ("-", operator.sub),
    ast.Mult: ("*", operator.mul),
    ast.Div: ("/", operator.truediv),
    ast.FloorDiv: ("//", operator.floordiv),
    ast.Mod: ("%", operator.mod),
    ast.Pow: ("**", operator.pow),
}
_UNARY: dict[type[ast.unaryop], tuple[str, Callable[[Any], Number]]] = {
    ast.USub: ("unary-", operator.neg),
    ast.UAdd: ("unary+", operator.pos),
}
# Operators people (and models) write that Python reads differently; named in the error.
_HINTS: dict[type[ast.AST], str] = {
    ast.BitXor: "`^` is bitwise xor here; write powers with `**`",
}


class SafeEvalError(ValueError):
    """The expression was refused or could not be evaluated; the message says why."""


class ExpressionSyntaxError(SafeEvalError):
    """Not a Python-syntax arithmetic expression at all."""


class DisallowedExpressionError(SafeEvalError):
    """Valid syntax, but uses something other than numbers and the allowed operators."""


class ExpressionLimitError(SafeEvalError):
    """Too long, too large an exponent, or a value too large."""


class ArithmeticFailure(SafeEvalError):
    """A mathematically undefined step, such as division by zero."""


@dataclass(frozen=True, slots=True)
class Evaluation:
    value: Number
    literals: list[Number]
    """Every number literal in the expression, in source order (for Countdown's multiset check)."""


def safe_eval(
    expression: str,
    *,
    operators: Iterable[str] = ALL_OPERATORS,
    max_length: int = MAX_LENGTH,
    max_exponent: int = MAX_EXPONENT,
    max_magnitude: int = MAX_MAGNITUDE,
) -> Number:
    """The exact value of `expression`; raises a `SafeEvalError` subclass instead of guessing."""
    return evaluate(
        expression,
        operators=operators,
        max_length=max_length,
        max_exponent=max_exponent,
        max_magnitude=max_magnitude,
    ).value


def evaluate(
    expression: str,
    *,
    operators: Iterable[str] = ALL_OPERATORS,
    max_length: int = MAX_LENGTH,
    max_exponent: int = MAX_EXPONENT,
    max_magnitude: int = MAX_MAGNITUDE,
) -> Evaluation:
    """Like `safe_eval`, also returning the literals the expression used."""
    allowed = frozenset(operators)
    if unknown := allowed - ALL_OPERATORS:
        raise ValueError(f"unknown operators {sorted(unknown)}; known: {sorted(ALL_OPERATORS)}")
    text = expression.strip()
    if len(text) > max_length:
        raise ExpressionLimitError(f"expression is {len(text)} characters; at most {max_length}")
    if not text:
        raise ExpressionSyntaxError("empty expression")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise ExpressionSyntaxError(f"not an arithmetic expression: {text!r}") from exc
    walker = _Evaluator(allowed, max_exponent, max_magnitude)
    try:
        value = walker.visit(tree.body)
    except RecursionError:
        raise ExpressionLimitError("expression is nested too deeply") from None
    return Evaluation(value=value, literals=walker.literals)


def format_number(value: Number) -> str:
    """How a value is shown to the model: `42`, `-7`, or a decimal such as `2.5`."""
    if isinstance(value, int):
        return str(value)
    return f"{float(value):.12g}"


class _Evaluator:
    def __init__(self, allowed: frozenset[str], max_exponent: int, max_magnitude: int) -> None:
        self.allowed = allowed
        self.max_exponent = max_exponent
        self.max_magnitude = max_magnitude
        self.literals: list[Number] = []

    def visit(self, node: ast.expr) -> Number:
        if isinstance(node, ast.Constant):
            value = self._literal(node.value)
            self.literals.append(value)
            return value
        if isinstance(node, ast.BinOp):
            symbol, apply = self._known(node.op, _BINARY)
            # Fractions throughout: int / int and int ** -n would otherwise give inexact floats.
            left = Fraction(self.visit(node.left))
            right = self.visit(node.right)
            if symbol == "**":
                self._check_exponent(right)
            try:
                return self._checked(apply(left, right if symbol == "**" else Fraction(right)))
            except ZeroDivisionError:
                raise ArithmeticFailure("division by zero") from None
        if isinstance(node, ast.UnaryOp):
            symbol, apply_unary = self._known(node.op, _UNARY)
            return self._checked(apply_unary(Fraction(self.visit(node.operand))))
        raise DisallowedExpressionError(_describe(node))

    def _known(self, op: ast.AST, table: Mapping[Any, tuple[str, _F]]) -> tuple[str, _F]:
        entry = table.get(type(op))
        if entry is None:
            hint = _HINTS.get(type(op), f"operator {type(op).__name__} is not allowed")
            raise DisallowedExpressionError(hint)
        if entry[0] not in self.allowed:
            raise DisallowedExpressionError(f"operator {entry[0]!r} is not allowed here")
        return entry

    def _literal(self, raw: object) -> Number:
        # bool is an int subclass; True/False are names to a reader, not numbers.
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise DisallowedExpressionError(f"only numbers are allowed, not {raw!r}")
        if isinstance(raw, float):
            try:
                # repr is the shortest round-trip form, i.e. what was written: 0.1 -> 1/10.
                raw = Fraction(repr(raw))
            except ValueError:
                raise ExpressionLimitError(f"number {raw!r} is out of range") from None
        return self._checked(raw)

    def _check_exponent(self, exponent: Number) -> None:
        if not isinstance(exponent, int):
            raise DisallowedExpressionError("exponents must be whole numbers")
        if abs(exponent) > self.max_exponent:
            raise ExpressionLimitError(f"exponent {exponent} is larger than {self.max_exponent}")

    def _checked(self, value: Number) -> Number:
        if isinstance(value, Fraction):
            too_big = max(abs(value.numerator), value.denominator) > self.max_magnitude
            value = value.numerator if value.denominator == 1 else value
        else:
            too_big = abs(value) > self.max_magnitude
        if too_big:
            raise ExpressionLimitError(f"a value exceeds the limit of {self.max_magnitude:.0e}")
        return value


def _describe(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return f"names are not allowed: {node.id!r}"
    if isinstance(node, ast.Call):
        return "function calls are not allowed"
    if isinstance(node, ast.Attribute):
        return f"attribute access is not allowed: {node.attr!r}"
    if isinstance(node, ast.Lambda):
        return "lambda is not allowed"
    if isinstance(node, ast.ListComp | ast.SetComp | ast.DictComp | ast.GeneratorExp):
        return "comprehensions are not allowed"
    return f"{type(node).__name__} is not allowed; use numbers, + - * / // % ** and parentheses"
