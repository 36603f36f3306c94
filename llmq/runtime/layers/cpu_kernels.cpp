// llmq's CPU kernels (llmq/runtime/layers/cpu_kernels.py builds and loads this file and says why each exists;
// tests/test_cpu_kernels.py checks each against the eager PyTorch code it replaces or a float64 reference).
//
// lowbit_linear: INT4 / INT8 weights x INT8 activations on AVX512-VNNI (compiled for it with target attributes, called
// only where the CPU has it):
// y[m, n] = sum_g s[n, g] * (sum_{b in g} d[m, b] * dot_b(u[n, :], xq[m, :])
//                             - z[n, g] * sum_{b in g} d[m, b] * sumq[m, b])
// with u the unsigned weight codes, xq the activations rounded per block of 32 inputs to int8 with scale d
// (absmax / 127, as llmq.quant computes it), and dot_b the exact integer dot product of block b (vpdpbusd).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/custom_class.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#define LLMQ_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma")))
#define LLMQ_AVX512 __attribute__((target("avx512f,avx512bw,fma")))  // what both kernels' targets have

namespace {

constexpr int64_t kBlock = 32;  // inputs per activation scale
constexpr int64_t kTile = 16;   // output rows per packed tile: one int32 lane each
constexpr int64_t kPairRows = 8;   // INT8 x 16-bit activations: from this many rows, tiles widened to bfloat16 pairs

// Row m of x quantized per block: xq [K] int8, d [K/32] scales, ds [K/32] = d * sum(xq of the block). The division
// and round-half-to-even of quant.quantize_blocks, 16 lanes at a time (IEEE division: the same quotients).
LLMQ_VNNI void quantize_row(const float* x, int64_t k, float eps, int8_t* xq, float* d, float* ds) {
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const __m512 v0 = _mm512_loadu_ps(x + b * kBlock), v1 = _mm512_loadu_ps(x + b * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float s = std::max(amax, eps) / 127.f;
    const __m512 sv = _mm512_set1_ps(s);
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(v0, sv), kRound));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(v1, sv), kRound));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + b * kBlock + 16), _mm512_cvtsepi32_epi8(q1));
    d[b] = s;
    ds[b] = s * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
}

LLMQ_VNNI inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

// The int32 dot products of one block of 32 inputs for the 16 rows of a tile; w advances past the block.
template <int Bits>
LLMQ_VNNI inline __m512i block_dot(const uint8_t*& w, const int8_t* xq) {
  __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
  if constexpr (Bits == 4) {  // 64 bytes = 16 rows x 8 inputs: low nibbles inputs 0-3, high nibbles 4-7
    const __m512i mask = _mm512_set1_epi8(0x0F);
    for (int s = 0; s < 4; ++s, w += 64, xq += 8) {
      _mm_prefetch(reinterpret_cast<const char*>(w) + 2048, _MM_HINT_T0);  // INT4: -14% a decode step here; INT8: +11%
      const __m512i v = _mm512_loadu_si512(w);
      a0 = _mm512_dpbusd_epi32(a0, _mm512_and_si512(v, mask), broadcast4(xq));
      a1 = _mm512_dpbusd_epi32(a1, _mm512_and_si512(_mm512_srli_epi16(v, 4), mask), broadcast4(xq + 4));
    }
  } else {  // 64 bytes = 16 rows x 4 inputs
    for (int s = 0; s < 8; s += 2, w += 128, xq += 8) {
      a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(w), broadcast4(xq));
      a1 = _mm512_dpbusd_epi32(a1, _mm512_loadu_si512(w + 64), broadcast4(xq + 4));
    }
  }
  return _mm512_add_epi32(a0, a1);
}

// 16 scales of a tile as float32: stored as float32, or as bfloat16 (uint16 bits) where that holds them exactly.
template <typename S>
LLMQ_AVX512 inline __m512 load_scales(const S* p) {
  if constexpr (std::is_same_v<S, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// One row's outputs for one tile of 16 rows. Zero points: sz (s * z per group) or, where every z is the codes'
// offset (symmetric weights), that constant: acc += s * (dot - z * sum(xq)).
template <int Bits, typename S, bool Zeros>
LLMQ_VNNI void tile_row(const uint8_t* w, const S* s, const float* sz, float zconst, const int8_t* xq, const float* d,
                        const float* dsg, int64_t k, int64_t group, float* y) {
  const int64_t groups = k / group, blocks = group / kBlock;
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 gacc = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b, xq += kBlock, ++d) {
      gacc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block_dot<Bits>(w, xq)), _mm512_set1_ps(*d), gacc);
    }
    const __m512 sg = load_scales(s + g * kTile);
    if constexpr (Zeros) {
      acc = _mm512_fmadd_ps(gacc, sg, acc);
      acc = _mm512_fnmadd_ps(_mm512_loadu_ps(sz + g * kTile), _mm512_set1_ps(dsg[g]), acc);
    } else {
      acc = _mm512_fmadd_ps(_mm512_sub_ps(gacc, _mm512_set1_ps(zconst * dsg[g])), sg, acc);
    }
  }
  _mm512_storeu_ps(y, acc);
}

template <int Bits, typename S, bool Zeros>
void tiles_rows(const at::Tensor& w, const at::Tensor& s, const at::Tensor& sz, const at::Tensor& xq,
                const at::Tensor& d, const at::Tensor& dsg, int64_t group, at::Tensor& y) {
  const int64_t m = xq.size(0), k = xq.size(1), tiles = s.size(0), groups = s.size(1), n = tiles * kTile;
  const int64_t tile_bytes = kTile * k * Bits / 8;
  const auto* wp = w.data_ptr<uint8_t>();
  const S* sp = reinterpret_cast<const S*>(s.data_ptr());
  const float* zp = Zeros ? sz.data_ptr<float>() : nullptr;
  const float zconst = 1 << (Bits - 1);
  at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      for (int64_t r = 0; r < m; ++r) {
        tile_row<Bits, S, Zeros>(wp + t * tile_bytes, sp + t * groups * kTile,
                                 Zeros ? zp + t * groups * kTile : nullptr,
                                 zconst, xq.data_ptr<int8_t>() + r * k, d.data_ptr<float>() + r * (k / kBlock),
                                 dsg.data_ptr<float>() + r * groups, k, group, y.data_ptr<float>() + r * n + t * kTile);
      }
    }
  });
}

template <int Bits>
void tiles_any(const at::Tensor& w, const at::Tensor& s, const at::Tensor& sz, const at::Tensor& xq,
               const at::Tensor& d, const at::Tensor& dsg, int64_t group, at::Tensor& y) {
  const bool bf16 = s.scalar_type() == at::kBFloat16, zeros = sz.numel() > 0;
  if (bf16 && zeros) tiles_rows<Bits, uint16_t, true>(w, s, sz, xq, d, dsg, group, y);
  else if (bf16) tiles_rows<Bits, uint16_t, false>(w, s, sz, xq, d, dsg, group, y);
  else if (zeros) tiles_rows<Bits, float, true>(w, s, sz, xq, d, dsg, group, y);
  else tiles_rows<Bits, float, false>(w, s, sz, xq, d, dsg, group, y);
}

// s: [tiles, groups, 16] float32 or bfloat16; sz: s * z in float32 of that shape, or empty where every zero point is
// the codes' offset 2^(bits - 1) (symmetric weights: half or less of the scale bytes a step reads).
at::Tensor lowbit_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, const at::Tensor& sz,
                         int64_t bits, int64_t group, double eps) {
  TORCH_CHECK(__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
              __builtin_cpu_supports("avx512vl"), "lowbit_linear needs a CPU with AVX512-VNNI");
  TORCH_CHECK(bits == 4 || bits == 8, "lowbit_linear: bits must be 4 or 8");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "lowbit_linear: x must be a 2-D CPU tensor");
  TORCH_CHECK(w.dtype() == at::kByte && (s.dtype() == at::kFloat || s.dtype() == at::kBFloat16) && s.dim() == 3 &&
              s.size(2) == kTile && w.is_contiguous() && s.is_contiguous() && sz.is_contiguous() &&
              (sz.numel() == 0 || (sz.dtype() == at::kFloat && sz.sizes() == s.sizes())),
              "lowbit_linear: bad packed weight");
  const int64_t m = x.size(0), k = x.size(1), tiles = s.size(0), groups = s.size(1), n = tiles * kTile;
  TORCH_CHECK(k % kBlock == 0 && group % kBlock == 0 && groups * group == k, "lowbit_linear: K=", k,
              " does not fit groups of ", group);
  TORCH_CHECK(w.numel() == n * k * bits / 8, "lowbit_linear: packed weight holds ", w.numel(), " bytes, expected ",
              n * k * bits / 8);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor xq = at::empty({m, k}, at::kChar), d = at::empty({m, k / kBlock}, at::kFloat);
  at::Tensor ds = at::empty({m, k / kBlock}, at::kFloat), dsg = at::empty({m, groups}, at::kFloat);
  at::Tensor y = at::empty({m, n}, at::kFloat);
  const int64_t blocks = group / kBlock;
  at::parallel_for(0, m, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      quantize_row(xf.data_ptr<float>() + r * k, k, static_cast<float>(eps), xq.data_ptr<int8_t>() + r * k,
                   d.data_ptr<float>() + r * (k / kBlock), ds.data_ptr<float>() + r * (k / kBlock));
      const float* dsr = ds.data_ptr<float>() + r * (k / kBlock);
      for (int64_t g = 0; g < groups; ++g) {
        float t = 0.f;
        for (int64_t b = 0; b < blocks; ++b) t += dsr[g * blocks + b];
        dsg.data_ptr<float>()[r * groups + g] = t;
      }
    }
  });
  if (bits == 4) tiles_any<4>(w, s, sz, xq, d, dsg, group, y);
  else tiles_any<8>(w, s, sz, xq, d, dsg, group, y);
  return y;
}


// lowbit_linear_bf16: symmetric INT4 weights (the same packed tiles, no zero points) x 16-bit activations, on
// AVX512-BF16: what PyTorch's INT4 CPU kernel (aten._weight_int4pack_mm_for_cpu, the layers' default) computes: x
// rounded to bfloat16 times the exactly dequantized weights, float32 sums, the output rounded to bfloat16 (checked
// bit-equal to that, in float64, on random inputs). Each code u becomes bfloat16(u - 8) by a table lookup (vpermw
// reads the low 5 bits of each 16-bit index) and vdpbf16ps multiplies pairs of them by pairs of x exactly into
// float32 sums: only the order of the sums differs from PyTorch's (and vdpbf16ps flushes subnormals, below 1e-38):
// y += s * sum x (u - 8) per group. (PyTorch's kernel rounds a zero-point term to bfloat16; weights with zero points
// keep it, and so do scales that bfloat16 does not hold exactly.) R rows at a time share each unpacked weight vector
// (prefill).
#define LLMQ_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16,fma")))

// Row r of x as the kernel reads it: x rounded to bfloat16 (c10's rounding, PyTorch's .to(bfloat16)), per 8 inputs
// the pairs (x0, x2) (x1, x3) (x4, x6) (x5, x7) in 32-bit lanes, matching the weight pairs that the lookups below make
// from a lane's low and high nibbles.
void bf16_pairs(const float* x, int64_t k, uint32_t* out) {
  const auto b = [&](int64_t i) { return static_cast<uint32_t>(c10::BFloat16(x[i]).x); };
  for (int64_t c = 0; c < k; c += 8, out += 4) {
    out[0] = b(c) | b(c + 2) << 16;
    out[1] = b(c + 1) | b(c + 3) << 16;
    out[2] = b(c + 4) | b(c + 6) << 16;
    out[3] = b(c + 5) | b(c + 7) << 16;
  }
}

// float32 rounded to the nearest bfloat16, ties to even, as c10::BFloat16 rounds (NaN stays NaN), kept in float32.
LLMQ_AVX512 inline __m512 round_bf16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))),
                                     _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_castsi512_ps(r), v);
}

// The two bfloat16 values of each 32-bit lane (low half, high half) as float32.
LLMQ_AVX512 inline __m512 even(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
LLMQ_AVX512 inline __m512 odd(__m512i v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

template <int N>
LLMQ_AVX512 inline void zeros(__m512* v) {
  for (int i = 0; i < N; ++i) v[i] = _mm512_setzero_ps();
}

// acc[r] += s * (the sum of row r's partial sums of a group), for the INT4 16-bit-activation kernel below.
template <int R, int A>
LLMQ_AVX512 inline void fold_group(const __m512 (&gacc)[R][A], __m512 s, __m512 (&acc)[R]) {
  for (int r = 0; r < R; ++r) {
    __m512 t = gacc[r][0];
    for (int a = 1; a < A; ++a) t = _mm512_add_ps(t, gacc[r][a]);
    acc[r] = _mm512_fmadd_ps(t, s, acc[r]);
  }
}

// Over every tile (threads split the tiles): rows(R)(tile, first row) for blocks of Wide rows (none if 0), then of
// 4, then single rows; rows(R) is the kernel for R rows at a time (std::integral_constant<int, R>).
template <int Wide, typename Rows>
void for_tiles(int64_t tiles, int64_t m, const Rows& rows) {
  at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      int64_t r = 0;
      if constexpr (Wide > 0) {
        for (; r + Wide <= m; r += Wide) rows(std::integral_constant<int, Wide>{})(t, r);
      }
      for (; r + 4 <= m; r += 4) rows(std::integral_constant<int, 4>{})(t, r);
      for (; r < m; ++r) rows(std::integral_constant<int, 1>{})(t, r);
    }
  });
}

// bfloat16(u - offset) for the INT4 / INT5 codes u (exact: small integers), as a vpermw table; the offset of signed
// codes unless given (Q4_K's are unsigned).
template <int Bits = 4>
LLMQ_AVX512 inline __m512i int_table(int offset = 1 << (Bits - 1)) {
  alignas(64) uint16_t lut[32] = {};
  for (int u = 0; u < 1 << Bits; ++u) {
    const float f = static_cast<float>(u - offset);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    lut[u] = static_cast<uint16_t>(bits >> 16);
  }
  return _mm512_load_si512(lut);
}

// Codes in bytes (lo: inputs 0-3 of each 32-bit lane's row, hi: inputs 4-7) as four vectors of bfloat16 pairs
// looked up in `table`, bf16_pairs' order.
LLMQ_AVX512 inline void byte_pairs(__m512i lo, __m512i hi, __m512i table, __m512i (&p)[4]) {
  p[0] = _mm512_permutexvar_epi16(lo, table);  // 16-bit words: (u0, u2)
  p[1] = _mm512_permutexvar_epi16(_mm512_srli_epi32(lo, 8), table);  // (u1, u3)
  p[2] = _mm512_permutexvar_epi16(hi, table);  // (u4, u6)
  p[3] = _mm512_permutexvar_epi16(_mm512_srli_epi32(hi, 8), table);  // (u5, u7)
}

// 64 bytes of an INT4 tile (16 rows x 8 inputs) as four vectors of bfloat16 pairs (u - 8), bf16_pairs' order.
LLMQ_AVX512 inline void int4_pairs(__m512i v, __m512i table, __m512i (&p)[4]) {
  const __m512i nibbles = _mm512_set1_epi8(0x0F);
  byte_pairs(_mm512_and_si512(v, nibbles), _mm512_and_si512(_mm512_srli_epi16(v, 4), nibbles), table, p);
}

// INT5 tiles: per 32 inputs, 64 bytes of fifth bits then four 64-byte chunks of the codes' low nibbles in the INT4
// layout. Row r's 32-bit word h of the fifth bits holds chunk c's input j (0-3) at bit 4 + 8j + c and input 4 + j at
// bit 8j + c, so one shift and mask puts them at bit 4 of the nibbles' bytes: a 5-bit index for vpermw (u - 16).
LLMQ_AVX512 inline void int5_pairs(__m512i v, __m512i h, int c, __m512i table, __m512i (&p)[4]) {
  const __m512i nibbles = _mm512_set1_epi8(0x0F), fifth = _mm512_set1_epi8(0x10);
  const __m512i down = _mm512_srl_epi32(h, _mm_cvtsi32_si128(c)), up = _mm512_sll_epi32(h, _mm_cvtsi32_si128(4 - c));
  const __m512i lo = _mm512_ternarylogic_epi32(_mm512_and_si512(v, nibbles), down, fifth, 0xF8);  // A | (B & C)
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(v, 4), nibbles), up, fifth, 0xF8);
  byte_pairs(lo, hi, table, p);
}

// Four vectors of bfloat16 pairs for the 8 inputs at i of an INT4 / INT5 tile (w at them; h: INT5's fifth bits of the
// 32 inputs i belongs to).
template <int Bits>
LLMQ_AVX512 inline void code_pairs(const uint8_t* w, __m512i h, int64_t i, __m512i table, __m512i (&p)[4]) {
  if constexpr (Bits == 5) int5_pairs(_mm512_loadu_si512(w), h, static_cast<int>(i / 8 % 4), table, p);
  else int4_pairs(_mm512_loadu_si512(w), table, p);
}

// Mins (Q4_K): unsigned codes, float32 scales, and per group a min m (value s u - m) subtracted as m times the group's
// sum of bfloat16(x) (xsum: [R rows][groups]); the output is not rounded to bfloat16 (no PyTorch kernel to match).
template <int R, int Bits = 4, typename S = uint16_t, bool Mins = false>
LLMQ_BF16 void tile_rows_bf16(const uint8_t* w, const S* s, const uint32_t* x, int64_t k, int64_t group,
                              float* y, int64_t n, const float* mins = nullptr, const float* xsum = nullptr) {
  constexpr int A = R == 1 ? 4 : 2;  // independent sums a row
  const __m512i table = Mins ? int_table<Bits>(0) : int_table<Bits>();
  __m512i h = _mm512_setzero_si512();
  __m512 acc[R];
  zeros<R>(acc);
  for (int64_t g = 0; g < k / group; ++g) {
    __m512 gacc[R][A];
    zeros<R * A>(&gacc[0][0]);
    for (int64_t i = g * group; i < (g + 1) * group; i += 8, w += 64) {  // 64 bytes = 16 rows x 8 inputs
      if (Bits == 5 && i % 32 == 0) {  // INT5: the next 32 inputs' fifth bits
        h = _mm512_loadu_si512(w);
        w += 64;
      }
      _mm_prefetch(reinterpret_cast<const char*>(w) + 2048, _MM_HINT_T0);
      __m512i p[4];
      code_pairs<Bits>(w, h, i, table, p);
      for (int r = 0; r < R; ++r) {
        const uint32_t* xr = x + r * k / 2 + i / 2;
        for (int j = 0; j < 4; ++j) {
          const __m512i xj = _mm512_set1_epi32(static_cast<int>(xr[j]));
          gacc[r][j % A] = _mm512_dpbf16_ps(gacc[r][j % A], (__m512bh)p[j], (__m512bh)xj);
        }
      }
    }
    fold_group<R, A>(gacc, load_scales(s + g * kTile), acc);
    if constexpr (Mins) {
      const __m512 mg = _mm512_loadu_ps(mins + g * kTile);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fnmadd_ps(_mm512_set1_ps(xsum[r * (k / group) + g]), mg, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * n, Mins ? acc[r] : round_bf16(acc[r]));
}

// The INT8 counterpart, for PyTorch's INT8 kernel (aten._weight_int8pack_mm: bfloat16(x) times the exact q * s,
// float32 sums, bfloat16 out). A 16-byte quarter of a chunk holds four rows' four inputs; zero-extended and converted
// (exact), its lanes 4a + j hold row a's code u = q + 128 for input j, multiplied by x's four inputs broadcast to each
// 128-bit lane: u * bfloat16(x) is exact in float32. A group's row sums are then folded out of the lanes, less
// 128 * the group's sum of x: y = s * (sum x u - 128 sum x) = s * sum x q, the same numbers up to float32 rounding of
// sums about twice as large (fewer instructions than sign-extending each byte in place: ~20 -> ~26 GB/s a core).
// x: the row already rounded to bfloat16, as float32; xsum: its sums per group.
LLMQ_AVX512 inline __m512 lane_sums(__m512 t) {  // every element: the sum of its 128-bit lane
  t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));
  return _mm512_add_ps(t, _mm512_permute_ps(t, 0x4E));
}

// The 16 rows' sums, row 4q + a being 128-bit lane a of t[q].
LLMQ_AVX512 inline __m512 row_sums(const __m512 (&t)[4]) {
  const __m512i first = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512 lo = _mm512_permutex2var_ps(lane_sums(t[0]), first, lane_sums(t[1]));  // rows 0-7 in lanes 0-7
  const __m512 hi = _mm512_permutex2var_ps(lane_sums(t[2]), first, lane_sums(t[3]));  // rows 8-15
  return _mm512_shuffle_f32x4(lo, hi, 0x44);
}

