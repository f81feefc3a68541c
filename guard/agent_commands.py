"""CLI subcommands of a room (filled in by the room's issue)."""

from __future__ import annotations

from typing import Any


def register(sub: Any, add: Any) -> None:
    """Add this room's subcommands to the ``guard`` parser."""
