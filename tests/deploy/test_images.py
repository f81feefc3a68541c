"""Images by role (deploy/images/): the slim agent and what it may import.

Guard's core dependencies are the agent's whole runtime (``pip install
'guard-telemetry[agent]'``, as the agent's image does); the services' are the ``services``
extra. Here the agent runs, for real against the broker, in a process where every installed
distribution outside the core's requirement closure is refused at import (a meta-path
finder): chDB, pyarrow, pandas, plotly, faust, kubernetes and the rest; every service's command
run there says in one line how to install the extra. Then deploy/images/build.sh builds the
agent's image with Debian's buildah on a debootstrap base (installing both when missing) and
runs ``guard agent`` in it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from guard.config import Settings

from ..agents.conftest import exporter  # noqa: F401  (dcgm-exporter's recorded /metrics)
from ..agents.fake_sysfs import make_fake_sysfs
from ..agents.test_publisher import consume_topics

ROOT = Path(__file__).resolve().parents[2]
#: what the issue names, and the services' other heavy dependencies
NOT_ON_A_GPU_NODE = {"chdb", "pyarrow", "pandas", "plotly", "kubernetes", "faust", "river"}

#: Run before Guard in the child: refuse every installed top-level module whose
#: distributions are all outside ALLOWED (the agent extra's closure); the standard library
#: and Guard itself load as usual.
PRELUDE = """
import importlib.abc, importlib.metadata, re, sys
ALLOWED = {allowed!r}
OWNERS = importlib.metadata.packages_distributions()

