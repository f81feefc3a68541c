"""The agents room's doctests run and pass."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["client", "dcgm", "nic", "spool"]


@pytest.mark.parametrize("name", MODULES)
def test_doctests_pass(name: str) -> None:
    module = importlib.import_module(f"guard.agents.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


def test_the_client_imports_nothing_outside_the_standard_library() -> None:
    import subprocess
    import sys

    code = (
        "import sys; import guard.agents.client; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('pydantic', 'numpy', 'confluent_kafka', 'torch', 'orjson')); print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
