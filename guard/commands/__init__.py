"""The rooms' subcommands, one module per room, registered by ``guard.cli``.

Each module's ``register(sub, add)`` receives the subparsers object and the
``add(name, handler, help, parent=sub)`` helper of :func:`guard.cli.build_parser`; a handler
is ``handler(args: argparse.Namespace, settings: Settings) -> int``.
"""

from __future__ import annotations

from typing import Any

from guard.commands import agents, evaluation, nodes, streams

__all__ = ["register_all"]


def register_all(sub: Any, add: Any) -> None:
    for room in (agents, evaluation, nodes, streams):
        room.register(sub, add)
