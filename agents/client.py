"""Training-side client: per-rank step and collective timings → the local Guard agent.

Dependency-free (standard library only) so that it can be imported inside any training
loop. Each call sends one JSON datagram (a ``step`` or ``collective`` message of the wire
contract) to the agent's Unix datagram socket. Sending is non-blocking and never raises
into the training loop: when the agent is absent, its socket is full or anything else goes
wrong, the message is dropped and counted (``client.dropped``, by reason in
``client.drops``). The agent validates every datagram against ``guard.schemas`` before it
forwards it to Kafka, so a malformed call cannot poison the pipeline.

>>> client = GuardClient(job="llm-70b", rank=0, socket_path="/nonexistent/agent.sock")
>>> client.step(step=1, step_s=2.0, compute_s=1.4, dp_rank=0)
False
>>> client.dropped
1

In a PyTorch loop, :class:`TorchStepTimer` measures the compute time with CUDA events up to
the gradient synchronisation, without synchronising the device::

    timer = TorchStepTimer(GuardClient(job=os.environ["SLURM_JOB_ID"]))
    for step, batch in enumerate(loader):
        timer.start()
        loss = model(batch).loss
        loss.backward()                 # (with DDP, call timer.compute_done() in a comm hook)
        timer.compute_done()            # before the gradient all-reduce / optimizer step
        optimizer.step()
        timer.end(step)                 # reported once the GPU has passed the events
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import time
from collections import deque
from typing import Any

__all__ = ["DEFAULT_SOCKET", "GuardClient", "TorchStepTimer"]

DEFAULT_SOCKET = "/run/guard/agent.sock"
#: Largest datagram sent; a collective with more peers is sent without its peer list.
MAX_DATAGRAM = 60_000


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                continue
    return None


class GuardClient:
    """Reports timings of one rank to the local agent; never blocks, never raises.

    ``job`` defaults to ``$GUARD_JOB`` then ``$SLURM_JOB_ID``; ``rank`` to ``$RANK`` /
    ``$SLURM_PROCID``; ``gpu`` to ``$LOCAL_RANK`` / ``$SLURM_LOCALID``; the socket to
    ``$GUARD_AGENT_SOCKET`` then ``/run/guard/agent.sock``.
    """

    def __init__(
        self,
        job: str | None = None,
        rank: int | None = None,
        gpu: int | None = None,
        socket_path: str | None = None,
        node: str | None = None,
    ) -> None:
        self.job = job or os.environ.get("GUARD_JOB") or os.environ.get("SLURM_JOB_ID") or "unknown"
        env_rank = _env_int("RANK", "SLURM_PROCID")
        self.rank = rank if rank is not None else (env_rank if env_rank is not None else 0)
        self.gpu = gpu if gpu is not None else _env_int("LOCAL_RANK", "SLURM_LOCALID")
        self.socket_path = socket_path or os.environ.get("GUARD_AGENT_SOCKET") or DEFAULT_SOCKET
        self.node = node or socket.gethostname() or "localhost"
        self.sent = 0
        self.drops: dict[str, int] = {}
        self._sock: socket.socket | None = None

    @property
    def dropped(self) -> int:
        return sum(self.drops.values())

    def step(
        self,
        step: int,
        step_s: float,
        compute_s: float | None = None,
        pp_stage: int | None = None,
        dp_rank: int | None = None,
        tokens: int | None = None,
        ts: float | None = None,
    ) -> bool:
        """Report one training iteration; True if handed to the agent."""
        return self._send(
            {
                "kind": "step",
                "rank": self.rank,
                "gpu": self.gpu,
                "step": step,
                "step_s": step_s,
                "compute_s": compute_s,
                "pp_stage": pp_stage,
                "dp_rank": dp_rank,
                "tokens": tokens,
            },
            ts,
        )

    def collective(
        self,
        comm: str,
        op: str,
        seq: int,
        nbytes: int,
        arrive_ts: float,
        end_ts: float | None = None,
        peers: list[tuple[int, int, float]] | None = None,
        ts: float | None = None,
    ) -> bool:
        """Report this rank's view of one collective; ``peers``: ``(rank, bytes, seconds)``."""
        message: dict[str, Any] = {
            "kind": "collective",
            "rank": self.rank,
            "comm": comm,
            "op": op,
            "seq": seq,
            "bytes": nbytes,
            "arrive_ts": arrive_ts,
            "end_ts": end_ts,
        }
        if peers:
            message["peers"] = [{"rank": r, "bytes": b, "duration_s": d} for r, b, d in peers]
        return self._send(message, ts if ts is not None else end_ts)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    # --- internals -------------------------------------------------------------------------

    def _drop(self, reason: str) -> bool:
        self.drops[reason] = self.drops.get(reason, 0) + 1
        return False

    def _send(self, fields: dict[str, Any], ts: float | None) -> bool:
        try:
            message = {
                "kind": fields.pop("kind"),
                "v": 1,
                "ts": time.time() if ts is None else ts,
                "node": self.node,
                "job": self.job,
            }
            message.update((k, v) for k, v in fields.items() if v is not None)
            for value in message.values():
                if isinstance(value, float) and not math.isfinite(value):
                    return self._drop("not_finite")
            data = json.dumps(message, separators=(",", ":")).encode()
            if len(data) > MAX_DATAGRAM and "peers" in message:
                del message["peers"]
                data = json.dumps(message, separators=(",", ":")).encode()
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                sock.setblocking(False)
                self._sock = sock
            self._sock.sendto(data, self.socket_path)
            self.sent += 1
            return True
        except (FileNotFoundError, ConnectionRefusedError):
            return self._drop("no_agent")
        except BlockingIOError:
            return self._drop("agent_busy")
        except OSError:
            return self._drop("os_error")
        except Exception:  # never raise into the training loop
            return self._drop("bad_input")


