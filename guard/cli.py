"""The ``guard`` command line. Thin: parse arguments, build settings, call into the rooms."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from guard.config import Settings, load_settings

__all__ = ["main"]

Handler = Callable[[argparse.Namespace, Settings], int]


class CommandError(RuntimeError):
    """A failure to report in one line, without a traceback."""


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


# --- commands -----------------------------------------------------------------------------


def cmd_config_show(args: argparse.Namespace, settings: Settings) -> int:
    _print_json(settings.masked())
    return 0


def cmd_schema_export(args: argparse.Namespace, settings: Settings) -> int:
    from guard.schemas import json_schemas

    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    for kind, schema in json_schemas().items():
        path = out / f"{kind}.schema.json"
        path.write_text(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        print(path)
    return 0


def cmd_topics_create(args: argparse.Namespace, settings: Settings) -> int:
    from guard.kafka import create_topics

    for topic, outcome in sorted(create_topics(settings, timeout_s=args.timeout).items()):
        print(f"{outcome:8} {topic}")
    return 0


def cmd_db_migrate(args: argparse.Namespace, settings: Settings) -> int:
    from guard.store import connect, migrate

    client = connect(settings)
    try:
        created = migrate(client, settings)
    finally:
        client.close()
    print(
        f"schema ready in {settings.clickhouse.database} "
        f"at {settings.masked()['clickhouse']['dsn']}:"
    )
    for name in created:
        print(f"  {name}")
    return 0


def cmd_broker(args: argparse.Namespace, settings: Settings) -> int:
    from guard.broker import EmbeddedBroker

    broker = EmbeddedBroker(port=args.port, log_path=Path(args.log) if args.log else None)
    stop = threading.Event()

    def _on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    started = time.monotonic()
    broker.start()
    try:
        if args.create_topics:
            from guard.kafka import create_topics

            settings.kafka.bootstrap = broker.bootstrap
            create_topics(settings)
        print(broker.bootstrap, flush=True)
        print(
            f"Tansu broker up in {time.monotonic() - started:.2f} s (memory storage, pid "
            f"{broker.process.pid if broker.process else '?'}); "
            f"export GUARD_KAFKA_BOOTSTRAP={broker.bootstrap}. Ctrl-C stops it.",
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(0.5):
            if broker.process is None or broker.process.poll() is not None:
                raise CommandError("the Tansu broker exited unexpectedly")
    finally:
        broker.stop()
        print("broker stopped", file=sys.stderr, flush=True)
    return 0


def cmd_demo(args: argparse.Namespace, settings: Settings) -> int:
    from guard.demo import DemoConfig, run_demo

    config = DemoConfig(
        nodes=args.nodes,
        duration_s=args.duration,
        seed=args.seed,
        speed=args.speed,
        workers=args.workers,
        engine=args.engine or settings.streams.engine,
        home=Path(args.home) if args.home else None,
    )
    run_demo(settings, config, as_json=args.json)
    return 0


# --- parser -------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="guard",
        description="Find grey GPU nodes and stragglers in training jobs; manage node health.",
    )
    parser.add_argument(
        "--config", help="TOML config file (default: $GUARD_CONFIG or ./guard.toml)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        name: str, handler: Handler, help_text: str, parent: Any = sub
    ) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = parent.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(handler=handler)
        return p

    p = add("demo", cmd_demo, "run the whole pipeline on a simulated cluster (embedded)")
    p.add_argument("--nodes", type=int, default=32, help="simulated nodes (8 GPUs each)")
    p.add_argument("--duration", type=float, default=600, help="simulated seconds")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--speed",
        type=float,
        default=None,
        help="simulated seconds per wall second (default: what the workers keep up with)",
    )
    p.add_argument("--workers", type=int, default=1, help="streams worker processes")
    p.add_argument(
        "--engine",
        choices=["faust", "native"],
        default=None,
        help="streams transport (default from config: native)",
    )
    p.add_argument("--home", help="data directory (default: a new temporary one)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")

    p = add("broker", cmd_broker, "start the embedded Tansu broker on loopback")
    p.add_argument("--port", type=int, default=None, help="default: a free port")
    p.add_argument("--log", help="file for the broker's own log")
    p.add_argument("--create-topics", action="store_true", help="create Guard's topics once up")

    topics = sub.add_parser("topics", help="Kafka topics").add_subparsers(dest="sub", required=True)
    p = add("create", cmd_topics_create, "create Guard's topics (idempotent)", topics)
    p.add_argument("--timeout", type=float, default=30.0)

    db = sub.add_parser("db", help="ClickHouse schema").add_subparsers(dest="sub", required=True)
    add("migrate", cmd_db_migrate, "create the ClickHouse schema (idempotent)", db)

    config = sub.add_parser("config", help="configuration").add_subparsers(
        dest="sub", required=True
    )
    add("show", cmd_config_show, "print the effective configuration, secrets masked", config)

    schema = sub.add_parser("schema", help="wire contract").add_subparsers(
        dest="sub", required=True
    )
    p = add("export", cmd_schema_export, "write one JSON Schema file per message kind", schema)
    p.add_argument("dir")

    from guard.commands import register_all

    register_all(sub, add)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from guard.broker import EmbeddedBrokerError
    from guard.kafka import BrokerUnreachable
    from guard.store import StoreUnavailable

    args = build_parser().parse_args(argv)
    try:
        settings = load_settings(args.config)
        code: int = args.handler(args, settings)
        return code
    except ValidationError as exc:
        print(
            f"guard: error: invalid configuration: {exc}\n(read from the TOML file and "
            "GUARD_<SECTION>_<FIELD> environment variables; `guard config show` prints "
            "the fields)",
            file=sys.stderr,
        )
    except (
        CommandError,
        BrokerUnreachable,
        StoreUnavailable,
        EmbeddedBrokerError,
        FileNotFoundError,
    ) as exc:
        print(f"guard: error: {exc}", file=sys.stderr)
    except KeyboardInterrupt:
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
