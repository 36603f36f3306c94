"""FP4 weight-only matmul on GPUs without FP4 tensor cores (Hopper, Ada, Ampere): Triton kernels.

The weight stays as stored (two E2M1 codes a byte, one E4M3 or E8M0 scale byte per block: 4.5 / 4.25 bits a weight)
and is decoded in registers: a code's doubled magnitude (0, 1, 2, 3, 4, 6, 8, 12) is an integer shift, its block
scale (halved) a float32 multiplier; every product is exact. One token (batch-1 decode) runs as a matrix-vector
product that sums each block's code x activation products first and scales the block sum once (a float32 reduction
order, not a rounding of the weight); more tokens decode the tile, scale it (exact in bfloat16) and multiply on the
tensor cores in the activations' dtype with float32 sums (IEEE float32 products for float32 activations, not TF32).
FP4Linear divides the float32 sums by NVFP4's global scale once, on either path. When there are too
few output tiles to fill the GPU (and for decode-sized batches always), K is split over several programs (float32
atomic adds).

Triton is imported only when this module is: the runtime imports it for a CUDA FP4 layer alone. `TRITON_INTERPRET=1`
runs the same kernels on CPU tensors (float32 activations: the interpreter's bfloat16 dot is not usable), which is
how the tests check the indexing and decoding here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _twice_e2m1(c):
    """FP4 codes (uint8, sign in bit 3) -> 2 x their E2M1 value as float32 (magnitudes 0, 1, 2, 3, 4, 6, 8, 12)."""
    c = c.to(tl.int32)
    e = (c >> 1) & 3
    m = c & 1
    mag = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0))
    return tl.where((c & 8) != 0, -mag, mag).to(tl.float32)


@triton.jit
def _half_scale(b, E8M0: tl.constexpr):
    """Block scale bytes -> half their value, float32: E8M0 biased exponents 2^(b - 128), or E4M3 (non-negative)."""
    if E8M0:
        return tl.exp2(b.to(tl.float32) - 128.0)
    b = b.to(tl.int32)
    e = (b >> 3) & 15
    m = (b & 7).to(tl.float32)
    return tl.where(e == 0, m, m + 8.0) * tl.exp2(tl.maximum(e, 1).to(tl.float32) - 11.0)  # (8 + m) 2^(e - 10) / 2


@triton.jit
def _fp4_gemv(x_ptr, w_ptr, s_ptr, y_ptr, N, K, K_SPLIT,
              GROUP: tl.constexpr, E8M0: tl.constexpr, ATOMIC: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """y[N] = x[K] . w[N, K]: each program BN rows over K_SPLIT columns."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    mn = rn < N
    acc = tl.zeros((BN,), dtype=tl.float32)
    for k0 in range(pid_k * K_SPLIT, (pid_k + 1) * K_SPLIT, BK):
        x = tl.load(x_ptr + k0 + tl.arange(0, BK)).to(tl.float32)
        packed = tl.load(w_ptr + rn[:, None] * (K // 2) + (k0 // 2 + tl.arange(0, BK // 2))[None, :],
                         mask=mn[:, None], other=0)
        v = _twice_e2m1(tl.interleave(packed & 15, packed >> 4))          # [BN, BK]: byte j holds codes 2j, 2j + 1
        sb = tl.load(s_ptr + rn[:, None] * (K // GROUP) + (k0 // GROUP + tl.arange(0, BK // GROUP))[None, :],
                     mask=mn[:, None], other=0)
        blocks = tl.sum(tl.reshape(v * x[None, :], (BN, BK // GROUP, GROUP)), axis=2)
        acc += tl.sum(blocks * _half_scale(sb, E8M0), axis=1)
    if ATOMIC:
        tl.atomic_add(y_ptr + rn, acc, mask=mn)
    else:
        tl.store(y_ptr + rn, acc, mask=mn)


@triton.jit
def _fp4_mm(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, K_SPLIT,
            GROUP: tl.constexpr, E8M0: tl.constexpr, ATOMIC: tl.constexpr, PRECISION: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """y[M, N] = x[M, K] @ w[N, K].T on the tensor cores."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    mm, mn = rm < M, rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(pid_k * K_SPLIT, (pid_k + 1) * K_SPLIT, BK):   # K and K_SPLIT are multiples of BK
        rk = k0 + tl.arange(0, BK)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=mm[:, None], other=0.0)
        packed = tl.load(w_ptr + rn[:, None] * (K // 2) + (k0 // 2 + tl.arange(0, BK // 2))[None, :],
                         mask=mn[:, None], other=0)
        v = _twice_e2m1(tl.interleave(packed & 15, packed >> 4))
        sb = tl.load(s_ptr + rn[:, None] * (K // GROUP) + (k0 // GROUP + tl.arange(0, BK // GROUP))[None, :],
                     mask=mn[:, None], other=0)
        w = tl.reshape(tl.reshape(v, (BN, BK // GROUP, GROUP)) * _half_scale(sb, E8M0)[:, :, None], (BN, BK))
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
    out = y_ptr + rm[:, None] * N + rn[None, :]
    if ATOMIC:
        tl.atomic_add(out, acc, mask=mm[:, None] & mn[None, :])
    else:
        tl.store(out, acc, mask=mm[:, None] & mn[None, :])


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8   # the interpreter: any value exercises the split
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan(m: int, n: int, k: int, sms: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, programs along K, warps) for x [m, k] @ w [n, k].T; BM 1 is the matrix-vector kernel. The
    decode-sized configurations are the fastest of a sweep on an H100 over the Llama-3-8B layer's gate_up and down
    projections (splitting K four ways won at every width there: more loads in flight); larger batches keep K whole
    unless the grid would hold under two programs an SM."""
    if m == 1:
        bm, bn, warps, ks = 1, 16, 8, (256, 128, 64, 32)
    elif m <= 16:
        bm, bn, warps, ks = 16, 64, 4, (256, 128, 64, 32)
    else:
        bm, bn, warps, ks = 64, 64, 4, (128, 64, 32)
    bk = next(b for b in ks if k % b == 0)
    chunks, split = k // bk, 1
    if m <= 16:
        split = next(s for s in (4, 2, 1) if chunks % s == 0 and chunks // s >= 2 or s == 1)
    else:
        while triton.cdiv(m, bm) * triton.cdiv(n, bn) * split < 2 * sms and chunks % (split * 2) == 0 and \
                chunks // (split * 2) >= 4:
            split *= 2
    return bm, bn, bk, split, warps


def fp4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] @ the FP4 weight [N, K] without NVFP4's global scale (packed [N, K / 2] uint8, scale bytes
    [N, K / group]) -> float32 [M, N]. K must be a multiple of 32."""
    x = x.contiguous()
    m, k = x.shape
    n = packed.shape[0]
    bm, bn, bk, split, warps = plan(m, n, k, _num_sms(x.device))
    y = (torch.zeros if split > 1 else torch.empty)((m, n), device=x.device, dtype=torch.float32)
    common = dict(GROUP=group, E8M0=scale.dtype == torch.uint8, ATOMIC=split > 1, BN=bn, BK=bk, num_warps=warps)
    if bm == 1:
        _fp4_gemv[(triton.cdiv(n, bn), split)](x, packed, scale.view(torch.uint8), y, n, k,
                                               k // split, **common)
    else:
        _fp4_mm[(triton.cdiv(m, bm), triton.cdiv(n, bn), split)](
            x, packed, scale.view(torch.uint8), y, m, n, k, k // split,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BM=bm, **common)
    return y
