"""docs/cli.md documents every command and every option the parser has."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from guard.cli import build_parser

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def _commands(parser: argparse.ArgumentParser, prefix: str = "guard") -> dict[str, list[str]]:
    """Each leaf command's full name -> its long options."""
    found: dict[str, list[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= _commands(sub, f"{prefix} {name}")
    if not found and prefix != "guard":
        found[prefix] = [
            o
            for a in parser._actions
            for o in a.option_strings
            if o.startswith("--") and o != "--help"
        ]
    return found


def test_every_command_and_option_is_in_the_cli_doc() -> None:
    text = DOC.read_text()
    sections = dict(re.findall(r"^### `(guard [^`]+)`\n(.*?)(?=^#|\Z)", text, re.M | re.S))
    commands = _commands(build_parser())
    assert len(commands) >= 18
    for command, options in commands.items():
        assert command in sections, f"docs/cli.md has no section for `{command}`"
        for option in options:
            assert option in sections[command], f"docs/cli.md: `{command}` lacks {option}"
