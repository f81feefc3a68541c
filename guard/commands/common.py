"""What every command shares: options onto the settings, the ``--log-level`` option."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import math
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from guard.config import Settings
from guard.errors import UsageError

__all__ = [
    "GC_THRESHOLDS",
    "LOG_LEVELS",
    "add_log_level",
    "add_metrics_port",
    "apply_options",
    "configure_logging",
    "own_the_process",
    "print_json",
    "tune_gc_for_the_data_path",
]

LOG_LEVELS = ("debug", "info", "warning", "error")

#: The cyclic collector's thresholds in a data-path process (CPython's: 700, 10, 10).
GC_THRESHOLDS = (100_000, 50, 100)
#: True once :func:`guard.cli.main` runs as the process's command line (``argv`` None); code
#: that calls ``main([...])`` in its own process (a test) keeps its collector as it set it.
_OWN_PROCESS = [False]


def own_the_process() -> None:
    """The command owns this process: it may tune process-wide settings (the collector)."""
    _OWN_PROCESS[0] = True


def need_services() -> None:
    """Fail at once where the ``services`` extra is not installed (a GPU node's ``[agent]``):
    ``main`` turns the missing module into one line that names the extra, before the command
    waits on a broker it would never use."""
    import importlib.util
    import sys

    from guard.cli import SERVICES_MODULES

    for module in SERVICES_MODULES:
        if module == "uvloop" and sys.platform == "win32":
            continue
        if importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"No module named {module!r}", name=module)


def tune_gc_for_the_data_path() -> None:
    """Fewer passes of the cyclic garbage collector, for a process that holds much long-lived
    detector state (a native streams worker, a backtest). With CPython's thresholds its young
    collections come every 700 allocations and its full ones walk every object the detectors
    keep (a node's river model is ~500 tree nodes): at 10k GPUs that was ~38 % of a worker's
    detector time, and a 3 s stall when every node's first model window closed. Cycles are
    still collected, less often; what start-up made (modules, schemas) is frozen out of
    every later walk. Only in a process the command owns (:func:`own_the_process`). Not in a
    faust worker: one stalled once in CI after a restart with these settings (cause not
    found), and faust is not the default engine.
    """
    if not _OWN_PROCESS[0]:
        return
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


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


def add_metrics_port(parser: argparse.ArgumentParser, setting: str) -> None:
    """``--metrics-port``: this process's ``/metrics`` and ``/healthz`` port, over ``setting``
    (one port per process: ``guard-streams@PORT.service`` passes its instance name)."""
    section, name = setting.split(".")
    default = Settings.model_fields[section].annotation.model_fields[name].default  # type: ignore[union-attr]
    parser.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        metavar="PORT",
        help=f"/metrics and /healthz port, 0 for none (default: {setting}, {default})",
    )


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0 to 65535)")
    return value


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def _integer(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{value} is not {what}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (a bad value is argparse's usage error, exit 2)."""
    return _integer(text, 1, "a positive integer (use 1 or more)")


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0 (0 meaning none, or off)."""
    return _integer(text, 0, "an integer >= 0")


def _finite(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a finite number > 0."""
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number (use more than 0)")
    return value


def non_negative_float(text: str) -> float:
    """An argparse type: a finite number >= 0 (a speed-up, where 0 means as fast as possible)."""
    value = _finite(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number >= 0")
    return value
