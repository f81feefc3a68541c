"""Sweep orchestrator: policy, node-state machine, scheduler adapters, sweep checks, webhook."""
