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
# What each room may import from guard.* (besides itself).
ALLOWED = {
    "schemas": set(),
    "detectors": {"schemas"},
    "agents": {"schemas", "config", "kafka", "broker"},
    "streams": {"schemas", "detectors", "config", "kafka", "store", "broker"},
    "sweeps": {"schemas", "config", "kafka"},
}
CORE_MODULES = {"config", "kafka", "store", "broker"}  # the thin core rooms may use


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
    for path in sorted((ROOT / room).glob("*.py")):
        bad = _guard_imports(path) - ALLOWED[room] - {room}
        assert not bad, f"{path.relative_to(ROOT)} imports guard.{sorted(bad)}"


def test_core_modules_import_no_room_but_schemas() -> None:
    for name in CORE_MODULES:
        bad = _guard_imports(ROOT / "guard" / f"{name}.py") - CORE_MODULES - {"schemas"}
        assert not bad, f"guard/{name}.py imports guard.{sorted(bad)}"


def test_rooms_install_under_the_guard_namespace() -> None:
    for room in ALLOWED:
        module = importlib.import_module(f"guard.{room}")
        assert Path(module.__file__).resolve().parent == ROOT / room  # type: ignore[arg-type]
    assert importlib.util.find_spec("schemas") is None or "guard" in str(
        importlib.util.find_spec("schemas").origin  # type: ignore[union-attr]
    )


def test_doctests_of_schemas_and_detectors_run_and_pass() -> None:
    attempted = 0
    for package in ("guard.schemas", "guard.detectors"):
        pkg = importlib.import_module(package)
        for info in pkgutil.iter_modules(pkg.__path__, prefix=f"{package}."):
            module = importlib.import_module(info.name)
            result = doctest.testmod(
                module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
            )
            assert result.failed == 0, info.name
            attempted += result.attempted
    assert attempted >= 2
