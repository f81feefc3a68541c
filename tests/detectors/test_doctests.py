"""Every module of guard.detectors has a docstring example (river style), and it runs."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import guard.detectors

MODULES = sorted(m.name for m in pkgutil.iter_modules(guard.detectors.__path__))


def test_the_package_has_its_modules() -> None:
    assert {"engine", "fusion", "peer_straggler", "collective", "nic", "thermal"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_module_doctests_run_and_pass(name: str) -> None:
    module = importlib.import_module(f"guard.detectors.{name}")
    assert module.__doc__ and "Example" in module.__doc__, f"{name} has no docstring example"
    assert getattr(module, "__all__", None), f"{name} has no __all__"
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"no doctest ran in guard.detectors.{name}"
    assert result.failed == 0
