"""llmq's own CPU kernels (cpu_kernels.cpp), where PyTorch's CPU operations, not the bytes read, set a small model's
decode step (docs/serve.md#cpu-kernels says what each computes; docs/performance.md what they measured):

- `lowbit_linear` (AVX512-VNNI, opt-in: EngineConfig.int8_activations): INT4 / INT8 weight-only products with each
  row's activations rounded to int8 per block of 32 inputs (quant.quantize_blocks), as llama.cpp's Q4_0 x Q8_0 are,
  summed on integers; the rounding is an approximation beyond the weights', hence opt-in. `reference` is its float64
  arithmetic.
- `lowbit_linear_bf16` (default; INT4 / INT5: AVX2, INT8: AVX-512): the same packed weights times bfloat16(x),
  float32 sums: PyTorch's INT4 / INT8 kernels' numbers up to summation order; on AMX where Linux grants the tile
  state (arch_prctl, not cpuid: a VM may advertise AMX and fault), scaled weights split exactly into bfloat16 hi +
  lo. Without AVX512-BF16, INT4 / INT5 run on AVX2 + FMA loops over the same tiles (a row at a time; from 6 rows the
  weight dequantized a chunk at a time on the BLAS): INT5 had no kernel there, and PyTorch's INT4 one is slower at
  batch 1 (docs/performance.md). Layers whose scales or zero points PyTorch's kernels would round keep those kernels.
  LLMQ_AMX=0 turns AMX off.
- `q4k_linear` (AVX512-BF16, or lowbit_linear_bf16's AVX2 loops): GGML's Q4_K (unsigned codes in the INT4 tiles,
  float32 scale and min per 32 inputs) times bfloat16(x), float32 sums: the reference layer's product up to x's
  rounding; on AMX from 16 rows, each weight s u - m (float32) split exactly into three bfloat16.
- `fp8_linear` (AVX512-VBMI, -BF16): block FP8 (W8A8) bytes in the INT8 tiles decoded exactly by table lookups,
  times the activations rounded to E4M3 per row and group in the kernel (`fp8_token_groups`:
  quant.quantize_token_groups' numbers), every product exact in bfloat16: the reference layer's product from the
  packed bytes.
- `table_linear` (AVX-512): bitsandbytes' NF4 / FP4 codes in the INT4 tiles looked up in their 16-value table, times
  the block absmax, rounded to the checkpoint's dtype per weight: bitsandbytes' dequantized weight, float32 sums; on
  AMX where the weights and x split exactly into at most three bfloat16 products a step (bfloat16 weights or x).
  GGML's IQ4_XS / IQ4_NL run on it too: their table, their float32 steps per 32 inputs, no rounding (every product
  exact).
- `fp4_linear` (AVX-512, or AVX2 loops like lowbit_linear_bf16's): NVFP4 / MXFP4 codes in the INT4 tiles decoded
  exactly by a 16-entry table, float32 sums: the dense FP4 path's numbers from the packed bytes.
- `rms_norm`, `rope_kv_write`, `decode_attention` (paged K/V read in place), `silu_mul`, `gated_delta_decode` (a
  Gated DeltaNet layer's decodes between its projections), `delta_prefill` (its prefill chunks, token by token): one
  pass each where PyTorch dispatches several operations; the same arithmetic as norm.py / rotary.py / attention.py /
  models/linear_attention.py.
- `dense16_linear` (AVX-512): a 16-bit weight as stored times float32 activations, F.linear's numbers on the float32
  cast without a float32 copy.
- `DecoderStack`: consecutive decode-only layers in one call, the same kernels in DecoderLayer's order (its
  Python side: stack.py).

Packed low-bit weight (`pack`): unsigned codes u (INT4: q + 8 when q is signed, INT8: q + 128), value (u - z) * s, in
tiles of 16 output rows; INT8 holds 4 inputs of a row per 32-bit lane, INT4 8 (low nibbles inputs 0-3, high 4-7). s
per (tile, group, row) in bfloat16 where that is exact, else float32; s * z likewise, or nothing where every z is the
codes' offset 2^(bits - 1).

Built on first use by PyTorch's extension builder (cpp_build.py: cached by the source's hash, a killed build
harmless). Where the build fails, or another process's build outlasts BUILD_WAIT seconds, the layers keep PyTorch's
operations (one warning); LLMQ_CPU_KERNELS=0 keeps them too.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

from ... import quant
from . import cpp_build

BLOCK = 32  # inputs per activation scale
TILE = 16  # output rows per packed tile
_VNNI = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
FP8_FLAGS = frozenset({"avx512bw", "avx512vbmi", "avx512_bf16"})   # fp8_linear's
AVX2 = frozenset({"avx2", "fma"})   # the INT4-tile products' loops without AVX512-BF16
BUILD_WAIT = 600.0  # seconds to wait for another process's build (one takes ~15-25 s on 2 cores)
log = logging.getLogger(__name__)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere); read once, not once a layer."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return next((frozenset(line.split(":", 1)[1].split()) for line in text.splitlines() if line.startswith("flags")),
                frozenset())


@functools.cache
def available() -> bool:
    """Whether the kernels are built and loaded here (built at most once a process)."""
    if os.environ.get("LLMQ_CPU_KERNELS", "1") == "0" or not _build():
        return False
    for name, fake in (("lowbit_linear", _fake_linear), ("lowbit_linear_bf16", _fake_linear_bf16),
                       ("dense16_linear", _fake_dense16), ("q4k_linear", _fake_q4k),
                       ("fp8_linear", _fake_fp8), ("table_linear", _fake_table),
                       ("rms_norm", _fake_same), ("silu_mul", _fake_half), ("decode_attention", _fake_same),
                       ("rope_kv_write", _fake_rope)):
        torch.library.register_fake(f"llmq_cpu::{name}")(fake)
    amx(os.environ.get("LLMQ_AMX", "1") != "0")
    return True


def amx(enable: bool) -> bool:
    """Turn on or off the products' AMX-BF16 path (INT4 / INT8 / FP4 / bfloat16 / float16 weights from 10 / 8 / 12 /
    12 / 16 rows, where Linux grants the tile state); whether it is on now. LLMQ_AMX=0 starts a process with it off,
    for comparing the two paths."""
    return bool(torch.ops.llmq_cpu.amx(enable))


def avx2_only(force: bool) -> bool:
    """Make lowbit_linear_bf16 (INT4 / INT5), q4k_linear, fp4_linear, fp8_linear and table_linear take their AVX2 loops
    (what CPUs without AVX-512 run) on a CPU that has it too, for comparing the two paths on one machine; returns the
    setting."""
    return bool(torch.ops.llmq_cpu.avx2_only(force))


def _build(wait: float = BUILD_WAIT) -> bool:
    """Build (or find built) and load the extension; False, with one warning, where that fails."""
    try:
        cpp_build.load("llmq_cpu_kernels", Path(__file__).with_suffix(".cpp"), ["-O3", "-fopenmp"], wait)
    except Exception as e:  # a missing compiler / ninja, a failed build, a build elsewhere too long: PyTorch's ops stay
        lines = str(e).splitlines() or [type(e).__name__]
        log.warning("llmq: its CPU kernels could not be built (%s); using PyTorch's operations",
                    next((x for x in lines if "error:" in x.lower()), lines[0])[:300])
        return False
    return True


def _fake_linear(x, w, s, sz, bits, group, eps):
    return x.new_empty(x.shape[0], s.shape[0] * TILE, dtype=torch.float32)


def _fake_linear_bf16(x, w, s, bits, group):
    return x.new_empty(x.shape[0], s.shape[0] * TILE, dtype=torch.float32)


def _fake_q4k(x, w, s, mins, group):
    return x.new_empty(x.shape[0], s.shape[0] * TILE, dtype=torch.float32)


def _fake_fp8(x, w, s, group, eps):
    return x.new_empty(x.shape[0], s.shape[0] * TILE, dtype=torch.float32)


def _fake_table(x, w, s, table, group, round):
    return x.new_empty(x.shape[0], s.shape[0] * TILE, dtype=torch.float32)


def _fake_dense16(x, w):
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)


def _fake_same(x, *args):
    return torch.empty_like(x)


def _fake_half(gu):
    return gu.new_empty(gu.shape[0], gu.shape[1] // 2)


def _fake_rope(qkv, cos, sin, k_cache, v_cache, slots, h, hkv):
    d = qkv.shape[1] // (h + 2 * hkv)
    return [qkv.new_empty(qkv.shape[0], h, d), qkv.new_empty(qkv.shape[0], hkv, d)]


def usable(t: torch.Tensor) -> bool:
    """Whether the kernels serve this tensor's device; not inside a compiled graph (inductor fuses the PyTorch
    operations there itself, and a cached availability check is nothing dynamo should trace)."""
    return t.device.type == "cpu" and not torch.compiler.is_compiling() and available()


def lowbit_fits(n: int, k: int, group: int, bits: int, int8_activations: bool) -> bool:
    """Whether a [n, k] weight in groups of `group` inputs (k: per channel) can take the low-bit kernels here:
    lowbit_linear (INT4 / INT8, int8 activations, AVX512-VNNI) or lowbit_linear_bf16 (INT4 / INT5: AVX512-BF16 or
    the AVX2 + FMA loops, INT8: AVX-512)."""
    shape = n % TILE == 0 and k % BLOCK == 0 and group % BLOCK == 0 and k % group == 0
    flags = cpu_flags()
    bf16 = {"avx512bw", "avx512_bf16"} <= flags or AVX2 <= flags if bits in (4, 5) else "avx512bw" in flags
    return shape and (bits != 5 and set(_VNNI) <= cpu_flags() if int8_activations else bf16)


def fp4_fits(n: int, k: int, group: int) -> bool:
    """Whether an FP4 weight [n, k] in blocks of `group` takes fp4_linear here (a CPU with AVX-512 or AVX2 + FMA, the
    kernels built)."""
    flags = cpu_flags()
    return n % TILE == 0 and group % 8 == 0 and k % group == 0 and ("avx512bw" in flags or AVX2 <= flags) and \
        available()


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes, s, s * z or empty) in the kernels' layout for q [N, K] with scale / zero [N, G] (value
    (q - zero) * scale)."""
    n, g = scale.shape
    offset = 1 << (bits - 1) if int(q.min()) < 0 else 0
    z = offset + (zero.float() if zero is not None else torch.zeros(n, g))
    scale = scale.float()
    sz = torch.empty(0) if bool((z == 1 << (bits - 1)).all()) else _tiles(scale * z)
    u = q.to(torch.int32) + offset
    if int(u.min()) < 0 or int(u.max()) >= 1 << bits:
        raise ValueError(f"cpu_kernels.pack: codes outside {bits} bits")
    return pack_codes(u, bits), pack_scales(scale), sz


