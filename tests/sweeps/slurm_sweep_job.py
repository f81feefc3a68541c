"""Stand-in for ``guard sweep run --json --node NODE`` inside a real Slurm job (until that
command is merged): prints one ``sweep`` message built from schemas' model, with checks that
say where it ran — the host, the Slurm job, its reservation, the GPUs Slurm gave it
(``TresPerNode``) and whether it has the node to itself (``OverSubscribe``), read from inside
the job. Its ``sweep_coverage`` plays a healthy GPU node: the GPUs it "sees" are those Slurm
allocated to the job (``SLURM_GPUS_ON_NODE``), judged against ``GUARD_SWEEP_EXPECTED_GPUS``.

    slurm_sweep_job.py --node NODE [--fail]     exit 0 passed, 1 a check failed

A multi-node sweep's arguments (``--sweep multi --peers --node-rank --rendezvous``, as the Slurm
multi-node job passes them) are echoed in a ``sweep_role`` check.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

from guard.schemas import SweepCheck, SweepResult, stable_id


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--node", required=True)
    parser.add_argument("--fail", action="store_true", help="fail a check (a broken node)")
    parser.add_argument("--sweep", default="single")
    parser.add_argument("--peers", default="")
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--rendezvous", default="")
    args = parser.parse_args()
    job = os.environ.get("SLURM_JOB_ID", "")
    shown = subprocess.run(
        ["scontrol", "show", "job", "-o", job], capture_output=True, text=True, check=False
    ).stdout
    fields = dict(w.split("=", 1) for w in shown.split() if "=" in w)
    checks = [
        SweepCheck(
            name="slurm_job_host",
            passed=os.environ.get("SLURMD_NODENAME") == socket.gethostname().split(".")[0],
            detail=f"job {job} on {os.environ.get('SLURMD_NODENAME')} "
            f"reservation={fields.get('Reservation', '')} "
            f"TresPerNode={fields.get('TresPerNode', '')} "
            f"OverSubscribe={fields.get('OverSubscribe', '')}",
        ),
        SweepCheck(
            name="stand_in_check",
            value=0.0 if args.fail else 1.0,
            unit="ok",
            baseline=1.0,
            passed=not args.fail,
            detail="fails on --fail",
        ),
    ]
    if args.sweep == "multi":
        checks.append(
            SweepCheck(
                name="sweep_role",
                value=float(args.node_rank),
                passed=True,
                detail=f"rank {args.node_rank} peers {args.peers} rendezvous {args.rendezvous}",
            )
        )
    expected = int(os.environ.get("GUARD_SWEEP_EXPECTED_GPUS", "-1"))
    seen = int(os.environ.get("SLURM_GPUS_ON_NODE", "0"))
    checks.append(
        SweepCheck(
            name="sweep_coverage",
            value=seen,
            unit="gpus",
            baseline=expected if expected >= 0 else None,
            passed=seen == expected,
            detail=f"{seen} GPUs allocated by Slurm of {expected} expected",
        )
    )
    now = time.time()
    result = SweepResult(
        id=stable_id("sweep", args.node, args.sweep, now),
        ts=now,
        node=args.node,
        sweep=args.sweep,
        checks=checks,
        passed=all(c.passed for c in checks),
    )
    print(result.model_dump_json())
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
