"""This machine's roofline: memory read bandwidth and matmul peak, measured once and cached per machine.

The cache (<llmq cache>/hw.json, usually ~/.cache/llmq/hw.json) is keyed by CPU model, core count and
accelerator, so a copied home directory on other hardware is measured afresh. Each measurement records the load
average it was taken under: one taken on a busy machine (peaks measured low, so every MBU against them too high) is
measured again as soon as the machine is quieter, and so is one from before the load was recorded. The offline
bench also re-measures when a figure it computes against the cache comes out impossible (see bench.offline).
"""

from __future__ import annotations

import json
import os
import platform
import time
from typing import Callable

import torch

from ..models import cache_dir, pick_device

METHOD = 2  # recorded with each measurement: 2 reads CPU memory on huge pages; entries by another method are redone


def machine_key(device: str) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    key = f"{cpu} x{os.cpu_count()}"
    if device.startswith("cuda"):
        key += f" | {torch.cuda.get_device_name(torch.device(device))}"
    return key


def _best(fn: Callable[[], object], sync: Callable[[], None], repeats: int) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


def _sync(device: torch.device) -> Callable[[], None]:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def read_bandwidth(device: str = "cpu", nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes/s of a sum over a buffer far larger than the caches (256 MiB on CPU, 2 GiB on a GPU). On CPU the buffer
    sits on huge pages, as the runtime's weights do (runtime.host_memory): on 4 KiB pages the same sum read ~40% less
    here, and an MBU against that would overstate how close a step comes to the machine."""
    dev = torch.device(device)
    nbytes = nbytes or (2 << 30 if dev.type == "cuda" else 256 << 20)
    if dev.type == "cpu":
        from ..runtime.host_memory import huge_block  # the runtime's package: imported only where it is measured

        buf = huge_block(nbytes // 4 * 4).view(torch.float32).fill_(1.0)
    else:
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
    t = _best(buf.sum, _sync(dev), repeats)
    return buf.numel() * 4 / t


def matmul_flops(dtype: torch.dtype, device: str = "cpu", n: int | None = None, repeats: int = 3) -> float:
    """FLOP/s of an n x n x n matmul (2 n^3 FLOPs); n defaults to what this device finishes in well under a second."""
    dev = torch.device(device)
    if n is None:
        n = 8192 if dev.type == "cuda" else (1024 if dtype == torch.float32 else 384)
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    t = _best(lambda: a @ b, _sync(dev), repeats)
    return 2 * n**3 / t


BUSY_LOAD = 0.5  # 1-minute load average per core above which a machine counts as busy


def load_per_core() -> float | None:
    """The 1-minute load average per core, or None where the platform has none."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (OSError, AttributeError):
        return None


def measure(device: str) -> dict:
    load = load_per_core()
    return {"device": device, "method": METHOD, "read_bandwidth": read_bandwidth(device),
            "fp32_flops": matmul_flops(torch.float32, device), "bf16_flops": matmul_flops(torch.bfloat16, device),
            "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_per_core": None if load is None else round(load, 2)}


def reusable(entry: dict) -> bool:
    """Whether a cached measurement still stands: it recorded its load, and either the machine was not busy then
    or it is at least as busy now (a peak measured under load understates the machine); and it was measured the way
    this version measures (METHOD)."""
    if "load_per_core" not in entry or entry.get("method") != METHOD:
        return False
    then, now = entry["load_per_core"], load_per_core()
    return then is None or then < BUSY_LOAD or (now is not None and now >= then)


def hardware(device: str | None = None, refresh: bool = False) -> dict:
    """The cached measurement for this machine and device, measuring (and caching) it when missing or no longer
    reusable."""
    device = pick_device(device)
    path = cache_dir() / "hw.json"
    key = machine_key(device)
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    if refresh or key not in cache or not reusable(cache[key]):
        cache[key] = measure(device)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache, indent=2))
        tmp.replace(path)
    return {"machine": key, **cache[key]}


def peak_flops(hw: dict, dtype: torch.dtype) -> float:
    """The matmul peak for the dtype the engine computes in (fp16 is taken as bf16's)."""
    return hw["fp32_flops"] if dtype == torch.float32 else hw["bf16_flops"]
