"""NIC collector over sysfs: one :class:`NicSample` per RDMA port (and per plain NIC).

Reads, under a sysfs root (``/sys`` on a host, a temporary tree in tests):

- ``class/infiniband/<dev>/ports/<port>/counters/*`` and ``hw_counters/*``: cumulative
  counters, published under their sysfs names, as they are (the detectors compute rates and
  handle resets and wrap-around);
- ``.../ports/<port>/state`` (``4: ACTIVE``) and ``rate`` (``400 Gb/sec (4X NDR)``): link up
  and speed;
- ``class/net/<netdev>/statistics/*`` of the port's netdev (found through
  ``class/infiniband/<dev>/device/net/``), merged into the same sample (names do not clash:
  ``rx_bytes`` vs ``port_rcv_data``); physical NICs without an RDMA device are published as
  ``device=<netdev>``, ``port=0``, with ``operstate`` and ``speed`` (Mb/s).

Counter files are kept open and re-read with ``pread`` at offset 0 (sysfs regenerates the
value on every read), so a cycle over 8 ports costs no ``open`` / ``close``. The tree is
re-scanned every ``rescan_s`` for hot-plugged or removed devices. A counter that cannot be
read (some ``hw_counters`` return EINVAL on some firmware) is dropped and logged once.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from guard.schemas import NicSample

__all__ = ["NicCollector"]

#: Files in the counter directories that are settings, not counters (mlx5 ``hw_counters``
#: has ``lifespan``, the counters' cache lifetime in ms).
_NOT_COUNTERS = frozenset({"lifespan"})

log = logging.getLogger(__name__)


@dataclass
class _Port:
    device: str
    port: int
    netdev: str | None
    state_path: Path | None
    rate_path: Path | None
    fds: dict[str, int] = field(default_factory=dict)  # counter name -> open fd


class NicCollector:
    """Samples every RDMA port and physical NIC found under ``root``."""

    def __init__(self, node: str, root: str | Path = "/sys", rescan_s: float = 60.0) -> None:
        self.node = node
        self.root = Path(root)
        self.rescan_s = rescan_s
        self._ports: list[_Port] = []
        self._scanned_at = -1e18
        self._bad: set[str] = set()
        self.errors = 0

    def close(self) -> None:
        for port in self._ports:
            for fd in port.fds.values():
                os.close(fd)
        self._ports = []

    @property
    def ports(self) -> list[tuple[str, int]]:
        self._maybe_rescan()
        return [(p.device, p.port) for p in self._ports]

    def sample(self, ts: float, job: str | None) -> list[NicSample]:
        self._maybe_rescan()
        out = []
        for port in self._ports:
            counters: dict[str, int] = {}
            dead: list[str] = []
            for name, fd in port.fds.items():
                value = self._read_counter(fd, port, name)
                if value is None:
                    dead.append(name)
                else:
                    counters[name] = value
            for name in dead:
                os.close(port.fds.pop(name))
            link_up, speed = self._link(port)
            out.append(
                NicSample(
                    ts=ts,
                    node=self.node,
                    job=job,
                    device=port.device,
                    port=port.port,
                    netdev=port.netdev,
                    link_up=link_up,
                    speed_gbps=speed,
                    counters=counters,
                )
            )
        return out

    # --- discovery -------------------------------------------------------------------------

    def _maybe_rescan(self) -> None:
        now = time.monotonic()
        if now - self._scanned_at < self.rescan_s:
            return
        self._scanned_at = now
        self.close()
        ib = self.root / "class" / "infiniband"
        rdma_netdevs: set[str] = set()
        for dev in _sorted_dirs(ib):
            netdevs = [p.name for p in _sorted_dirs(dev / "device" / "net")]
            rdma_netdevs.update(netdevs)
            for port_dir in _sorted_dirs(dev / "ports"):
                try:
                    number = int(port_dir.name)
                except ValueError:
                    continue
                netdev = (
                    netdevs[number - 1]
                    if 0 < number <= len(netdevs)
                    else (netdevs[0] if netdevs else None)
                )
                port = _Port(dev.name, number, netdev, port_dir / "state", port_dir / "rate")
                for sub in ("counters", "hw_counters"):
                    self._open_counters(port, port_dir / sub, "")
                if netdev:
                    self._open_counters(
                        port, self.root / "class" / "net" / netdev / "statistics", ""
                    )
                self._ports.append(port)
        for net in _sorted_dirs(self.root / "class" / "net"):
            if net.name in rdma_netdevs or not (net / "device").exists():
                continue  # virtual interfaces (lo, bridges, veth) have no device link
            port = _Port(net.name, 0, net.name, None, None)
            self._open_counters(port, net / "statistics", "")
            self._ports.append(port)

    def _open_counters(self, port: _Port, directory: Path, prefix: str) -> None:
        try:
            names = sorted(os.listdir(directory))
        except OSError:
            return
        for name in names:
            if name in _NOT_COUNTERS:
                continue
            path = directory / name
            key = prefix + name
            if key in port.fds or str(path) in self._bad:
                continue
            try:
                port.fds[key] = os.open(path, os.O_RDONLY)
            except OSError as exc:
                self._note_bad(path, exc)

    # --- reading ---------------------------------------------------------------------------

    def _read_counter(self, fd: int, port: _Port, name: str) -> int | None:
        try:
            raw = os.pread(fd, 64, 0)
            return int(raw)
        except (OSError, ValueError) as exc:
            self._note_bad(Path(port.device, str(port.port), name), exc)
            return None

    def _note_bad(self, path: Path, exc: Exception) -> None:
        self.errors += 1
        if str(path) not in self._bad:
            self._bad.add(str(path))
            log.info("NIC counter %s is unreadable (%s); skipping it", path, exc)

    def _link(self, port: _Port) -> tuple[bool | None, float | None]:
        if port.state_path is not None:
            state = _read_text(port.state_path)
            rate = _read_text(port.rate_path) if port.rate_path else None
            link_up = None if state is None else "ACTIVE" in state.upper()
            return link_up, _parse_rate_gbps(rate)
        net = self.root / "class" / "net" / (port.netdev or port.device)
        oper = _read_text(net / "operstate")
        speed = _read_text(net / "speed")
        try:
            mbps = float(speed) if speed is not None else None
        except ValueError:
            mbps = None
        return (None if oper is None else oper.strip() == "up"), (
            mbps / 1000.0 if mbps is not None and mbps > 0 else None
        )


def _sorted_dirs(path: Path) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir())
    except OSError:
        return []


def _read_text(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        with open(path) as f:
            return f.read(256).strip()
    except OSError:
        return None


def _parse_rate_gbps(text: str | None) -> float | None:
    """``"400 Gb/sec (4X NDR)"`` → 400.0; anything unreadable → None.

    >>> _parse_rate_gbps("400 Gb/sec (4X NDR)"), _parse_rate_gbps("25 Gb/sec (1X EDR)")
    (400.0, 25.0)
    >>> _parse_rate_gbps("garbage") is None
    True
    """
    if not text:
        return None
    try:
        return float(text.split()[0])
    except (ValueError, IndexError):
        return None