class TorchStepTimer:
    """Step and compute time of one rank from CUDA events, reported without device syncs.

    ``compute_s`` is the GPU time from :meth:`start` to :meth:`compute_done` (call it just
    before the gradient synchronisation); ``step_s`` is the host wall time from ``start`` to
    :meth:`end`. Events are read when the GPU has passed them (``query()``), so reporting
    lags a step or two and never stalls the loop. Needs PyTorch with CUDA; without them every
    call is a no-op.
    """

    def __init__(
        self, client: GuardClient, pp_stage: int | None = None, dp_rank: int | None = None
    ):
        self.client = client
        self.pp_stage = pp_stage
        self.dp_rank = dp_rank
        try:
            import torch

            self._torch: Any = torch if torch.cuda.is_available() else None
        except Exception:
            self._torch = None
        self._pending: deque[tuple[int, Any, Any, float]] = deque(maxlen=64)
        self._start_event: Any = None
        self._compute_event: Any = None
        self._t0 = 0.0

    def start(self) -> None:
        self._report_ready()
        self._t0 = time.perf_counter()
        if self._torch is not None:
            self._start_event = self._torch.cuda.Event(enable_timing=True)
            self._start_event.record()

    def compute_done(self) -> None:
        if self._torch is not None:
            self._compute_event = self._torch.cuda.Event(enable_timing=True)
            self._compute_event.record()

    def end(self, step: int) -> None:
        step_s = time.perf_counter() - self._t0
        if self._start_event is not None and self._compute_event is not None:
            self._pending.append((step, self._start_event, self._compute_event, step_s))
        else:
            self.client.step(step=step, step_s=step_s, pp_stage=self.pp_stage, dp_rank=self.dp_rank)
        self._start_event = self._compute_event = None
        self._report_ready()

    def _report_ready(self) -> None:
        while self._pending:
            step, start, done, step_s = self._pending[0]
            try:
                if not done.query():
                    return
                compute_s = start.elapsed_time(done) / 1000.0
            except Exception:
                compute_s = None
            self._pending.popleft()
            self.client.step(
                step=step,
                step_s=step_s,
                compute_s=compute_s,
                pp_stage=self.pp_stage,
                dp_rank=self.dp_rank,
            )
