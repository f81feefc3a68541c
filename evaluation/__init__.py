"""Evaluation: detectors over recorded telemetry (backtest), scoring against ground truth, and
the real public datasets. Files in, figures out: no Kafka, no ClickHouse."""
