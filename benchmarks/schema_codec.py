"""Encode and decode rates of wire messages (messages/s, one core), medians of several runs.

Compares Guard's path (pydantic-core straight from/to bytes) with the obvious baseline
(json.loads + model_validate / model_dump + json.dumps) measured in the same run.

    .venv/bin/python benchmarks/schema_codec.py [--n 50000] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from guard.schemas import (
    CollectiveTiming,
    ConnectionStat,
    GpuSample,
    NicSample,
    StepTiming,
    decode,
    encode,
    parse_message,
)

SAMPLES = {
    "gpu": GpuSample(
        ts=1_767_225_600.123,
        node="gpu-node-0042",
        job="llm-pretrain-7",
        gpu=3,
        uuid="GPU-5f3c1d2e-8a9b-4c7d-9e0f-1a2b3c4d5e6f",
        temp_c=67.0,
        power_w=612.4,
        power_limit_w=700.0,
        sm_clock_mhz=1980.0,
        sm_clock_max_mhz=1980.0,
        mem_clock_mhz=2619.0,
        util_pct=99.0,
        mem_util_pct=41.0,
        clock_event_reasons=0,
        ecc_sbe_total=0,
        ecc_dbe_total=0,
        pcie_replay_total=0,
    ),
    "nic": NicSample(
        ts=1_767_225_600.1,
        node="gpu-node-0042",
        device="mlx5_3",
        port=1,
        netdev="ib3",
        link_up=True,
        speed_gbps=400.0,
        counters={
            "port_xmit_data": 918_273_645_123,
            "port_rcv_data": 912_345_678_901,
            "symbol_error": 0,
            "link_downed": 0,
            "link_error_recovery": 0,
            "port_rcv_errors": 0,
            "port_xmit_discards": 0,
            "port_xmit_wait": 123_456,
            "out_of_sequence": 12,
            "packet_seq_err": 0,
            "local_ack_timeout_err": 0,
            "np_ecn_marked_roce_packets": 4_567,
            "rp_cnp_handled": 3_210,
        },
    ),
    "step": StepTiming(
        ts=1_767_225_600.5,
        node="gpu-node-0042",
        job="llm-pretrain-7",
        rank=339,
        gpu=3,
        step=12_345,
        step_s=2.013,
        compute_s=1.712,
        pp_stage=0,
        dp_rank=42,
        tokens=4_194_304,
    ),
    "collective": CollectiveTiming(
        ts=1_767_225_600.5,
        node="gpu-node-0042",
        job="llm-pretrain-7",
        rank=339,
        comm="dp-0",
        op="allreduce",
        seq=98_765,
        bytes=268_435_456,
        arrive_ts=1_767_225_600.41,
        end_ts=1_767_225_600.49,
        peers=[
            ConnectionStat(rank=338, bytes=134_217_728, duration_s=0.071),
            ConnectionStat(rank=340, bytes=134_217_728, duration_s=0.072),
        ],
    ),
}


def rate(fn: Callable[[], object], n: int, runs: int) -> float:
    results = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        results.append(n / (time.perf_counter() - t0))
    return statistics.median(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=50_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(
        f"{'kind':11} {'bytes':>5} {'encode/s':>10} {'base enc/s':>10} {'decode/s':>10} "
        f"{'decode(kind)/s':>14} {'base dec/s':>10} {'dec ratio':>9}"
    )
    for kind, message in SAMPLES.items():
        raw = encode(message)
        model = type(message)
        enc = rate(lambda m=message: encode(m), args.n, args.runs)
        base_enc = rate(
            lambda m=message: json.dumps(m.model_dump(exclude_none=True)).encode(),
            args.n,
            args.runs,
        )
        dec = rate(lambda r=raw: parse_message(r), args.n, args.runs)
        dec_kind = rate(lambda r=raw, k=kind: decode(r, k), args.n, args.runs)
        base_dec = rate(lambda r=raw, m=model: m.model_validate(json.loads(r)), args.n, args.runs)
        print(
            f"{kind:11} {len(raw):5d} {enc:10,.0f} {base_enc:10,.0f} {dec:10,.0f} "
            f"{dec_kind:14,.0f} {base_dec:10,.0f} {dec / base_dec:8.2f}x"
        )


if __name__ == "__main__":
    main()