template <int R, typename S = uint16_t>
LLMQ_AVX512 void tile_rows_int8_bf16(const uint8_t* w, const S* s, const float* x, const float* xsum, int64_t k,
                                     int64_t group, float* y, int64_t n) {
  constexpr int A = R == 1 ? 2 : 1;  // independent sums a quarter-tile and row
  const int64_t groups = (k + group - 1) / group;
  __m512 acc[R];
  zeros<R>(acc);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 gacc[R][A][4];
    zeros<R * A * 4>(&gacc[0][0][0]);
    const int64_t end = std::min((g + 1) * group, k);
    for (int64_t i = g * group; i < end; i += 4 * A, w += 64 * A) {  // 64 bytes = 16 rows x 4 inputs
      for (int a = 0; a < A; ++a) {
        __m512 xv[R];
        for (int r = 0; r < R; ++r) xv[r] = _mm512_broadcast_f32x4(_mm_loadu_ps(x + r * k + i + 4 * a));
        for (int q = 0; q < 4; ++q) {
          const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 64 * a + 16 * q));
          const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
          for (int r = 0; r < R; ++r) gacc[r][a][q] = _mm512_fmadd_ps(c, xv[r], gacc[r][a][q]);
        }
      }
    }
    const __m512 sc = load_scales(s + g * kTile);
    for (int r = 0; r < R; ++r) {
      __m512 t[4];
      for (int q = 0; q < 4; ++q) {
        t[q] = gacc[r][0][q];
        for (int a = 1; a < A; ++a) t[q] = _mm512_add_ps(t[q], gacc[r][a][q]);
      }
      const __m512 xg = _mm512_set1_ps(xsum[r * groups + g]);
      acc[r] = _mm512_fmadd_ps(_mm512_fnmadd_ps(_mm512_set1_ps(128.f), xg, row_sums(t)), sc, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * n, round_bf16(acc[r]));
}

// The same INT8 product for many rows at the bfloat16 dot-product rate: each tile's codes widened once to bfloat16
// (exact: |q| <= 128) and paired as bf16_pairs pairs x, (q_i, q_i+2) and (q_i+1, q_i+3) per four inputs, then R rows
// at a time take vdpbf16ps with them: bfloat16(x) times the exact q, float32 sums, times s per group, bfloat16 out, as
// tile_rows_int8_bf16 computes (and vdpbf16ps flushes subnormal x, below 1e-38, as the INT4 kernel does).
// 64 bytes of an INT8 tile (16 rows x 4 inputs) as float32 q_j (exact), j = 0..3.
LLMQ_AVX512 inline void int8_floats(const uint8_t* w, __m512 (&f)[4]) {
  const __m512i flip = _mm512_set1_epi32(static_cast<int>(0x80808080u));  // u ^ 0x80: q as a signed byte
  const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(w), flip);
  for (int j = 0; j < 4; ++j) f[j] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * j), 24));
}

LLMQ_AVX512 void int8_tile_pairs(const uint8_t* w, int64_t k, uint32_t* pairs) {
  for (int64_t i = 0; i < k; i += 4, w += 64, pairs += 2 * kTile) {  // 64 bytes = 16 rows x 4 inputs
    __m512 f[4];
    int8_floats(w, f);
    __m512i h[4];  // bfloat16(q_j) in each lane's low half: float32(q_j)'s top 16 bits, exact
    for (int j = 0; j < 4; ++j) h[j] = _mm512_srli_epi32(_mm512_castps_si512(f[j]), 16);
    _mm512_storeu_si512(pairs, _mm512_or_si512(h[0], _mm512_slli_epi32(h[2], 16)));
    _mm512_storeu_si512(pairs + kTile, _mm512_or_si512(h[1], _mm512_slli_epi32(h[3], 16)));
  }
}

template <int R>
LLMQ_BF16 void pair_rows_bf16(const uint32_t* pairs, const uint16_t* s, const uint32_t* x, int64_t k, int64_t group,
                              float* y, int64_t n) {
  __m512 acc[R];
  zeros<R>(acc);
  for (int64_t g = 0; g < k / group; ++g) {
    __m512 gacc[R][2];
    zeros<R * 2>(&gacc[0][0]);
    for (int64_t p = g * group / 2; p < (g + 1) * group / 2; p += 2) {
      for (int a = 0; a < 2; ++a) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(pairs + (p + a) * kTile);
        for (int r = 0; r < R; ++r) {
          const __m512i xj = _mm512_set1_epi32(static_cast<int>(x[r * k / 2 + p + a]));
          gacc[r][a] = _mm512_dpbf16_ps(gacc[r][a], wv, (__m512bh)xj);
        }
      }
    }
    fold_group<R, 2>(gacc, load_scales(s + g * kTile), acc);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * n, round_bf16(acc[r]));
}

// Block FP8's activations, row x [K] rounded to E4M3 per group of `group` inputs (the last one may be short) as
// quant.quantize_token_groups rounds them: scale xs = max(amax, eps) / 448, the quotient x / xs (IEEE division, the
// same float32 quotient) saturated to +-448 and rounded to the nearest E4M3 value, ties to even: the nearest multiple
// of its binade's step 2^(e - 3), of 2^-9 below 2^-6 (E4M3's subnormals). q: the values' bfloat16 bits (exact: the
// float32 value's top half).
LLMQ_AVX512 void fp8_row(const float* x, int64_t k, int64_t group, float eps, uint16_t* q, float* xs) {
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const auto mask = [](int64_t left) { return static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1); };
  for (int64_t g = 0, i0 = 0; i0 < k; ++g, i0 += group) {
    const int64_t end = std::min(i0 + group, k);
    __m512 mx = _mm512_setzero_ps();
    for (int64_t i = i0; i < end; i += 16)
      mx = _mm512_max_ps(mx, _mm512_abs_ps(_mm512_maskz_loadu_ps(mask(end - i), x + i)));
    const float s = std::max(_mm512_reduce_max_ps(mx), eps) / 448.f;
    xs[g] = s;
    const __m512 sv = _mm512_set1_ps(s), top = _mm512_set1_ps(448.f), three = _mm512_set1_ps(3.f);
    for (int64_t i = i0; i < end; i += 16) {
      const __mmask16 mk = mask(end - i);
      const __m512 v = _mm512_max_ps(_mm512_min_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(mk, x + i), sv), top),
                                     _mm512_sub_ps(_mm512_setzero_ps(), top));
      const __m512 e = _mm512_max_ps(_mm512_getexp_ps(_mm512_abs_ps(v)), _mm512_set1_ps(-6.f));  // getexp(0) = -inf
      const __m512 r = _mm512_roundscale_ps(_mm512_scalef_ps(v, _mm512_sub_ps(three, e)), kRound);
      const __m512i bits = _mm512_castps_si512(_mm512_scalef_ps(r, _mm512_sub_ps(e, three)));
      _mm512_mask_cvtepi32_storeu_epi16(q + i, mk, _mm512_srli_epi32(bits, 16));
    }
  }
}

#define LLMQ_FP8 __attribute__((target("avx512f,avx512bw,avx512vbmi,avx512bf16,fma")))

// The bfloat16 of each E4M3 magnitude (codes 0-127; 127 is NaN) as two 128-entry byte tables for vpermi2b: its high
// bytes (the exponent's top seven bits) and low bytes (the exponent's last bit and the mantissa). Every value is exact
// in bfloat16, subnormal ones too (m * 2^-9 is a normal bfloat16).
struct E4m3Tables {
  __m512i hi0, hi1, lo0, lo1;
};

LLMQ_FP8 inline E4m3Tables e4m3_tables() {
  struct Bytes {
    alignas(64) uint8_t hi[128], lo[128];
  };
  static const Bytes bytes = [] {  // built once a process
    Bytes t;
    for (int c = 0; c < 128; ++c) {
      const int e = c >> 3, m = c & 7;
      const float f = c == 127 ? std::numeric_limits<float>::quiet_NaN()
                               : e ? std::ldexp(1.f + m / 8.f, e - 7) : std::ldexp(static_cast<float>(m), -9);
      uint32_t bits;
      std::memcpy(&bits, &f, sizeof bits);
      t.hi[c] = static_cast<uint8_t>(bits >> 24);
      t.lo[c] = static_cast<uint8_t>(bits >> 16);
    }
    return t;
  }();
  return {_mm512_load_si512(bytes.hi), _mm512_load_si512(bytes.hi + 64), _mm512_load_si512(bytes.lo),
          _mm512_load_si512(bytes.lo + 64)};
}

// A 64-byte chunk of E4M3 codes (16 rows x 4 inputs, row a at bytes 4a..4a+3) as bfloat16 in two vectors: two table
// lookups (vpermi2b reads an index's low seven bits), the sign put back into the high bytes, the bytes interleaved in
// each 128-bit lane: a holds rows 4l, 4l + 1 of lane l, b rows 4l + 2, 4l + 3; each row's four inputs in two 32-bit
// lanes, pairs (0, 1) then (2, 3).
LLMQ_FP8 inline void e4m3_bf16(const uint8_t* w, const E4m3Tables& t, __m512i& a, __m512i& b) {
  const __m512i c = _mm512_loadu_si512(w);
  const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(t.hi0, c, t.hi1), c,
                                               _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // A | (B & C)
  const __m512i lo = _mm512_permutex2var_epi8(t.lo0, c, t.lo1);
  a = _mm512_unpacklo_epi8(lo, hi);
  b = _mm512_unpackhi_epi8(lo, hi);
}

