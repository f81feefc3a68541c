"""The rooms' import direction (STYLE.md) and the installed namespace."""

from __future__ import annotations

import ast
import doctest
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The guard base: what every room may use; it imports nothing of ours but schemas.
BASE_MODULES = {"config", "kafka", "store", "broker", "errors", "shutdown", "metrics"}
# The guard top ties rooms together; no room imports it.
TOP_MODULES = {"cli", "commands", "demo"}
# What each room may import from guard.* besides itself: the arrow
# schemas <- {detectors, planning} <- {agents, streams, sweeps, evaluation} <- guard top,
# over the base; planning (C4P path planning and advice) is pure like detectors, beside them.
ALLOWED = {
    "schemas": set(),
    "detectors": {"schemas"},
    "planning": {"schemas"},
    "agents": {"schemas"} | BASE_MODULES,
    "streams": {"schemas", "detectors", "planning"} | BASE_MODULES,
    "sweeps": {"schemas", "detectors"} | BASE_MODULES,
    "evaluation": {"schemas", "detectors"},
}


def _guard_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "guard" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_rooms_import_in_one_direction(room: str) -> None:
    paths = sorted((ROOT / room).rglob("*.py"))
    assert paths, room
    for path in paths:
        bad = _guard_imports(path) - ALLOWED[room] - {room}
        assert not bad, f"{path.relative_to(ROOT)} imports guard.{sorted(bad)}"


def test_base_modules_import_no_room_but_schemas() -> None:
    for name in BASE_MODULES:
        bad = _guard_imports(ROOT / "guard" / f"{name}.py") - BASE_MODULES - {"schemas"}
        assert not bad, f"guard/{name}.py imports guard.{sorted(bad)}"


def test_guard_holds_only_its_base_and_its_top() -> None:
    entries = {
        p.stem
        for p in (ROOT / "guard").iterdir()
        if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    assert entries - {"__init__"} == BASE_MODULES | TOP_MODULES


def test_rooms_install_under_the_guard_namespace() -> None:
    for room in ALLOWED:
        module = importlib.import_module(f"guard.{room}")
        assert Path(module.__file__).resolve().parent == ROOT / room  # type: ignore[arg-type]
    assert importlib.util.find_spec("schemas") is None or "guard" in str(
        importlib.util.find_spec("schemas").origin  # type: ignore[union-attr]
    )


def test_doctests_of_schemas_detectors_and_planning_run_and_pass() -> None:
    attempted = 0
    for package in ("guard.schemas", "guard.detectors", "guard.planning"):
        pkg = importlib.import_module(package)
        for info in pkgutil.iter_modules(pkg.__path__, prefix=f"{package}."):
            module = importlib.import_module(info.name)
            result = doctest.testmod(
                module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
            )
            assert result.failed == 0, info.name
            attempted += result.attempted
    assert attempted >= 2


#: the detection core's rooms, where no production function may run past this many lines
CORE_ROOMS = ("detectors", "streams")
MAX_FUNCTION_LINES = 60


def test_no_function_of_the_detection_core_runs_past_sixty_lines() -> None:
    """Issue 25: the core is small functions, each one concept (decorators and docstring
    counted)."""
    long = []
    for room in CORE_ROOMS:
        for path in sorted((ROOT / room).glob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    lines = (node.end_lineno or node.lineno) - first + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{room}/{path.name}:{node.lineno} {node.name} ({lines})")
    assert long == []
