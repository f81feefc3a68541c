"""GPU and NIC physics, and the GPU / NIC samples each node's agent reports every second.

A fault's effect on its GPU or NIC (slowdown, clocks, reason bits, temperatures, error
counters) is computed per tick by :meth:`HardwareModel.gpu_state`; the samples follow the
same physics plus noise from the shared noise stream, drawn in a fixed order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from guard.schemas import GpuSample, NicSample
from guard.schemas.fast import fast_builder
from guard.schemas.nvml_codes import (
    HW_POWER_BRAKE,
    HW_SLOWDOWN,
    HW_THERMAL,
    IDLE,
    SW_POWER_CAP,
    SW_THERMAL,
)
from guard.schemas.truth import ramped_slowdown

from .config import (
    BUSY_TEMP_C,
    CLOCK_BOUND,
    IDLE_TEMP_C,
    LINK_GBPS,
    MEM_CLOCK_MHZ,
    NIC_COUNTERS,
    POWER_LIMIT_W,
    SM_CLOCK_IDLE_MHZ,
    SM_CLOCK_MAX_MHZ,
    THROTTLE_TEMP_C,
)
from .config import COUNTER_INDEX as _C
from .scenario import InjectedFault, Scenario

__all__ = ["HardwareModel"]

_DEVICES = [f"mlx5_{j}" for j in range(256)]
_NETDEVS = [f"ib{j}" for j in range(256)]
_gpu_model = fast_builder(GpuSample)
_nic_model = fast_builder(NicSample)


class HardwareModel:
    """Every GPU's and NIC's physical state, and the samples the node agents report.

    Holds what changes with time (temperatures, NIC counters, ECC and PCIe replay counts)
    and draws its noise from ``noise``, in a fixed order each tick. The per-device offsets
    (temperature, power) and the sampling phases come from the planning stream.
    """

    def __init__(
        self,
        scenario: Scenario,
        plan: np.random.Generator,
        noise: np.random.Generator,
        offsets: tuple[np.ndarray, np.ndarray],
        phase: np.ndarray,
        uuids: list[list[str]],
    ) -> None:
        cfg = self.config = scenario.config
        n, g = cfg.nodes, cfg.gpus_per_node
        self.scenario = scenario
        self._noise = noise
        self._temp_offset, self._power_offset = offsets
        self._phase_l: list[float] = phase.tolist()
        self._uuids = uuids
        self._counters = np.zeros((n, g, len(NIC_COUNTERS)), dtype=np.int64)
        self._counters[:, :, _C["port_xmit_data"]] = plan.integers(10**9, 10**12, (n, g))
        self._counters[:, :, _C["port_rcv_data"]] = self._counters[:, :, _C["port_xmit_data"]]
        self._ecc_sbe = plan.poisson(0.3, (n, g)).astype(np.int64)
        self._ecc_dbe = np.zeros((n, g), dtype=np.int64)
        self._pcie = plan.poisson(0.5, (n, g)).astype(np.int64)
        self._temp = np.where(scenario.busy_mask(), BUSY_TEMP_C, IDLE_TEMP_C) + self._temp_offset
        #: hot idle nodes (scenario.plan_hot_idle), None when there are none: their steady
        #: extra temperature and power while idle
        self._hot_idle = (
            (scenario.hot_idle_c[:, None], scenario.hot_idle_w[:, None])
            if cfg.hot_idle_nodes > 0
            else None
        )
        if self._hot_idle is not None:
            self._temp += np.where(scenario.busy_mask(), 0.0, self._hot_idle[0])
        self._templates: dict[
            int, tuple[str | None, list[dict[str, Any]], list[dict[str, Any]]]
        ] = {}
        self._objects: dict[int, tuple[Any, list[Any], list[Any]]] = {}
        #: The JSONL writer's mode: one message object per device, refilled every tick
        #: (it encodes a tick before the next is built; see :meth:`_sample_objects`).
        self.reuse_samples = False

    def gpu_state(self, t: float, dt: float) -> dict[str, np.ndarray]:
        """Physical state of every GPU during [t, t + dt): slowdown, clocks, temperatures."""
        cfg = self.config
        n, g = cfg.nodes, cfg.gpus_per_node
        busy = self.scenario.busy_mask()
        temp_target = np.where(busy, BUSY_TEMP_C, IDLE_TEMP_C) + self._temp_offset
        temp_target[self.scenario.hot_nodes, :] += self.scenario.hot_extra
        if self._hot_idle is not None:
            temp_target += np.where(busy, 0.0, self._hot_idle[0])
        s = {
            "busy": busy,
            "slow": np.zeros((n, g)),
            "reasons": np.where(busy, 0, IDLE).astype(np.int64),
            "power_limit": np.full((n, g), POWER_LIMIT_W),
            "power_factor": np.ones((n, g)),
            "link_slow": np.zeros((n, g)),
            "speed": np.full((n, g), LINK_GBPS),
            "link_down": np.zeros((n, g), dtype=bool),
            "xid": np.zeros((n, g), dtype=np.int64),
            "err_rate": np.zeros((n, g)),
            "flapped": np.zeros((n, g), dtype=np.int64),
            "dbe": np.zeros((n, g), dtype=np.int64),
        }
        mid = t + dt / 2
        for f in self.scenario.faults:
            self._fault_events(f, t, dt, s)
            if f.active(mid):
                self._fault_effect_at(f, mid, s, temp_target)
        slow, reasons = s["slow"], s["reasons"]
        # Clock faults slow compute through the clock; a silent slow GPU keeps its clock.
        clocked = (reasons & ~IDLE) != 0
        clock_ratio = np.where(clocked, 1.0 / (1.0 + slow / CLOCK_BOUND), 1.0)
        # Healthy busy GPUs touch their power limit now and then: 0x4 for a sample, -2..4 %.
        touch = busy & ~clocked & (self._noise.random((n, g)) < 0.03)
        s["clock_ratio"] = np.where(
            touch, 1.0 - self._noise.uniform(0.02, 0.04, (n, g)), clock_ratio
        )
        s["reasons"] = np.where(touch, reasons | SW_POWER_CAP, reasons)
        # Temperatures follow their targets with a ~30 s time constant.
        alpha = min(1.0, dt / 30.0)
        self._temp += alpha * (temp_target - self._temp)
        return s

    @staticmethod
    def _fault_events(f: InjectedFault, t: float, dt: float, s: dict[str, np.ndarray]) -> None:
        """Flaps, Xids and DBEs that happen in [t, t + dt); a flapped link is down 2.5 s."""
        k, i, j = f.kind, f.node, f.gpu
        mid = t + dt / 2
        for ev in f.events:
            if t <= ev < t + dt:
                if k == "link_flap":
                    s["flapped"][i, j] += 1
                else:
                    s["xid"][i, j] = f.detail["xid"]
                    if k == "ecc_dbe":
                        s["dbe"][i, j] += 1
            if k == "link_flap" and ev <= mid < ev + 2.5:
                s["link_down"][i, j] = True

    @staticmethod
    def _fault_effect_at(
        f: InjectedFault, mid: float, s: dict[str, np.ndarray], temp_target: np.ndarray
    ) -> None:
        """What an active fault does to its GPU or NIC at ``mid``."""
        k, i, j = f.kind, f.node, f.gpu
        slow, reasons, link_slow = s["slow"], s["reasons"], s["link_slow"]
        on_busy = s["busy"][i, j]
        if k == "thermal_throttle":
            on = True
            if f.pattern == "intermittent":
                period = f.detail["on_s"] + f.detail["off_s"]
                on = (mid - f.onset) % period < f.detail["on_s"]
            # Heats up over ~2 minutes; throttles once past the slowdown temperature.
            warm = min(1.0, (mid - f.onset) / 120.0)
            if on and on_busy:
                temp_target[i, j] = max(temp_target[i, j], f.detail["temp_c"] * (0.9 + 0.1 * warm))
                if warm >= 1.0 or temp_target[i, j] >= THROTTLE_TEMP_C:
                    slow[i, j] = max(slow[i, j], f.slowdown)
                    reasons[i, j] |= SW_THERMAL | (HW_THERMAL if f.slowdown > 0.15 else 0)
            elif on_busy:
                temp_target[i, j] = max(temp_target[i, j], THROTTLE_TEMP_C - 6)
        elif k == "power_cap":
            s["power_limit"][i, j] = f.detail["power_limit_w"]
            if on_busy:
                slow[i, j] = max(slow[i, j], f.slowdown)
                reasons[i, j] |= SW_POWER_CAP
        elif k == "power_brake":
            if on_busy:
                slow[i, j] = max(slow[i, j], f.slowdown)
                reasons[i, j] |= HW_POWER_BRAKE | HW_SLOWDOWN
                s["power_factor"][i, j] = 0.55
        elif k == "slow_gpu":
            level = ramped_slowdown(f.slowdown, f.onset, f.detail.get("ramp_s"), mid)
            slow[i, j] = max(slow[i, j], level)  # silent: nothing else changes
        elif k == "degraded_nic":
            link_slow[i, j] = max(link_slow[i, j], f.slowdown)
            s["err_rate"][i, j] = f.detail["symbol_errors_per_s"]
        elif k == "host_slow":
            # The host feeds its GPUs late: every busy GPU of the node does its step's work
            # slower, at full clocks, no reason bits, normal power (silent on the GPU side).
            node_busy = s["busy"][i, :]
            slow[i, node_busy] = np.maximum(slow[i, node_busy], f.slowdown)
        elif k == "nic_reduced_speed":
            s["speed"][i, j] = f.detail["speed_gbps"]
            link_slow[i, j] = max(link_slow[i, j], f.slowdown)

    def samples(
        self, t: float, dt: float, s: dict[str, np.ndarray], out: list[tuple[float, Any]] | None
    ) -> None:
        """Advance the GPUs' and NICs' readings by one tick; with ``out``, add the samples."""
        readings = self._advance_gpus(dt, s)
        self._advance_nics(t, dt, s)
        if out is not None:
            self._sample_messages(t, dt, s, readings, out)

    def _advance_gpus(self, dt: float, s: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This tick's GPU readings (temperature, clocks, power, utilisation), error counters."""
        cfg = self.config
        n, g = cfg.nodes, cfg.gpus_per_node
        noise = self._noise
        busy = s["busy"]
        clock_ratio = s["clock_ratio"]
        temp = self._temp + 0.4 * noise.standard_normal((n, g))
        sm = np.where(busy, SM_CLOCK_MAX_MHZ * clock_ratio, SM_CLOCK_IDLE_MHZ)
        sm = np.round(sm / 15.0) * 15.0  # NVML reports clocks in 15 MHz steps on H100
        base_power = np.where(
            busy, 0.86 * POWER_LIMIT_W * self._power_offset, 72.0 + 4 * self._power_offset
        )
        if self._hot_idle is not None:
            base_power = base_power + np.where(busy, 0.0, self._hot_idle[1])
        power = base_power * (clock_ratio**1.5) * s["power_factor"] + 6.0 * noise.standard_normal(
            (n, g)
        )
        power = np.minimum(power, s["power_limit"] - 1.0 * noise.random((n, g)))
        power = np.maximum(power, 50.0)
        util = np.where(busy, np.minimum(100.0, 97.0 + 3.0 * noise.random((n, g))), 0.0)
        mem_util = np.where(busy, 38.0 + 6.0 * noise.random((n, g)), 0.0)
        self._ecc_sbe += (noise.random((n, g)) < 0.0002) + s["dbe"] * 3
        self._ecc_dbe += s["dbe"]
        self._pcie += noise.random((n, g)) < 0.0005
        return {"temp": temp, "sm": sm, "power": power, "util": util, "mem_util": mem_util}

    def _advance_nics(self, t: float, dt: float, s: dict[str, np.ndarray]) -> None:
        """Add this tick's traffic, congestion and error counts to the NIC counters."""
        cfg = self.config
        n, g = cfg.nodes, cfg.gpus_per_node
        noise = self._noise
        busy = s["busy"]
        comm = self.scenario.comm_factor(t)
        c = self._counters
        traffic = np.where(busy, 2.5e9, 2.0e6) * dt / (1.0 + s["link_slow"])  # 4-byte words
        traffic = traffic * (0.9 + 0.2 * noise.random((n, g))) / comm
        words = traffic.astype(np.int64)
        c[:, :, _C["port_xmit_data"]] += words
        c[:, :, _C["port_rcv_data"]] += words
        congested = comm > 1.0
        wait_rate = np.where(busy, 2e3, 5.0) * (40.0 if congested else 1.0)
        ecn_rate = np.where(busy, 3.0, 0.0) * (200.0 if congested else 1.0)
        fabric = self.scenario.fabric
        if fabric is not None:  # a NIC whose connection shares a hot link: back-pressure
            excess = fabric.nic_excess(self.scenario.jobs, t)
            wait_rate = wait_rate * (1.0 + 20.0 * excess)
            ecn_rate = ecn_rate * (1.0 + 100.0 * excess)
        c[:, :, _C["port_xmit_wait"]] += noise.poisson(wait_rate * dt)
        c[:, :, _C["np_ecn_marked_roce_packets"]] += noise.poisson(ecn_rate * dt)
        c[:, :, _C["rp_cnp_handled"]] += noise.poisson(ecn_rate * dt * 0.8)
        err = s["err_rate"]
        if err.any():
            c[:, :, _C["symbol_error"]] += noise.poisson(err * dt)
            c[:, :, _C["port_rcv_errors"]] += noise.poisson(err * dt * 0.2)
            c[:, :, _C["out_of_sequence"]] += noise.poisson(err * dt * 0.5)
            c[:, :, _C["packet_seq_err"]] += noise.poisson(err * dt * 0.2)
            c[:, :, _C["local_ack_timeout_err"]] += noise.poisson(err * dt * 0.05)
            c[:, :, _C["link_error_recovery"]] += noise.poisson(err * dt * 0.002)
        c[:, :, _C["symbol_error"]] += noise.random((n, g)) < 1e-5  # healthy links: rare BER hits
        flapped = s["flapped"]
        if flapped.any():
            c[:, :, _C["link_downed"]] += flapped
            c[:, :, _C["link_error_recovery"]] += flapped
        for node, reset_ts in self.scenario.restarts:
            if t <= reset_ts < t + dt:
                c[node, :, :] = 0
                self._pcie[node, :] = 0

    def _sample_messages(
        self,
        t: float,
        dt: float,
        s: dict[str, np.ndarray],
        readings: dict[str, np.ndarray],
        out: list[tuple[float, Any]],
    ) -> None:
        """Every node's GPU and NIC samples of this tick (less the gaps), keyed by arrival."""
        g = self.config.gpus_per_node
        c = self._counters
        rows = zip(
            np.round(readings["temp"], 0).tolist(),
            np.round(readings["power"], 1).tolist(),
            s["power_limit"].tolist(),
            readings["sm"].tolist(),
            np.round(readings["util"], 0).tolist(),
            np.round(readings["mem_util"], 0).tolist(),
            s["reasons"].tolist(),
            self._ecc_sbe.tolist(),
            self._ecc_dbe.tolist(),
            self._pcie.tolist(),
            s["xid"].tolist(),
            s["speed"].tolist(),
            (~s["link_down"]).tolist(),
            c.tolist(),
            strict=True,
        )
        job_of = self.scenario.job_of_node()
        gaps = {node for node, start, end, _ in self.scenario.gaps if start <= t + dt and end > t}
        ooo = {node for node, start, end, _ in self.scenario.ooo if start <= t + dt and end > t}
        gpus = range(g)
        offsets = self.scenario.offset_list
        for i, row in enumerate(rows):
            temp_r, power_r, limit_r, sm_r, util_r, mem_r, reasons_r = row[:7]
            sbe_r, dbe_r, pcie_r, xid_r, speed_r, up_r, counters_r = row[7:]
            ts_node = t + self._phase_l[i] * dt
            if i in gaps and self.scenario.suppressed(i, ts_node, samples=True):
                continue
            key = ts_node + self.scenario.skew_list[i]
            ts = key + offsets[i]
            if i in ooo:
                key += self.scenario.delay(i, ts_node)
            gpu_templates, nic_templates = self._sample_templates(i, job_of.get(i))
            reuse = self.reuse_samples and i not in ooo  # late ones must not be overwritten
            if reuse:
                gpu_objects, nic_objects = self._sample_objects(i, gpu_templates, nic_templates)
            for j in gpus:
                if reuse:
                    message = gpu_objects[j]
                    d = message.__dict__
                    d["xid"] = None
                else:
                    d = gpu_templates[j].copy()
                    message = _gpu_model(d)
                d["ts"] = ts
                d["temp_c"] = temp_r[j]
                d["power_w"] = power_r[j]
                d["power_limit_w"] = limit_r[j]
                d["sm_clock_mhz"] = sm_r[j]
                d["util_pct"] = util_r[j]
                d["mem_util_pct"] = mem_r[j]
                d["clock_event_reasons"] = reasons_r[j]
                d["ecc_sbe_total"] = sbe_r[j]
                d["ecc_dbe_total"] = dbe_r[j]
                d["pcie_replay_total"] = pcie_r[j]
                if xid_r[j]:
                    d["xid"] = xid_r[j]
                out.append((key, message))
            for j in gpus:
                if reuse:
                    message = nic_objects[j]
                    d = message.__dict__
                    d["counters"].update(zip(NIC_COUNTERS, counters_r[j], strict=True))
                else:
                    d = nic_templates[j].copy()
                    message = _nic_model(d)
                    d["counters"] = dict(zip(NIC_COUNTERS, counters_r[j], strict=True))
                d["ts"] = ts
                d["link_up"] = up_r[j]
                d["speed_gbps"] = speed_r[j]
                out.append((key, message))

    def _sample_objects(
        self, node: int, gpu_templates: list[dict[str, Any]], nic_templates: list[dict[str, Any]]
    ) -> tuple[list[Any], list[Any]]:
        """Writer mode: one GPU and one NIC message object per device, refilled every tick
        (the writer encodes a tick before the next is built, so nothing sees the change)."""
        cached = self._objects.get(node)
        if cached is not None and cached[0] is gpu_templates:
            return cached[1], cached[2]
        gpu = [_gpu_model(t.copy()) for t in gpu_templates]
        nic = [_nic_model({**t, "counters": {}}) for t in nic_templates]
        self._objects[node] = (gpu_templates, gpu, nic)
        return gpu, nic

    def _sample_templates(
        self, node: int, job: str | None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The fields of a node's GPU and NIC samples that do not change every second."""
        cached = self._templates.get(node)
        if cached is not None and cached[0] == job:
            return cached[1], cached[2]
        name = self.scenario.node_names[node]
        gpu = [
            {
                "kind": "gpu",
                "v": 1,
                "ts": 0.0,
                "node": name,
                "job": job,
                "gpu": j,
                "uuid": self._uuids[node][j],
                "temp_c": None,
                "temp_slowdown_c": THROTTLE_TEMP_C,
                "power_w": None,
                "power_limit_w": None,
                "sm_clock_mhz": None,
                "sm_clock_max_mhz": SM_CLOCK_MAX_MHZ,
                "mem_clock_mhz": MEM_CLOCK_MHZ,
                "util_pct": None,
                "mem_util_pct": None,
                "clock_event_reasons": None,
                "ecc_sbe_total": None,
                "ecc_dbe_total": None,
                "xid": None,
                "pcie_replay_total": None,
            }
            for j in range(self.config.gpus_per_node)
        ]
        nic = [
            {
                "kind": "nic",
                "v": 1,
                "ts": 0.0,
                "node": name,
                "job": job,
                "device": _DEVICES[j],
                "port": 1,
                "netdev": _NETDEVS[j],
                "link_up": None,
                "speed_gbps": None,
                "counters": None,
            }
            for j in range(self.config.gpus_per_node)
        ]
        self._templates[node] = (job, gpu, nic)
        return gpu, nic
