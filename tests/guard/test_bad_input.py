"""Bad input never shows a user a traceback: every ``guard`` command, run as the user runs it
(a subprocess), answers a bad file, a bad value or a closed pipe with one line on stderr and
exit 2 (usage) or 1 (runtime)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from guard.cli import build_parser

GUARD = [sys.executable, "-m", "guard.cli"]


def _commands() -> list[list[str]]:
    """Every command's argv prefix, nested ones (``node list``) included."""
    import argparse

    def walk(sub: argparse._SubParsersAction, prefix: list[str]) -> list[list[str]]:
        found: list[list[str]] = []
        for name, p in sub.choices.items():
            nested = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
            found += walk(nested[0], [*prefix, name]) if nested else [[*prefix, name]]
        return found

    top = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return walk(top, [])


COMMANDS = _commands()


def guard(
    *argv: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GUARD_")}
    base["GUARD_HOME"] = str(cwd / "home")
    return subprocess.run(
        [*GUARD, *argv],
        cwd=cwd,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def assert_one_line_error(done: subprocess.CompletedProcess[str], code: int, *words: str) -> None:
    err = done.stderr
    assert "Traceback" not in err, err[-3000:]
    assert done.returncode == code, (done.returncode, err[-3000:])
    # librdkafka's own log goes through Python logging (guard.kafka.LibrdkafkaLog): never its
    # raw ``%3|...|FAIL|`` lines from its threads, and Guard's error is the last line
    lines = err.strip().splitlines()
    assert not [line for line in lines if line.startswith("%")], err[-3000:]
    last = lines[-1]
    assert last.startswith("guard") and "error:" in last, err[-3000:]
    for word in words:
        assert word in last, last


def test_every_command_is_driven() -> None:
    assert len(COMMANDS) >= 20, COMMANDS
    assert ["node", "list"] in COMMANDS and ["demo"] in COMMANDS


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_a_malformed_toml_file_is_one_line_for_every_command(
    command: list[str], tmp_path: Path
) -> None:
    bad = tmp_path / "guard.toml"
    bad.write_text("[kafka\nbootstrap = \n")
    done = guard("--config", str(bad), *command, *_required(command, tmp_path), cwd=tmp_path)
    assert_one_line_error(done, 1, str(bad), "not valid TOML")


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_an_unknown_option_and_a_bad_log_level_are_usage_errors(
    command: list[str], tmp_path: Path
) -> None:
    required = _required(command, tmp_path)
    done = guard(*command, *required, "--no-such-option", cwd=tmp_path)
    assert_one_line_error(done, 2, "--no-such-option")
    done = guard(*command, *required, "--log-level", "loud", cwd=tmp_path)
    assert_one_line_error(done, 2, "--log-level", "loud")


def test_bad_config_values_are_one_line_naming_each_field(tmp_path: Path) -> None:
    config = tmp_path / "guard.toml"
    config.write_text('[kafka]\ntelemetry_partitions = -1\nsession_timeout_ms = "soon"\n')
    done = guard("config", "show", cwd=tmp_path)
    assert_one_line_error(
        done, 1, "kafka.telemetry_partitions", "(got -1)", "kafka.session_timeout_ms", "'soon'"
    )
    done = guard("config", "show", cwd=tmp_path, env={"GUARD_KAFKA_REPLICATION_FACTOR": "zero"})
    assert_one_line_error(done, 1, "kafka.replication_factor")


def test_a_config_file_that_is_not_text_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "guard.bin"
    config.write_bytes(b"\xff\xfe\x00garbage")
    done = guard("--config", str(config), "config", "show", cwd=tmp_path)
    assert_one_line_error(done, 1, str(config))


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--nodes", "-3"],
        ["demo", "--nodes", "many"],
        ["demo", "--duration", "0"],
        ["demo", "--speed", "-1"],
        ["demo", "--workers", "0"],
        ["demo", "--compression", "0"],
        ["simulate", "--nodes", "0", "--out", "t.jsonl", "--truth", "t.json"],
        ["simulate", "--duration", "nan", "--out", "t.jsonl", "--truth", "t.json"],
        ["simulate", "--gpus-per-node", "-8", "--out", "t.jsonl", "--truth", "t.json"],
        ["simulate", "--clock-offset", "-0.5", "--out", "t.jsonl", "--truth", "t.json"],
        ["simulate", "--hot-idle-nodes", "-1", "--out", "t.jsonl", "--truth", "t.json"],
        ["agent", "--interval", "0"],
        ["agent", "--simulate", "--speed", "-2"],
    ],
    ids=" ".join,
)
def test_bad_numbers_are_usage_errors_and_leave_nothing_behind(
    argv: list[str], tmp_path: Path
) -> None:
    before = set(Path(os.environ.get("TMPDIR", "/tmp")).iterdir())
    done = guard(*argv, cwd=tmp_path)
    assert_one_line_error(done, 2, argv[-1] if argv[0] != "simulate" else argv[2])
    assert not (tmp_path / "t.jsonl").exists()
    left = {p for p in set(Path(os.environ.get("TMPDIR", "/tmp")).iterdir()) - before}
    assert not {p for p in left if p.name.startswith("guard-demo")}, left


