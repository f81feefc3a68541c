"""faust stream processors and the ClickHouse sink: transport around ``guard.detectors``."""
