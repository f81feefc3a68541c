"""``guard advise``: the live C4P traffic-engineering advice producer (docs/c4p.md)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from guard.config import Settings

from .common import add_log_level, apply_options, configure_logging

__all__ = ["register"]


def cmd_advise(args: argparse.Namespace, settings: Settings) -> int:
    from guard.kafka import create_topics
    from guard.shutdown import stop_on_signals
    from guard.streams.advisor import AdviceProducer
    from guard.streams.processing import progress_line

    configure_logging(args.log_level)
    apply_options(settings, args, {"fabric.topology": "topology", "fabric.advise_every_s": "every"})
    settings.fabric.load()  # a bad topology file fails now, before the broker is asked
    create_topics(settings)
    producer = AdviceProducer(settings, group_id=args.group)
    last = [time.monotonic()]

    def report(stats: Any) -> None:
        if time.monotonic() - last[0] >= settings.streams.progress_s:
            last[0] = time.monotonic()
            print(progress_line("advise", **vars(stats)), file=sys.stderr, flush=True)

    with stop_on_signals() as stop:
        stats = producer.run(stop, on_progress=report)
    print(progress_line("advise", "stopped", **vars(stats)), file=sys.stderr, flush=True)
    return 0


def register(sub: Any, add: Any) -> None:
    """Add ``advise`` to the ``guard`` parser."""
    p = add("advise", cmd_advise, "publish path-planning advice (C4P) from the jobs' collectives")
    p.add_argument("--topology", default=None, help="topology file (default: [fabric] topology)")
    p.add_argument("--every", type=float, default=None, help="seconds of event time between plans")
    p.add_argument("--group", default="guard-advise", help="consumer group id")
    add_log_level(p, "info")
