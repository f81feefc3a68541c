"""The columns the store inserts are the rows of the tables, pivoted: same values, same order."""

from __future__ import annotations

from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from guard.schemas.tables import TABLE_BY_KIND, columns_by_table, rows_by_table

from .strategies import STRATEGIES


@hsettings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.one_of(*STRATEGIES.values()), min_size=1, max_size=30))
def test_columns_are_the_rows_pivoted(messages: list) -> None:
    rows = rows_by_table(messages)
    columns = columns_by_table(messages)
    assert set(columns) == set(rows)
    for table, table_rows in rows.items():
        n, data = columns[table]
        assert n == len(table_rows)
        assert len(data) == len(table.columns)
        assert data == [list(values) for values in zip(*table_rows, strict=True)]


def test_column_types_drop_only_the_codecs() -> None:
    gpu = TABLE_BY_KIND["gpu"]
    types = dict(zip(gpu.column_names, gpu.column_type_names, strict=True))
    assert types["ts"] == "DateTime64(6, 'UTC')"
    assert types["temp_c"] == "Nullable(Float32)"
    assert types["node"] == "LowCardinality(String)"
    assert all(
        "CODEC" not in t for table in TABLE_BY_KIND.values() for t in table.column_type_names
    )
