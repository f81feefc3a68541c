"""A fake sysfs tree of an 8-rail node: mlx5_0..7 (port 1, netdev ib0..7), eth0 and lo."""

from __future__ import annotations

from pathlib import Path

IB_COUNTERS = (
    "excessive_buffer_overrun_errors",
    "link_downed",
    "link_error_recovery",
    "local_link_integrity_errors",
    "port_rcv_constraint_errors",
    "port_rcv_data",
    "port_rcv_errors",
    "port_rcv_packets",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_constraint_errors",
    "port_xmit_data",
    "port_xmit_discards",
    "port_xmit_packets",
    "port_xmit_wait",
    "symbol_error",
    "VL15_dropped",
    "multicast_rcv_packets",
    "multicast_xmit_packets",
    "unicast_rcv_packets",
    "unicast_xmit_packets",
)
HW_COUNTERS = (
    "duplicate_request",
    "implied_nak_seq_err",
    "local_ack_timeout_err",
    "np_cnp_sent",
    "np_ecn_marked_roce_packets",
    "out_of_buffer",
    "out_of_sequence",
    "packet_seq_err",
    "req_cqe_error",
    "resp_cqe_error",
    "rnr_nak_retry_err",
    "roce_adp_retrans",
    "roce_slow_restart",
    "rp_cnp_handled",
    "rp_cnp_ignored",
)
NET_STATISTICS = (
    "rx_bytes",
    "rx_packets",
    "rx_errors",
    "rx_dropped",
    "rx_crc_errors",
    "tx_bytes",
    "tx_packets",
    "tx_errors",
    "tx_dropped",
    "collisions",
)


def write(path: Path, value: object) -> None:
    """Rewrite a sysfs file in place (same inode, as the kernel's values change)."""
    with open(path, "w") as f:
        f.write(f"{value}\n")


def make_fake_sysfs(root: Path, rails: int = 8) -> Path:
    for i in range(rails):
        dev = root / "class" / "infiniband" / f"mlx5_{i}"
        port = dev / "ports" / "1"
        (port / "counters").mkdir(parents=True)
        (port / "hw_counters").mkdir()
        (dev / "device" / "net" / f"ib{i}").mkdir(parents=True)
        write(port / "state", "4: ACTIVE")
        write(port / "rate", "400 Gb/sec (4X NDR)")
        for n, name in enumerate(IB_COUNTERS):
            write(port / "counters" / name, 1000 * i + n if "data" not in name else 10**12 + i)
        for name in HW_COUNTERS:
            write(port / "hw_counters" / name, 0)
        write(port / "hw_counters" / "lifespan", 10)  # a setting (ms), not a counter
        net = root / "class" / "net" / f"ib{i}"
        (net / "statistics").mkdir(parents=True)
        (net / "device").mkdir()
        write(net / "operstate", "up")
        for name in NET_STATISTICS:
            write(net / "statistics" / name, 7)
    for name, physical in (("eth0", True), ("lo", False)):
        net = root / "class" / "net" / name
        (net / "statistics").mkdir(parents=True)
        if physical:
            (net / "device").mkdir()
            write(net / "speed", 25000)
        write(net / "operstate", "up" if physical else "unknown")
        for stat in NET_STATISTICS:
            write(net / "statistics" / stat, 3)
    return root
