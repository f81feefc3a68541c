"""The ``guard`` command line: the parser and ``main``; the commands live in ``guard.commands``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tomllib
from collections.abc import Callable, Sequence
from typing import Any

from guard import installed_version
from guard.config import Settings, load_settings
from guard.errors import EXIT_FAILURE, EXIT_INTERRUPTED, GuardError

__all__ = ["build_parser", "main"]

Handler = Callable[[argparse.Namespace, Settings], int]

#: Import name -> distribution, for every requirement of the ``services`` extra
#: (pyproject.toml; tests/deploy/test_images.py holds the two together). A command that
#: needs one of them on an install without the extra (a GPU node's ``[agent]``) says so in one
#: line instead of a traceback.
SERVICES_MODULES = {
    "faust": "faust-streaming",
    "river": "river",
    "clickhouse_connect": "clickhouse-connect",
    "chdb": "chdb",
    "orjson": "orjson",
    "msgspec": "msgspec",
    "rich": "rich",
    "numpy": "numpy",
    "cramjam": "cramjam",
    "uvloop": "uvloop",
    "plotly": "plotly",
}

EPILOG = (
    "exit status: 0 done; 1 a runtime failure (one line on stderr says what was wrong and "
    "what to do next); 2 a usage error; 130 interrupted."
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="guard",
        description="Find grey GPU nodes and stragglers in training jobs; manage node health.",
        epilog=EPILOG,
    )
    parser.add_argument(
        "--config", help="TOML config file (default: $GUARD_CONFIG or ./guard.toml)"
    )
    parser.add_argument("--version", action="version", version=f"guard {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str, handler: Handler, help_text: str, parent: Any = sub
    ) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = parent.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(handler=handler)
        return p

    from guard.commands import register_all

    register_all(sub, add)
    _log_level_everywhere(sub)
    return parser


def _log_level_everywhere(sub: Any) -> None:
    """``--log-level`` on every command: those that do not set up logging themselves (the
    services do, with their own default) get one that ``main`` applies (default: warning)."""
    from guard.commands.common import add_log_level

    for p in sub.choices.values():
        nested = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        if nested:
            _log_level_everywhere(nested[0])
        elif "--log-level" not in p._option_string_actions:
            add_log_level(p, None, "log level (default: warning)")
            p.set_defaults(_main_sets_log_level=True)


def _one_line(exc: GuardError) -> str:
    """The error in one line; an invalid configuration as ``field: problem (got value)``."""
    from pydantic import ValidationError

    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, ValidationError):
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']} (got {e['input']!r})"
            for e in cause.errors(include_url=False)
        )
        return (
            f"invalid configuration: {problems} (from the TOML file or "
            "GUARD_<SECTION>_<FIELD> variables; `guard config show` lists the fields)"
        )
    return " ".join(str(exc).split())


def _services_module(exc: BaseException) -> str | None:
    """The services' module whose absence ``exc`` is (or was raised from), if it is one."""
    while exc is not None:
        if isinstance(exc, ModuleNotFoundError):
            top = (exc.name or "").partition(".")[0]
            if top in SERVICES_MODULES:
                return top
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return None


def _load(config: str | None) -> Settings:
    try:
        return load_settings(config)
    except tomllib.TOMLDecodeError as exc:
        name = config or os.environ.get("GUARD_CONFIG") or "guard.toml"
        raise GuardError(f"{name} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        name = config or os.environ.get("GUARD_CONFIG") or "guard.toml"
        raise GuardError(f"{name} is not a UTF-8 text file (a TOML config)") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None:  # the process's own command line, not a call from other code
        from guard.commands.common import own_the_process

        own_the_process()
    if getattr(args, "_main_sets_log_level", False):
        from guard.commands.common import configure_logging

        configure_logging(args.log_level or "warning")  # warnings formatted like the services
    try:
        settings = _load(args.config)
        code: int = args.handler(args, settings)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return code
    except GuardError as exc:
        print(f"guard: error: {_one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # `guard config show | head`: the reader left; say nothing, and keep the interpreter's
        # own flush at exit from raising again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILURE
    except Exception as exc:  # a bug: one line for the user, the traceback in the debug log
        missing = _services_module(exc)
        if missing:
            print(
                f"guard: error: guard {args.command} needs the services' dependencies "
                f"({SERVICES_MODULES[missing]} is not installed): "
                "pip install 'guard-telemetry[services]'",
                file=sys.stderr,
            )
            return EXIT_FAILURE
        logging.getLogger("guard").debug("unexpected failure", exc_info=True)
        print(
            f"guard: error: unexpected {type(exc).__name__}: {' '.join(str(exc).split())} "
            "(a bug in guard: please report it with the command line)",
            file=sys.stderr,
        )
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