// Block FP8 on AVX512-BF16: the E4M3 weight and activation values are exact in bfloat16, so vdpbf16ps multiplies them
// exactly into float32 sums, 32 products an instruction; per group the sums times the row's weight scale (s) and the
// activation row's scale (xs [R rows][groups]), float32 out; the last group may be short. Each row's sum is two lanes
// (e4m3_bf16's pairs), folded at the group's end. x: each row's E4M3 values as bfloat16 bits.
template <int R>
LLMQ_FP8 void tile_rows_fp8(const uint8_t* w, const float* s, const uint16_t* x, const float* xs, int64_t k,
                            int64_t group, float* y, int64_t n) {
  constexpr int A = R == 1 ? 2 : 1;  // independent sums a chunk and row
  const int64_t groups = (k + group - 1) / group;
  const E4m3Tables tables = e4m3_tables();
  __m512 acc[R];
  zeros<R>(acc);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 gacc[R][A][2];
    zeros<R * A * 2>(&gacc[0][0][0]);
    const int64_t end = std::min((g + 1) * group, k);
    for (int64_t i = g * group; i < end; i += 4 * A, w += 64 * A) {  // 64 bytes = 16 rows x 4 inputs
      _mm_prefetch(reinterpret_cast<const char*>(w) + 2048, _MM_HINT_T0);
      for (int a = 0; a < A; ++a) {
        __m512i wa, wb;
        e4m3_bf16(w + 64 * a, tables, wa, wb);
        for (int r = 0; r < R; ++r) {
          int64_t xv;
          std::memcpy(&xv, x + r * k + i + 4 * a, sizeof xv);
          const __m512bh xb = (__m512bh)_mm512_set1_epi64(xv);  // even lanes inputs (0, 1), odd ones (2, 3)
          gacc[r][a][0] = _mm512_dpbf16_ps(gacc[r][a][0], (__m512bh)wa, xb);
          gacc[r][a][1] = _mm512_dpbf16_ps(gacc[r][a][1], (__m512bh)wb, xb);
        }
      }
    }
    const __m512 sc = _mm512_loadu_ps(s + g * kTile);
    for (int r = 0; r < R; ++r) {
      __m512 sa = gacc[r][0][0], sb = gacc[r][0][1];
      for (int a = 1; a < A; ++a) {
        sa = _mm512_add_ps(sa, gacc[r][a][0]);
        sb = _mm512_add_ps(sb, gacc[r][a][1]);
      }
      sa = _mm512_add_ps(sa, _mm512_permute_ps(sa, 0xB1));  // each row's two lanes, summed into both
      sb = _mm512_add_ps(sb, _mm512_permute_ps(sb, 0xB1));
      const __m512 rows = _mm512_shuffle_ps(sa, sb, 0x88);  // lane l: rows 4l, 4l + 1 (from a), 4l + 2, 4l + 3 (b)
      acc[r] = _mm512_fmadd_ps(rows, _mm512_mul_ps(sc, _mm512_set1_ps(xs[r * groups + g])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * n, acc[r]);
}

// The same INT4 / INT8 / FP4 products on AMX-BF16's tile unit, for many rows (prefill, large decode batches): a tile
// of 16 weight rows is built once into AMX's B layout (a 32-bit bfloat16 pair per output row and input pair,
// bf16_pairs' order), then tdpbf16ps multiplies 16 rows of x by it, 16 x 16 x 32 products an instruction, into
// float32 sums. Every product stays exact, so only the float32 summation order differs from the vector kernels
// (tdpbf16ps flushes subnormals, below 1e-38, as vdpbf16ps does):
// - INT4 / INT8 (bfloat16(x) times the exact weights, bfloat16 out): where the scales change along K (groups), each
//   weight s * q is folded in and split exactly into two bfloat16, hi (its top 8 significant bits) + lo (the rest:
//   s * q has at most 8 + 7 of them), both multiplied by x; one scale a channel multiplies the sums instead.
// - FP4 (float32 x, float32 out): an E2M1 value times its E4M3 / E8M0 block scale has at most 6 significant bits, one
//   bfloat16; x is split exactly into three bfloat16 (8 + 8 + 8 of float32's 24 bits), each multiplied by the weights.
// - 16-bit weights as stored (dense16_linear, float32 x and out): bfloat16 ones as they are, float16 ones (11
//   significant bits) split into hi + lo; x in three parts as for FP4.
// - Block FP8 (float32 out): E4M3 weights and activations, both exact in bfloat16; the two scales vary along K per
//   group and per row of x, so each group's sums are stored and scaled (amx_fp8_tiles).
// - Q4_K (bfloat16(x), float32 out): each weight s u - m, rounded once to float32 as llama.cpp rounds it, split
//   exactly into three bfloat16 (q4k_weight_pairs), each multiplied by x.
// - bitsandbytes NF4 / FP4 (float32 out): each weight in the checkpoint's dtype (one bfloat16, float16 in two,
//   float32 in three: table_weight_pairs), x in three parts as for FP4 (one where it comes in bfloat16); only where
//   that makes at most three tile products a step.
// Linux hands a process the tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM); where a kernel or VM
// withholds it, the first tile instruction faults (SIGILL), so the grant is checked, not cpuid's bits alone.
#define LLMQ_AMX __attribute__((target("avx512f,avx512bw,fma,amx-tile,amx-bf16")))
enum class Codes { kInt4, kInt5, kInt8, kFp4 };
std::atomic<bool> amx_enabled{true};

bool amx_granted() {
  static const bool granted = [] {
    unsigned a, b, c, d;  // cpuid leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 22 & 1) || !(d >> 24 & 1)) return false;
    constexpr long kGetPerm = 0x1022, kReqPerm = 0x1023, kTileData = 18;  // ARCH_*_XCOMP_PERM, XFEATURE_XTILEDATA
    unsigned long perm = 0;
    return syscall(SYS_arch_prctl, kReqPerm, kTileData) == 0 && syscall(SYS_arch_prctl, kGetPerm, &perm) == 0 &&
           (perm >> kTileData & 1);
  }();
  return granted;
}

// Turns the AMX path on (where Linux grants the tiles) or off, for comparing and testing both paths; whether it is on.
bool amx(bool enable) {
  amx_enabled = enable;
  return enable && amx_granted();
}

// From this many rows of x AMX is faster, by weight format (benchmarks/bench_lowbit_products.py, a Xeon's one and two
// threads; below, 16-row tiles mostly empty lose to the vector paths' per-row work).
constexpr int64_t kAmxFromInt4 = 10, kAmxFromInt8 = 8, kAmxFromFp4 = 12, kAmxFromBf16 = 12, kAmxFromHalf = 16,
                  kAmxFromFp8 = 8, kAmxFromQ4k = 16, kAmxFromTable = 12;

bool use_amx(int64_t m, int64_t k, int64_t from) { return m >= from && k % 32 == 0 && amx_enabled && amx_granted(); }

struct alignas(64) TileConfig {  // palette 1: eight tiles of up to 16 rows x 64 bytes
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes (palette 1), for this thread.
LLMQ_AMX void load_tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// e, o: the first and second weight of each lane's pair as float32; `planes` (1 to 3) bfloat16 pair planes (plane q
// at p + q * plane), each the top 8 significant bits of what the ones before leave: their sum is e (o) exactly where
// it has at most 8 * planes significant bits (bfloat16: 8, float16: 11, float32: 24).
LLMQ_AVX512 inline void split_planes(__m512 e, __m512 o, uint32_t* p, int64_t plane, int planes) {
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int q = 0; q < planes; ++q) {
    const __m512i eh = _mm512_and_si512(_mm512_castps_si512(e), top), oh = _mm512_and_si512(_mm512_castps_si512(o), top);
    _mm512_storeu_si512(p + q * plane, _mm512_or_si512(_mm512_srli_epi32(eh, 16), oh));
    e = _mm512_sub_ps(e, _mm512_castsi512_ps(eh));
    o = _mm512_sub_ps(o, _mm512_castsi512_ps(oh));
  }
}

// x [K] (K % 32 == 0) as three bfloat16 rows in bf16_pairs' order (at out, out + plane, out + 2 * plane) whose sum is
// x exactly: each the top 8 significant bits of what the ones before leave.
LLMQ_AVX512 void bf16_split_pairs(const float* x, int64_t k, uint32_t* out, int64_t plane) {
  alignas(64) uint16_t idx[32];  // 16-bit word o of a pair row: x[8 (o / 8) + order[o % 8]]'s high half
  constexpr int order[8] = {0, 2, 1, 3, 4, 6, 5, 7};
  for (int o = 0; o < 32; ++o) {
    const int c = 8 * (o / 8) + order[o % 8];
    idx[o] = static_cast<uint16_t>(c < 16 ? 2 * c + 1 : 32 + 2 * (c - 16) + 1);
  }
  const __m512i ix = _mm512_load_si512(idx), top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t c = 0; c < k; c += 32) {
    __m512 r[2] = {_mm512_loadu_ps(x + c), _mm512_loadu_ps(x + c + 16)};
    for (int p = 0; p < 3; ++p) {
      __m512i h[2];
      for (int j = 0; j < 2; ++j) {
        h[j] = _mm512_and_si512(_mm512_castps_si512(r[j]), top);
        r[j] = _mm512_sub_ps(r[j], _mm512_castsi512_ps(h[j]));
      }
      _mm512_storeu_si512(out + p * plane + c / 2, _mm512_permutex2var_epi16(h[0], ix, h[1]));
    }
  }
}

// bfloat16 of the 16 E2M1 codes (bit 3 the sign; exact), as a vpermw table.
LLMQ_AVX512 inline __m512i fp4_table() {
  constexpr float values[8] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  alignas(64) uint16_t lut[32] = {};
  for (int u = 0; u < 16; ++u) {
    const float f = u < 8 ? values[u] : -values[u - 8];
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    lut[u] = static_cast<uint16_t>(bits >> 16);
  }
  return _mm512_load_si512(lut);
}

// Whether a format's weights need hi + lo (scales folded in that bfloat16 does not hold with the codes).
bool amx_split(Codes codes, int64_t groups) { return codes != Codes::kFp4 && groups > 1; }

// One tile's weights as B pairs [K/2][16]: the codes' values times s per group where the scales are folded in (FP4
// always, INT4 / INT8 in groups: then hi, then lo), else the codes' values alone.
template <Codes C>
LLMQ_AVX512 void amx_weights(const uint8_t* w, const uint16_t* s, int64_t k, int64_t group, int64_t groups,
                             uint32_t* hi) {
  const bool fold = C == Codes::kFp4 || groups > 1;
  const int planes = amx_split(C, groups) ? 2 : 1;
  const int64_t plane = k / 2 * kTile;
  if constexpr (C == Codes::kInt8) {
    for (int64_t i = 0; i < k; i += 4, w += 64) {
      const __m512 sc = fold ? load_scales(s + i / group * kTile) : _mm512_set1_ps(1.f);
      __m512 f[4];
      int8_floats(w, f);
      split_planes(_mm512_mul_ps(f[0], sc), _mm512_mul_ps(f[2], sc), hi + i / 2 * kTile, plane, planes);
      split_planes(_mm512_mul_ps(f[1], sc), _mm512_mul_ps(f[3], sc), hi + (i / 2 + 1) * kTile, plane, planes);
    }
  } else {
    constexpr int bits = C == Codes::kInt5 ? 5 : 4;
    const __m512i table = C == Codes::kFp4 ? fp4_table() : int_table<bits>();
    __m512i h = _mm512_setzero_si512();
    for (int64_t i = 0; i < k; i += 8, w += 64) {
      if (C == Codes::kInt5 && i % 32 == 0) {
        h = _mm512_loadu_si512(w);
        w += 64;
      }
      const __m512 sc = fold ? load_scales(s + i / group * kTile) : _mm512_set1_ps(1.f);
      __m512i p[4];
      code_pairs<bits>(w, h, i, table, p);
      for (int j = 0; j < 4; ++j)
        split_planes(_mm512_mul_ps(even(p[j]), sc), _mm512_mul_ps(odd(p[j]), sc), hi + (i / 2 + j) * kTile, plane,
                     planes);
    }
  }
}

// Sums for 16 (Two: 32) rows of x times two tiles' B pairs into c ([row block][tile][16][16] float32): x as `parts`
// planes of bfloat16 pair rows (2k bytes a row; plane p at xa + p * plane), the weights as `halves` of [K/2][16]
// pairs each (b0, b1); every part times every half.
template <bool Two>
LLMQ_AMX void amx_rows(const uint32_t* xa, int64_t plane, int parts, int64_t k, const uint32_t* b0,
                       const uint32_t* b1, int halves, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (Two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t half = k / 2 * kTile;
  for (int64_t i = 0; i < k; i += 32) {
    for (int h = 0; h < halves; ++h) {
      _tile_loadd(6, b0 + h * half + i / 2 * kTile, 64);
      _tile_loadd(7, b1 + h * half + i / 2 * kTile, 64);
      for (int p = 0; p < parts; ++p) {
        if (h == 0 || parts > 1) {  // one part stays loaded for the second half
          _tile_loadd(4, xa + p * plane + i / 2, 2 * k);
          if constexpr (Two) _tile_loadd(5, xa + p * plane + 8 * k + i / 2, 2 * k);
        }
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if constexpr (Two) {
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
    }
  }
  _tile_stored(0, c, 64);
  _tile_stored(1, c + 256, 64);
  if constexpr (Two) {
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
  }
}

// `rows` rows of a tile's 16 x 16 sums into y (n apart; the first `cols` columns): times s (one scale a channel;
// null: none) over `divisor`, rounded to bfloat16 where `round`.
LLMQ_AVX512 void amx_store(const float* c, int64_t rows, int64_t cols, const uint16_t* s, float divisor, bool round,
                           float* y, int64_t n) {
  const __m512 sc = s == nullptr ? _mm512_set1_ps(1.f) : load_scales(s), d = _mm512_set1_ps(divisor);
  const auto valid = static_cast<__mmask16>((1u << cols) - 1);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = _mm512_div_ps(_mm512_mul_ps(_mm512_loadu_ps(c + r * 16), sc), d);
    _mm512_mask_storeu_ps(y + r * n, valid, round ? round_bf16(v) : v);
  }
}

// Tile pairs [lo, hi) on one thread: fill(t, b) writes tile t's weights as `halves` of B pairs [K/2][16] at b;
// store(t, c, r0, rows) takes rows [r0, r0 + rows) of its 16 x 16 sums c. x: `parts` planes of bf16_pairs rows (a
// multiple of 16, zeros past m).
template <typename Fill, typename Store>
LLMQ_AMX void amx_tiles(int64_t lo, int64_t hi, const uint32_t* xa, int parts, int64_t m, int64_t k, int64_t tiles,
                        int halves, const Fill& fill, const Store& store) {
  load_tile_config();
  const int64_t mpad = (m + 15) / 16 * 16, plane = mpad * k / 2, bsize = halves * k / 2 * kTile;
  std::vector<uint32_t> b(2 * bsize);
  alignas(64) float c[4 * 256];
  for (int64_t pair = lo; pair < hi; ++pair) {
    const int64_t t[2] = {2 * pair, std::min(2 * pair + 1, tiles - 1)};
    for (int j = 0; j < 2; ++j) fill(t[j], b.data() + j * bsize);
    for (int64_t r = 0; r < mpad; r += 32) {
      const bool two = r + 16 < mpad;
      if (two) amx_rows<true>(xa + r * k / 2, plane, parts, k, b.data(), b.data() + bsize, halves, c);
      else amx_rows<false>(xa + r * k / 2, plane, parts, k, b.data(), b.data() + bsize, halves, c);
      for (int blk = 0; blk < 1 + two; ++blk) {
        const int64_t r0 = r + 16 * blk, rows = std::min<int64_t>(16, m - r0);
        for (int j = 0; j < 2 - (t[1] == t[0]) && rows > 0; ++j) store(t[j], c + blk * 512 + j * 256, r0, rows);
      }
    }
  }
  _tile_release();
}

// A block-FP8 tile's weights as AMX B pairs [K/2][16] of their E4M3 values in bfloat16 (exact), pair p = inputs
// 2p, 2p + 1 (e4m3_bf16's lanes hold rows 4l, 4l + 1 in a and 4l + 2, 4l + 3 in b, two pairs each: one shuffle
// gathers each pair's 16 rows).
LLMQ_FP8 void fp8_weight_pairs(const uint8_t* w, int64_t k, uint32_t* b) {
  const E4m3Tables tables = e4m3_tables();
  for (int64_t i = 0; i < k; i += 4, w += 64) {
    __m512i wa, wb;
    e4m3_bf16(w, tables, wa, wb);
    const __m512 a = _mm512_castsi512_ps(wa), c = _mm512_castsi512_ps(wb);
    _mm512_storeu_ps(reinterpret_cast<float*>(b + i / 2 * kTile), _mm512_shuffle_ps(a, c, 0x88));
    _mm512_storeu_ps(reinterpret_cast<float*>(b + (i / 2 + 1) * kTile), _mm512_shuffle_ps(a, c, 0xDD));
  }
}

// Block FP8 on AMX-BF16 (prefill), tile pairs [lo, hi) on one thread: the E4M3 weights (B, fp8_weight_pairs) times
// the activations' E4M3 values (xa: bfloat16 rows in input order, zeros past m; both exact), each group's products
// summed on the tile unit, stored and folded in with both scales (s: the weight rows', xs [m][groups]: the
// activation rows'), as tile_rows_fp8 folds them; float32 out. K and the group are multiples of 32.
LLMQ_AMX void amx_fp8_tiles(int64_t lo, int64_t hi, const uint16_t* xa, const float* xs, int64_t m, int64_t k,
                            int64_t tiles, int64_t groups, int64_t group, const uint8_t* w, const float* s, float* y) {
  load_tile_config();
  const int64_t mpad = (m + 15) / 16 * 16, n = tiles * kTile, bsize = k / 2 * kTile;
  std::vector<uint32_t> b(2 * bsize);
  alignas(64) float c[4 * 256], acc[4 * 256];
  for (int64_t pair = lo; pair < hi; ++pair) {
    const int64_t t[2] = {2 * pair, std::min(2 * pair + 1, tiles - 1)};
    for (int j = 0; j < 2; ++j) fp8_weight_pairs(w + t[j] * kTile * k, k, b.data() + j * bsize);
    for (int64_t r = 0; r < mpad; r += 32) {
      const bool two = r + 16 < mpad;
      std::fill(acc, acc + 4 * 256, 0.f);
      for (int64_t g = 0; g < groups; ++g) {
        _tile_zero(0);  // tile 2 * blk + j: row block blk, weight tile j
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t i = g * group; i < std::min((g + 1) * group, k); i += 32) {
          _tile_loadd(6, b.data() + i / 2 * kTile, 64);
          _tile_loadd(7, b.data() + bsize + i / 2 * kTile, 64);
          _tile_loadd(4, xa + r * k + i, 2 * k);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          if (two) {
            _tile_loadd(5, xa + (r + 16) * k + i, 2 * k);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
        }
        _tile_stored(0, c, 64);
        _tile_stored(1, c + 256, 64);
        _tile_stored(2, c + 512, 64);
        _tile_stored(3, c + 768, 64);
        for (int blk = 0; blk < 1 + two; ++blk) {
          for (int j = 0; j < 2; ++j) {
            const __m512 ws = _mm512_loadu_ps(s + (t[j] * groups + g) * kTile);
            float* at = acc + (2 * blk + j) * 256;
            for (int64_t q = 0; q < 16 && r + 16 * blk + q < m; ++q) {
              const __m512 sc = _mm512_mul_ps(ws, _mm512_set1_ps(xs[(r + 16 * blk + q) * groups + g]));
              _mm512_storeu_ps(at + q * 16, _mm512_fmadd_ps(_mm512_loadu_ps(c + (2 * blk + j) * 256 + q * 16), sc,
                                                            _mm512_loadu_ps(at + q * 16)));
            }
          }
        }
      }
      for (int blk = 0; blk < 1 + two; ++blk)
        for (int j = 0; j < 2 - (t[1] == t[0]); ++j)
          for (int64_t q = 0; q < 16 && r + 16 * blk + q < m; ++q)
            std::memcpy(y + (r + 16 * blk + q) * n + t[j] * kTile, acc + (2 * blk + j) * 256 + q * 16,
                        kTile * sizeof(float));
    }
  }
  _tile_release();
}

// A Q4_K tile's weights as three AMX B planes [K/2][16] (plane p at b + p * K/2 * 16): each weight s u - m rounded
// once to float32, as llama.cpp dequantizes it, cut into its top 8 significant bits, the next 8 and the last 8, so
// the planes sum to it exactly (s u alone has up to 21 of them: two planes do not hold it).
LLMQ_AVX512 void q4k_weight_pairs(const uint8_t* w, const float* s, const float* mins, int64_t k, int64_t group,
                                  uint32_t* b) {
  const __m512i table = int_table<4>(0);
  const int64_t plane = k / 2 * kTile;
  for (int64_t i = 0; i < k; i += 8, w += 64) {
    const __m512 sc = _mm512_loadu_ps(s + i / group * kTile), mn = _mm512_loadu_ps(mins + i / group * kTile);
    __m512i p[4];
    int4_pairs(_mm512_loadu_si512(w), table, p);
    for (int j = 0; j < 4; ++j)
      split_planes(_mm512_fmsub_ps(even(p[j]), sc, mn), _mm512_fmsub_ps(odd(p[j]), sc, mn), b + (i / 2 + j) * kTile,
                   plane, 3);
  }
}

// x [m, k] float32 as AMX's A planes: bfloat16(x) (one part), or x split exactly into three (exact).
std::vector<uint32_t> amx_x(const float* x, int64_t m, int64_t k, bool exact) {
  const int64_t plane = (m + 15) / 16 * 16 * k / 2;
  std::vector<uint32_t> xa((exact ? 3 : 1) * plane, 0);
  for (int64_t r = 0; r < m; ++r) {
    if (exact) bf16_split_pairs(x + r * k, k, xa.data() + r * k / 2, plane);
    else bf16_pairs(x + r * k, k, xa.data() + r * k / 2);
  }
  return xa;
}

// y [m, n] for x [m, k] float32 times a packed weight with bfloat16 scales, on AMX (use_amx holds): INT4 / INT8 on
// bfloat16(x), rounded to bfloat16; FP4 on x exactly (three parts), divided by `divisor`.
template <Codes C>
void amx_product(const float* x, int64_t m, int64_t k, const uint8_t* w, const uint16_t* s, int64_t tiles,
                 int64_t groups, int64_t group, float divisor, float* y) {
  const bool fp4 = C == Codes::kFp4, scale_out = !fp4 && groups == 1;  // one scale a channel multiplies the sums
  const int halves = amx_split(C, groups) ? 2 : 1;
  const int64_t n = tiles * kTile, tile_bytes = kTile * k * (C == Codes::kInt8 ? 8 : C == Codes::kInt5 ? 5 : 4) / 8;
  const std::vector<uint32_t> xa = amx_x(x, m, k, fp4);
  const auto fill = [&](int64_t t, uint32_t* b) {
    amx_weights<C>(w + t * tile_bytes, s + t * groups * kTile, k, group, groups, b);
  };
  const auto store = [&](int64_t t, const float* c, int64_t r0, int64_t rows) {
    amx_store(c, rows, kTile, scale_out ? s + t * kTile : nullptr, divisor, !fp4, y + r0 * n + t * kTile, n);
  };
  at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t lo, int64_t hi) {
    amx_tiles(lo, hi, xa.data(), fp4 ? 3 : 1, m, k, tiles, halves, fill, store);
  });
}

// x rounded to bfloat16 (as c10 rounds, kept in float32) and the sum of each group of it; count groups of `group`.
LLMQ_AVX512 void round_groups(const float* x, int64_t count, int64_t group, float* xb, float* sums) {
  for (int64_t g = 0; g < count; ++g, x += group, xb += group) {
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= group; i += 16) {
      const __m512 v = round_bf16(_mm512_loadu_ps(x + i));
      _mm512_storeu_ps(xb + i, v);
      acc = _mm512_add_ps(acc, v);
    }
    float t = _mm512_reduce_add_ps(acc);
    for (; i < group; ++i) t += xb[i] = static_cast<float>(c10::BFloat16(x[i]));
    sums[g] = t;
  }
}

// The INT4-tile products on CPUs with AVX2 + FMA but not AVX512-BF16 (lowbit_linear_bf16's INT4 / INT5, q4k_linear's
// Q4_K): a tile's 16 rows as two halves of 8 lanes; per 8 inputs, each input's codes u (shifted out of the rows'
// 32-bit words; INT5's fifth bit from its word of the 32 inputs, int5_pairs' layout) converted to float32 and
// multiplied by bfloat16(x) (exact: 5 x 8 significant bits); per group the float32 sum less the codes' offset times
// the group's sum of x (the INT8 kernel's way: no subtraction a weight, sums up to twice as large), times the group's
// scale (bfloat16 or float32); Mins (Q4_K: unsigned codes) less the min times the group's sum of x; rounded to
// bfloat16 unless Mins. tile_rows_bf16's numbers up to float32 rounding.
#define LLMQ_AVX2 __attribute__((target("avx2,fma")))
#define LLMQ_AVX2_F16C __attribute__((target("avx2,fma,f16c")))

LLMQ_AVX2 inline __m256 avx2_scales(const uint16_t* p) {  // 8 bfloat16 widened exactly
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
LLMQ_AVX2 inline __m256 avx2_scales(const float* p) { return _mm256_loadu_ps(p); }

LLMQ_AVX2 inline __m256 avx2_bf16_rounded(__m256 v) {  // c10's rounding to bfloat16 (ties to even; NaN stays NaN)
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))),
                                     _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

// The 8 inputs at i of a tile's half (its rows 8 half to 8 half + 7: w at the chunk, h the INT5 fifth bits of the 32
// inputs i belongs to) as two words of whole codes a row: byte j of lo is input j's code, of hi input 4 + j's.
template <int Bits>
LLMQ_AVX2 inline void avx2_code_words(const uint8_t* w, __m256i h, int64_t i, int half, __m256i& lo, __m256i& hi) {
  const __m256i nibbles = _mm256_set1_epi32(0x0F0F0F0F), fifth = _mm256_set1_epi32(0x10101010);
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * half));
  lo = _mm256_and_si256(words, nibbles);   // byte j: input j's low nibble, input 4 + j's high one
  hi = _mm256_and_si256(_mm256_srli_epi32(words, 4), nibbles);
  if constexpr (Bits == 5) {
    const __m256i hc = _mm256_srl_epi32(h, _mm_cvtsi32_si128(static_cast<int>(i / 8 % 4)));
    lo = _mm256_or_si256(lo, _mm256_and_si256(hc, fifth));
    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi32(hc, 4), fifth));
  }
}

// Input j's codes (of avx2_code_words' 8) as float32.
LLMQ_AVX2 inline __m256 avx2_code(__m256i lo, __m256i hi, int j) {
  const __m256i v = j < 4 ? lo : hi;
  const int shift = 8 * (j % 4);
  const __m256i u = shift ? _mm256_srli_epi32(v, shift) : v;
  return _mm256_cvtepi32_ps(shift == 24 ? u : _mm256_and_si256(u, _mm256_set1_epi32(0xFF)));
}

// INT5: the fifth bits of the next 32 inputs (64 bytes: a word a row), both halves; w advances past them.
LLMQ_AVX2 inline void avx2_fifth_bits(const uint8_t*& w, __m256i (&h)[2]) {
  h[0] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  h[1] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
  w += 64;
}

// One row of x against one tile.
template <int Bits, typename S, bool Mins>
LLMQ_AVX2 void avx2_row(const uint8_t* w, const S* s, const float* mins, const float* x, const float* xsum, int64_t k,
                        int64_t group, float* y) {
  constexpr int A = 2;
  const __m256 offset = _mm256_set1_ps(Mins ? 0.f : static_cast<float>(1 << (Bits - 1)));
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256i h[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int64_t g = 0; g < k / group; ++g) {
    __m256 gacc[2][A] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}, {_mm256_setzero_ps(), _mm256_setzero_ps()}};
    for (int64_t i = g * group; i < (g + 1) * group; i += 8, w += 64) {  // 64 bytes = 16 rows x 8 inputs
      if (Bits == 5 && i % 32 == 0) avx2_fifth_bits(w, h);
      for (int half = 0; half < 2; ++half) {
        __m256i lo, hi;
        avx2_code_words<Bits>(w, h[half], i, half, lo, hi);
        for (int j = 0; j < 8; ++j) {
          gacc[half][j % A] = _mm256_fmadd_ps(avx2_code(lo, hi, j), _mm256_broadcast_ss(x + i + j), gacc[half][j % A]);
        }
      }
    }
    const __m256 xs = _mm256_set1_ps(xsum[g]);
    for (int half = 0; half < 2; ++half) {
      __m256 t = _mm256_add_ps(gacc[half][0], gacc[half][1]);
      t = _mm256_fnmadd_ps(offset, xs, t);  // sum x (u - offset): the offset once a group
      acc[half] = _mm256_fmadd_ps(t, avx2_scales(s + g * kTile + 8 * half), acc[half]);
      if constexpr (Mins) acc[half] = _mm256_fnmadd_ps(xs, avx2_scales(mins + g * kTile + 8 * half), acc[half]);
    }
  }
  for (int half = 0; half < 2; ++half) _mm256_storeu_ps(y + 8 * half, Mins ? acc[half] : avx2_bf16_rounded(acc[half]));
}

// A tile's weight as float32 columns of W^T (wt [K, ld], its 16 columns): (u - offset) s, exact; Q4_K's s u - m in
// two float32 roundings, as llama.cpp's dequantize_row_q4_K computes it.
template <int Bits, typename S, bool Mins>
LLMQ_AVX2 void avx2_dequantize(const uint8_t* w, const S* s, const float* mins, int64_t k, int64_t group, float* wt,
                               int64_t ld) {
  const __m256 offset = _mm256_set1_ps(Mins ? 0.f : static_cast<float>(1 << (Bits - 1)));
  __m256i h[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int64_t i = 0; i < k; i += 8, w += 64) {
    if (Bits == 5 && i % 32 == 0) avx2_fifth_bits(w, h);
    const int64_t g = i / group;
    for (int half = 0; half < 2; ++half) {
      const __m256 sg = avx2_scales(s + g * kTile + 8 * half);
      __m256i lo, hi;
      avx2_code_words<Bits>(w, h[half], i, half, lo, hi);
      for (int j = 0; j < 8; ++j) {
        const __m256 u = avx2_code(lo, hi, j);
        const __m256 v = Mins ? _mm256_sub_ps(_mm256_mul_ps(u, sg), avx2_scales(mins + g * kTile + 8 * half))
                              : _mm256_mul_ps(_mm256_sub_ps(u, offset), sg);
        _mm256_storeu_ps(wt + (i + j) * ld + 8 * half, v);
      }
    }
  }
}

// FP4 (fp4_linear) on the AVX2 loops: an E2M1 code's magnitude looked up by its low 3 bits (vpermps reads only those
// bits of a lane) and its sign bit xored into bit 31 by the code shifted up 28 (its low bits land on 28-30 too, which
// the table holds xored in already, so the xor takes them out again); float32 x, per group the sums times the block
// scale, divided by `divisor`: tile_rows_fp4's numbers up to float32 rounding.
LLMQ_AVX2 inline __m256 avx2_fp4(__m256i words, int j) {  // input j (of 8) of a tile half's rows, as float32
  const __m256 table = _mm256_xor_ps(_mm256_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f),
                                     _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                                           28)));
  const int shift = j < 4 ? 8 * j : 8 * (j - 4) + 4;
  const __m256i u = shift ? _mm256_srli_epi32(words, shift) : words;
  return _mm256_xor_ps(_mm256_permutevar8x32_ps(table, u), _mm256_castsi256_ps(_mm256_slli_epi32(u, 28)));
}

