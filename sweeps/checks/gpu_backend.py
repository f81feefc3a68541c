"""The GPU library boundary: timings of GEMMs, copies and all-reduces, measured with torch.

The GPU checks (:mod:`.gpu`, :mod:`.network`) compute throughputs and verdicts from what a
:class:`GpuBackend` returns — milliseconds per operation, measured with CUDA events — so
that the same check code runs on a GPU (:class:`TorchBackend`, the ``[sweeps]`` extra) and in
tests on recorded timings (a stand-in with the same methods).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

from .base import CheckError

__all__ = ["GpuBackend", "TorchBackend", "torch_backend"]


class GpuBackend(Protocol):
    def device_count(self) -> int: ...

    def gemm_ms(self, gpu: int, dtype: str, n: int, samples: int) -> list[float]:
        """Milliseconds per ``n`` x ``n`` matmul in ``dtype`` (bf16, fp16, tf32), one per sample."""
        ...

    def copy_ms(self, gpu: int, kind: str, nbytes: int, samples: int) -> list[float]:
        """Milliseconds per copy of ``nbytes`` (``kind``: d2d, h2d, d2h; pinned host memory)."""
        ...

    def burn(self, gpus: Sequence[int], stop: threading.Event) -> None:
        """GEMMs on every GPU in ``gpus`` at once until ``stop`` is set (the soak's load)."""
        ...

    def allreduce_ms(
        self, sizes: Sequence[int], samples: int, rendezvous: str, node_rank: int, nodes: int
    ) -> dict[int, list[float]]:
        """Milliseconds per all-reduce of each size over every GPU of ``nodes`` nodes."""
        ...


_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "tf32": "float32"}
_INNER = 10  # operations per timed sample: one CUDA event pair around several kernels


class TorchBackend:
    """:class:`GpuBackend` on PyTorch (CUDA events for timing, NCCL for the all-reduce)."""

    def __init__(self, torch: Any) -> None:
        self.torch = torch

    def device_count(self) -> int:
        return int(self.torch.cuda.device_count())

    def _timed(self, gpu: int, op: Any, samples: int) -> list[float]:
        cuda = self.torch.cuda
        out = []
        with cuda.device(gpu):
            for _ in range(samples):
                start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
                start.record()
                for _ in range(_INNER):
                    op()
                end.record()
                end.synchronize()
                out.append(start.elapsed_time(end) / _INNER)
        return out

    def gemm_ms(self, gpu: int, dtype: str, n: int, samples: int) -> list[float]:
        t = self.torch
        t.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
        kind = getattr(t, _DTYPES[dtype])
        a = t.randn(n, n, dtype=kind, device=f"cuda:{gpu}")
        b = t.randn(n, n, dtype=kind, device=f"cuda:{gpu}")
        c = t.empty(n, n, dtype=kind, device=f"cuda:{gpu}")
        return self._timed(gpu, lambda: t.matmul(a, b, out=c), samples)

    def copy_ms(self, gpu: int, kind: str, nbytes: int, samples: int) -> list[float]:
        t = self.torch
        dev = f"cuda:{gpu}"
        host = t.empty(nbytes, dtype=t.uint8, pin_memory=True)
        device = t.empty(nbytes, dtype=t.uint8, device=dev)
        if kind == "d2d":
            other = t.empty(nbytes, dtype=t.uint8, device=dev)
            return self._timed(gpu, lambda: other.copy_(device), samples)
        if kind == "h2d":
            return self._timed(gpu, lambda: device.copy_(host, non_blocking=True), samples)
        return self._timed(gpu, lambda: host.copy_(device, non_blocking=True), samples)

    def burn(self, gpus: Sequence[int], stop: threading.Event) -> None:
        def load(gpu: int) -> None:
            t = self.torch
            a = t.randn(8192, 8192, dtype=t.bfloat16, device=f"cuda:{gpu}")
            while not stop.is_set():
                for _ in range(20):
                    a = t.matmul(a, a).clamp_(-1, 1)
                t.cuda.synchronize(gpu)

        threads = [threading.Thread(target=load, args=(g,), daemon=True) for g in gpus]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def allreduce_ms(
        self, sizes: Sequence[int], samples: int, rendezvous: str, node_rank: int, nodes: int
    ) -> dict[int, list[float]]:
        mp = self.torch.multiprocessing.get_context("spawn")
        local = self.device_count()
        queue = mp.SimpleQueue()
        args = (list(sizes), samples, rendezvous, node_rank, nodes, local, queue)
        procs = [mp.Process(target=_allreduce_worker, args=(i, *args)) for i in range(local)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        if any(proc.exitcode != 0 for proc in procs):
            raise CheckError(
                f"an all-reduce worker failed (exit codes {[p.exitcode for p in procs]}); "
                "run with NCCL_DEBUG=WARN to see why"
            )
        result: dict[int, list[float]] = queue.get()
        return result


def _allreduce_worker(
    local_rank: int,
    sizes: list[int],
    samples: int,
    rendezvous: str,
    node_rank: int,
    nodes: int,
    local: int,
    queue: Any,
) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(local_rank)
    dist.init_process_group(
        "nccl",
        init_method=f"tcp://{rendezvous}",
        rank=node_rank * local + local_rank,
        world_size=nodes * local,
    )
    times: dict[int, list[float]] = {}
    for size in sizes:
        buf = torch.ones(size // 2, dtype=torch.bfloat16, device="cuda")
        for _ in range(2):  # warm-up: connections, buffers
            dist.all_reduce(buf)
        torch.cuda.synchronize()
        times[size] = []
        for _ in range(samples):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dist.all_reduce(buf)
            end.record()
            end.synchronize()
            times[size].append(start.elapsed_time(end))
        del buf
    dist.destroy_process_group()
    if node_rank == 0 and local_rank == 0:
        queue.put(times)


def torch_backend() -> TorchBackend | None:
    """The torch backend when torch and a CUDA device are here, else None (the CPU path)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return None
    return TorchBackend(torch)
