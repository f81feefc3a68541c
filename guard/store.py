"""ClickHouse connection, migrations and batched inserts from wire models.

The same client (clickhouse-connect) talks to chDB in-process (``chdb:///path``) and to a
ClickHouse server over HTTP. A chDB path can be open in one process only: in embedded
mode one process owns the store and other commands ask it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import clickhouse_connect

from guard.config import Settings
from guard.errors import GuardError
from guard.schemas import GuardMessage
from guard.schemas.tables import TABLES, Table, columns_by_table, ddl_statements

__all__ = ["StoreUnavailable", "connect", "insert_columns", "insert_messages", "migrate"]


class StoreUnavailable(GuardError):
    """ClickHouse could not be reached or opened."""


def connect(settings: Settings) -> Any:
    """A clickhouse-connect client for the configured DSN."""
    dsn = settings.clickhouse_dsn
    if dsn.startswith("chdb://"):
        Path(dsn.removeprefix("chdb://")).mkdir(parents=True, exist_ok=True)
    try:
        return clickhouse_connect.get_client(dsn=dsn)
    except Exception as exc:
        hint = (
            " (a chDB path can be open in one process only: is a `guard sink` or `guard demo`"
            " using it? Point GUARD_CLICKHOUSE_DSN elsewhere or ask that process)"
            if dsn.startswith("chdb://")
            else ""
        )
        raise StoreUnavailable(f"cannot open ClickHouse at {_safe(dsn)}: {exc}{hint}") from exc


def migrate(client: Any, settings: Settings) -> list[str]:
    """Create the database, tables, rollup and view if missing. Safe to run again."""
    statements = ddl_statements(
        settings.clickhouse.database,
        ttl_days=settings.clickhouse.ttl_days,
        rollup_ttl_days=settings.clickhouse.rollup_ttl_days,
    )
    for statement in statements:
        client.command(statement)
    return [t.name for t in TABLES] + ["gpu_1m", "gpu_1m_mv"]


def insert_messages(
    client: Any,
    settings: Settings,
    messages: Iterable[GuardMessage],
    dedup_token: str | None = None,
) -> dict[str, int]:
    """Insert messages as rows, one batch per table. Returns rows written per table.

    With ``dedup_token`` (e.g. the Kafka offsets the batch came from), retrying the same
    batch is a no-op instead of a second copy.
    """
    return insert_columns(client, settings, columns_by_table(messages), dedup_token)


def insert_columns(
    client: Any,
    settings: Settings,
    tables: Mapping[Table, tuple[int, list[list[Any]]]],
    dedup_token: str | None = None,
) -> dict[str, int]:
    """Insert rows given as columns (per table: the row count and the columns in the
    table's column order, as :func:`guard.schemas.tables.columns_by_table` or the sink's
    :func:`guard.schemas.rows.decode_columns` give them). Returns rows written per table."""
    written: dict[str, int] = {}
    database = settings.clickhouse.database
    for table, (rows, columns) in tables.items():
        if not rows:
            continue
        table_name = table.name
        settings_arg: dict[str, Any] = {}
        if dedup_token is not None:
            token = hashlib.blake2b(f"{dedup_token}/{table_name}".encode(), digest_size=16)
            settings_arg = {
                "insert_deduplicate": 1,
                "insert_deduplication_token": token.hexdigest(),
                "deduplicate_blocks_in_dependent_materialized_views": 1,
            }
        client.insert(  # columns, not rows: no tuple per row and no pivot in the client
            f"`{database}`.`{table_name}`",
            columns,
            column_names=table.column_names,
            column_type_names=table.column_type_names,  # ours: no DESCRIBE per insert
            column_oriented=True,
            settings=settings_arg,
        )
        written[table_name] = rows
    return written


def _safe(dsn: str) -> str:
    if "@" in dsn and "://" in dsn:
        scheme, rest = dsn.split("://", 1)
        return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"
    return dsn
