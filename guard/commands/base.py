"""The base's commands: ``guard broker``, ``topics create``, ``db migrate``, ``config show``,
``schema export``, ``schema doc``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from guard.config import Settings
from guard.errors import GuardError

from .common import add_log_level, configure_logging, print_json

__all__ = ["register"]


def cmd_config_show(args: argparse.Namespace, settings: Settings) -> int:
    print_json(settings.masked())
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


def cmd_schema_doc(args: argparse.Namespace, settings: Settings) -> int:
    from guard.schemas.contract import render_markdown

    text = render_markdown()
    if args.check:
        path = Path(args.check)
        if not path.exists() or path.read_text() != text:
            raise GuardError(
                f"{path} does not match the models in schemas/; regenerate it with "
                f"`guard schema doc --out {path}`"
            )
        print(f"{path} is up to date")
    elif args.out:
        Path(args.out).write_text(text)
        print(args.out)
    else:
        sys.stdout.write(text)
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
    from guard.shutdown import stop_on_signals

    configure_logging(args.log_level)
    broker = EmbeddedBroker(port=args.port, log_path=Path(args.log) if args.log else None)
    with stop_on_signals() as stop:
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
                    raise GuardError(
                        "the Tansu broker exited unexpectedly; run `guard broker --log FILE` "
                        "and read FILE"
                    )
        finally:
            broker.stop()
            print("broker stopped", file=sys.stderr, flush=True)
    return 0


def register(sub: Any, add: Any) -> None:
    """Add ``broker``, ``topics``, ``db``, ``config`` and ``schema`` to the ``guard`` parser."""
    p = add("broker", cmd_broker, "start the embedded Tansu broker on loopback")
    p.add_argument("--port", type=int, default=None, help="default: a free port")
    p.add_argument("--log", help="file for the broker's own log")
    p.add_argument("--create-topics", action="store_true", help="create Guard's topics once up")
    add_log_level(p, "warning")

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
    p = add("doc", cmd_schema_doc, "the wire contract as Markdown (docs/wire-contract.md)", schema)
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", help="write it to this file (default: standard output)")
    where.add_argument("--check", metavar="FILE", help="fail (exit 1) if FILE differs from it")
