"""Subcommands contributed by the rooms, registered by ``guard.cli``.

Each ``register_*`` receives the subparsers object and the ``add(name, handler, help,
parent=sub)`` helper of :func:`guard.cli.build_parser`; a handler is
``handler(args: argparse.Namespace, settings: Settings) -> int``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["register_all"]


def register_all(sub: Any, add: Any) -> None:
    for module_name in (
        "guard.agent_commands",
        "guard.detect_commands",
        "guard.node_commands",
        "guard.stream_commands",
    ):
        module = __import__(module_name, fromlist=["register"])
        module.register(sub, add)