class AgentExtraOnly(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        owners = {{re.sub(r"[-_.]+", "-", d).lower() for d in OWNERS.get(top, ())}}
        if owners and not owners & ALLOWED and top != "guard":
            raise ModuleNotFoundError(f"{{top}} is not in the agent extra", name=name)
        return None

sys.meta_path.insert(0, AgentExtraOnly())
for refused in {refused!r}:
    try:
        __import__(refused)
    except ModuleNotFoundError as exc:
        assert "not in the agent extra" in str(exc), exc
    else:
        raise SystemExit(f"{{refused}} imported: the finder does not work")
from guard.cli import main
sys.argv[0] = "guard"
raise SystemExit(main())
"""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _agent_closure() -> set[str]:
    """The distributions ``pip install 'guard-telemetry[agent]'`` brings: the core
    dependencies and the agent extra, their requirements and theirs, recursively (markers
    evaluated for this interpreter, no extras of theirs)."""
    from importlib import metadata

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    todo = [Requirement(r) for r in project["dependencies"]]
    todo += [Requirement(r) for r in project["optional-dependencies"]["agent"]]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        name = _norm(req.name)
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        for sub in metadata.requires(req.name) or []:
            todo.append(Requirement(sub))
    return seen


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # imported already by another test in this process, without a spec
        return module in sys.modules  # (faust's module has __spec__ None)


def _child(tmp_path: Path) -> list[str]:
    # those this environment has, so that refusing them means something
    refused = sorted(m for m in NOT_ON_A_GPU_NODE if _installed(m))
    assert {"chdb", "plotly", "kubernetes"} <= set(refused)
    script = tmp_path / "agent_extra_only.py"
    script.write_text(PRELUDE.format(allowed=_agent_closure(), refused=refused))
    return [sys.executable, str(script)]


def test_the_agent_extra_brings_none_of_the_services_dependencies() -> None:
    closure = _agent_closure()
    assert {"confluent-kafka", "nvidia-ml-py", "pydantic", "prometheus-client"} <= closure
    assert not closure & {_norm(m) for m in NOT_ON_A_GPU_NODE | {"chdb-core", "numpy"}}


def test_guard_agent_help_needs_only_the_agent_extra(tmp_path: Path) -> None:
    done = subprocess.run(
        [*_child(tmp_path), "agent", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "node agent" in done.stdout


#: commands of the services, each with what it needs to get past its parser
SERVICE_COMMANDS = [
    ["demo"],
    ["streams"],
    ["sink"],
    ["orchestrator"],
    ["db", "migrate"],
    ["replay", "telemetry.jsonl"],
    ["simulate", "--out", "t.jsonl", "--truth", "t.json"],
    ["agent", "--simulate", "--once", "--dry-run"],
]


@pytest.mark.parametrize("command", SERVICE_COMMANDS, ids=" ".join)
def test_a_services_command_without_the_services_extra_says_how_to_install_it(
    command: list[str], tmp_path: Path
) -> None:
    env = {
        **os.environ,
        "GUARD_KAFKA_BOOTSTRAP": f"127.0.0.1:{_free_port()}",  # nobody: nothing to wait for
        "GUARD_HOME": str(tmp_path / "home"),
    }
    done = subprocess.run(
        [*_child(tmp_path), *command],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
        env=env,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    [line] = done.stderr.strip().splitlines()
    assert line.startswith(f"guard: error: guard {command[0]} needs the services' dependencies")
    assert line.endswith("pip install 'guard-telemetry[services]'"), line


def test_the_cli_knows_every_module_of_the_services_extra() -> None:
    """guard/cli.py's import names are those of the extra's distributions, all of them."""
    from importlib import metadata

    from guard.cli import SERVICES_MODULES

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["services"]
    assert set(SERVICES_MODULES.values()) == {_norm(Requirement(r).name) for r in extra}
    owners = metadata.packages_distributions()
    for module, distribution in SERVICES_MODULES.items():
        assert distribution in {_norm(d) for d in owners.get(module, ())}, module
    assert not set(SERVICES_MODULES.values()) & _agent_closure()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except OSError:
        return 0, ""


@pytest.mark.kafka
def test_the_agent_samples_serves_and_publishes_with_only_the_agent_extra(
    kafka_settings: Settings,
    tmp_path: Path,
    exporter: str,  # noqa: F811
) -> None:
    port = _free_port()
    env = {
        **os.environ,
        "GUARD_KAFKA_BOOTSTRAP": kafka_settings.kafka.bootstrap,
        "GUARD_KAFKA_TOPIC_PREFIX": kafka_settings.kafka.topic_prefix,
        "GUARD_HOME": str(tmp_path / "home"),
        "GUARD_METRICS_HOST": "127.0.0.1",
        "GUARD_METRICS_AGENT_PORT": str(port),
    }
    command = [
        *_child(tmp_path),
        "agent",
        "--node",
        "slim-1",
        "--interval",
        "0.2",
        "--gpu-source",
        "dcgm",  # NVML needs a GPU; dcgm-exporter's recorded exposition stands in
        "--dcgm-url",
        exporter,
        "--sysfs",
        str(make_fake_sysfs(tmp_path / "sys")),
        "--socket",
        str(tmp_path / "agent.sock"),
    ]
    agent = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        cycles = 0.0
        while time.monotonic() < deadline and agent.poll() is None:
            status, text = _get(f"http://127.0.0.1:{port}/metrics")
            found = re.search(r"^guard_agent_cycles_total (\S+)$", text, re.M)
            cycles = float(found.group(1)) if found else 0.0
            if status == 200 and cycles >= 5:
                break
            time.sleep(0.3)
        assert cycles >= 5, "the agent did not sample 5 cycles in 60 s"
        assert _get(f"http://127.0.0.1:{port}/healthz")[0] == 200
    finally:
        agent.send_signal(signal.SIGTERM)
        _, stderr = agent.communicate(timeout=60)
    assert agent.returncode == 0, stderr[-3000:]
    assert "not in the agent extra" not in stderr
    # every record it published (its last line says how many), so that both kinds are in
    published = re.search(r"agent stopping: .*'published': (\d+)", stderr)
    assert published, stderr[-3000:]
    records = consume_topics(kafka_settings, ["gpu", "nic"], int(published.group(1)))
    assert len(records) == int(published.group(1))
    kinds = {r.kind for r in records}
    assert {"gpu_batch", "nic_batch"} <= kinds, kinds
    assert {r.node for r in records} == {"slim-1"}  # the exporter says h100-07: not used


# --- the image -------------------------------------------------------------------------------


@pytest.mark.timeout(1800)  # a fresh machine: buildah and debootstrap installed, the base made
def test_the_agent_image_builds_with_buildah_on_debootstrap_and_runs_the_agent() -> None:
    """deploy/images/build.sh agent: base by debootstrap (once), image by buildah (once per
    source tree), then ``guard agent --help`` and one ``--once --dry-run`` cycle in it."""
    done = subprocess.run(
        [str(ROOT / "deploy" / "images" / "build.sh"), "agent"],
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["image"].startswith("localhost/guard-agent:src-")
    # the script enforces its budget (GUARD_IMAGE_MAX_MB, 250 MB for the agent) itself
    assert 0 < report["env_mb"] < report["size_mb"] <= 250, report
    # in buildah's store (inspect: a listing of every image races other builds' cleanup)
    inspected = subprocess.run(
        ["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", report["image"]],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert inspected.returncode == 0 and inspected.stdout.strip(), inspected.stderr
