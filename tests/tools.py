"""Tools the tests need that a fresh machine may lack, got the way the README promises."""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path

__all__ = ["debian_tool"]


@functools.cache
def debian_tool(command: str, package: str) -> str:
    """``command``'s path: the one on PATH, else installed from Debian's ``package`` by
    deploy/tools/debian-tool.sh (as root), so the README's test command needs nothing
    installed by hand."""
    script = Path(__file__).resolve().parent.parent / "deploy/tools/debian-tool.sh"
    done = subprocess.run(
        [str(script), command, package], capture_output=True, text=True, timeout=900, check=False
    )
    assert done.returncode == 0, f"{script} {command} {package} failed: {done.stderr[-2000:]}"
    return done.stdout.strip().splitlines()[-1]