template <typename S>
LLMQ_AVX2 void avx2_fp4_row(const uint8_t* w, const S* s, const float* x, int64_t k, int64_t group, float divisor,
                            float* y) {
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < k / group; ++g) {
    __m256 gacc[2][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}, {_mm256_setzero_ps(), _mm256_setzero_ps()}};
    for (int64_t i = g * group; i < (g + 1) * group; i += 8, w += 64) {
      for (int half = 0; half < 2; ++half) {
        const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * half));
        for (int j = 0; j < 8; ++j) {
          gacc[half][j % 2] = _mm256_fmadd_ps(avx2_fp4(words, j), _mm256_broadcast_ss(x + i + j), gacc[half][j % 2]);
        }
      }
    }
    for (int half = 0; half < 2; ++half) {
      acc[half] = _mm256_fmadd_ps(_mm256_add_ps(gacc[half][0], gacc[half][1]), avx2_scales(s + g * kTile + 8 * half),
                                  acc[half]);
    }
  }
  for (int half = 0; half < 2; ++half) _mm256_storeu_ps(y + 8 * half, _mm256_div_ps(acc[half], _mm256_set1_ps(divisor)));
}

template <typename S>  // a tile's FP4 weight as float32 columns of W^T: code value times block scale
LLMQ_AVX2 void avx2_fp4_dequantize(const uint8_t* w, const S* s, int64_t k, int64_t group, float* wt, int64_t ld) {
  for (int64_t i = 0; i < k; i += 8, w += 64) {
    for (int half = 0; half < 2; ++half) {
      const __m256 sg = avx2_scales(s + i / group * kTile + 8 * half);
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * half));
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(wt + (i + j) * ld + 8 * half, _mm256_mul_ps(avx2_fp4(words, j), sg));
    }
  }
}

// Block FP8 (fp8_linear) on the AVX2 loops. Input j's E4M3 codes (byte j of each lane: a row's four inputs) as
// float32 in four instructions: the byte shifted to the top of the lane and arithmetically back by 4 puts its sign at
// bit 31, its 4 exponent bits at float32's lowest exponent bits and its 3 mantissa bits at the top of float32's
// mantissa; masked, that is the float 2^(e - 127) (1 + m / 8) (a float32 subnormal m 2^-129 for e = 0), and times
// 2^120 the E4M3 value, exactly, subnormal codes included (their multiply needs denormal inputs honoured: the loops
// clear MXCSR's DAZ bit while they run, FlushDenormals). Code 0x7F (NaN, which no quantizer writes) reads as 480.
LLMQ_AVX2 inline __m256 avx2_e4m3(__m256i words, int j) {
  const __m256i top = j == 3 ? words : _mm256_slli_epi32(words, 24 - 8 * j);
  const __m256i bits = _mm256_and_si256(_mm256_srai_epi32(top, 4), _mm256_set1_epi32(static_cast<int>(0x87F00000u)));
  return _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0x1p120f));
}

// MXCSR with DAZ (denormals read as zero) cleared for a scope on this thread, as it was before afterwards.
struct HonourDenormals {
  const unsigned csr = _mm_getcsr();
  HonourDenormals() { _mm_setcsr(csr & ~0x40u); }
  ~HonourDenormals() { _mm_setcsr(csr); }
};

// fp8_row on AVX2: the same E4M3 rounding (the exponent from the float's bits, at least -6; the value scaled by
// 2^(3 - e), rounded to nearest even, scaled back), bfloat16 bits out. k and group multiples of 8.
LLMQ_AVX2 void avx2_fp8_round(const float* x, int64_t k, int64_t group, float eps, uint16_t* q, float* xs) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t g = 0, i0 = 0; i0 < k; ++g, i0 += group) {
    const int64_t end = std::min(i0 + group, k);
    __m256 mx = _mm256_setzero_ps();
    for (int64_t i = i0; i < end; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, mx);
    const float s = std::max(*std::max_element(lanes, lanes + 8), eps) / 448.f;
    xs[g] = s;
    const __m256 sv = _mm256_set1_ps(s), top = _mm256_set1_ps(448.f), bottom = _mm256_set1_ps(-448.f);
    for (int64_t i = i0; i < end; i += 8) {
      const __m256 v = _mm256_max_ps(_mm256_min_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), sv), top), bottom);
      const __m256i e = _mm256_max_epi32(
          _mm256_sub_epi32(_mm256_srli_epi32(_mm256_castps_si256(_mm256_and_ps(v, abs_mask)), 23),
                           _mm256_set1_epi32(127)), _mm256_set1_epi32(-6));
      const __m256 up = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(_mm256_set1_epi32(130), e), 23));
      const __m256 down = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(124)), 23));
      const __m256 r = _mm256_mul_ps(_mm256_round_ps(_mm256_mul_ps(v, up), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                     down);
      const __m256i b = _mm256_srli_epi32(_mm256_castps_si256(r), 16);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i),
                       _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
    }
  }
}

// One row of x (its E4M3 values as float32, xs its group scales) against one tile of E4M3 codes in the INT8 tiles
// (64 bytes: 16 rows x 4 inputs, a 32-bit word a row): each product exact, float32 sums, per group times the row's
// weight scale and the group's activation scale; float32 out. tile_rows_fp8's numbers up to float32 summation order.
LLMQ_AVX2 void avx2_fp8_row(const uint8_t* w, const float* s, const float* x, const float* xs, int64_t k,
                            int64_t group, float* y) {
  const HonourDenormals denormals;
  const int64_t groups = (k + group - 1) / group;
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < groups; ++g) {
    __m256 gacc[2][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}, {_mm256_setzero_ps(), _mm256_setzero_ps()}};
    const int64_t end = std::min((g + 1) * group, k);
    for (int64_t i = g * group; i < end; i += 4, w += 64) {
      for (int half = 0; half < 2; ++half) {
        const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * half));
        for (int j = 0; j < 4; ++j) {
          gacc[half][j % 2] = _mm256_fmadd_ps(avx2_e4m3(words, j), _mm256_broadcast_ss(x + i + j), gacc[half][j % 2]);
        }
      }
    }
    const __m256 xg = _mm256_set1_ps(xs[g]);
    for (int half = 0; half < 2; ++half) {
      acc[half] = _mm256_fmadd_ps(_mm256_add_ps(gacc[half][0], gacc[half][1]),
                                  _mm256_mul_ps(_mm256_loadu_ps(s + g * kTile + 8 * half), xg), acc[half]);
    }
  }
  for (int half = 0; half < 2; ++half) _mm256_storeu_ps(y + 8 * half, acc[half]);
}

// A tile's block-FP8 weight as float32 columns of W^T: the E4M3 value times its row's group scale.
LLMQ_AVX2 void avx2_fp8_dequantize(const uint8_t* w, const float* s, int64_t k, int64_t group, float* wt, int64_t ld) {
  const HonourDenormals denormals;
  for (int64_t i = 0; i < k; i += 4, w += 64) {
    for (int half = 0; half < 2; ++half) {
      const __m256 sg = _mm256_loadu_ps(s + i / group * kTile + 8 * half);
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * half));
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(wt + (i + j) * ld + 8 * half, _mm256_mul_ps(avx2_e4m3(words, j), sg));
    }
  }
}

// bitsandbytes NF4 / FP4 (table_linear) on the AVX2 loops: input j (of 8) of a tile half's rows (INT4 layout) looked
// up in the 16-value table (two vpermps on the code's low 3 bits, blended by its fourth, moved to the sign bit), times
// the block's absmax, rounded to the checkpoint's dtype as tile_rows_table rounds it (Round: 0 float32, 1 bfloat16,
// 2 float16).
LLMQ_AVX2 inline __m256 avx2_table_value(__m256i words, int j, __m256 lo, __m256 hi) {   // table[u] alone
  const int shift = j < 4 ? 8 * j : 8 * (j - 4) + 4;
  const __m256i u = shift ? _mm256_srli_epi32(words, shift) : words;
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, u), _mm256_permutevar8x32_ps(hi, u),
                          _mm256_castsi256_ps(_mm256_slli_epi32(u, 28)));
}

template <int Round>
LLMQ_AVX2_F16C inline __m256 avx2_table(__m256i words, int j, __m256 lo, __m256 hi, __m256 sg) {
  const __m256 v = _mm256_mul_ps(avx2_table_value(words, j, lo, hi), sg);
  if constexpr (Round == 1) return avx2_bf16_rounded(v);
  if constexpr (Round == 2) return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  return v;
}

// One row of float32 x against one tile: float32 sums, float32 out. Float32 weights (Round 0) take the absmax once a
// block, on the block's sum of x times the table values (the same terms, rounded once a block instead of a weight).
template <int Round>
LLMQ_AVX2_F16C void avx2_table_row(const uint8_t* w, const float* s, const float* table16, const float* x, int64_t k,
                                   int64_t group, float* y) {
  const __m256 lo = _mm256_loadu_ps(table16), hi = _mm256_loadu_ps(table16 + 8), one = _mm256_set1_ps(1.f);
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int64_t g = 0; g < k / group; ++g) {
    __m256 gacc[2][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}, {_mm256_setzero_ps(), _mm256_setzero_ps()}};
    for (int64_t i = g * group; i < (g + 1) * group; i += 8, w += 64) {
      for (int half = 0; half < 2; ++half) {
        const __m256 sg = Round == 0 ? one : _mm256_loadu_ps(s + g * kTile + 8 * half);
        const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * half));
        for (int j = 0; j < 8; ++j) {
          const __m256 v = Round == 0 ? avx2_table_value(words, j, lo, hi) : avx2_table<Round>(words, j, lo, hi, sg);
          gacc[half][j % 2] = _mm256_fmadd_ps(v, _mm256_broadcast_ss(x + i + j), gacc[half][j % 2]);
        }
      }
    }
    for (int half = 0; half < 2; ++half) {
      const __m256 t = _mm256_add_ps(gacc[half][0], gacc[half][1]);
      acc[half] = Round == 0 ? _mm256_fmadd_ps(t, _mm256_loadu_ps(s + g * kTile + 8 * half), acc[half])
                             : _mm256_add_ps(t, acc[half]);
    }
  }
  for (int half = 0; half < 2; ++half) _mm256_storeu_ps(y + 8 * half, acc[half]);
}

template <int Round>  // a tile's weights, rounded as avx2_table rounds them, as float32 columns of W^T
LLMQ_AVX2_F16C void avx2_table_dequantize(const uint8_t* w, const float* s, const float* table16, int64_t k,
                                          int64_t group, float* wt, int64_t ld) {
  const __m256 lo = _mm256_loadu_ps(table16), hi = _mm256_loadu_ps(table16 + 8);
  for (int64_t i = 0; i < k; i += 8, w += 64) {
    for (int half = 0; half < 2; ++half) {
      const __m256 sg = _mm256_loadu_ps(s + i / group * kTile + 8 * half);
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32 * half));
      for (int j = 0; j < 8; ++j) {
        _mm256_storeu_ps(wt + (i + j) * ld + 8 * half, avx2_table<Round>(words, j, lo, hi, sg));
      }
    }
  }
}

std::atomic<bool> avx2_forced{false};  // avx2_only: the AVX2 loops on a CPU with AVX-512 too

bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// Over every tile (threads split the tiles) and every row of x: row(tile, row), for the AVX2 loops' one-row kernels.
template <typename Row>
void for_tile_rows(int64_t tiles, int64_t m, const Row& row) {
  at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      for (int64_t r = 0; r < m; ++r) row(t, r);
    }
  });
}

constexpr int64_t kAvx2BlasFrom = 6;  // rows from which the dequantized weight on the BLAS is faster (a Zen 2)
constexpr int64_t kAvx2Chunk = 16;    // tiles dequantized for one BLAS call: 256 output rows

// y [m, n] = x [m, k] times the weight fill(tile, wt, ld) writes (a tile's 16 float32 columns of W^T) on the BLAS,
// kAvx2Chunk tiles at a time, into a buffer the thread keeps (a fresh one faulted its pages in on every call);
// each chunk's product through finish before it is stored.
template <typename Fill, typename Finish>
void blas_chunks(const float* x, int64_t m, int64_t k, int64_t tiles, float* y, const Fill& fill, const Finish& finish) {
  const int64_t n = tiles * kTile;
  const at::Tensor xt = at::from_blob(const_cast<float*>(x), {m, k}, at::kFloat);
  const at::Tensor yt = at::from_blob(y, {m, n}, at::kFloat);
  thread_local std::vector<float> buffer;
  buffer.resize(std::max<size_t>(buffer.size(), k * kAvx2Chunk * kTile));
  float* wp = buffer.data();
  for (int64_t t0 = 0; t0 < tiles; t0 += kAvx2Chunk) {
    const int64_t t1 = std::min(tiles, t0 + kAvx2Chunk), cols = (t1 - t0) * kTile;
    at::parallel_for(t0, t1, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t t = lo; t < hi; ++t) fill(t, wp + (t - t0) * kTile, cols);
    });
    yt.narrow(1, t0 * kTile, cols).copy_(finish(at::mm(xt, at::from_blob(wp, {k, cols}, at::kFloat))));
  }
}

// The product on the AVX2 loops: a row at a time (avx2_row) for decode; from kAvx2BlasFrom rows, bfloat16(x)
// times the dequantized weight on the BLAS (the same exact products, summed in another order).
template <int Bits, typename S, bool Mins>
void avx2_product(const float* x, int64_t m, int64_t k, const uint8_t* w, const S* s, const float* mins,
                      int64_t tiles, int64_t groups, int64_t group, float* y) {
  TORCH_CHECK(has_avx2(), "llmq's INT4-tile kernels need a CPU with AVX2 and FMA at least");
  std::vector<float> xb(m * k), xsum(m * groups);  // x rounded to bfloat16 as c10 rounds (float32), its group sums
  for (int64_t i = 0; i < m * k; ++i) xb[i] = static_cast<float>(c10::BFloat16(x[i]));
  for (int64_t i = 0; i < m * groups; ++i) {
    xsum[i] = std::accumulate(xb.begin() + i * group, xb.begin() + (i + 1) * group, 0.f);
  }
  const int64_t tile_bytes = kTile * k * Bits / 8, n = tiles * kTile;
  if (m >= kAvx2BlasFrom) {
    const auto fill = [&](int64_t t, float* wt, int64_t ld) {
      avx2_dequantize<Bits, S, Mins>(w + t * tile_bytes, s + t * groups * kTile,
                                     Mins ? mins + t * groups * kTile : nullptr, k, group, wt, ld);
    };
    blas_chunks(xb.data(), m, k, tiles, y, fill, [](const at::Tensor& c) { return Mins ? c : c.to(at::kBFloat16); });
    return;
  }
  for_tile_rows(tiles, m, [&](int64_t t, int64_t r) {
    avx2_row<Bits, S, Mins>(w + t * tile_bytes, s + t * groups * kTile, Mins ? mins + t * groups * kTile : nullptr,
                            xb.data() + r * k, xsum.data() + r * groups, k, group, y + r * n + t * kTile);
  });
}


// Whether lowbit_linear_bf16 (INT4 / INT5), q4k_linear and fp4_linear take their AVX2 loops on a CPU with AVX-512
// too (tests compare the two paths on one machine); returns the setting.
bool avx2_only(bool force) {
  avx2_forced = force;
  return force;
}

// x [M, K] (any float dtype) times a packed symmetric INT4 / INT5 / INT8 weight with bfloat16 scales (as PyTorch's
// kernels hold them) -> [M, N] float32 holding bfloat16 values (the callers compute in float32: no conversion on the
// way). INT8 needs AVX-512; INT4 / INT5 run on AVX512-BF16 below, elsewhere on the AVX2 loops (avx2_product).
at::Tensor lowbit_linear_bf16(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, int64_t bits,
                              int64_t group) {
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 8, "lowbit_linear_bf16: bits must be 4, 5 or 8");
  const bool avx512 = __builtin_cpu_supports("avx512bw") && (bits == 8 || __builtin_cpu_supports("avx512bf16"));
  TORCH_CHECK(avx512 || bits != 8, "lowbit_linear_bf16 needs a CPU with AVX-512 for INT8");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "lowbit_linear_bf16: x must be a 2-D CPU tensor");
  TORCH_CHECK(w.dtype() == at::kByte && s.dtype() == at::kBFloat16 && s.dim() == 3 && s.size(2) == kTile &&
              w.is_contiguous() && s.is_contiguous(), "lowbit_linear_bf16: bad packed weight (bfloat16 scales)");
  const int64_t m = x.size(0), k = x.size(1), tiles = s.size(0), groups = s.size(1), n = tiles * kTile;
  TORCH_CHECK(group % (bits == 5 ? 32 : 8) == 0 && groups * group == k && w.numel() == n * k * bits / 8,
              "lowbit_linear_bf16: K=", k,
              " does not fit ", groups, " groups of ", group, " or a ", w.numel(), "-byte weight");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({m, n}, at::kFloat);
  const float* src = xf.data_ptr<float>();
  const auto* wp = w.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(s.data_ptr());
  float* yp = y.data_ptr<float>();
  const int64_t tile_bytes = kTile * k * bits / 8;
  if (bits != 8 && (!avx512 || avx2_forced)) {
    if (bits == 5) avx2_product<5, uint16_t, false>(src, m, k, wp, sp, nullptr, tiles, groups, group, yp);
    else avx2_product<4, uint16_t, false>(src, m, k, wp, sp, nullptr, tiles, groups, group, yp);
    return y;
  }
  if (use_amx(m, k, bits == 8 ? kAmxFromInt8 : kAmxFromInt4)) {
    if (bits == 4) amx_product<Codes::kInt4>(src, m, k, wp, sp, tiles, groups, group, 1.f, yp);
    else if (bits == 5) amx_product<Codes::kInt5>(src, m, k, wp, sp, tiles, groups, group, 1.f, yp);
    else amx_product<Codes::kInt8>(src, m, k, wp, sp, tiles, groups, group, 1.f, yp);
    return y;
  }
  if (bits == 8 && m >= kPairRows && __builtin_cpu_supports("avx512bf16")) {
    std::vector<uint32_t> xp(m * k / 2);
    for (int64_t r = 0; r < m; ++r) bf16_pairs(src + r * k, k, xp.data() + r * k / 2);
    at::parallel_for(0, tiles, 1, [&](int64_t lo, int64_t hi) {
      std::vector<uint32_t> pairs(k / 2 * kTile);
      for (int64_t t = lo; t < hi; ++t) {
        int8_tile_pairs(wp + t * tile_bytes, k, pairs.data());
        const uint16_t* st = sp + t * groups * kTile;
        float* yt = yp + t * kTile;
        int64_t r = 0;
        for (; r + 8 <= m; r += 8) pair_rows_bf16<8>(pairs.data(), st, xp.data() + r * k / 2, k, group, yt + r * n, n);
        for (; r + 4 <= m; r += 4) pair_rows_bf16<4>(pairs.data(), st, xp.data() + r * k / 2, k, group, yt + r * n, n);
        for (; r < m; ++r) pair_rows_bf16<1>(pairs.data(), st, xp.data() + r * k / 2, k, group, yt + r * n, n);
      }
    });
    return y;
  }
  if (bits == 8) {
    std::vector<float> xb(m * k), xsum(m * groups);  // x rounded to bfloat16 as c10 rounds, in float32
    round_groups(src, m * groups, group, xb.data(), xsum.data());
    const auto rows = [&](auto r_const) {
      return [&, r_const](int64_t t, int64_t r) {
        tile_rows_int8_bf16<decltype(r_const)::value>(wp + t * tile_bytes, sp + t * groups * kTile, xb.data() + r * k,
                                                      xsum.data() + r * groups, k, group, yp + r * n + t * kTile, n);
      };
    };
    for_tiles<0>(tiles, m, rows);
    return y;
  }
  std::vector<uint32_t> xp(m * k / 2);
  for (int64_t r = 0; r < m; ++r) bf16_pairs(src + r * k, k, xp.data() + r * k / 2);
  const auto rows = [&](auto r_const) {
    return [&, r_const](int64_t t, int64_t r) {
      constexpr int R = decltype(r_const)::value;
      const uint16_t* st = sp + t * groups * kTile;
      const uint32_t* xr = xp.data() + r * k / 2;
      float* yr = yp + r * n + t * kTile;
      if (bits == 5) tile_rows_bf16<R, 5>(wp + t * tile_bytes, st, xr, k, group, yr, n);
      else tile_rows_bf16<R, 4>(wp + t * tile_bytes, st, xr, k, group, yr, n);
    };
  };
  for_tiles<8>(tiles, m, rows);  // 8 rows share each unpacked weight vector (16 sums in registers): +5% at 32+ rows
  return y;
}

// Block FP8's activations x [M, K] rounded per row and group as the layer rounds them (fp8_row): their bfloat16 bits
// (`rows` >= M rows, zeros past M) and scales [M, groups].
std::pair<std::vector<uint16_t>, at::Tensor> fp8_rows(const at::Tensor& x, int64_t group, double eps, int64_t rows) {
  const bool avx512 = __builtin_cpu_supports("avx512bw") && !avx2_forced;
  TORCH_CHECK(avx512 || has_avx2(), "fp8_token_groups needs a CPU with AVX-512, or AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && group > 0, "fp8_token_groups: x must be a 2-D CPU tensor");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t m = xf.size(0), k = xf.size(1), groups = (k + group - 1) / group;
  std::vector<uint16_t> q(std::max(rows, m) * k, 0);
  at::Tensor xs = at::empty({m, groups}, at::kFloat);
  const float* xp = xf.data_ptr<float>();
  float* sp = xs.data_ptr<float>();
  at::parallel_for(0, m, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      if (avx512) {
        fp8_row(xp + r * k, k, group, static_cast<float>(eps), q.data() + r * k, sp + r * groups);
      } else {
        avx2_fp8_round(xp + r * k, k, group, static_cast<float>(eps), q.data() + r * k, sp + r * groups);
      }
    }
  });
  return {std::move(q), xs};
}