def test_config_show_into_a_closed_pipe_says_nothing_and_fails(tmp_path: Path) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GUARD_")}
    read, write = os.pipe()
    os.close(read)  # the reader is gone before guard writes (as `| head` once it has enough)
    try:
        done = subprocess.run(
            [*GUARD, "config", "show"],
            cwd=tmp_path,
            env=base,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == 1, done.stderr


def test_a_missing_broker_is_one_line(tmp_path: Path) -> None:
    env = {"GUARD_KAFKA_BOOTSTRAP": "127.0.0.1:9"}
    done = guard("node", "list", "--timeout", "2", cwd=tmp_path, env=env)
    assert_one_line_error(done, 1, "127.0.0.1:9")
    # what librdkafka said about it: formatted, a warning, once (not once per retry)
    said = [line for line in done.stderr.splitlines() if "guard.kafka.librdkafka" in line]
    assert len(said) <= 1 and all(" WARNING " in line for line in said), done.stderr
    # --log-level error: Guard's error alone
    done = guard("node", "list", "--timeout", "2", "--log-level", "error", cwd=tmp_path, env=env)
    assert_one_line_error(done, 1, "127.0.0.1:9")
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_replay_from_an_empty_store_is_one_line(tmp_path: Path, kafka_bootstrap: str) -> None:
    """A live broker, a chDB store with nothing in it: first no database at all, then Guard's
    tables but no telemetry (after `guard db migrate`)."""
    env = {"GUARD_KAFKA_BOOTSTRAP": kafka_bootstrap}
    done = guard("replay", "clickhouse", "--quiet", cwd=tmp_path, env=env)
    assert_one_line_error(done, 1, "has no Guard tables", "guard sink")
    assert guard("db", "migrate", cwd=tmp_path, env=env).returncode == 0
    done = guard("replay", "clickhouse", "--quiet", cwd=tmp_path, env=env)
    assert_one_line_error(done, 1, "holds no telemetry", "nothing to replay")
    done = guard("replay", "clickhouse", "--nodes", "node-1", "--quiet", cwd=tmp_path, env=env)
    assert_one_line_error(done, 1, "holds no telemetry for --nodes node-1", "widen")


def _required(command: list[str], tmp_path: Path) -> list[str]:
    """Arguments a command requires, so that the config is what fails, not argparse."""
    t = str(tmp_path)
    return {
        "simulate": ["--out", f"{t}/t.jsonl", "--truth", f"{t}/t.json"],
        "backtest": [f"{t}/in.jsonl", "--out", f"{t}/f.jsonl"],
        "eval": ["--truth", f"{t}/t.json", "--flags", f"{t}/f.jsonl"],
        "replay": [f"{t}/in.jsonl"],
        "report": ["--out", f"{t}/r.html"],
        "export": [f"{t}/schemas"],
        "show": ["node-1"] if command[0] == "node" else [],
        "release": ["node-1"],
        "repair": ["node-1"],
    }.get(command[-1], [])
