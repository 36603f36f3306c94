"""Host memory for the runtime's weights: one block on transparent huge pages, and freed heap handed back.

gather_weights (Linux, THP `madvise` or `always`): a decode step streams every weight once. On 4 KiB pages the
hardware prefetchers stop at each page boundary and every page costs a TLB miss: on the 2-core EPYC this was measured
on, one thread read a 256 MiB float32 tensor at 22 GB/s on 4 KiB pages and at 36 GB/s on 2 MiB ones (torch.sum), and
dense16_linear streamed a model's bfloat16 weights at 14.9 against 18.6 GB/s (llama.cpp's mmapped GGUFs sat on huge
page-cache pages). PyTorch's allocator advises huge pages only under THP_MEM_ALLOC_ENABLE and only for single
allocations of 2 MiB or more; a model's weights are hundreds of tensors, most of them smaller."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import itertools
import sys

import torch
from torch import nn

HUGE_PAGE = 2 << 20
_ALIGN = 64  # each tensor's start: a cache line, and the alignment every dtype's view needs
_MADV_HUGEPAGE = 14  # Linux
_TRIM_EVERY = 256 << 20


@functools.cache
def _libc(name: str):
    """A libc function by name, or None (not glibc / not Linux)."""
    if sys.platform != "linux":
        return None
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def release_free_heap() -> None:
    """Hand freed heap memory back to the OS. glibc keeps what the packing temporaries of each layer leave behind
    (1.4 GB after loading an 8B INT4 model, 25% of it); no-op where malloc_trim does not exist."""
    trim = _libc("malloc_trim")
    if trim is not None:
        trim(0)


def huge_block(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 CPU tensor of nbytes starting on a 2 MiB boundary, advised for huge pages before any
    page of it is touched (where the kernel has no THP the advice fails and it is ordinary memory)."""
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    advise = _libc("madvise")
    if advise is not None:
        advise(ctypes.c_void_p(raw.data_ptr() + start), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE)
    return raw[start:start + nbytes]


def gather_weights(module: nn.Module) -> int:
    """Move every contiguous CPU parameter and buffer of `module` into one huge_block, in module order (a layer's
    weights next to each other, as a step reads them); tensors that shared memory still do. Each old tensor is freed
    as it is moved (unless held elsewhere). Returns the bytes moved. Whatever captured the old tensors (a
    cpu_kernels.DecoderStack) must be built after this."""
    def tensors():
        for m in module.modules():
            for name, t in itertools.chain(m._parameters.items(), m._buffers.items()):
                if t is not None and t.device.type == "cpu" and t.numel() and t.is_contiguous() and not t.is_mkldnn:
                    yield m, name, t

    key = lambda t: (t.data_ptr(), t.dtype, tuple(t.shape))  # noqa: E731
    offsets: dict[tuple, int] = {}
    total = 0
    for _, _, t in tensors():
        if key(t) not in offsets:
            offsets[key(t)] = total
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    if not total:
        return 0
    block = huge_block(total)
    moved: dict[tuple, torch.Tensor] = {}
    since_trim = 0
    for m, name, t in tensors():  # the modules' dicts change values only, not keys, as they are walked
        k = key(t)
        if k not in moved:
            off = offsets[k]
            moved[k] = block[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape).copy_(t)
            since_trim += t.numel() * t.element_size()
            if since_trim > _TRIM_EVERY:  # what was moved out of the heap goes back as it goes: no 2x peak
                release_free_heap()
                since_trim = 0
        if name in m._parameters:
            m._parameters[name] = nn.Parameter(moved[k], requires_grad=False)
        else:
            m._buffers[name] = moved[k]
    return total
