"""Training client: never blocks or raises without an agent; delivers through the listener."""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from guard.agents.client import GuardClient
from guard.agents.daemon import ClientListener
from guard.schemas import CollectiveTiming, StepTiming


@pytest.fixture
def sock_path(tmp_path: Path) -> Path:
    return tmp_path / "agent.sock"


@pytest.fixture
def listener(sock_path: Path) -> Iterator[ClientListener]:
    ears = ClientListener(sock_path, node="node-5").start()
    yield ears
    ears.stop()


def _drain(listener: ClientListener, count: int) -> list[object]:
    got = []
    deadline = time.monotonic() + 10
    while len(got) < count and time.monotonic() < deadline:
        try:
            got.append(listener.messages.get(timeout=0.1))
        except Exception:
            continue
    return got


def test_without_an_agent_every_call_returns_at_once_and_is_counted(sock_path: Path) -> None:
    client = GuardClient(job="j", rank=3, socket_path=str(sock_path))
    for step in range(1000):
        assert client.step(step=step, step_s=1.0, compute_s=0.7) is False
    assert client.collective("dp", "allreduce", 1, 10, 1.0, 2.0) is False
    assert client.dropped == 1001 and client.drops == {"no_agent": 1001} and client.sent == 0


def test_a_stale_socket_file_without_a_reader_is_a_drop(sock_path: Path) -> None:
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dead.bind(str(sock_path))
    dead.close()  # the file stays, nobody listens
    client = GuardClient(job="j", socket_path=str(sock_path))
    assert client.step(step=1, step_s=1.0) is False and client.drops == {"no_agent": 1}


def test_a_full_agent_socket_drops_instead_of_blocking(sock_path: Path) -> None:
    stuck = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stuck.bind(str(sock_path))  # bound, never read
    try:
        client = GuardClient(job="j", socket_path=str(sock_path))
        results = [client.step(step=i, step_s=1.0, compute_s=0.5) for i in range(5000)]
        assert results[0] is True and results[-1] is False
        assert client.drops.get("agent_busy", 0) > 0 and client.sent + client.dropped == 5000
    finally:
        stuck.close()


def test_steps_and_collectives_reach_the_agent_validated(
    listener: ClientListener, sock_path: Path
) -> None:
    client = GuardClient(job="llm-1", rank=17, gpu=1, socket_path=str(sock_path), node="pod-abc")
    assert client.step(step=42, step_s=2.01, compute_s=1.43, pp_stage=0, dp_rank=17, tokens=8192)
    assert client.collective(
        "dp0", "allreduce", 42, 2 << 30, 100.0, 100.6, peers=[(16, 1 << 28, 0.55)]
    )
    step, coll = _drain(listener, 2)
    assert isinstance(step, StepTiming) and isinstance(coll, CollectiveTiming)
    assert (step.node, step.job, step.rank, step.gpu, step.step) == ("node-5", "llm-1", 17, 1, 42)
    assert step.compute_s == 1.43 and coll.peers is not None and coll.peers[0].rank == 16
    assert coll.ts == 100.6 and coll.end_ts == 100.6


def test_bad_datagrams_are_counted_not_forwarded(listener: ClientListener, sock_path: Path) -> None:
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    for data in (
        b"\xff\xfe",
        b"{}",
        b'{"kind":"gpu","ts":1,"node":"n","gpu":0}',
        b'{"kind":"step"}',
    ):
        raw.sendto(data, str(sock_path))
    raw.close()
    GuardClient(job="j", socket_path=str(sock_path)).step(step=1, step_s=1.0)
    assert len(_drain(listener, 1)) == 1
    assert listener.invalid == 4 and listener.messages.empty()


@settings(max_examples=60, deadline=None)
@given(
    step=st.one_of(st.integers(), st.floats(), st.text(max_size=5), st.none()),
    step_s=st.one_of(st.floats(allow_nan=True), st.integers(), st.text(max_size=3)),
    peers=st.one_of(
        st.none(), st.lists(st.tuples(st.integers(), st.integers(), st.floats()), max_size=3)
    ),
)
def test_any_input_never_raises(step: object, step_s: object, peers: object) -> None:
    client = GuardClient(job="j", socket_path="/nonexistent/dir/agent.sock")
    client.step(step=step, step_s=step_s)  # type: ignore[arg-type]
    client.collective("c", "allreduce", 1, 1, math.nan, None, peers=peers)  # type: ignore[arg-type]
    assert client.dropped == 2


def test_the_torch_timer_reports_steps_even_without_cuda(
    listener: ClientListener, sock_path: Path
) -> None:
    from guard.agents.client import TorchStepTimer

    timer = TorchStepTimer(GuardClient(job="j", rank=2, socket_path=str(sock_path)), dp_rank=2)
    for step in range(3):
        timer.start()
        timer.compute_done()
        timer.end(step)
    got = _drain(listener, 3)
    assert [m.step for m in got] == [0, 1, 2]  # type: ignore[attr-defined]
    assert all(m.dp_rank == 2 and m.step_s >= 0 for m in got)  # type: ignore[attr-defined]
