"""Writes acme/word_problems.jsonl: 320 one-step word problems (sums, differences, products of
one-digit numbers in a sentence), one {"question", "answer"} per line, the same file every time.

    python examples/data/word_problems.py > examples/data/acme/word_problems.jsonl

The untrained SmolLM2-135M answers about a fifth of them greedily: it works the sum out in a
sentence and trails off, so its reply seldom ends on the answer, and the token limit often
cuts it off first. bench/learning.py's dataset job trains on them (a quarter held out by the
dataset environment's hash split).
"""

from __future__ import annotations

import json
import random

NAMES = (
    "Ana Ben Carla Dev Emma Farid Gus Hana Ivan Jun Kofi Lena "
    "Mia Noor Omar Pia Raj Sara Tom Uma Vera Wes Yara Zoe"
).split()
THINGS = ["apples", "books", "coins", "marbles", "pencils", "stickers", "cards", "shells"]
THINGS += ["stamps", "cookies", "balloons", "toy cars"]


def problem(rng: random.Random) -> tuple[str, int]:
    name, thing, kind = rng.choice(NAMES), rng.choice(THINGS), rng.randrange(6)
    a, b = rng.randint(2, 9), rng.randint(1, 9)
    if kind == 0:
        q = f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"
        return q, a + b
    if kind == 1:
        a = rng.randint(b + 1, b + 9)
        return f"{name} had {a} {thing} and gave {b} away. How many {thing} are left?", a - b
    if kind == 2:
        q = f"There are {a} boxes with {b} {thing} in each box. How many {thing} are there in all?"
        return q, a * b
    if kind == 3:
        c = rng.randint(1, 9)
        q = f"{name} has {a} {thing}, finds {b} more and then {c} more. "
        return q + f"How many {thing} does {name} have?", a + b + c
    if kind == 4:
        q = f"{name} buys {a} bags of {thing}. Each bag holds {b}. How many {thing} did {name} buy?"
        return q, a * b
    other = rng.choice(NAMES)
    q = f"{name} has {a} {thing} and {other} has {b} {thing}. "
    return q + f"How many {thing} do they have together?", a + b


def main(count: int = 320, seed: int = 20261205) -> None:
    rng = random.Random(seed)
    problems: dict[str, int] = {}
    while len(problems) < count:
        question, answer = problem(rng)
        problems.setdefault(question, answer)
    for question, answer in problems.items():
        print(json.dumps({"question": question, "answer": str(answer)}))


if __name__ == "__main__":
    main()
