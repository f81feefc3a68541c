"""CPU cost of one agent sampling cycle: 8 GPUs (NVML stand-in) + 8 NIC ports (fake sysfs).

Prints the process CPU time of one cycle (collect, build the wire messages, encode them to
Kafka records; no network) and what that is as a share of one core at the default 1 Hz.
Several rounds, median reported (the machine is shared and noisy). Target: <= 0.5 %.

    .venv/bin/python benchmarks/agent_overhead.py [--cycles 300] [--rounds 7]

Caveat: the NVML stand-in is Python; real NVML calls go through ctypes into the driver and
take a few microseconds to tens of microseconds each (about 12 calls per GPU per cycle), so
on a real node add roughly 0.1-1 ms per cycle for the driver.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from guard.agents.daemon import AgentDaemon, JobTracker  # noqa: E402
from guard.agents.nic import NicCollector  # noqa: E402
from guard.agents.nvml import NvmlCollector  # noqa: E402
from guard.config import load_settings  # noqa: E402
from guard.kafka import to_record  # noqa: E402
from tests.agents.fake_sysfs import make_fake_sysfs  # noqa: E402
from tests.agents.nvml_standin import NvmlStandIn  # noqa: E402


class EncodingPublisher:
    """Does everything the real publisher does per message except the network."""

    def __init__(self) -> None:
        self.settings = load_settings()
        self.bytes = 0
        self.count = 0

    def publish(self, message: object) -> None:
        record = to_record(self.settings, message)  # type: ignore[arg-type]
        self.bytes += len(record.value)
        self.count += 1

    def poll(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        nvml = NvmlStandIn()
        gpus = NvmlCollector("node-0", nvml=nvml)
        nics = NicCollector("node-0", make_fake_sysfs(Path(tmp) / "sys"))
        publisher = EncodingPublisher()
        daemon = AgentDaemon(
            "node-0", publisher, [gpus.sample, nics.sample], JobTracker("job-a", {})
        )
        daemon.cycle()  # warm up: discovery, static values
        ports = len(nics.ports)
        per_cycle_ms = []
        for _ in range(args.rounds):
            start = time.process_time()
            for _ in range(args.cycles):
                daemon.cycle()
            per_cycle_ms.append((time.process_time() - start) / args.cycles * 1000)
        gpus.close()
        nics.close()
    median = statistics.median(per_cycle_ms)
    messages = publisher.count / (args.rounds * args.cycles + 1)
    print(
        f"cycle: 8 GPUs + {ports} NIC ports (8 rails + eth0), {messages:.0f} messages, "
        f"{publisher.bytes / publisher.count:.0f} B each"
    )
    print(
        f"CPU per cycle: median {median:.3f} ms over {args.rounds} rounds of {args.cycles} "
        f"(min {min(per_cycle_ms):.3f}, max {max(per_cycle_ms):.3f})"
    )
    print(f"share of one core at 1 Hz: {median / 10:.3f} %  (target <= 0.5 %)")


if __name__ == "__main__":
    main()