// fp8_rows' rounding as tensors: (values [M, K], scales [M, groups]), float32.
std::tuple<at::Tensor, at::Tensor> fp8_token_groups(const at::Tensor& x, int64_t group, double eps) {
  auto [q, xs] = fp8_rows(x, group, eps, 0);
  at::Tensor values = at::empty(x.sizes(), at::kFloat);
  float* vp = values.data_ptr<float>();
  for (size_t i = 0; i < q.size(); ++i) {
    const uint32_t bits = static_cast<uint32_t>(q[i]) << 16;
    std::memcpy(vp + i, &bits, sizeof bits);
  }
  return {values, xs};
}

// Block FP8 (W8A8; E4M3 weight bytes in the INT8 tiles, a float32 scale per row and group of `group` inputs) times x
// rounded to E4M3 per row and group (fp8_token_groups): every product exact, float32 sums, times both scales per
// group; float32 out. From kAmxFromFp8 rows on AMX where Linux grants it (amx_fp8_tiles), else the vector kernel.
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, int64_t group, double eps) {
  const bool avx512 = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi") &&
                      __builtin_cpu_supports("avx512bf16") && !avx2_forced;
  TORCH_CHECK(avx512 || has_avx2(), "fp8_linear needs a CPU with AVX512-VBMI and AVX512-BF16, or AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "fp8_linear: x must be a 2-D CPU tensor");
  TORCH_CHECK(w.dtype() == at::kByte && s.dtype() == at::kFloat && s.dim() == 3 && s.size(2) == kTile &&
              w.is_contiguous() && s.is_contiguous(), "fp8_linear: bad packed weight (float32 scales)");
  const int64_t m = x.size(0), k = x.size(1), tiles = s.size(0), groups = s.size(1), n = tiles * kTile;
  TORCH_CHECK(group % 8 == 0 && k % 8 == 0 && groups == (k + group - 1) / group && w.numel() == n * k,
              "fp8_linear: K=", k, " does not fit ", groups, " groups of ", group, " or a ", w.numel(), "-byte weight");
  const bool tile_unit = avx512 && use_amx(m, k, kAmxFromFp8) && group % 32 == 0;
  const auto rounded = fp8_rows(x, group, eps, tile_unit ? (m + 15) / 16 * 16 : m);  // AMX: whole 16-row tiles
  const std::vector<uint16_t>& xb = rounded.first;
  const at::Tensor& xs = rounded.second;
  at::Tensor y = at::empty({m, n}, at::kFloat);
  const auto* wp = w.data_ptr<uint8_t>();
  const float *sp = s.data_ptr<float>(), *xsp = xs.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (tile_unit) {
    at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t lo, int64_t hi) {
      amx_fp8_tiles(lo, hi, xb.data(), xsp, m, k, tiles, groups, group, wp, sp, yp);
    });
    return y;
  }
  if (!avx512) {   // the AVX2 loops: a row at a time, or from kAvx2BlasFrom rows x (its values times their group
    std::vector<float> xf(m * k);   // scales) times the dequantized weight on the BLAS
    for (int64_t i = 0; i < m * k; ++i) {
      const uint32_t bits = static_cast<uint32_t>(xb[i]) << 16;
      std::memcpy(&xf[i], &bits, sizeof bits);
    }
    if (m >= kAvx2BlasFrom) {
      for (int64_t r = 0; r < m; ++r) {
        for (int64_t i = 0; i < k; ++i) xf[r * k + i] *= xsp[r * groups + i / group];
      }
      const auto fill = [&](int64_t t, float* wt, int64_t ld) {
        avx2_fp8_dequantize(wp + t * kTile * k, sp + t * groups * kTile, k, group, wt, ld);
      };
      blas_chunks(xf.data(), m, k, tiles, yp, fill, [](const at::Tensor& c) { return c; });
      return y;
    }
    for_tile_rows(tiles, m, [&](int64_t t, int64_t r) {
      avx2_fp8_row(wp + t * kTile * k, sp + t * groups * kTile, xf.data() + r * k, xsp + r * groups, k, group,
                   yp + r * n + t * kTile);
    });
    return y;
  }
  const auto rows = [&](auto r_const) {
    return [&, r_const](int64_t t, int64_t r) {
      tile_rows_fp8<decltype(r_const)::value>(wp + t * kTile * k, sp + t * groups * kTile, xb.data() + r * k,
                                              xsp + r * groups, k, group, yp + r * n + t * kTile, n);
    };
  };
  for_tiles<8>(tiles, m, rows);
  return y;
}

// GGML's Q4_K (unsigned 4-bit codes u in the INT4 tiles; per group of 32 a float32 scale s and min m: the weight is
// s u - m, llama.cpp's dequantized value up to its one float32 rounding) x 16-bit activations, on AVX512-BF16:
// bfloat16(x) times the exact s u, less m times the group's sum of bfloat16(x), float32 sums and out. Prefill shares
// each unpacked weight vector across 8 rows, or runs on AMX (q4k_weight_pairs: s u - m in three bfloat16 planes).
at::Tensor q4k_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, const at::Tensor& mins,
                      int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "q4k_linear: x must be a 2-D CPU tensor");
  TORCH_CHECK(w.dtype() == at::kByte && s.dtype() == at::kFloat && mins.dtype() == at::kFloat && s.dim() == 3 &&
              s.size(2) == kTile && mins.sizes() == s.sizes() && w.is_contiguous() && s.is_contiguous() &&
              mins.is_contiguous(), "q4k_linear: bad packed weight (float32 scales and mins)");
  const int64_t m = x.size(0), k = x.size(1), tiles = s.size(0), groups = s.size(1), n = tiles * kTile;
  TORCH_CHECK(group % 8 == 0 && groups * group == k && w.numel() == n * k / 2, "q4k_linear: K=", k,
              " does not fit ", groups, " groups of ", group, " or a ", w.numel(), "-byte weight");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const float* src = xf.data_ptr<float>();
  at::Tensor y = at::empty({m, n}, at::kFloat);
  const auto* wp = w.data_ptr<uint8_t>();
  const float *sp = s.data_ptr<float>(), *mp = mins.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (!(__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512bf16")) || avx2_forced) {
    avx2_product<4, float, true>(src, m, k, wp, sp, mp, tiles, groups, group, yp);
    return y;
  }
  if (use_amx(m, k, kAmxFromQ4k)) {
    const std::vector<uint32_t> xa = amx_x(src, m, k, false);
    const auto fill = [&](int64_t t, uint32_t* b) {
      q4k_weight_pairs(wp + t * kTile * k / 2, sp + t * groups * kTile, mp + t * groups * kTile, k, group, b);
    };
    const auto store = [&](int64_t t, const float* c, int64_t r0, int64_t rows) {
      amx_store(c, rows, kTile, nullptr, 1.f, false, yp + r0 * n + t * kTile, n);
    };
    at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t lo, int64_t hi) {
      amx_tiles(lo, hi, xa.data(), 1, m, k, tiles, 3, fill, store);
    });
    return y;
  }
  std::vector<uint32_t> xp(m * k / 2);
  std::vector<float> xb(m * k), xsum(m * groups);
  for (int64_t r = 0; r < m; ++r) bf16_pairs(src + r * k, k, xp.data() + r * k / 2);
  round_groups(src, m * groups, group, xb.data(), xsum.data());
  const auto rows = [&](auto r_const) {
    return [&, r_const](int64_t t, int64_t r) {
      tile_rows_bf16<decltype(r_const)::value, 4, float, true>(wp + t * kTile * k / 2, sp + t * groups * kTile,
                                                               xp.data() + r * k / 2, k, group, yp + r * n + t * kTile,
                                                               n, mp + t * groups * kTile, xsum.data() + r * groups);
    };
  };
  for_tiles<8>(tiles, m, rows);
  return y;
}

// FP4 weights (NVFP4 / MXFP4) in the INT4 layout, times float32 activations: each nibble an E2M1 code (bit 3 the
// sign), decoded exactly to float32 by one table register (vpermps reads only an index's low 4 bits, so a lane shifted
// to its nibble is the index); per group the 16 rows' sums times the block scale (E4M3 / E8M0, exact in bfloat16),
// and the output divided by `divisor` (NVFP4's global scale, times the input's for W4A4). F.linear's numbers on
// quant.dequantize_fp4's weight, up to float32 rounding: the FP4 layers' arithmetic (runtime/layers/fp4.py).
template <int R, typename S>
LLMQ_AVX512 void tile_rows_fp4(const uint8_t* w, const S* s, const float* x, int64_t k, int64_t group, float divisor,
                               float* y, int64_t n) {
  constexpr int A = R == 1 ? 4 : 2;  // independent sums a row
  const __m512 table = _mm512_setr_ps(0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f,
                                      -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f);
  __m512 acc[R];
  zeros<R>(acc);
  for (int64_t g = 0; g < k / group; ++g) {
    __m512 gacc[R][A];
    zeros<R * A>(&gacc[0][0]);
    for (int64_t i = g * group; i < (g + 1) * group; i += 8, w += 64) {  // 64 bytes = 16 rows x 8 inputs
      _mm_prefetch(reinterpret_cast<const char*>(w) + 2048, _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(w);
      for (int j = 0; j < 8; ++j) {  // input i + j: byte j % 4 of each lane, low nibble for j < 4
        const __m512 wj = _mm512_permutexvar_ps(_mm512_srli_epi32(v, j < 4 ? 8 * j : 8 * (j - 4) + 4), table);
        for (int r = 0; r < R; ++r) {
          gacc[r][j % A] = _mm512_fmadd_ps(wj, _mm512_set1_ps(x[r * k + i + j]), gacc[r][j % A]);
        }
      }
    }
    fold_group<R, A>(gacc, load_scales(s + g * kTile), acc);
  }
  const __m512 d = _mm512_set1_ps(divisor);
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + r * n, _mm512_div_ps(acc[r], d));
}

// bitsandbytes' NF4 / FP4 (4-bit codes in the INT4 layout, a float32 absmax per row and block of `group` inputs):
// each weight table[u] * absmax in float32, rounded to the checkpoint's dtype (Round: 0 float32, 1 bfloat16,
// 2 float16) as bitsandbytes' dequantize makes it, times float32 x, float32 sums: F.linear on that weight up to
// summation order.
template <int R, int Round>
LLMQ_AVX512 void tile_rows_table(const uint8_t* w, const float* s, const float* table16, const float* x, int64_t k,
                                 int64_t group, float* y, int64_t n) {
  constexpr int A = R == 1 ? 4 : 2;  // independent sums a row
  const __m512 table = _mm512_loadu_ps(table16);
  __m512 acc[R][A];
  zeros<R * A>(&acc[0][0]);
  for (int64_t g = 0; g < k / group; ++g) {
    const __m512 sg = _mm512_loadu_ps(s + g * kTile);
    for (int64_t i = g * group; i < (g + 1) * group; i += 8, w += 64) {  // 64 bytes = 16 rows x 8 inputs
      _mm_prefetch(reinterpret_cast<const char*>(w) + 2048, _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(w);
      for (int j = 0; j < 8; ++j) {  // input i + j: byte j % 4 of each lane, low nibble for j < 4
        __m512 wj = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(v, j < 4 ? 8 * j : 8 * (j - 4) + 4), table),
                                  sg);
        if constexpr (Round == 1) wj = round_bf16(wj);
        if constexpr (Round == 2) wj = _mm512_cvtph_ps(_mm512_cvtps_ph(wj, _MM_FROUND_TO_NEAREST_INT));
        for (int r = 0; r < R; ++r) acc[r][j % A] = _mm512_fmadd_ps(wj, _mm512_set1_ps(x[r * k + i + j]), acc[r][j % A]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512 t = acc[r][0];
    for (int a = 1; a < A; ++a) t = _mm512_add_ps(t, acc[r][a]);
    _mm512_storeu_ps(y + r * n, t);
  }
}

// A bitsandbytes NF4 / FP4 tile's weights, each table[u] * absmax rounded as tile_rows_table rounds it, as AMX B
// planes [K/2][16] that sum to it exactly: one for bfloat16 weights, two for float16, three for float32.
template <int Round>
LLMQ_AVX512 inline __m512 table_value(__m512 u, __m512 table, __m512 sg) {  // u: the codes as float32
  __m512 v = _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_cvttps_epi32(u), table), sg);
  if constexpr (Round == 1) v = round_bf16(v);
  if constexpr (Round == 2) v = _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  return v;
}

template <int Round>
LLMQ_AVX512 void table_weight_pairs(const uint8_t* w, const float* s, const float* table16, int64_t k, int64_t group,
                                    uint32_t* b) {
  const __m512i codes = int_table<4>(0);
  const __m512 table = _mm512_loadu_ps(table16);
  for (int64_t i = 0; i < k; i += 8, w += 64) {
    const __m512 sg = _mm512_loadu_ps(s + i / group * kTile);
    __m512i p[4];
    int4_pairs(_mm512_loadu_si512(w), codes, p);
    for (int j = 0; j < 4; ++j)
      split_planes(table_value<Round>(even(p[j]), table, sg), table_value<Round>(odd(p[j]), table, sg),
                   b + (i / 2 + j) * kTile, k / 2 * kTile, Round == 1 ? 1 : Round == 2 ? 2 : 3);
  }
}

at::Tensor table_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, const at::Tensor& table,
                        int64_t group, int64_t round) {
  const bool avx512 = __builtin_cpu_supports("avx512bw") && !avx2_forced;
  TORCH_CHECK(avx512 || (has_avx2() && __builtin_cpu_supports("f16c")),
              "table_linear needs a CPU with AVX-512, or AVX2, FMA and F16C");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "table_linear: x must be a 2-D CPU tensor");
  TORCH_CHECK(w.dtype() == at::kByte && s.dtype() == at::kFloat && s.dim() == 3 && s.size(2) == kTile &&
              w.is_contiguous() && s.is_contiguous() && table.dtype() == at::kFloat && table.numel() == 16 &&
              table.is_contiguous() && round >= 0 && round <= 2, "table_linear: bad packed weight");
  const int64_t m = x.size(0), k = x.size(1), tiles = s.size(0), groups = s.size(1), n = tiles * kTile;
  TORCH_CHECK(group % 8 == 0 && groups * group == k && w.numel() == n * k / 2, "table_linear: K=", k,
              " does not fit ", groups, " groups of ", group, " or a ", w.numel(), "-byte weight");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const bool x16 = x.scalar_type() == at::kBFloat16;
  at::Tensor y = at::empty({m, n}, at::kFloat);
  const float *xp = xf.data_ptr<float>(), *sp = s.data_ptr<float>(), *tp = table.data_ptr<float>();
  const auto* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const auto run = [&](auto round_const) {
    constexpr int round_v = decltype(round_const)::value, planes = round_v == 1 ? 1 : round_v == 2 ? 2 : 3;
    if (!avx512) {   // the AVX2 loops: a row at a time, or from kAvx2BlasFrom rows the rounded weight on the BLAS
      if (m >= kAvx2BlasFrom) {
        const auto fill = [&](int64_t t, float* wt, int64_t ld) {
          avx2_table_dequantize<round_v>(wp + t * kTile * k / 2, sp + t * groups * kTile, tp, k, group, wt, ld);
        };
        blas_chunks(xp, m, k, tiles, yp, fill, [](const at::Tensor& c) { return c; });
        return;
      }
      for_tile_rows(tiles, m, [&](int64_t t, int64_t r) {
        avx2_table_row<round_v>(wp + t * kTile * k / 2, sp + t * groups * kTile, tp, xp + r * k, k, group,
                                yp + r * n + t * kTile);
      });
      return;
    }
    // x in three exact parts (one where it is bfloat16) times the weights' planes, where that is at most three tile
    // products a step (more lose to the vector path: benchmarks/bench_lowbit_products.py)
    if ((x16 ? 1 : 3) * planes <= 3 && use_amx(m, k, kAmxFromTable)) {
      const std::vector<uint32_t> xa = amx_x(xp, m, k, !x16);
      const auto fill = [&](int64_t t, uint32_t* b) {
        table_weight_pairs<round_v>(wp + t * kTile * k / 2, sp + t * groups * kTile, tp, k, group, b);
      };
      const auto store = [&](int64_t t, const float* c, int64_t r0, int64_t rows) {
        amx_store(c, rows, kTile, nullptr, 1.f, false, yp + r0 * n + t * kTile, n);
      };
      at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t lo, int64_t hi) {
        amx_tiles(lo, hi, xa.data(), x16 ? 1 : 3, m, k, tiles, planes, fill, store);
      });
      return;
    }
    const auto rows = [&](auto r_const) {
      return [&, r_const](int64_t t, int64_t r) {
        tile_rows_table<decltype(r_const)::value, decltype(round_const)::value>(
            wp + t * kTile * k / 2, sp + t * groups * kTile, tp, xp + r * k, k, group, yp + r * n + t * kTile, n);
      };
    };
    for_tiles<0>(tiles, m, rows);
  };
  if (round == 1) run(std::integral_constant<int, 1>{});
  else if (round == 2) run(std::integral_constant<int, 2>{});
  else run(std::integral_constant<int, 0>{});
  return y;
}

// x [M, K] (any float dtype) times a packed FP4 weight (codes in the INT4 layout, block scales per (tile, group, row)
// in bfloat16 or float32) -> [M, N] float32, divided by `divisor`.
at::Tensor fp4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& s, int64_t group, double divisor) {
  const bool avx512 = __builtin_cpu_supports("avx512bw") && !avx2_forced;
  TORCH_CHECK(avx512 || has_avx2(), "fp4_linear needs a CPU with AVX-512, or AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "fp4_linear: x must be a 2-D CPU tensor");
  TORCH_CHECK(w.dtype() == at::kByte && (s.dtype() == at::kBFloat16 || s.dtype() == at::kFloat) && s.dim() == 3 &&
              s.size(2) == kTile && w.is_contiguous() && s.is_contiguous(), "fp4_linear: bad packed weight");
  const int64_t m = x.size(0), k = x.size(1), tiles = s.size(0), groups = s.size(1), n = tiles * kTile;
  TORCH_CHECK(group % 8 == 0 && groups * group == k && w.numel() == n * k / 2, "fp4_linear: K=", k,
              " does not fit ", groups, " groups of ", group, " or a ", w.numel(), "-byte weight");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({m, n}, at::kFloat);
  const float* xp = xf.data_ptr<float>();
  const auto* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const float dv = static_cast<float>(divisor);
  if (!avx512) {  // the AVX2 loops: a row at a time, from kAvx2BlasFrom rows the dequantized weight on the BLAS
    const auto run = [&](auto* sp) {
      using S = std::remove_const_t<std::remove_pointer_t<decltype(sp)>>;
      if (m >= kAvx2BlasFrom) {
        const auto fill = [&](int64_t t, float* wt, int64_t ld) {
          avx2_fp4_dequantize<S>(wp + t * kTile * k / 2, sp + t * groups * kTile, k, group, wt, ld);
        };
        blas_chunks(xp, m, k, tiles, yp, fill, [&](const at::Tensor& c) { return c / static_cast<double>(dv); });
        return;
      }
      for_tile_rows(tiles, m, [&](int64_t t, int64_t r) {
        avx2_fp4_row<S>(wp + t * kTile * k / 2, sp + t * groups * kTile, xp + r * k, k, group, dv,
                        yp + r * n + t * kTile);
      });
    };
    if (s.dtype() == at::kFloat) run(s.data_ptr<float>());
    else run(reinterpret_cast<const uint16_t*>(s.data_ptr()));
    return y;
  }
  if (s.dtype() == at::kBFloat16 && use_amx(m, k, kAmxFromFp4)) {
    amx_product<Codes::kFp4>(xp, m, k, wp, reinterpret_cast<const uint16_t*>(s.data_ptr()), tiles, groups, group, dv,
                             yp);
    return y;
  }
  const auto run = [&](auto* sp) {
    const auto rows = [&](auto r_const) {
      return [&, r_const](int64_t t, int64_t r) {
        tile_rows_fp4<decltype(r_const)::value>(wp + t * kTile * k / 2, sp + t * groups * kTile, xp + r * k, k, group,
                                                dv, yp + r * n + t * kTile, n);
      };
    };
    for_tiles<0>(tiles, m, rows);
  };
  if (s.dtype() == at::kFloat) {
    run(s.data_ptr<float>());
  } else {
    run(reinterpret_cast<const uint16_t*>(s.data_ptr()));
  }
  return y;
}

// Batches (prefill) of the float32-arithmetic products below: a task takes one tile of 16 weight rows, writes their
// exact float32 values input-major into `wide` ([K][16], in L1 / L2: fill(tile, wide)), then every row of x multiplies
// it by broadcasts, 16 outputs a vector and no horizontal sums. Only the summation order differs from F.linear on the
// same float32 weights.
template <int R>
LLMQ_AVX512 void wide_rows(const float* wide, const float* x, int64_t k, float* y, int64_t n, __mmask16 valid) {
  __m512 acc[R];
  zeros<R>(acc);
  for (int64_t i = 0; i < k; ++i) {
    const __m512 wv = _mm512_loadu_ps(wide + i * kTile);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[r * k + i]), acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(y + r * n, valid, acc[r]);
}

template <typename Fill>
void wide_product(const float* x, float* y, int64_t m, int64_t n, int64_t k, const Fill& fill) {
  at::parallel_for(0, (n + kTile - 1) / kTile, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> wide(kTile * k);
    for (int64_t t = lo; t < hi; ++t) {
      fill(t, wide.data());
      const int64_t n0 = t * kTile;
      const auto valid = static_cast<__mmask16>((1u << std::min<int64_t>(kTile, n - n0)) - 1);
      int64_t r = 0;
      for (; r + 8 <= m; r += 8) wide_rows<8>(wide.data(), x + r * k, k, y + r * n + n0, n, valid);
      for (; r + 4 <= m; r += 4) wide_rows<4>(wide.data(), x + r * k, k, y + r * n + n0, n, valid);
      for (; r < m; ++r) wide_rows<1>(wide.data(), x + r * k, k, y + r * n + n0, n, valid);
    }
  });
}

