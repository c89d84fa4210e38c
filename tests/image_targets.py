"""What a Dockerfile target installs, and a Python process that can import only that.

`make test-compose` builds and runs the images for real; this is the fast check `make test`
runs without Docker: an image is checked from its definition, the requirement
lines each target's `pip install` gets (its own and its parent stages'), their closure over
the installed distributions' metadata (the project's own from pyproject.toml), and an import
guard that makes every module of any other distribution missing, as it is in the image.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import shlex
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "marlaas"


def dockerfile_stages(dockerfile_text: str) -> dict[str, list[str]]:
    """Stage name -> its instruction lines (continuations joined), for `FROM ... AS name`."""
    joined = re.sub(r"\\\n\s*", " ", dockerfile_text)
    stages: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if from_match := re.match(r"FROM\s+(?:--\S+\s+)*\S+\s+AS\s+(\S+)$", line, re.IGNORECASE):
            current = stages.setdefault(from_match.group(1), [])
        elif line.upper().startswith("FROM "):
            current = None
        if current is not None:
            current.append(line)
    return stages


def stages(dockerfile: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (the image or stage it is built FROM, its RUN commands)."""
    return {
        name: (lines[0].split()[1], [line[4:] for line in lines if line.upper().startswith("RUN ")])
        for name, lines in dockerfile_stages(dockerfile).items()
    }


def requirement_lines(dockerfile: str, target: str) -> list[tuple[str, bool]]:
    """(requirement, with its dependencies) for every `pip install` in `target` and the
    stages it is built from; the project's own source (`/src[extras]`) is `marlaas[extras]`."""
    all_stages, lines = stages(dockerfile), []
    while target in all_stages:
        parent, runs = all_stages[target]
        for run in runs:
            if "pip install" not in run:
                continue
            words = shlex.split(run.partition("pip install")[2].partition("&&")[0])
            follow = "--no-deps" not in words
            for word in words:
                # Options, and shell expansions of build arguments (an optional index URL).
                if not word.startswith("-") and "$" not in word:
                    lines.append(
                        (
                            PROJECT + word.removeprefix("/src")
                            if word.startswith("/src")
                            else word,
                            follow,
                        )
                    )
        target = parent
    return lines


def _project_requirements(extras: set[str]) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        found += [Requirement(r) for r in project["optional-dependencies"][extra]]
    return found


def allowed_distributions(lines: list[tuple[str, bool]]) -> set[str]:
    """The canonical names of the distributions `pip install` of `lines` would bring, from
    the metadata of what is installed here (a distribution not installed here cannot be
    imported here either)."""
    seen: set[tuple[str, frozenset[str]]] = {
        (canonicalize_name(Requirement(line).name), frozenset()) for line, _ in lines
    }
    todo = [Requirement(line) for line, follow in lines if follow]
    seen -= {(canonicalize_name(r.name), frozenset()) for r in todo}
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        key = (name, frozenset(requirement.extras))
        if key in seen:
            continue
        seen.add(key)
        if name == PROJECT:
            todo += _project_requirements(set(requirement.extras))
            continue
        try:
            requires = metadata.requires(requirement.name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            needed = Requirement(line)
            wanted = requirement.extras or {""}
            if needed.marker is None or any(needed.marker.evaluate({"extra": e}) for e in wanted):
                todo.append(needed)
    return {name for name, _ in seen}


GUARD = """
import importlib.metadata, re, sys
ALLOWED = set({allowed!r})

def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()

# A module set to None in sys.modules is missing: `import` raises ModuleNotFoundError and
# importlib.util.find_spec answers None, as for a distribution that is not installed.
for module, owners in importlib.metadata.packages_distributions().items():
    if module not in sys.modules and not any(canonical(o) in ALLOWED for o in owners):
        sys.modules[module] = None
"""


def guarded(code: str, allowed: set[str]) -> str:
    """`code` run in a process that can import only stdlib, the project and `allowed`."""
    return GUARD.format(allowed=sorted(allowed)) + code