def pack_codes(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes u [N, K] (INT8: 0-255, INT5: 0-31, INT4 / FP4: 0-15) in the kernels' tiles, flat uint8."""
    n, k = u.shape
    u = u.to(torch.uint8)
    if bits == 5:   # per 32 inputs: the fifth bits (64 bytes), then the low nibbles as INT4 tiles (256)
        nibbles = pack_codes(u & 15, 4).view(n // TILE, k // 32, 256)
        fifth = (u >> 4).to(torch.int64).view(n // TILE, TILE, k // 32, 4, 8)   # [tile, row, block, chunk, input]
        word = (fifth << _FIFTH_BIT).sum((-1, -2))                              # one 32-bit word a row and block
        words = ((word.unsqueeze(-1) >> torch.tensor([0, 8, 16, 24])) & 255).to(torch.uint8).transpose(1, 2)
        return torch.cat([words.reshape(n // TILE, k // 32, 64), nibbles], -1).contiguous().view(-1)
    if bits == 4:
        u = u.view(n, k // 8, 2, 4)
        u = u[:, :, 0] | (u[:, :, 1] << 4)  # [N, K/8, 4]: a byte holds input j (low nibble) and j + 4 (high)
        codes = u.view(n // TILE, TILE, k // 8, 4).permute(0, 2, 1, 3)
    else:
        codes = u.view(n // TILE, TILE, k // 4, 4).permute(0, 2, 1, 3)
    return codes.contiguous().view(-1)


# where cpu_kernels.cpp's int5_pairs reads input j (of 8) of chunk c (of 4) in a row's word of fifth bits
_FIFTH_BIT = torch.tensor([[4 + 8 * j + c if j < 4 else 8 * (j - 4) + c for j in range(8)] for c in range(4)])


def pack_scales(scale: torch.Tensor) -> torch.Tensor:
    """Per-group scales [N, G] as [N / 16, G, 16]: bfloat16 where that holds every one exactly, else float32."""
    scale = scale.float()
    exact16 = scale.to(torch.bfloat16)
    return _tiles(exact16 if torch.equal(exact16.float(), scale) else scale)


def _tiles(t: torch.Tensor) -> torch.Tensor:
    n, g = t.shape
    return t.reshape(n // TILE, TILE, g).transpose(1, 2).contiguous()


def lowbit_linear(x: torch.Tensor, codes: torch.Tensor, s: torch.Tensor, sz: torch.Tensor, bits: int,
                  group: int) -> torch.Tensor:
    """x [M, K] times the packed weight, float32 [M, N]."""
    return torch.ops.llmq_cpu.lowbit_linear(x, codes, s, sz, bits, group, quant.EPS)


def lowbit_linear_bf16(x: torch.Tensor, codes: torch.Tensor, s: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """x [M, K] times a packed symmetric INT4 / INT5 / INT8 weight with bfloat16 scales, [M, N] float32 holding
    bfloat16 values: the arithmetic of PyTorch's INT4 / INT8 kernels (bfloat16 in and out, exact products, float32
    sums)."""
    return torch.ops.llmq_cpu.lowbit_linear_bf16(x, codes, s, bits, group)



def fp4_linear(x: torch.Tensor, codes: torch.Tensor, s: torch.Tensor, group: int, divisor: float) -> torch.Tensor:
    """x [M, K] times a packed FP4 weight's exact values (E2M1 x block scale) in float32 arithmetic, divided by
    `divisor`: float32 [M, N]."""
    return torch.ops.llmq_cpu.fp4_linear(x, codes, s, group, divisor)


def q4k_fits(n: int, k: int) -> bool:
    """Whether a Q4_K weight [n, k] takes q4k_linear here (a CPU with AVX512-BF16 or AVX2 + FMA, the kernels
    built)."""
    flags = cpu_flags()
    return n % TILE == 0 and k % BLOCK == 0 and ({"avx512bw", "avx512_bf16"} <= flags or AVX2 <= flags) and \
        available()


def pack_q4k(codes: torch.Tensor, s: torch.Tensor, mins: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor]:
    """A Q4_K weight (codes [N, K] 0-15; per group of 32 its float32 step s and min, [N, K / 32]) in q4k_linear's
    layout: the INT4 tiles, scales and mins as [N / 16, K / 32, 16]."""
    return pack_codes(codes, 4), _tiles(s.float()), _tiles(mins.float())


def q4k_linear(x: torch.Tensor, codes: torch.Tensor, s: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """x [M, K] times a packed Q4_K weight (pack_q4k): bfloat16(x) times s u - m, float32 sums, [M, N] float32."""
    return torch.ops.llmq_cpu.q4k_linear(x, codes, s, mins, BLOCK)


def fp8_fits(n: int, k: int, group: int) -> bool:
    """Whether a block-FP8 weight [n, k] with `group`-input blocks (the last one may be short) takes fp8_linear here
    (a CPU with AVX512-VBMI and -BF16, or the AVX2 + FMA loops; the kernels built)."""
    flags = cpu_flags()
    return n % TILE == 0 and group % 8 == 0 and k % 8 == 0 and (FP8_FLAGS <= flags or AVX2 <= flags) and available()


def pack_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-FP8 weight (E4M3 q [N, K], float32 scale per block [ceil(N / b0), ceil(K / b1)]) in fp8_linear's
    layout: the bytes in the INT8 tiles, each row's scale per group [N / 16, ceil(K / b1), 16]."""
    rows = scale.float().repeat_interleave(block[0], 0)[:q.shape[0]]
    return pack_codes(q.view(torch.uint8), 8), _tiles(rows)


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    """x [M, K] rounded to E4M3 per row and group (fp8_token_groups) times a packed block-FP8 weight (pack_fp8):
    exact products, float32 sums, [M, N] float32."""
    return torch.ops.llmq_cpu.fp8_linear(x, codes, s, group, quant.EPS)


def fp8_token_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_linear's rounding of x [M, K]: quant.quantize_token_groups' (values as float32, scales [M, groups])."""
    return torch.ops.llmq_cpu.fp8_token_groups(x, group, quant.EPS)


def table_fits(n: int, k: int, group: int) -> bool:
    """Whether a 4-bit table weight [n, k] (bitsandbytes' NF4 / FP4, GGML's IQ4_XS) in blocks of `group` takes
    table_linear here: whole blocks a row, a CPU with AVX-512 or AVX2 + FMA + F16C, the kernels built."""
    flags = cpu_flags()
    return n % TILE == 0 and group % 8 == 0 and k % group == 0 and \
        ("avx512bw" in flags or AVX2 | {"f16c"} <= flags) and available()


_ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}   # table_linear's `round`


def table_linear(x: torch.Tensor, codes: torch.Tensor, s: torch.Tensor, table: torch.Tensor, group: int,
                 weight_dtype: torch.dtype) -> torch.Tensor:
    """x [M, K] times 4-bit codes looked up in a 16-value table (bitsandbytes' NF4 / FP4 `code`) times a float32
    scale per row and group, each weight rounded to `weight_dtype` as bitsandbytes' dequantize returns it: float32
    sums, [M, N] float32."""
    return torch.ops.llmq_cpu.table_linear(x, codes, s, table, group, _ROUNDING[weight_dtype])


def dense16_fits(dtype: torch.dtype, shape: tuple[int, ...], device) -> bool:
    """Whether dense16_linear takes a weight of this dtype and shape on this device: bfloat16 / float16 [N, K] with
    K % 16 == 0, on a CPU with AVX-512 (F and BW: the kernel's compile target) where the kernels are built."""
    return dtype in (torch.bfloat16, torch.float16) and len(shape) == 2 and shape[1] % 16 == 0 and \
        torch.device(device).type == "cpu" and "avx512bw" in cpu_flags() and not torch.compiler.is_compiling() and \
        available()


def dense16_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] times a bfloat16 / float16 weight [N, K] as stored, float32 [M, N]: F.linear on the weight cast to
    float32, reading half the bytes."""
    return torch.ops.llmq_cpu.dense16_linear(x, w)


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    """What lowbit_linear computes, in float64: activations rounded per block of 32 (quant.quantize_blocks) times
    the dequantized weight."""
    xq, d = quant.quantize_blocks(x.float(), BLOCK)
    xr = (xq.double().view(x.shape[0], -1, BLOCK) * d.double().unsqueeze(-1)).view(x.shape)
    return xr @ quant.dequantize(q, scale, zero, torch.float64).t()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.llmq_cpu.rms_norm(x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of fused gate_up rows [T, 2I] (the decoder layer's MLP activation), one pass."""
    return torch.ops.llmq_cpu.silu_mul(gate_up)


def gated_delta_decode(mixed: torch.Tensor, tails: torch.Tensor, states: torch.Tensor, slots: torch.Tensor,
                       conv: torch.Tensor, neg_rate: torch.Tensor, dt_bias: torch.Tensor, norm: torch.Tensor,
                       eps: float, key_heads: int, key_dim: int) -> torch.Tensor:
    """A Gated DeltaNet layer's decode rows from its mix projection [B, C + V + 2 Hv] (qkv, z, b, a) to its out
    projection's input [B, V] (GatedDeltaNet.forward's arithmetic), on the slots' convolution tails [slots, C, K - 1]
    and states [slots, Hv, Dk, Dv] (both updated in place)."""
    return torch.ops.llmq_cpu.gated_delta_decode(mixed, tails, states, slots, conv, neg_rate, dt_bias, norm, eps,
                                                 key_heads, key_dim)


def delta_prefill(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, tails: torch.Tensor,
                  states: torch.Tensor, slot: int, conv: torch.Tensor, key_heads: int, key_dim: int) -> torch.Tensor:
    """n tokens of one sequence through a Gated DeltaNet layer's convolution and delta rule, token after token, on
    its slot's tail and state (moved on in place): qkv [n, C], g / beta [n, Hv] float32 -> o [n, Hv, Dv] float32."""
    return torch.ops.llmq_cpu.delta_prefill(qkv, g, beta, tails, states, slot, conv, key_heads, key_dim)


def rope_kv_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, num_heads: int, num_kv_heads: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated q [T, H, D] and k [T, Hkv, D] of the fused qkv rows; k and v stored at their flat cache slots."""
    q, k = torch.ops.llmq_cpu.rope_kv_write(qkv, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads)
    return q, k


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                     mask: torch.Tensor, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D] against the cache blocks [B, n] under mask [B, n * block_size] -> [B, H, D]; sinks [H] float32:
    each head's sink logit, one more score of no value (Arch.sinks)."""
    return torch.ops.llmq_cpu.decode_attention(q, k_cache, v_cache, blocks, mask, scale, sinks)
