"""The ``guard`` subcommands, one module per room, registered by ``guard.cli``.

Each module's ``register(sub, add)`` receives the subparsers object and the
``add(name, handler, help, parent=sub)`` helper of :func:`guard.cli.build_parser`; a handler
is ``handler(args: argparse.Namespace, settings: Settings) -> int`` and fails by raising
:class:`guard.errors.GuardError`.
"""

from __future__ import annotations

from typing import Any

from guard.commands import (
    advise,
    agents,
    base,
    demo,
    evaluation,
    nodes,
    orchestrator,
    replay,
    report,
    streams,
    sweep,
)

__all__ = ["register_all"]


def register_all(sub: Any, add: Any) -> None:
    # The order is the order of `guard --help`.
    for module in (
        demo,
        base,
        agents,
        evaluation,
        report,
        orchestrator,
        nodes,
        sweep,
        streams,
        advise,
        replay,
    ):
        module.register(sub, add)
