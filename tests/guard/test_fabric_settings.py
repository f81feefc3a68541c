"""The ``[fabric]`` section: a topology file reaches the engine and ``guard advise``; a bad one
fails at start with the field that is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from guard.cli import main
from guard.config import ConfigError, Settings, load_settings
from guard.detectors.core import MessageFeed
from guard.streams.processing import engine_config_of

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "topology" / "example.yaml"


def test_a_topology_file_reaches_the_engine_and_the_default_infers_one(
    tmp_path: Path, settings: Settings
) -> None:
    config = tmp_path / "guard.toml"
    config.write_text(f'[fabric]\ntopology = "{EXAMPLE}"\nnodes_per_leaf = 4\n')
    cfg = engine_config_of(load_settings(config))
    assert cfg.topology is not None and cfg.topology.name == "example-2pod"
    engine = MessageFeed(cfg)
    assert engine.fabric is not None and engine.fabric.topology is cfg.topology
    assert engine.fabric.nodes_per_leaf is None  # a file: nothing inferred
    inferred = MessageFeed(engine_config_of(settings)).fabric
    assert inferred is not None and inferred.topology is None and inferred.nodes_per_leaf == 32
    fabric = settings.fabric.fabric(["n2", "n1", "n3"])
    assert fabric.name == "inferred" and [n.name for n in fabric.nodes] == ["n1", "n2", "n3"]


def test_a_bad_topology_file_is_a_config_error_naming_the_field(
    tmp_path: Path, settings: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "fabric.json"
    bad.write_text('{"nodes": [{"name": "a", "nics": [{"rail": 0, "leaf": "l0"}]}]}')
    settings.fabric.topology = bad
    with pytest.raises(ConfigError, match=r"\[fabric\] topology: .*nodes\.0\.nics\.0\.device"):
        engine_config_of(settings)
    config = tmp_path / "guard.toml"
    config.write_text(f'[fabric]\ntopology = "{tmp_path / "missing.yaml"}"\n')
    assert main(["--config", str(config), "advise", "--every", "5"]) == 1
    assert "cannot read topology file" in capsys.readouterr().err