// dense16_linear: x [M, K] float32 times a 16-bit weight [N, K] as the checkpoint stores it (bfloat16 or float16)
// -> [M, N] float32. Each weight widens to float32 exactly, products and sums are float32: what F.linear computes with
// the weight cast to float32 (the CPU layers' arithmetic), reading half the bytes; only the summation order differs.
// Rows as stored (no packing): a tied lm_head shares the embedding table's memory. One row of x streams the weight
// row by row; up to 15 share each weight load, four at a time; 16 and more go through wide_product.
template <typename T>
LLMQ_AVX512 inline __m512 widen16(const T* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (std::is_same_v<T, at::Half>) {
    return _mm512_cvtph_ps(h);
  } else {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// 2-15 rows of x: W weight rows x R rows of x, W x R sums sharing each load.
template <typename T, int W, int R>
LLMQ_AVX512 void dense_rows(const T* w, const float* x, int64_t k, float* y, int64_t n) {
  __m512 acc[W][R];
  zeros<W * R>(&acc[0][0]);
  for (int64_t c = 0; c < k; c += 16) {
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(x + r * k + c);
    for (int j = 0; j < W; ++j) {
      const __m512 wv = widen16(w + j * k + c);
      for (int r = 0; r < R; ++r) acc[j][r] = _mm512_fmadd_ps(wv, xv[r], acc[j][r]);
    }
  }
  for (int j = 0; j < W; ++j)
    for (int r = 0; r < R; ++r) y[r * n + j] = _mm512_reduce_add_ps(acc[j][r]);
}

template <typename T, int R>
void dense_rows_all(const T* w, const float* x, int64_t k, int64_t rows, float* y, int64_t n) {
  int64_t j = 0;
  for (; j + 4 <= rows; j += 4) dense_rows<T, 4, R>(w + j * k, x, k, y + j, n);
  for (; j < rows; ++j) dense_rows<T, 1, R>(w + j * k, x, k, y + j, n);
}

// One weight row after another, four sums each: a single sequential stream through memory, which the prefetchers
// follow best (eight rows interleaved streamed ~20% slower).
template <typename T>
LLMQ_AVX512 void dense_seq(const T* w, const float* x, int64_t k, int64_t rows, float* y) {
  for (int64_t j = 0; j < rows; ++j, w += k) {
    __m512 acc[4];
    zeros<4>(acc);
    int64_t c = 0;
    for (; c + 64 <= k; c += 64)
      for (int a = 0; a < 4; ++a)
        acc[a] = _mm512_fmadd_ps(widen16(w + c + 16 * a), _mm512_loadu_ps(x + c + 16 * a), acc[a]);
    for (; c < k; c += 16) acc[0] = _mm512_fmadd_ps(widen16(w + c), _mm512_loadu_ps(x + c), acc[0]);
    y[j] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
  }
}

// The bfloat16 decode row without the widening shuffle: a 32-bit lane holds inputs 2i (low half) and 2i + 1 (high), so
// a shift and a mask give both as float32 (even, odd), against x permuted per 32 inputs (even_x: evens, then odds; a
// tail of 16 as it is).

LLMQ_AVX512 void dense_seq_bf16(const at::BFloat16* w, const float* xp, int64_t k, int64_t rows, float* y) {
  for (int64_t j = 0; j < rows; ++j, w += k) {
    __m512 acc[4];
    zeros<4>(acc);
    int64_t c = 0;
    for (; c + 64 <= k; c += 64) {
      const __m512i v0 = _mm512_loadu_si512(w + c), v1 = _mm512_loadu_si512(w + c + 32);
      acc[0] = _mm512_fmadd_ps(even(v0), _mm512_loadu_ps(xp + c), acc[0]);
      acc[1] = _mm512_fmadd_ps(odd(v0), _mm512_loadu_ps(xp + c + 16), acc[1]);
      acc[2] = _mm512_fmadd_ps(even(v1), _mm512_loadu_ps(xp + c + 32), acc[2]);
      acc[3] = _mm512_fmadd_ps(odd(v1), _mm512_loadu_ps(xp + c + 48), acc[3]);
    }
    for (; c + 32 <= k; c += 32) {
      const __m512i v = _mm512_loadu_si512(w + c);
      acc[0] = _mm512_fmadd_ps(even(v), _mm512_loadu_ps(xp + c), acc[0]);
      acc[1] = _mm512_fmadd_ps(odd(v), _mm512_loadu_ps(xp + c + 16), acc[1]);
    }
    if (c < k) acc[2] = _mm512_fmadd_ps(widen16(w + c), _mm512_loadu_ps(xp + c), acc[2]);
    y[j] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
  }
}

// A row of x [K] in dense_seq_bf16's order.
void even_x(const float* x, int64_t k, float* out) {
  int64_t c = 0;
  for (; c + 32 <= k; c += 32)
    for (int64_t i = 0; i < 16; ++i) {
      out[c + i] = x[c + 2 * i];
      out[c + 16 + i] = x[c + 2 * i + 1];
    }
  std::copy(x + c, x + k, out + c);
}

// c[j] = column j of the 16 x 16 float32 block r (rows r[0..15]).
LLMQ_AVX512 void transpose16(const __m512 (&r)[16], __m512 (&c)[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: (a0 b0 a1 b1), (a2 b2 a3 b3) of rows a = 2i, b = 2i + 1
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int q = 0; q < 4; ++q) {  // rows 4q..4q+3: u[4q + e] holds element e of each 128-bit lane, four rows
    const __m512d a = _mm512_castps_pd(t[4 * q]), b = _mm512_castps_pd(t[4 * q + 2]);
    const __m512d c2 = _mm512_castps_pd(t[4 * q + 1]), d = _mm512_castps_pd(t[4 * q + 3]);
    u[4 * q] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    u[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    u[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c2, d));
    u[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c2, d));
  }
  for (int e = 0; e < 4; ++e) {  // column 4L + e is lane L of u[e], u[4 + e], u[8 + e], u[12 + e]
    const __m512 v0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0x88), v1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0x88);
    const __m512 w0 = _mm512_shuffle_f32x4(u[e], u[4 + e], 0xDD), w1 = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], 0xDD);
    c[e] = _mm512_shuffle_f32x4(v0, v1, 0x88);
    c[8 + e] = _mm512_shuffle_f32x4(v0, v1, 0xDD);
    c[4 + e] = _mm512_shuffle_f32x4(w0, w1, 0x88);
    c[12 + e] = _mm512_shuffle_f32x4(w0, w1, 0xDD);
  }
}

// Rows [n0, n0 + rows) of a 16-bit weight as float32 [K][16] (rows past the weight's end: zeros), 16 x 16 at a time.
template <typename T>
LLMQ_AVX512 void widen_tile(const T* w, int64_t rows, int64_t k, float* wide) {
  for (int64_t i = 0; i < k; i += 16) {
    __m512 r[16], c[16];
    for (int j = 0; j < 16; ++j) r[j] = j < rows ? widen16(w + j * k + i) : _mm512_setzero_ps();
    transpose16(r, c);
    for (int j = 0; j < 16; ++j) _mm512_storeu_ps(wide + (i + j) * kTile, c[j]);
  }
}

// Rows [n0, n0 + rows) of a 16-bit weight as AMX B pairs in bf16_pairs' order (rows past the weight's end: zeros):
// bfloat16 as stored, float16 split exactly into hi + lo (its 11 significant bits), then for amx_tiles.
template <typename T>
LLMQ_AVX512 void dense_pairs(const T* w, int64_t rows, int64_t k, uint32_t* hi) {
  const int planes = std::is_same_v<T, at::Half> ? 2 : 1;
  for (int64_t i = 0; i < k; i += 16) {
    __m512 r[16], c[16];
    for (int j = 0; j < 16; ++j) r[j] = j < rows ? widen16(w + j * k + i) : _mm512_setzero_ps();
    transpose16(r, c);  // c[e]: input i + e of the 16 rows
    for (int q = 0; q < 16; q += 4) {  // inputs q..q + 3: pairs (q, q + 2), (q + 1, q + 3)
      const int64_t p = (i + q) / 2;
      split_planes(c[q], c[q + 2], hi + p * kTile, k / 2 * kTile, planes);
      split_planes(c[q + 1], c[q + 3], hi + (p + 1) * kTile, k / 2 * kTile, planes);
    }
  }
}

// dense16_linear's product on AMX (use_amx holds): x split exactly into three bfloat16, so float32 products as above.
template <typename T>
void amx_dense(const float* x, const T* w, float* y, int64_t m, int64_t n, int64_t k) {
  const int64_t tiles = (n + kTile - 1) / kTile;
  const std::vector<uint32_t> xa = amx_x(x, m, k, true);
  const auto fill = [&](int64_t t, uint32_t* b) {
    dense_pairs(w + t * kTile * k, std::min(kTile, n - t * kTile), k, b);
  };
  const auto store = [&](int64_t t, const float* c, int64_t r0, int64_t rows) {
    amx_store(c, rows, std::min(kTile, n - t * kTile), nullptr, 1.f, false, y + r0 * n + t * kTile, n);
  };
  at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t lo, int64_t hi) {
    amx_tiles(lo, hi, xa.data(), 3, m, k, tiles, std::is_same_v<T, at::Half> ? 2 : 1, fill, store);
  });
}

template <typename T>
void dense16_impl(const float* x, const T* w, float* y, int64_t m, int64_t n, int64_t k) {
  if (use_amx(m, k, std::is_same_v<T, at::Half> ? kAmxFromHalf : kAmxFromBf16)) {
    amx_dense(x, w, y, m, n, k);
    return;
  }
  if (m >= 16) {  // the transposing widen costs about two passes of 4 rows of x: wide pays from 16 rows on
    wide_product(x, y, m, n, k, [&](int64_t t, float* wide) {
      widen_tile(w + t * kTile * k, std::min(kTile, n - t * kTile), k, wide);
    });
    return;
  }
  std::vector<float> xp;
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (m % 4 == 1) {  // the row left to dense_seq_bf16
      xp.resize(k);
      even_x(x + (m - 1) * k, k, xp.data());
    }
  }
  at::parallel_for(0, (n + kTile - 1) / kTile, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t n0 = t * kTile, rows = std::min(kTile, n - n0);
      const T* wt = w + n0 * k;
      int64_t r = 0;
      for (; r + 4 <= m; r += 4) dense_rows_all<T, 4>(wt, x + r * k, k, rows, y + r * n + n0, n);
      if (m - r == 3) dense_rows_all<T, 3>(wt, x + r * k, k, rows, y + r * n + n0, n);
      if (m - r == 2) dense_rows_all<T, 2>(wt, x + r * k, k, rows, y + r * n + n0, n);
      if (m - r != 1) continue;
      if constexpr (std::is_same_v<T, at::BFloat16>)
        dense_seq_bf16(wt, xp.data(), k, rows, y + r * n + n0);
      else
        dense_seq(wt, x + r * k, k, rows, y + r * n + n0);
    }
  });
}

at::Tensor dense16_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bw"), "dense16_linear needs a CPU with AVX-512 (F and BW)");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.device().is_cpu() && x.size(1) == w.size(1),
              "dense16_linear: x [M, K] and w [N, K] on the CPU");
  TORCH_CHECK((w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf) && w.is_contiguous() &&
                  w.size(1) % 16 == 0, "dense16_linear: w must be contiguous bfloat16 / float16 with K % 16 == 0");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t m = x.size(0), n = w.size(0), k = w.size(1);
  at::Tensor y = at::empty({m, n}, at::kFloat);
  if (w.scalar_type() == at::kHalf)
    dense16_impl(xf.data_ptr<float>(), w.data_ptr<at::Half>(), y.data_ptr<float>(), m, n, k);
  else
    dense16_impl(xf.data_ptr<float>(), w.data_ptr<at::BFloat16>(), y.data_ptr<float>(), m, n, k);
  return y;
}

}  // namespace

// rms_norm: one pass per row instead of the ~6 operations (each a dispatch) PyTorch's CPU rms_norm runs; the same
// arithmetic as runtime/layers/norm.py (float32: x * r * w; 16-bit: w * round16(x * r), r computed in float32).
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* y, int64_t rows, int64_t c, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const T* xr = x + r * c;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < c; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(c) + eps);
      T* yr = y + r * c;
      for (int64_t i = 0; i < c; ++i) {
        const float h = static_cast<float>(xr[i]) * inv;
        const float wi = static_cast<float>(w[i]);
        yr[i] = std::is_same_v<T, float> ? static_cast<T>(h * wi)
                                         : static_cast<T>(wi * static_cast<float>(static_cast<T>(h)));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.device().is_cpu() && x.dtype() == w.dtype() && w.dim() == 1 && x.size(-1) == w.size(0),
              "rms_norm: x [..., C] and w [C] of one dtype on the CPU");
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t c = w.size(0), rows = c ? xc.numel() / c : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows, c,
                            static_cast<float>(eps));
  });
  return y;
}

// decode_attention: single-token queries against their sequences' paged K/V, read in place through the block table
// (the eager path copies every block out with index_select, then runs SDPA with a mask). Scores, softmax and the
// weighted sum in float32; mask [B, nblocks * block_size] is the eager path's (models.spec.attends). The float loops
// are cloned for AVX-512 / AVX2 and picked at load time (the file is otherwise built for any x86-64).
#define LLMQ_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))

#define LLMQ_INLINE __attribute__((always_inline)) inline  // compiled inside each clone, for its target

// 16 floats as one value (GCC's vector extension): one zmm register in the AVX-512 clone, two ymm in the AVX2 one,
// four xmm in the baseline, so each clone vectorises without intrinsics and without -ffast-math.
typedef float f32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));

LLMQ_INLINE f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// A cache's 16 values as float32: bfloat16 widened exactly by a shift of its bits. (float16 caches are widened
// into scratch rows first, by the caller: no clone here has a vector conversion for them.)
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
LLMQ_INLINE f32x16 load16(const c10::BFloat16* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof h);
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f32x16 v;
  std::memcpy(&v, &w, sizeof v);
  return v;
}
LLMQ_INLINE f32x16 load16(const double* p) {  // rounded to float32, in which the scores are computed
  f32x16 v;
  for (int i = 0; i < 16; ++i) v[i] = static_cast<float>(p[i]);
  return v;
}

