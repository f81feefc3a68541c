"""The agent's batch records (agent.batch_records): one record per node and kind per cycle."""

from __future__ import annotations

from guard.agents.daemon import AgentDaemon, JobTracker
from guard.schemas import (
    GpuBatch,
    GpuSample,
    GuardMessage,
    NicSample,
    decode,
    encode,
    expand,
    parse_message,
)


class Recording:
    """Keeps what it is given to publish, as the encoded bytes a broker would hold."""

    def __init__(self) -> None:
        self.records: list[bytes] = []

    def publish(self, message: GuardMessage, timestamp_ms: int | None = None) -> None:
        self.records.append(encode(message))

    def poll(self) -> None:
        pass


def _gpus(ts: float, job: str | None) -> list[GuardMessage]:
    return [GpuSample(ts=ts, node="node-4", job=job, gpu=g, temp_c=55.0 + g) for g in range(8)]


def _nics(ts: float, job: str | None) -> list[GuardMessage]:
    return [
        NicSample(ts=ts, node="node-4", job=job, device=f"mlx5_{p}", port=1, counters={"x": p})
        for p in range(4)
    ]


def test_a_batching_agent_sends_one_record_per_kind_per_cycle_holding_every_sample() -> None:
    sent = {}
    for batch in (False, True):
        publisher = Recording()
        daemon = AgentDaemon("node-4", publisher, [_gpus, _nics], JobTracker("job-1"), batch=batch)
        assert daemon.cycle(ts=1767225600.0) == (2 if batch else 12)
        sent[batch] = publisher.records
    assert len(sent[True]) == 2 and len(sent[False]) == 12
    batch = decode(sent[True][0], "gpu")
    assert isinstance(batch, GpuBatch) and batch.kafka_key() == b"node-4"
    samples = [m for raw in sent[True] for m in expand(parse_message(raw))]
    assert [encode(m) for m in samples] == sent[False]
