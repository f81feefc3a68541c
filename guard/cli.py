"""The ``guard`` command line: the parser and ``main``; the commands live in ``guard.commands``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from guard.config import Settings, load_settings
from guard.errors import EXIT_INTERRUPTED, GuardError

__all__ = ["build_parser", "main"]

Handler = Callable[[argparse.Namespace, Settings], int]

EPILOG = (
    "exit status: 0 done; 1 a runtime failure (one line on stderr says what was wrong and "
    "what to do next); 2 a usage error; 130 interrupted."
)


def _version() -> str:
    try:
        return version("guard-telemetry")
    except PackageNotFoundError:  # a source tree that is not installed
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="guard",
        description="Find grey GPU nodes and stragglers in training jobs; manage node health.",
        epilog=EPILOG,
    )
    parser.add_argument(
        "--config", help="TOML config file (default: $GUARD_CONFIG or ./guard.toml)"
    )
    parser.add_argument("--version", action="version", version=f"guard {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str, handler: Handler, help_text: str, parent: Any = sub
    ) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = parent.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(handler=handler)
        return p

    from guard.commands import register_all

    register_all(sub, add)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None:  # the process's own command line, not a call from other code
        from guard.commands.common import own_the_process

        own_the_process()
    try:
        settings = load_settings(args.config)
        code: int = args.handler(args, settings)
        return code
    except GuardError as exc:
        print(f"guard: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