// The sum of the 16 lanes in a tree (four shuffles and adds; a sequential sum is a chain of 16 dependent additions).
LLMQ_INLINE float sum16(f32x16 v) {
  v += __builtin_shuffle(v, i32x16{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, i32x16{4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
  v += __builtin_shuffle(v, i32x16{2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
  v += __builtin_shuffle(v, i32x16{1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
  return v[0];
}

// Lane r: sum16(v[r]), the same additions in the same order, for 16 vectors at once: each level adds the two halves
// of every row's lanes for two vectors in one add (30 shuffles and 15 adds where 16 sum16 take 64 and 64). Rows end
// in bit-reversed lanes; the last shuffle puts them in order.
LLMQ_INLINE f32x16 sums16(f32x16 (&v)[16]) {
  for (int i = 0; i < 8; ++i) {
    v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], i32x16{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}) +
           __builtin_shuffle(v[2 * i], v[2 * i + 1], i32x16{8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31});
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], i32x16{0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}) +
           __builtin_shuffle(v[2 * i], v[2 * i + 1], i32x16{4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31});
  }
  for (int i = 0; i < 2; ++i) {
    v[i] = __builtin_shuffle(v[2 * i], v[2 * i + 1], i32x16{0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}) +
           __builtin_shuffle(v[2 * i], v[2 * i + 1], i32x16{2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31});
  }
  const f32x16 t = __builtin_shuffle(v[0], v[1], i32x16{0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30}) +
                   __builtin_shuffle(v[0], v[1], i32x16{1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31});
  return __builtin_shuffle(t, i32x16{0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15});
}

// exp(x) for x <= 0 (scores minus their maximum) in straight-line float arithmetic, so the softmax loop vectorises
// (a call to expf does not): 2^n * p(r), r = x - n ln2 split in two parts, p Cephes' degree-7 expf polynomial
// (relative error ~1e-7, like expf's); below -87 (e^-87 ~ 1e-38) it returns 0.
LLMQ_INLINE float exp_nonpositive(float x) {
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.f) - 12582912.f;  // round to nearest (|t| < 2^22)
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.f ? 0.f : p * scale;
}

// Scores to exp(score - max) in place (sj[n]); returns {max, sum of the exps}.
LLMQ_INLINE std::pair<float, float> softmax_unnormalised(float* sj, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t p = 0; p < n; ++p) mx = std::max(mx, sj[p]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t p = 0; p < n; ++p) {
    sj[p] = exp_nonpositive(sj[p] - mx);
    sum += sj[p];
  }
  return {mx, sum};
}

// Rows q of the next work's positions (K and V, all KV heads: `span` values each), asked for while this work computes
// from the cache: its first head's score pass issues them spread over its n positions, so the next chunk streams in
// behind the arithmetic instead of each chunk waiting for its own. (SmolLM2's shapes, 32 sequences of 160 positions,
// one thread, 30 layers' caches from memory: float32 13.2 ms either way, 6.8 from cache; bfloat16 caches, read in
// place with this: 18.6 -> 11.0 ms.)
template <typename T>
LLMQ_INLINE void prefetch_rows(const T* const* kpos, const T* const* vpos, int64_t from, int64_t to, int64_t span) {
  for (int64_t r = from; r < to; ++r) {
    for (int64_t e = 0; e < span; e += 64 / sizeof(T)) {
      __builtin_prefetch(kpos[r] + e);
      __builtin_prefetch(vpos[r] + e);
    }
  }
}

constexpr int64_t kMaxHead = 256;  // the largest head size the vector path holds in its accumulators

// Flash-decoding's partial result for one KV head's `group` query heads (q [group, d]) over n rows: per query head
// the largest score (m), the sum of exp(score - m) (l) and the exp-weighted sum of the V rows (acc [group, d]), so
// chunks of a sequence's rows run on any thread and merge exactly afterwards. sc: scratch [group, n]. kpos / vpos:
// npf position rows to prefetch (prefetch_rows). D: the head size as a compile-time constant (64, 128: q and the
// accumulators stay in registers); 0: d, any multiple of 16 up to kMaxHead. T: the cache's type, each value widened
// exactly where it is read. Scores 16 positions at a time (sums16), the rest one by one: the same sums either way.
template <int D, typename T>
LLMQ_INLINE void attend_part_impl(const float* q, int64_t group, int64_t d_any, const T* const* krows,
                                  const T* const* vrows, int64_t n, float scale, const T* const* kpos,
                                  const T* const* vpos, int64_t npf, int64_t span, float* sc, float* acc_out, float* m,
                                  float* l) {
  const int64_t d = D ? D : d_any, c = d / 16;
  for (int64_t j = 0; j < group; ++j) {
    f32x16 qj[D ? D / 16 : kMaxHead / 16];
    for (int64_t i = 0; i < c; ++i) qj[i] = load16(q + j * d + 16 * i);
    float* sj = sc + j * n;
    const auto dot = [&](int64_t p) {
      if (j == 0) prefetch_rows(kpos, vpos, p * npf / n, (p + 1) * npf / n, span);
      f32x16 s = qj[0] * load16(krows[p]);
      for (int64_t i = 1; i < c; ++i) s += qj[i] * load16(krows[p] + 16 * i);
      return s;
    };
    int64_t p = 0;
    for (; p + 16 <= n; p += 16) {
      f32x16 part[16];
      for (int r = 0; r < 16; ++r) part[r] = dot(p + r);
      const f32x16 s = sums16(part) * scale;
      std::memcpy(sj + p, &s, sizeof s);
    }
    for (; p < n; ++p) sj[p] = sum16(dot(p)) * scale;
    std::tie(m[j], l[j]) = softmax_unnormalised(sj, n);
    f32x16 acc[D ? D / 16 : kMaxHead / 16] = {};
    for (int64_t p = 0; p < n; ++p) {
      for (int64_t i = 0; i < c; ++i) acc[i] += sj[p] * load16(vrows[p] + 16 * i);
    }
    std::memcpy(acc_out + j * d, acc, d * sizeof(float));
  }
}

// Any other head size, scalar (a vectorising compiler does what it can).
template <typename T>
LLMQ_INLINE void attend_part_scalar(const float* q, int64_t group, int64_t d, const T* const* krows,
                                    const T* const* vrows, int64_t n, float scale, float* sc, float* acc_out,
                                    float* m, float* l) {
  for (int64_t j = 0; j < group; ++j) {
    float* sj = sc + j * n;
    for (int64_t p = 0; p < n; ++p) {
      float s = 0.f;
      for (int64_t e = 0; e < d; ++e) s += q[j * d + e] * static_cast<float>(krows[p][e]);
      sj[p] = s * scale;
    }
    std::tie(m[j], l[j]) = softmax_unnormalised(sj, n);
    float* acc = acc_out + j * d;
    std::fill(acc, acc + d, 0.f);
    for (int64_t p = 0; p < n; ++p) {
      for (int64_t e = 0; e < d; ++e) acc[e] += sj[p] * static_cast<float>(vrows[p][e]);
    }
  }
}

#define LLMQ_ATTEND_PART(name, D, T)                                                                                \
  LLMQ_CLONES void name(const float* q, int64_t group, int64_t d, const T* const* krows, const T* const* vrows,     \
                        int64_t n, float scale, const T* const* kpos, const T* const* vpos, int64_t npf,            \
                        int64_t span, float* sc, float* acc, float* m, float* l) {                                  \
    if (D || (d % 16 == 0 && d <= kMaxHead)) {                                                                    \
      attend_part_impl<D, T>(q, group, d, krows, vrows, n, scale, kpos, vpos, npf, span, sc, acc, m, l);         \
    } else {                                                                                                      \
      attend_part_scalar<T>(q, group, d, krows, vrows, n, scale, sc, acc, m, l);                                  \
    }                                                                                                             \
  }
#define LLMQ_ATTEND_PARTS(suffix, T)                   \
  LLMQ_ATTEND_PART(attend_part_64_##suffix, 64, T)     \
  LLMQ_ATTEND_PART(attend_part_128_##suffix, 128, T)   \
  LLMQ_ATTEND_PART(attend_part_any_##suffix, 0, T)     \
  auto attend_part(int64_t d, const T*) {              \
    return d == 64 ? attend_part_64_##suffix : d == 128 ? attend_part_128_##suffix : attend_part_any_##suffix; \
  }
LLMQ_ATTEND_PARTS(f32, float)
LLMQ_ATTEND_PARTS(bf16, c10::BFloat16)
LLMQ_ATTEND_PARTS(f64, double)

constexpr int64_t kChunk = 64;  // rows of one sequence per work item: threads share a long sequence

template <typename T>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& blocks,
                           const at::Tensor& mask, float scale, const float* sinks, at::Tensor& out) {
  const int64_t bd = q.size(0), h = q.size(1), d = q.size(2);
  const int64_t bs = kc.size(1), hkv = kc.size(2), nblk = blocks.size(1), len = nblk * bs, group = h / hkv;
  const int64_t span = hkv * d;  // one position's row, all KV heads
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int64_t* bt = blocks.data_ptr<int64_t>();
  const bool* mp = mask.data_ptr<bool>();
  T* op = out.data_ptr<T>();
  // the visible positions of each sequence (offsets of their rows), and the work items: (sequence, first row)
  std::vector<int64_t> offs, first(bd + 1, 0), item_seq, item_row, items_of(bd + 1, 0);
  for (int64_t b = 0; b < bd; ++b) {
    for (int64_t blk = 0; blk < nblk; ++blk) {
      for (int64_t o = 0; o < bs; ++o) {
        if (mp[b * len + blk * bs + o]) offs.push_back((bt[b * nblk + blk] * bs + o) * span);
      }
    }
    first[b + 1] = static_cast<int64_t>(offs.size());
    for (int64_t r = first[b]; r < first[b + 1]; r += kChunk) {
      item_seq.push_back(b);
      item_row.push_back(r);
    }
    items_of[b + 1] = static_cast<int64_t>(item_seq.size());
  }
  const int64_t items = static_cast<int64_t>(item_seq.size());
  std::vector<float> pm(items * h), pl(items * h), pacc(items * h * d);
  using R = std::conditional_t<std::is_same_v<T, c10::Half>, float, T>;  // the rows' type as the kernel reads them
  constexpr bool widen = !std::is_same_v<R, T>;
  const auto attend = attend_part(d, static_cast<const R*>(nullptr));
  at::parallel_for(0, items, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> qf(h * d), sc(group * kChunk), conv(widen ? 2 * kChunk * d : 0);
    std::vector<const R*> krows(kChunk), vrows(kChunk), kpos(kChunk), vpos(kChunk);
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t b = item_seq[it], r0 = item_row[it], n = std::min(kChunk, first[b + 1] - r0);
      for (int64_t e = 0; e < h * d; ++e) qf[e] = static_cast<float>(qp[b * h * d + e]);
      for (int64_t g = 0; g < hkv; ++g) {
        for (int64_t i = 0; i < n; ++i) {
          const int64_t at = offs[r0 + i] + g * d;
          if constexpr (widen) {
            float* kf = conv.data() + 2 * i * d;
            float* vf = kf + d;
            for (int64_t e = 0; e < d; ++e) {
              kf[e] = static_cast<float>(kp[at + e]);
              vf[e] = static_cast<float>(vp[at + e]);
            }
            krows[i] = kf;
            vrows[i] = vf;
          } else {
            krows[i] = kp + at;
            vrows[i] = vp + at;
          }
        }
        // the next work's rows, a 1 / hkv share of them per KV head here
        int64_t nf = 0;
        if constexpr (!widen) {
          if (it + 1 < hi) {
            const int64_t b1 = item_seq[it + 1], r1 = item_row[it + 1], n1 = std::min(kChunk, first[b1 + 1] - r1);
            for (int64_t i = g * n1 / hkv; i < (g + 1) * n1 / hkv; ++i, ++nf) {
              kpos[nf] = kp + offs[r1 + i];
              vpos[nf] = vp + offs[r1 + i];
            }
          }
        }
        const int64_t at = it * h + g * group;
        attend(qf.data() + g * group * d, group, d, krows.data(), vrows.data(), n, scale, kpos.data(), vpos.data(), nf,
               span, sc.data(), pacc.data() + at * d, pm.data() + at, pl.data() + at);
      }
    }
  });
  // merge each sequence's chunks: out = sum_c e^(m_c - M) acc_c / (sum_c e^(m_c - M) l_c [+ e^(sink - M)]), a
  // head's sink logit (where given) one more score of no value
  at::parallel_for(0, bd * h, 16, [&](int64_t lo, int64_t hi) {
    std::vector<float> o(d);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t b = i / h, head = i % h;
      float mx = sinks ? sinks[head] : -std::numeric_limits<float>::infinity();
      for (int64_t it = items_of[b]; it < items_of[b + 1]; ++it) mx = std::max(mx, pm[it * h + head]);
      float den = sinks ? std::exp(sinks[head] - mx) : 0.f;
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t it = items_of[b]; it < items_of[b + 1]; ++it) {
        const float w = std::exp(pm[it * h + head] - mx);
        den += w * pl[it * h + head];
        const float* acc = pacc.data() + (it * h + head) * d;
        for (int64_t e = 0; e < d; ++e) o[e] += w * acc[e];
      }
      const float inv = den > 0.f ? 1.f / den : 0.f;
      for (int64_t e = 0; e < d; ++e) op[i * d + e] = static_cast<T>(o[e] * inv);
    }
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& blocks,
                            const at::Tensor& mask, double scale, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && kc.dim() == 4 && kc.sizes() == vc.sizes() && q.dtype() == kc.dtype() &&
              vc.dtype() == kc.dtype() && kc.is_contiguous() && vc.is_contiguous() && q.size(2) == kc.size(3) &&
              q.size(1) % kc.size(2) == 0, "decode_attention: q [B, H, D], caches [blocks, block, Hkv, D]");
  TORCH_CHECK(blocks.dtype() == at::kLong && mask.dtype() == at::kBool && blocks.size(0) == q.size(0) &&
              mask.size(0) == q.size(0) && mask.size(1) == blocks.size(1) * kc.size(1),
              "decode_attention: blocks [B, n] int64, mask [B, n * block] bool");
  TORCH_CHECK(!sinks || (sinks->dtype() == at::kFloat && sinks->numel() == q.size(1)),
              "decode_attention: sinks [H] float32");
  const at::Tensor qc = q.contiguous(), bc = blocks.contiguous(), mc = mask.contiguous();
  const at::Tensor sc = sinks ? sinks->contiguous() : at::Tensor();
  at::Tensor out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention", [&] {
    decode_attention_impl<scalar_t>(qc, kc, vc, bc, mc, static_cast<float>(scale),
                                    sinks ? sc.data_ptr<float>() : nullptr, out);
  });
  return out;
}

// silu(gate) * up over the fused gate_up rows [T, 2I] -> [T, I], one pass instead of three operations; rounded where
// PyTorch's silu and mul_ round (after each, for 16-bit types). silu(g) = g / (1 + e^-g), with e = e^-|g| <= 1:
// g / (1 + e) for g >= 0, g e / (1 + e) below.
template <typename T>
LLMQ_CLONES void silu_mul_rows(const T* gu, T* out, int64_t t, int64_t inter) {
  for (int64_t r = 0; r < t; ++r) {
    const T* g = gu + r * 2 * inter;
    const T* u = g + inter;
    T* o = out + r * inter;
#pragma omp simd
    for (int64_t i = 0; i < inter; ++i) {
      const float x = static_cast<float>(g[i]);
      const float e = exp_nonpositive(-std::fabs(x));
      const float silu = (x >= 0.f ? x : x * e) / (1.f + e);
      o[i] = static_cast<T>(static_cast<float>(static_cast<T>(silu)) * static_cast<float>(u[i]));
    }
  }
}

at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0 && gu.is_contiguous(), "silu_mul: gate_up [T, 2I], contiguous");
  const int64_t t = gu.size(0), inter = gu.size(1) / 2;
  at::Tensor out = at::empty({t, inter}, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gu.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), t, inter);
  });
  return out;
}

// delta_head: one decode token through a value head's gated delta rule (runtime.layers.delta_rule.step's arithmetic,
// float32) on its state s [Dk, Dv] in place: S <- e^g S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q. Two passes
// over the state (the second from cache: 64 KiB at 128 x 128).
LLMQ_CLONES void delta_head(float* s, const float* q, const float* k, const float* v, float eg, float beta,
                            int64_t dk, int64_t dv, float* u, float* o) {
  for (int64_t j = 0; j < dv; ++j) u[j] = 0.f;
  for (int64_t i = 0; i < dk; ++i) {
    const float* row = s + i * dv;
    const float ki = k[i];
    for (int64_t j = 0; j < dv; ++j) u[j] += row[j] * ki;
  }
  for (int64_t j = 0; j < dv; ++j) {
    u[j] = beta * (v[j] - eg * u[j]);
    o[j] = 0.f;
  }
  for (int64_t i = 0; i < dk; ++i) {
    float* row = s + i * dv;
    const float ki = k[i], qi = q[i];
    for (int64_t j = 0; j < dv; ++j) {
      const float x = eg * row[j] + ki * u[j];
      row[j] = x;
      o[j] += x * qi;
    }
  }
}

// gated_delta_decode: the decode rows of a Gated DeltaNet layer between its two projections, in one call where the
// eager path (models/linear_attention.py) dispatches ~30 operations a layer: the short causal convolution over each
// slot's last kernel - 1 inputs and the new one (the tail in the pool moved on in place), SiLU; q and k normalized
// per key head (x / sqrt(|x|^2 + 1e-6), q also times key_dim^-1/2), each value head reading its key head (no
// repeated copy); beta = sigmoid(b), g = -e^A_log softplus(a + dt_bias); delta_head on the slot's state; the gated
// RMSNorm over each value head times SiLU(z). Rounded where the eager path rounds to the compute dtype T.
// One channel's causal convolution at its next input x: the kernel over its tail [K - 1] and x, SiLU; the tail
// moves on by x. Each product rounded to T, the sum and the SiLU too (the eager decode's roundings).
template <typename T>
LLMQ_CLONES float conv_channel(T* tail, const T* w, int64_t kernel, T x) {
  float acc = 0.f;
  for (int64_t j = 0; j < kernel - 1; ++j)
    acc += static_cast<float>(static_cast<T>(static_cast<float>(tail[j]) * static_cast<float>(w[j])));
  acc += static_cast<float>(static_cast<T>(static_cast<float>(x) * static_cast<float>(w[kernel - 1])));
  const float s = static_cast<float>(static_cast<T>(acc));
  for (int64_t j = 0; j + 1 < kernel - 1; ++j) tail[j] = tail[j + 1];
  if (kernel > 1) tail[kernel - 2] = x;
  return static_cast<float>(static_cast<T>(s / (1.f + std::exp(-s))));
}

template <typename T>
void conv_rows(const T* mixed, int64_t width, T* tails, const int64_t* slot, const T* conv, int64_t channels,
               int64_t kernel, int64_t row, float* y) {
  const T* x = mixed + row * width;
  T* tail = tails + slot[row] * channels * (kernel - 1);
  for (int64_t c = 0; c < channels; ++c) y[c] = conv_channel<T>(tail + c * (kernel - 1), conv + c * kernel, kernel, x[c]);
}

LLMQ_CLONES void unit_heads(float* x, int64_t heads, int64_t dim, float scale) {
  for (int64_t hd = 0; hd < heads; ++hd) {
    float* v = x + hd * dim;
    float ss = 0.f;
    for (int64_t e = 0; e < dim; ++e) ss += v[e] * v[e];
    const float r = 1.f / std::sqrt(ss + 1e-6f);
    for (int64_t e = 0; e < dim; ++e) v[e] = v[e] * r * scale;
  }
}

// A convolved row's q and k [Hk Dk each, first in the row] normalized per key head, q also times Dk^-1/2.
void unit_qk(float* y, int64_t kh, int64_t dk) {
  unit_heads(y, kh, dk, 1.f / std::sqrt(static_cast<float>(dk)));
  unit_heads(y + kh * dk, kh, dk, 1.f);
}

template <typename T>
void gated_delta_impl(const at::Tensor& mixed, at::Tensor& tails, at::Tensor& states, const int64_t* slot,
                      const at::Tensor& conv, const float* neg_rate, const float* dt_bias, const T* norm, float eps,
                      int64_t kh, int64_t dk, at::Tensor& out) {
  const int64_t b = mixed.size(0), width = mixed.size(1), hv = states.size(1), dv = states.size(3);
  const int64_t channels = tails.size(1), kernel = tails.size(2) + 1, vs = hv * dv, group = hv / kh;
  const T* mp = mixed.data_ptr<T>();
  T* tp = tails.data_ptr<T>();
  float* sp = states.data_ptr<float>();
  T* op = out.data_ptr<T>();
  std::vector<float> y(b * channels);
  at::parallel_for(0, b, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      float* yi = y.data() + i * channels;
      conv_rows<T>(mp, width, tp, slot, conv.data_ptr<T>(), channels, kernel, i, yi);
      unit_qk(yi, kh, dk);
    }
  });
  at::parallel_for(0, b * hv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> u(dv), o(dv);
    for (int64_t x = lo; x < hi; ++x) {
      const int64_t i = x / hv, head = x % hv, key = head / group;
      const T* row = mp + i * width;
      const float* yi = y.data() + i * channels;
      const float bb = static_cast<float>(row[channels + vs + head]);
      const float aa = static_cast<float>(row[channels + vs + hv + head]) + dt_bias[head];
      const float beta = 1.f / (1.f + std::exp(-bb));
      const float g = neg_rate[head] * (aa > 20.f ? aa : std::log1p(std::exp(aa)));
      delta_head(sp + (slot[i] * hv + head) * dk * dv, yi + key * dk, yi + (kh + key) * dk, yi + 2 * kh * dk + head * dv,
                 std::exp(g), beta, dk, dv, u.data(), o.data());
      float ss = 0.f;
      for (int64_t e = 0; e < dv; ++e) {
        o[e] = static_cast<float>(static_cast<T>(o[e]));
        ss += o[e] * o[e];
      }
      const float r = 1.f / std::sqrt(ss / static_cast<float>(dv) + eps);
      const T* z = row + channels + head * dv;
      T* dst = op + i * vs + head * dv;
      for (int64_t e = 0; e < dv; ++e) {
        const float n = static_cast<float>(static_cast<T>(static_cast<float>(norm[e]) *
                                                          static_cast<float>(static_cast<T>(o[e] * r))));
        const float zf = static_cast<float>(z[e]);
        dst[e] = static_cast<T>(n * (zf / (1.f + std::exp(-zf))));
      }
    }
  });
}

at::Tensor gated_delta_decode(const at::Tensor& mixed, at::Tensor tails, at::Tensor states, const at::Tensor& slots,
                              const at::Tensor& conv, const at::Tensor& neg_rate, const at::Tensor& dt_bias,
                              const at::Tensor& norm, double eps, int64_t key_heads, int64_t key_dim) {
  TORCH_CHECK(states.dim() == 4 && states.dtype() == at::kFloat && states.is_contiguous() && tails.dim() == 3 &&
              tails.is_contiguous() && tails.dtype() == mixed.dtype() && slots.dtype() == at::kLong &&
              states.size(0) == tails.size(0) && states.size(2) == key_dim && key_heads > 0 &&
              states.size(1) % key_heads == 0,
              "gated_delta_decode: state pool [slots, Hv, Dk, Dv] float32, tails [slots, C, K - 1] of mixed's dtype");
  const int64_t b = mixed.size(0), hv = states.size(1), dv = states.size(3), channels = tails.size(1);
  TORCH_CHECK(mixed.dim() == 2 && mixed.size(1) == channels + hv * dv + 2 * hv &&
              channels == 2 * key_heads * key_dim + hv * dv && slots.numel() == b,
              "gated_delta_decode: mixed [B, C + Hv Dv + 2 Hv] (qkv, z, b, a), C = 2 Hk Dk + Hv Dv, slots [B]");
  TORCH_CHECK(conv.dtype() == mixed.dtype() && conv.dim() == 2 && conv.size(0) == channels &&
              conv.size(1) == tails.size(2) + 1 && neg_rate.dtype() == at::kFloat && dt_bias.dtype() == at::kFloat &&
              neg_rate.numel() == hv && dt_bias.numel() == hv && norm.dtype() == mixed.dtype() && norm.numel() == dv,
              "gated_delta_decode: conv [C, K] and norm [Dv] of mixed's dtype, neg_rate / dt_bias [Hv] float32");
  const at::Tensor mc = mixed.contiguous(), sl = slots.contiguous(), cc = conv.contiguous(),
                   nr = neg_rate.contiguous(), db = dt_bias.contiguous(), nc = norm.contiguous();
  const int64_t* slot = sl.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i) TORCH_CHECK(slot[i] >= 0 && slot[i] < states.size(0), "gated_delta_decode: slot");
  at::Tensor out = at::empty({b, hv * dv}, mixed.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, mixed.scalar_type(), "gated_delta_decode", [&] {
    gated_delta_impl<scalar_t>(mc, tails, states, slot, cc, nr.data_ptr<float>(), db.data_ptr<float>(),
                               nc.data_ptr<scalar_t>(), static_cast<float>(eps), key_heads, key_dim, out);
  });
  return out;
}

