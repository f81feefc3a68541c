"""Node agent: collectors, training-side client, publisher with spool, simulator.

Modules (flat; import as ``guard.agents.<module>``):

- :mod:`~guard.agents.nvml` — GPU samples from NVML (nvidia-ml-py), Xid event thread.
- :mod:`~guard.agents.dcgm` — GPU samples from dcgm-exporter's Prometheus text.
- :mod:`~guard.agents.nic` — NIC samples from sysfs (InfiniBand / RoCE counters, netdevs).
- :mod:`~guard.agents.client` — the training-side client (standard library only) and a
  PyTorch CUDA-event step timer.
- :mod:`~guard.agents.spool` — bounded on-disk spool of Kafka records.
- :mod:`~guard.agents.publisher` — messages → Kafka, spooling while the broker is away.
- :mod:`~guard.agents.daemon` — ``guard agent``: sampling loop, client socket, job discovery.
- :mod:`~guard.agents.simulator` — fault-injecting cluster simulator (``guard simulate``,
  ``guard agent --simulate``, and in-process use by the demo and benchmarks).
- :mod:`~guard.agents.calibration` — the simulator's fault mix from the InfiniteHBD trace.

This package imports nothing at import time, so ``guard.agents.client`` stays light.
"""
