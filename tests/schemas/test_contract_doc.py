"""docs/wire-contract.md is generated from the models: it fails here when the two drift."""

from __future__ import annotations

from pathlib import Path

from guard.schemas import MODELS
from guard.schemas.contract import render_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "wire-contract.md"


def test_committed_wire_contract_matches_the_models() -> None:
    assert DOC.read_text() == render_markdown(), (
        "docs/wire-contract.md is out of date: run `guard schema doc` to regenerate it"
    )


def test_every_kind_and_every_field_is_documented() -> None:
    text = render_markdown()
    for kind, model in MODELS.items():
        assert f"## `{kind}` — {model.__name__}" in text
        for name in model.model_fields:
            assert f"| `{name}` |" in text, (kind, name)


def test_guard_schema_doc_check_fails_on_a_stale_file(tmp_path: Path) -> None:
    from guard.cli import main

    assert main(["schema", "doc", "--check", str(DOC)]) == 0
    stale = tmp_path / "wire-contract.md"
    stale.write_text(DOC.read_text().replace("| `compute_s` |", "| `busy_s` |"))
    assert main(["schema", "doc", "--check", str(stale)]) == 1
    assert main(["schema", "doc", "--out", str(stale)]) == 0
    assert stale.read_text() == DOC.read_text()