// delta_prefill: n tokens of one sequence through a Gated DeltaNet layer's convolution and delta rule, one token
// after the other, on its slot's tail and state (both moved on in place): what a prefill chunk (or the replay of
// kept tokens after a rejected draft) computes, where the eager path runs the chunked rule's ~40 operations a block
// of 64 (models/linear_attention.py's _chunk, delta_rule.chunked). The recurrence is the rule's definition, so the
// two agree up to float32 summation order. qkv [n, C] (a row stride of its own: the mix projection's rows), g / beta
// [n, Hv] float32 -> o [n, Hv, Dv] float32 (the gated norm follows in Python for every prefill row at once).
template <typename T>
void delta_prefill_impl(const at::Tensor& qkv, const float* g, const float* beta, T* tail, float* state,
                        const T* conv, int64_t kernel, int64_t hv, int64_t kh, int64_t dk, int64_t dv, float* out) {
  const int64_t n = qkv.size(0), channels = qkv.size(1), stride = qkv.stride(0), group = hv / kh;
  const T* xp = qkv.data_ptr<T>();
  std::vector<float> y(n * channels);
  at::parallel_for(0, channels, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c)
      for (int64_t t = 0; t < n; ++t)
        y[t * channels + c] = conv_channel<T>(tail + c * (kernel - 1), conv + c * kernel, kernel, xp[t * stride + c]);
  });
  at::parallel_for(0, n, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) unit_qk(y.data() + t * channels, kh, dk);
  });
  at::parallel_for(0, hv, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> u(dv);
    for (int64_t head = lo; head < hi; ++head) {
      const int64_t key = head / group;
      for (int64_t t = 0; t < n; ++t) {
        const float* yt = y.data() + t * channels;
        delta_head(state + head * dk * dv, yt + key * dk, yt + (kh + key) * dk, yt + 2 * kh * dk + head * dv,
                   std::exp(g[t * hv + head]), beta[t * hv + head], dk, dv, u.data(), out + (t * hv + head) * dv);
      }
    }
  });
}

at::Tensor delta_prefill(const at::Tensor& qkv, const at::Tensor& g, const at::Tensor& beta, at::Tensor tails,
                         at::Tensor states, int64_t slot, const at::Tensor& conv, int64_t key_heads, int64_t key_dim) {
  TORCH_CHECK(states.dim() == 4 && states.dtype() == at::kFloat && states.is_contiguous() && tails.dim() == 3 &&
              tails.is_contiguous() && tails.dtype() == qkv.dtype() && states.size(0) == tails.size(0) &&
              slot >= 0 && slot < states.size(0) && states.size(2) == key_dim && key_heads > 0 &&
              states.size(1) % key_heads == 0,
              "delta_prefill: state pool [slots, Hv, Dk, Dv] float32, tails [slots, C, K - 1] of qkv's dtype, a slot");
  const int64_t n = qkv.size(0), hv = states.size(1), dv = states.size(3), channels = tails.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == channels && qkv.stride(1) == 1 &&
              channels == 2 * key_heads * key_dim + hv * dv,
              "delta_prefill: qkv [n, C] (rows of unit stride), C = 2 Hk Dk + Hv Dv");
  TORCH_CHECK(g.dtype() == at::kFloat && beta.dtype() == at::kFloat && g.numel() == n * hv && beta.numel() == n * hv &&
              conv.dtype() == qkv.dtype() && conv.dim() == 2 && conv.size(0) == channels &&
              conv.size(1) == tails.size(2) + 1, "delta_prefill: g / beta [n, Hv] float32, conv [C, K] of qkv's dtype");
  const at::Tensor gc = g.contiguous(), bc = beta.contiguous(), cc = conv.contiguous();
  at::Tensor out = at::empty({n, hv, dv}, qkv.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "delta_prefill", [&] {
    delta_prefill_impl<scalar_t>(qkv, gc.data_ptr<float>(), bc.data_ptr<float>(),
                                 tails.data_ptr<scalar_t>() + slot * channels * tails.size(2),
                                 states.data_ptr<float>() + slot * hv * key_dim * dv, cc.data_ptr<scalar_t>(),
                                 tails.size(2) + 1, hv, key_heads, key_dim, dv, out.data_ptr<float>());
  });
  return out;
}

// rope_kv_write: the rotary embedding of q and k (rotary.py's arithmetic: x * cos + roll(x, R/2) * sin over the first
// R = cos.size(-1) of each head's D, the sign folded into sin; the rest as it is where R < D: a partial rotary
// embedding) and the store of k and v at their cache slots, in one pass over the fused qkv rows. Returns the rotated
// q [T, H, D] and k [T, Hkv, D]; eagerly these are ~10 dispatched operations a layer.
template <typename T>
void rope_kv_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kc, at::Tensor& vc,
                  const at::Tensor& slots, int64_t h, int64_t hkv, at::Tensor& q, at::Tensor& k) {
  const int64_t t = qkv.size(0), width = qkv.size(1), d = width / (h + 2 * hkv), rot = cos.size(-1), half = rot / 2;
  const T* src = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  T* kcp = kc.data_ptr<T>();
  T* vcp = vc.data_ptr<T>();
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  at::parallel_for(0, t, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const T* row = src + r * width;
      const T* c = cp + r * rot;
      const T* sn = sp + r * rot;
      for (int64_t head = 0; head < h + hkv; ++head) {
        const T* x = row + head * d;
        T* out = head < h ? qp + (r * h + head) * d : kp + (r * hkv + head - h) * d;
        for (int64_t e = 0; e < rot; ++e) {
          const T rolled = x[e < half ? e + half : e - half];
          const float xc = static_cast<float>(static_cast<T>(static_cast<float>(x[e]) * static_cast<float>(c[e])));
          out[e] = static_cast<T>(xc + static_cast<float>(rolled) * static_cast<float>(sn[e]));
        }
        std::memcpy(out + rot, x + rot, (d - rot) * sizeof(T));
      }
      T* kdst = kcp + slot[r] * hkv * d;
      T* vdst = vcp + slot[r] * hkv * d;
      std::memcpy(kdst, kp + r * hkv * d, hkv * d * sizeof(T));
      std::memcpy(vdst, row + (h + hkv) * d, hkv * d * sizeof(T));
    }
  });
}

std::vector<at::Tensor> rope_kv_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                      at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots, int64_t h,
                                      int64_t hkv) {
  const int64_t t = qkv.size(0), d = qkv.size(1) / (h + 2 * hkv), rot = cos.size(-1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (h + 2 * hkv) * d && qkv.stride(1) == 1 && cos.numel() == t * rot &&
              sin.numel() == t * rot && rot % 2 == 0 && rot <= d,
              "rope_kv_write: qkv [T, (H + 2 Hkv) D], cos / sin [T, 1, R], R even, R <= D");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dtype() == qkv.dtype() &&
              v_cache.dtype() == qkv.dtype() && cos.dtype() == qkv.dtype() && sin.dtype() == qkv.dtype() &&
              k_cache.size(2) == hkv && k_cache.size(3) == d && slots.dtype() == at::kLong && slots.numel() == t,
              "rope_kv_write: caches [blocks, block, Hkv, D] of qkv's dtype, slots [T] int64");
  const at::Tensor x = qkv.stride(0) == qkv.size(1) ? qkv : qkv.contiguous();
  const at::Tensor c = cos.contiguous(), s = sin.contiguous(), sl = slots.contiguous();
  const int64_t nslots = k_cache.numel() / (hkv * d);
  for (int64_t r = 0; r < t; ++r) {
    const int64_t v = sl.data_ptr<int64_t>()[r];
    TORCH_CHECK(v >= 0 && v < nslots, "rope_kv_write: slot ", v, " out of range");
  }
  at::Tensor q = at::empty({t, h, d}, qkv.options()), k = at::empty({t, hkv, d}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_kv_write", [&] {
    rope_kv_impl<scalar_t>(x, c, s, k_cache, v_cache, sl, h, hkv, q, k);
  });
  return {q, k};
}

// DecoderStack: consecutive decoder layers of a decode-only step whose projections all have a kernel for decode
// batches, in one call a step: the same kernels and ATen operations in the order models/decoder.py's DecoderLayer,
// linear.py's layers and linear_attention.py's GatedDeltaNet run them, without a trip through Python between them
// (eagerly ~25 dispatched calls an attention layer, ~40 a Gated DeltaNet one; one call a layer still cost ~15 us of
// Python and dispatch). It holds the layers' constant arguments, so a step passes only what changes. A layer's token
// mixer is attention over its paged KV cache (optionally q / k norms per head, Qwen3's and Qwen3.5's, and Qwen3.5's
// output gate) or a Gated DeltaNet (gated_delta_decode on its states). Its four projections (mixer in, mixer out,
// gate_up, down) are each one or more parts whose outputs are concatenated (loader.py's ConcatLinear), each part four
// tensors, the last its bias (empty when none), with a kind (stack.py's Kind) and a group: 0 / 1: lowbit_linear INT4
// / INT8 [codes, s, sz]; 2: PyTorch's INT4 kernel [packed, scales_zeros, -]; 3: PyTorch's INT8 kernel [q, scales, -];
// 4 / 5 / 8: lowbit_linear_bf16 INT4 / INT8 / INT5 [codes, s, -]; 2-5 and 8 take and give bfloat16 (the layers'
// default arithmetic); 6: dense16_linear [w, -, -]; 7: fp4_linear [codes, s, divisor (a one-element float32
// tensor)]; 9: q4k_linear [codes, s, mins]; 10: fp8_linear [codes, s, -] (activations rounded to E4M3 in the
// kernel); 11 / 12 / 13: table_linear [codes, s, table], each weight rounded to float32 / bfloat16 / float16.
at::Tensor project(const at::Tensor& x, const at::Tensor* w, int64_t kind, int64_t group, double eps,
                   at::ScalarType dtype) {
  const at::Tensor &a = w[0], &b = w[1], &c = w[2], &bias = w[3];
  at::Tensor y;
  if (kind <= 1) {
    y = lowbit_linear(x, a, b, c, kind == 0 ? 4 : 8, group, eps);
  } else if (kind == 6) {
    y = dense16_linear(x, a);
  } else if (kind == 7) {
    y = fp4_linear(x, a, b, group, c.item<double>());
  } else if (kind == 9) {
    y = q4k_linear(x, a, b, c, group);
  } else if (kind == 10) {
    y = fp8_linear(x, a, b, group, eps);
  } else if (kind >= 11) {
    TORCH_CHECK(kind <= 13, "DecoderStack: unknown linear kind ", kind);
    y = table_linear(x, a, b, c, group, kind - 11);
  } else if (kind >= 4) {
    TORCH_CHECK(kind <= 5 || kind == 8, "DecoderStack: unknown linear kind ", kind);
    y = lowbit_linear_bf16(x, a, b, kind == 4 ? 4 : kind == 5 ? 8 : 5, group);
  } else if (kind == 2) {
    y = at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16).contiguous(), a, group, b);
  } else {
    TORCH_CHECK(kind == 3, "DecoderStack: unknown linear kind ", kind);
    y = at::_weight_int8pack_mm(x.to(at::kBFloat16).contiguous(), a, b);
  }
  y = y.to(dtype);
  return bias.numel() ? y + bias : y;
}

// A projection of parts: each part's output, concatenated (ConcatLinear's forward).
at::Tensor project_parts(const at::Tensor& x, const at::Tensor* w, const int64_t* kinds, const int64_t* groups,
                         int64_t parts, double eps, at::ScalarType dtype) {
  if (parts == 1) return project(x, w, kinds[0], groups[0], eps, dtype);
  std::vector<at::Tensor> ys;
  for (int64_t p = 0; p < parts; ++p) ys.push_back(project(x, w + 4 * p, kinds[p], groups[p], eps, dtype));
  return at::cat(ys, -1);
}

enum Mixer : int64_t { kAttention = 0, kGatedDelta = 1 };

struct DecoderStack : torch::CustomClassHolder {
  // per layer: in_norms, post_norms, mixers (Mixer), parts (4: of each projection), extras (4 tensors: attention's q
  // and k norms, or empty; a Gated DeltaNet's conv [C, K], neg_rate, dt_bias, norm), ints (2: attention's output gate
  // 0 / 1; a Gated DeltaNet's key heads and key dim), floats (1: the q / k norms' or the gated norm's epsilon); per
  // part: four tensors in linears, a kind, a group; first_part: each projection's first part
  std::vector<at::Tensor> in_norms, post_norms, linears, extras;
  std::vector<int64_t> kinds, groups, parts, mixers, ints, first_part;
  std::vector<double> floats;
  double norm_eps;

  DecoderStack(std::vector<at::Tensor> in_norms, std::vector<at::Tensor> post_norms, double norm_eps,
               std::vector<at::Tensor> linears, std::vector<int64_t> kinds, std::vector<int64_t> groups,
               std::vector<int64_t> parts, std::vector<int64_t> mixers, std::vector<at::Tensor> extras,
               std::vector<int64_t> ints, std::vector<double> floats)
      : in_norms(std::move(in_norms)), post_norms(std::move(post_norms)), linears(std::move(linears)),
        extras(std::move(extras)), kinds(std::move(kinds)), groups(std::move(groups)), parts(std::move(parts)),
        mixers(std::move(mixers)), ints(std::move(ints)), floats(std::move(floats)), norm_eps(norm_eps) {
    const size_t n = this->in_norms.size();
    TORCH_CHECK(this->post_norms.size() == n && this->parts.size() == 4 * n && this->mixers.size() == n &&
                    this->extras.size() == 4 * n && this->ints.size() == 2 * n && this->floats.size() == n,
                "DecoderStack: per layer two norms, a mixer, four projections' part counts, four extra tensors, two "
                "integers and a float");
    int64_t total = 0;
    for (size_t i = 0; i < 4 * n; ++i) {
      TORCH_CHECK(this->parts[i] >= 1, "DecoderStack: a projection has at least one part");
      first_part.push_back(total);
      total += this->parts[i];
    }
    TORCH_CHECK(this->linears.size() == 4 * static_cast<size_t>(total) && this->kinds.size() == static_cast<size_t>(total) &&
                    this->groups.size() == static_cast<size_t>(total),
                "DecoderStack: four tensors, a kind and a group a part");
    for (size_t i = 0; i < n; ++i)
      TORCH_CHECK(this->mixers[i] == kAttention || this->mixers[i] == kGatedDelta, "DecoderStack: unknown mixer");
  }

  // Projection `which` (0 mixer in, 1 mixer out, 2 gate_up, 3 down) of layer i on x, its output in dtype.
  at::Tensor projection(size_t i, int which, const at::Tensor& x, double eps, at::ScalarType dtype) const {
    const int64_t p = first_part[4 * i + which];
    return project_parts(x, linears.data() + 4 * p, kinds.data() + p, groups.data() + p, parts[4 * i + which], eps,
                         dtype);
  }

  // One attention layer's mixer on the normalized rows y: its queries (gated, q / k-normed where it has them) over
  // the cache it writes at slots.
  at::Tensor attention(size_t i, const at::Tensor& y, const at::Tensor& cos, const at::Tensor& sin, at::Tensor kc,
                       at::Tensor vc, const at::Tensor& slots, const at::Tensor& blocks, const at::Tensor& mask,
                       int64_t h, int64_t hkv, double scale, double eps) {
    const auto dtype = y.scalar_type();
    const int64_t t = y.size(0), d = kc.size(3), qs = h * d;
    at::Tensor qkv = projection(i, 0, y, eps, dtype);
    at::Tensor gate;
    if (ints[2 * i]) {  // [query, gate] per head, then k and v
      const at::Tensor qg = qkv.narrow(1, 0, 2 * qs).view({t, h, 2 * d});
      gate = qg.narrow(2, d, d).reshape({t, qs});
      qkv = at::cat({qg.narrow(2, 0, d).reshape({t, qs}), qkv.narrow(1, 2 * qs, qkv.size(1) - 2 * qs)}, -1);
    }
    const at::Tensor& qn = extras[4 * i];
    if (qn.numel()) {
      const at::Tensor q = rms_norm(qkv.narrow(1, 0, qs).reshape({t, h, d}), qn, floats[i]).reshape({t, qs});
      const at::Tensor k = rms_norm(qkv.narrow(1, qs, hkv * d).reshape({t, hkv, d}), extras[4 * i + 1], floats[i]);
      qkv = at::cat({q, k.reshape({t, hkv * d}), qkv.narrow(1, qs + hkv * d, hkv * d)}, -1);
    }
    const auto qk = rope_kv_write(qkv, cos, sin, kc, vc, slots, h, hkv);
    at::Tensor a = decode_attention(qk[0], kc, vc, blocks, mask, scale, std::nullopt).view({t, qs});
    if (gate.defined()) a = a * at::sigmoid(gate);
    return projection(i, 1, a, eps, dtype);
  }

  // One Gated DeltaNet layer's mixer on the normalized rows y, on its convolution tails and states at state_slots.
  at::Tensor gated_delta(size_t i, const at::Tensor& y, at::Tensor tails, at::Tensor states,
                         const at::Tensor& state_slots, double eps) {
    const auto dtype = y.scalar_type();
    const at::Tensor* e = extras.data() + 4 * i;
    const at::Tensor o = gated_delta_decode(projection(i, 0, y, eps, dtype), tails, states, state_slots, e[0], e[1],
                                            e[2], e[3], floats[i], ints[2 * i], ints[2 * i + 1]);
    return projection(i, 1, o, eps, dtype);
  }

  // x [T, hidden] after the stack. firsts / seconds: each layer's K and V caches (written at slots), or a Gated
  // DeltaNet layer's convolution tails and recurrent states (read and written at state_slots: the decodes'
  // BlockManager state slots, empty in a stack without such layers).
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const std::vector<at::Tensor>& firsts,
                     const std::vector<at::Tensor>& seconds, const at::Tensor& slots, const at::Tensor& blocks,
                     const at::Tensor& mask, int64_t h, int64_t hkv, double scale, double eps,
                     const at::Tensor& state_slots) {
    TORCH_CHECK(firsts.size() == in_norms.size() && seconds.size() == in_norms.size(),
                "DecoderStack: two state tensors a layer");
    const auto dtype = x.scalar_type();
    for (size_t i = 0; i < in_norms.size(); ++i) {
      const at::Tensor y = rms_norm(x, in_norms[i], norm_eps);
      const at::Tensor m = mixers[i] == kGatedDelta
                               ? gated_delta(i, y, firsts[i], seconds[i], state_slots, eps)
                               : attention(i, y, cos, sin, firsts[i], seconds[i], slots, blocks, mask, h, hkv, scale,
                                           eps);
      const at::Tensor x1 = x + m;
      const at::Tensor gu = projection(i, 2, rms_norm(x1, post_norms[i], norm_eps), eps, dtype);
      x = x1.add_(projection(i, 3, silu_mul(gu), eps, dtype));
    }
    return x;
  }
};

TORCH_LIBRARY(llmq_cpu, m) {
  m.def("lowbit_linear(Tensor x, Tensor w, Tensor s, Tensor sz, int bits, int group, float eps) -> Tensor");
  m.def("lowbit_linear_bf16(Tensor x, Tensor w, Tensor s, int bits, int group) -> Tensor");
  m.def("amx(bool enable) -> bool", &amx);
  m.def("avx2_only(bool force) -> bool", &avx2_only);
  m.def("dense16_linear(Tensor x, Tensor w) -> Tensor");
  m.def("fp4_linear(Tensor x, Tensor w, Tensor s, int group, float divisor) -> Tensor");
  m.def("q4k_linear(Tensor x, Tensor w, Tensor s, Tensor mins, int group) -> Tensor");
  m.def("fp8_linear(Tensor x, Tensor w, Tensor s, int group, float eps) -> Tensor");
  m.def("fp8_token_groups(Tensor x, int group, float eps) -> (Tensor, Tensor)");
  m.def("table_linear(Tensor x, Tensor w, Tensor s, Tensor table, int group, int round) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gated_delta_decode(Tensor mixed, Tensor(a!) tails, Tensor(b!) states, Tensor slots, Tensor conv, "
        "Tensor neg_rate, Tensor dt_bias, Tensor norm, float eps, int key_heads, int key_dim) -> Tensor");
  m.def("delta_prefill(Tensor qkv, Tensor g, Tensor beta, Tensor(a!) tails, Tensor(b!) states, int slot, "
        "Tensor conv, int key_heads, int key_dim) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor blocks, Tensor mask, float scale, "
        "Tensor? sinks=None) -> Tensor");
  m.def("rope_kv_write(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
        "int h, int hkv) -> Tensor[]");
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, double, std::vector<at::Tensor>,
                       std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                       std::vector<at::Tensor>, std::vector<int64_t>, std::vector<double>>())
      .def("forward", &DecoderStack::forward);
}

TORCH_LIBRARY_IMPL(llmq_cpu, CPU, m) {
  m.impl("lowbit_linear", &lowbit_linear);
  m.impl("lowbit_linear_bf16", &lowbit_linear_bf16);
  m.impl("dense16_linear", &dense16_linear);
  m.impl("fp4_linear", &fp4_linear);
  m.impl("q4k_linear", &q4k_linear);
  m.impl("fp8_linear", &fp8_linear);
  m.impl("fp8_token_groups", &fp8_token_groups);
  m.impl("table_linear", &table_linear);
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("gated_delta_decode", &gated_delta_decode);
  m.impl("delta_prefill", &delta_prefill);
  m.impl("decode_attention", &decode_attention);
  m.impl("rope_kv_write", &rope_kv_write);
}
