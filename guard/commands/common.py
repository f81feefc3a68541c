"""What every command shares: options onto the settings, the ``--log-level`` option."""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from guard.config import Settings
from guard.errors import UsageError

__all__ = ["LOG_LEVELS", "add_log_level", "apply_options", "configure_logging", "print_json"]

LOG_LEVELS = ("debug", "info", "warning", "error")


def apply_options(settings: Settings, args: argparse.Namespace, fields: Mapping[str, str]) -> None:
    """Set ``settings.<section>.<field>`` from each option given on the command line.

    ``fields`` maps ``"section.field"`` to the option's ``args`` name; an option left at
    None keeps the configured value.
    """
    for path, option in fields.items():
        value = getattr(args, option, None)
        if value is None:
            continue
        section, name = path.split(".")
        try:
            setattr(getattr(settings, section), name, value)
        except ValidationError as exc:
            message = exc.errors()[0]["msg"]
            raise UsageError(f"--{option.replace('_', '-')} {value!r}: {message}") from None


def add_log_level(
    parser: argparse.ArgumentParser,
    default: str | None,
    help_text: str | None = None,
    *aliases: str,
) -> None:
    parser.add_argument(
        "--log-level",
        *aliases,
        dest="log_level",
        type=str.lower,
        default=default,
        choices=LOG_LEVELS,
        help=help_text or f"log level (default: {default})",
    )


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))
