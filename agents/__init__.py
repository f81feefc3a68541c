"""Node agent: collectors (NVML, sysfs NIC, dcgm-exporter), training-side client, simulator."""
