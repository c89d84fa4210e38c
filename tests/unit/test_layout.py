"""The package layout is a contract (docs/architecture.md, "Code layout"): checked on the source.

`common/` is what the services share: every module in it is imported (directly or through
another common module) by at least one service, and it imports neither the operator console
nor a service. Services never import each other or the console. The client library
(`marlaas/`) imports `common/` only; the tenant API (`api_svc/`) imports `common/` and the client
library only, and nothing imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("env_svc", "rollout_svc", "trainer_svc")
PACKAGES = ("api_svc", "common", "console", "marlaas", *SERVICES)
API_MAY_IMPORT = ("api_svc", "common", "marlaas")
"""The tenant API, a deployable of its own: `common` and the client library."""
LIBRARY_MAY_IMPORT = ("marlaas", "common")
"""The client library: `common` (the wire format) and nothing else of the deployment."""


def imports_of(path: Path) -> set[str]:
    """Top-level-package-qualified modules a file imports (`common.bus.kafka`, `env_svc`...)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in PACKAGES}


def modules(package: str) -> dict[str, Path]:
    return {
        ".".join(path.relative_to(ROOT).with_suffix("").parts): path
        for path in (ROOT / package).rglob("*.py")
        if path.name != "__init__.py"
    }


def test_common_imports_neither_the_console_nor_a_service() -> None:
    offenders = {
        module: sorted(name for name in imports_of(path) if not name.startswith("common"))
        for module, path in modules("common").items()
    }
    assert {module: names for module, names in offenders.items() if names} == {}


def test_services_import_neither_each_other_nor_the_console() -> None:
    for service in SERVICES:
        allowed = ("common", service)
        for module, path in modules(service).items():
            foreign = [n for n in imports_of(path) if not n.startswith(allowed)]
            assert foreign == [], f"{module} imports {foreign}"


def test_every_common_module_is_used_by_a_service() -> None:
    common = modules("common")
    reached: set[str] = set()
    frontier = [name for s in SERVICES for path in modules(s).values() for name in imports_of(path)]
    while frontier:
        name = frontier.pop()
        module = name if name in common else name.rsplit(".", 1)[0]
        if module in common and module not in reached:
            reached.add(module)
            frontier += imports_of(common[module])
    assert sorted(set(common) - reached) == []


def test_common_modules_import_each_other_without_a_cycle() -> None:
    """Even an import inside a function counts: a cycle means two modules own one contract
    (as `messages` and its wire layouts did)."""
    common = modules("common")

    def module_of(name: str) -> str | None:
        return name if name in common else name.rsplit(".", 1)[0] if "." in name else None

    graph = {
        module: {m for name in imports_of(path) if (m := module_of(name)) in common} - {module}
        for module, path in common.items()
    }
    cycles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        for imported in sorted(graph[module]):
            if imported in path:
                cycles.append([*path[path.index(imported) :], imported])
            elif imported not in done:
                visit(imported, [*path, imported])
        done.add(module)

    done: set[str] = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [module])
    assert cycles == []


def test_the_api_imports_common_and_the_client_library_and_nothing_imports_it() -> None:
    for module, path in modules("api_svc").items():
        foreign = [n for n in imports_of(path) if not n.startswith(API_MAY_IMPORT)]
        assert foreign == [], f"{module} imports {foreign}"
    for package in ("common", "console", *SERVICES):
        for module, path in modules(package).items():
            assert not [n for n in imports_of(path) if n.startswith("api_svc")], module


def test_the_client_library_imports_common_only() -> None:
    for module, path in modules("marlaas").items():
        foreign = [n for n in imports_of(path) if not n.startswith(LIBRARY_MAY_IMPORT)]
        assert foreign == [], f"{module} imports {foreign}"


def test_the_api_reaches_no_console_module() -> None:
    """Following every import (inside functions too) from the API's modules, through the
    client library and `common`, reaches nothing of the operator's console."""
    known = {
        **{name: path for package in PACKAGES for name, path in modules(package).items()},
        **{package: ROOT / package / "__init__.py" for package in PACKAGES},
    }
    known |= {
        ".".join(path.parent.relative_to(ROOT).parts): path
        for package in PACKAGES
        for path in (ROOT / package).rglob("__init__.py")
    }

    def module_of(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    reached: set[str] = set()
    frontier = list(modules("api_svc"))
    while frontier:
        module = frontier.pop()
        if module in reached:
            continue
        reached.add(module)
        parts = module.split(".")
        packages = [".".join(parts[:i]) for i in range(1, len(parts))]  # their __init__ runs
        frontier += [p for p in packages if p in known]
        frontier += [m for name in imports_of(known[module]) if (m := module_of(name))]
    assert sorted(m for m in reached if m.split(".")[0] == "console") == []
    assert "marlaas.client" in reached  # the walk does follow the API into the library


def test_the_console_is_in_rooms() -> None:
    """console/ (and api_svc/): no folder a flat list of more than 12 modules, no module
    over 400 lines; a new one goes into the room it belongs to, or makes one."""
    for package in ("console", "api_svc"):
        folders = {path.parent for path in (ROOT / package).rglob("*.py")}
        for folder in folders:
            flat = [p.name for p in folder.glob("*.py") if p.name != "__init__.py"]
            assert len(flat) <= 12, f"{folder.relative_to(ROOT)}: {len(flat)} modules"
        for path in (ROOT / package).rglob("*.py"):
            lines = len(path.read_text().splitlines())
            assert lines <= 400, f"{path.relative_to(ROOT)}: {lines} lines"


def test_the_environment_api_imports_without_the_bus_the_store_or_torch() -> None:
    """`env_svc.protocol` and the built-in environments are what plugin authors and TRL's side
    of the peer benches (bench/peer_trl.py, in a venv with msgspec only) import: neither Kafka's
    client, nor Redis's, nor torch may be needed to import them."""
    import subprocess
    import sys

    blocked = ("aiokafka", "redis", "torch")
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {blocked!r}:\n"
        "            raise ImportError(f'{name} is blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from env_svc.protocol import available_environments, get_environment\n"
        "for name in available_environments():\n"
        "    get_environment(name) if name not in ('dataset', 'verifiers') else 0\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_common_is_in_rooms_each_saying_what_it_owns() -> None:
    """common/ is a few rooms (wire, bus, state, runtime, security, files), not a flat list:
    at most 12 modules at its top level, and each room's `__init__` says what it owns."""
    top = [p.name for p in (ROOT / "common").glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= 12, top
    rooms = [p for p in (ROOT / "common").iterdir() if (p / "__init__.py").is_file()]
    assert len(rooms) >= 4
    for room in rooms:
        docstring = ast.get_docstring(ast.parse((room / "__init__.py").read_text()))
        assert docstring and len(docstring) > 80, f"{room.name}/__init__.py says nothing"


def test_product_code_names_no_issue() -> None:
    """Comments and docstrings say what and why; the history (issue numbers, sessions) is in
    the issues and bench/HISTORY.md."""
    import re

    history = re.compile(r"\bissue \d+|\bsession \d+", re.IGNORECASE)
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if history.search(line)
    ]
    assert found == []
