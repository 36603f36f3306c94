"""Tensor parallelism: one process per rank over torch.distributed (gloo on CPU, NCCL on CUDA); rank 0 schedules.
(LocalTPContext runs the same collectives between threads of one process, for checking shards without spawning.)

Rank 0 lives in the engine's process. Ranks 1..N-1 are spawned workers that load their own weight slice, allocate
their own KV cache and then loop: receive the step's inputs (broadcast by rank 0), run the same forward, take part
in its all-reduces, and send their lm_head vocabulary slice of the logits to rank 0, which samples.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch

from ..errors import LlmqError

INIT_TIMEOUT_S = 600


@dataclass
class TPContext:
    rank: int = 0
    world: int = 1
    vocab_parallel: bool = False  # lm_head rows split across ranks (logits gathered on rank 0)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return t

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        if self.world == 1 or not self.vocab_parallel:
            return logits if self.rank == 0 else None
        import torch.distributed as dist

        parts = [torch.empty_like(logits) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(logits.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def broadcast(self, obj):
        """Rank 0's object on every rank (the step's inputs; None tells workers to stop)."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


class LocalGroup:
    """The meeting point of ranks that are threads of one process: each collective is an exchange at a barrier."""

    def __init__(self, world: int):
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: list = [None] * world

    def exchange(self, rank: int, value) -> list:
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()   # nobody overwrites a slot before every rank has read them all
        return out


@dataclass
class LocalTPContext(TPContext):
    """TPContext over a LocalGroup: the same all-reduce (every rank sums the parts in rank order) and vocab gather."""

    group: LocalGroup | None = None

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        parts = self.group.exchange(self.rank, t.clone())
        total = parts[0].clone()
        for part in parts[1:]:
            total += part
        return t.copy_(total)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        parts = self.group.exchange(self.rank, logits)
        if self.rank:
            return None
        return torch.cat(parts, dim=-1) if self.vocab_parallel else logits

    def broadcast(self, obj):
        return self.group.exchange(self.rank, obj)[0]


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def threads_per_rank(world: int) -> int:
    """The cores this process may run on (its affinity: taskset, a container's cpuset), shared by the ranks."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // world)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(rank: int, world: int, port: int, device: torch.device) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        raise LlmqError("a torch.distributed process group already exists in this process; "
                        "run one tensor-parallel engine per process")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=INIT_TIMEOUT_S))


class WorkerGroup:
    """The spawned ranks 1..N-1 of one engine."""

    def __init__(self, world: int, load_args: dict, device: torch.device, entry):
        """entry(rank, world, port, load_args, conn) is each spawned rank's main (model_runner.worker_main)."""
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.port = free_port()
        self.procs, self.conns = [], []
        for rank in range(1, world):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=entry, args=(rank, world, self.port, load_args, child), daemon=True,
                            name=f"llmq-tp-rank{rank}")
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    def wait_ready(self) -> None:
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), 1):
            while not conn.poll(1.0):
                if not p.is_alive():
                    raise LlmqError(f"tensor-parallel rank {rank} exited (code {p.exitcode}) while loading")
            status, msg = conn.recv()
            if status != "ok":
                raise LlmqError(f"tensor-parallel rank {rank} failed to load: {msg.splitlines()[0]}")

    def stop(self, timeout: float = 30.0) -> None:
        for p in self.procs:
            p.join(timeout)
            if p.is_alive():
                p.terminate()
                p.join(5)
        self.procs = []
