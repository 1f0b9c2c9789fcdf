// CPU Adam/AdamW: one pass over p, g, m, v (and an optional bf16/fp16 copy of p), vectorized with
// AVX-512 or AVX2+FMA chosen at run time, a scalar path elsewhere, OpenMP across cores.
//
// [Note: arithmetic order] Each element follows torch.optim.AdamW's single-tensor CPU path step
// by step — scalars computed in double and rounded to float once, `p *= 1 - lr*wd`,
// `m.lerp_(g, 1-beta1)` (an FMA), `v = fma((1-beta2)*g, g, v*beta2)` (addcmul's FMA), `sqrt(v)/sqrt(bc2) + eps`,
// `p += (-lr/bc1) * m / denom` — so results agree with torch to an ulp or two, and every ISA path
// (including the scalar tails) gives bit-identical results. The file is compiled with
// -ffp-contract=off so the compiler cannot fuse multiplies and adds that torch keeps apart.
//
// [Note: partitioning] The tensors of a call are laid end to end, each padded to a multiple of 16
// elements, and every thread takes one contiguous slice of that space (a static schedule): each
// thread streams through memory once, and slice boundaries fall on 16-element (64-byte for fp32)
// offsets inside every tensor, which keeps vector loads and the streaming stores aligned.
#include "cpu_adam.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "lowp_convert.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define SS_X86 1
#define SS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#define SS_AVX2 __attribute__((target("avx2,fma,f16c")))
#include <immintrin.h>
#else
#define SS_X86 0
#endif

namespace slipstream {
namespace {

constexpr int64_t kAlign = 16;              // elements per slice boundary (one AVX-512 fp32 vector)
constexpr int64_t kSerialBelow = 1 << 15;   // smaller calls run on the calling thread
// Software prefetch distance in elements (2 KB ahead for fp32). The hardware prefetchers alone
// leave ~10% of the bandwidth unused with five concurrent streams per core on this kind of CPU.
constexpr int64_t kPrefetch = 512;

template <DType G>
inline float load_grad(const void* g, int64_t i) {
  if constexpr (G == DType::kFloat32) return static_cast<const float*>(g)[i];
  if constexpr (G == DType::kBFloat16) return bf16_to_float(static_cast<const uint16_t*>(g)[i]);
  if constexpr (G == DType::kFloat16) return fp16_to_float(static_cast<const uint16_t*>(g)[i]);
  return 0.0f;
}

template <DType L>
inline void store_lowp(void* out, int64_t i, float p) {
  if constexpr (L == DType::kBFloat16) static_cast<uint16_t*>(out)[i] = float_to_bf16(p);
  if constexpr (L == DType::kFloat16) static_cast<uint16_t*>(out)[i] = float_to_fp16(p);
}

// One element; the vector paths perform the same operations lane by lane.
#if SS_X86
template <DType G>
inline void prefetch_streams(const AdamTensor& t, int64_t i) {
  const int64_t ahead = i + kPrefetch;
  _mm_prefetch(reinterpret_cast<const char*>(t.param + ahead), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(t.exp_avg + ahead), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(t.exp_avg_sq + ahead), _MM_HINT_T0);
  const char* grad = static_cast<const char*>(t.grad) + ahead * (G == DType::kFloat32 ? 4 : 2);
  _mm_prefetch(grad, _MM_HINT_T0);
}
#endif

template <DType G, DType L, bool Probe>
inline void adam_element(const AdamTensor& t, int64_t i, const AdamScalars& s) {
  float p = t.param[i];
  float g = load_grad<G>(t.grad, i);
  float m = t.exp_avg[i];
  float v = t.exp_avg_sq[i];
  if constexpr (Probe) {
    p += g;
    m += g;
    v += p;
  } else {
    p = p * s.decay;
    g = g * s.grad_scale;
    if (s.use_l2) g = std::fma(p, s.l2, g);
    m = std::fma(s.w1, g - m, m);
    v = std::fma(s.c2 * g, g, v * s.beta2);
    const float denom = std::sqrt(v) / s.bc2_sqrt + s.eps;
    p = p + (s.neg_step * m) / denom;
  }
  t.param[i] = p;
  t.exp_avg[i] = m;
  t.exp_avg_sq[i] = v;
  store_lowp<L>(t.lowp_out, i, p);
}

template <DType G, DType L, bool Probe>
void range_scalar(const AdamTensor& t, int64_t begin, int64_t end, const AdamScalars& s) {
  for (int64_t i = begin; i < end; ++i) adam_element<G, L, Probe>(t, i, s);
}

#if SS_X86

// ---------------------------------------------------------------------------------------- AVX-512

template <DType G>
SS_AVX512 inline __m512 load_grad16(const void* g, int64_t i, __mmask16 mask) {
  if constexpr (G == DType::kFloat32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(g) + i);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(g) + i);
    if constexpr (G == DType::kBFloat16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
  }
}

template <DType L>
SS_AVX512 inline __m256i to_lowp16(__m512 p) {
  if constexpr (L == DType::kFloat16) {
    return _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    // Round to nearest even on the bit pattern, like c10::BFloat16 (not VCVTNEPS2BF16, which
    // flushes subnormals); NaN becomes the canonical 0x7FC0.
    const __m512i u = _mm512_castps_si512(p);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
  }
}

template <DType G, DType L, bool Probe>
SS_AVX512 void range_avx512(const AdamTensor& t, int64_t begin, int64_t end, const AdamScalars& s) {
  const __m512 decay = _mm512_set1_ps(s.decay), l2 = _mm512_set1_ps(s.l2), gs = _mm512_set1_ps(s.grad_scale);
  const __m512 w1 = _mm512_set1_ps(s.w1), b2 = _mm512_set1_ps(s.beta2), c2 = _mm512_set1_ps(s.c2);
  const __m512 bc2 = _mm512_set1_ps(s.bc2_sqrt), eps = _mm512_set1_ps(s.eps), step = _mm512_set1_ps(s.neg_step);
  uint16_t* lowp = static_cast<uint16_t*>(t.lowp_out);
  // The low-precision copy is write-only: streaming stores skip reading its lines first.
  const bool stream = L != DType::kNone && (reinterpret_cast<uintptr_t>(lowp + begin) % 32) == 0;
  for (int64_t i = begin; i < end; i += 16) {
    const int64_t left = end - i;
    const __mmask16 mask = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1u);
    prefetch_streams<G>(t, i);
    __m512 p = _mm512_maskz_loadu_ps(mask, t.param + i);
    __m512 g = load_grad16<G>(t.grad, i, mask);
    __m512 m = _mm512_maskz_loadu_ps(mask, t.exp_avg + i);
    __m512 v = _mm512_maskz_loadu_ps(mask, t.exp_avg_sq + i);
    if constexpr (Probe) {
      p = _mm512_add_ps(p, g);
      m = _mm512_add_ps(m, g);
      v = _mm512_add_ps(v, p);
    } else {
      p = _mm512_mul_ps(p, decay);
      g = _mm512_mul_ps(g, gs);
      if (s.use_l2) g = _mm512_fmadd_ps(p, l2, g);
      m = _mm512_fmadd_ps(w1, _mm512_sub_ps(g, m), m);
      v = _mm512_fmadd_ps(_mm512_mul_ps(c2, g), g, _mm512_mul_ps(v, b2));
      const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2), eps);
      p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(step, m), denom));
    }
    _mm512_mask_storeu_ps(t.param + i, mask, p);
    _mm512_mask_storeu_ps(t.exp_avg + i, mask, m);
    _mm512_mask_storeu_ps(t.exp_avg_sq + i, mask, v);
    if constexpr (L != DType::kNone) {
      const __m256i h = to_lowp16<L>(p);
      if (stream && left >= 16) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(lowp + i), h);
      } else {
        _mm256_mask_storeu_epi16(lowp + i, mask, h);
      }
    }
  }
  if (stream) _mm_sfence();
}

// ------------------------------------------------------------------------------------- AVX2 + FMA

template <DType G>
SS_AVX2 inline __m256 load_grad8(const void* g, int64_t i) {
  if constexpr (G == DType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    if constexpr (G == DType::kBFloat16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
  }
}

template <DType L>
SS_AVX2 inline __m128i to_lowp8(__m256 p) {
  if constexpr (L == DType::kFloat16) {
    return _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    const __m256i u = _mm256_castps_si256(p);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256 nan = _mm256_cmp_ps(p, p, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
}

template <DType G, DType L, bool Probe>
SS_AVX2 void range_avx2(const AdamTensor& t, int64_t begin, int64_t end, const AdamScalars& s) {
  const __m256 decay = _mm256_set1_ps(s.decay), l2 = _mm256_set1_ps(s.l2), gs = _mm256_set1_ps(s.grad_scale);
  const __m256 w1 = _mm256_set1_ps(s.w1), b2 = _mm256_set1_ps(s.beta2), c2 = _mm256_set1_ps(s.c2);
  const __m256 bc2 = _mm256_set1_ps(s.bc2_sqrt), eps = _mm256_set1_ps(s.eps), step = _mm256_set1_ps(s.neg_step);
  uint16_t* lowp = static_cast<uint16_t*>(t.lowp_out);
  const bool stream = L != DType::kNone && (reinterpret_cast<uintptr_t>(lowp + begin) % 16) == 0;
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    prefetch_streams<G>(t, i);
    __m256 p = _mm256_loadu_ps(t.param + i);
    __m256 g = load_grad8<G>(t.grad, i);
    __m256 m = _mm256_loadu_ps(t.exp_avg + i);
    __m256 v = _mm256_loadu_ps(t.exp_avg_sq + i);
    if constexpr (Probe) {
      p = _mm256_add_ps(p, g);
      m = _mm256_add_ps(m, g);
      v = _mm256_add_ps(v, p);
    } else {
      p = _mm256_mul_ps(p, decay);
      g = _mm256_mul_ps(g, gs);
      if (s.use_l2) g = _mm256_fmadd_ps(p, l2, g);
      m = _mm256_fmadd_ps(w1, _mm256_sub_ps(g, m), m);
      v = _mm256_fmadd_ps(_mm256_mul_ps(c2, g), g, _mm256_mul_ps(v, b2));
      const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2), eps);
      p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(step, m), denom));
    }
    _mm256_storeu_ps(t.param + i, p);
    _mm256_storeu_ps(t.exp_avg + i, m);
    _mm256_storeu_ps(t.exp_avg_sq + i, v);
    if constexpr (L != DType::kNone) {
      const __m128i h = to_lowp8<L>(p);
      if (stream) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(lowp + i), h);
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(lowp + i), h);
      }
    }
  }
  if (stream) _mm_sfence();
  for (; i < end; ++i) adam_element<G, L, Probe>(t, i, s);
}

#endif  // SS_X86

// ------------------------------------------------------------------------------------- dispatch

enum class Isa { kScalar, kAvx2, kAvx512 };

Isa detect_isa() {
  Isa best = Isa::kScalar;
#if SS_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::kAvx2;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl")) {
    best = Isa::kAvx512;
  }
#endif
  const char* cap = std::getenv("SLIPSTREAM_CPU_ADAM_ISA");
  if (cap != nullptr && std::strcmp(cap, "scalar") == 0) best = Isa::kScalar;
  if (cap != nullptr && std::strcmp(cap, "avx2") == 0 && best == Isa::kAvx512) best = Isa::kAvx2;
  return best;
}

Isa isa() {
  static const Isa chosen = detect_isa();
  return chosen;
}

using RangeFn = void (*)(const AdamTensor&, int64_t, int64_t, const AdamScalars&);

template <DType G, DType L, bool Probe>
RangeFn pick_for_isa() {
#if SS_X86
  if (isa() == Isa::kAvx512) return &range_avx512<G, L, Probe>;
  if (isa() == Isa::kAvx2) return &range_avx2<G, L, Probe>;
#endif
  return &range_scalar<G, L, Probe>;
}

template <DType G, bool Probe>
RangeFn pick_lowp(DType lowp) {
  switch (lowp) {
    case DType::kBFloat16: return pick_for_isa<G, DType::kBFloat16, Probe>();
    case DType::kFloat16: return pick_for_isa<G, DType::kFloat16, Probe>();
    default: return pick_for_isa<G, DType::kNone, Probe>();
  }
}

template <bool Probe>
RangeFn pick(DType grad, DType lowp) {
  switch (grad) {
    case DType::kBFloat16: return pick_lowp<DType::kBFloat16, Probe>(lowp);
    case DType::kFloat16: return pick_lowp<DType::kFloat16, Probe>(lowp);
    default: return pick_lowp<DType::kFloat32, Probe>(lowp);
  }
}

void run(RangeFn fn, const AdamTensor* tensors, int64_t count, const AdamScalars& s, int num_threads) {
  std::vector<int64_t> offsets(count + 1, 0);  // padded start of each tensor in the joint space
  for (int64_t k = 0; k < count; ++k) {
    offsets[k + 1] = offsets[k] + (tensors[k].numel + kAlign - 1) / kAlign * kAlign;
  }
  const int64_t total = offsets[count];
  if (num_threads <= 0) num_threads = omp_get_max_threads();
  if (total < kSerialBelow) num_threads = 1;
  num_threads = static_cast<int>(std::min<int64_t>(num_threads, std::max<int64_t>(1, total / kAlign)));

  auto slice = [&](int thread) {
    const int64_t blocks = total / kAlign;
    const int64_t begin = blocks * thread / num_threads * kAlign;
    const int64_t end = blocks * (thread + 1) / num_threads * kAlign;
    // First tensor whose padded range ends after `begin`.
    int64_t k = std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin() - 1;
    for (; k < count && offsets[k] < end; ++k) {
      const int64_t lo = std::max<int64_t>(begin - offsets[k], 0);
      const int64_t hi = std::min<int64_t>(end - offsets[k], tensors[k].numel);
      if (lo < hi) fn(tensors[k], lo, hi, s);
    }
  };
  if (num_threads == 1) {
    slice(0);
    return;
  }
#pragma omp parallel num_threads(num_threads)
  {
    // The runtime may grant fewer threads than asked (nesting, OMP_THREAD_LIMIT): cover every slice.
    for (int t = omp_get_thread_num(); t < num_threads; t += omp_get_num_threads()) slice(t);
  }
}

}  // namespace

const char* cpu_adam_isa() {
  switch (isa()) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "scalar";
  }
}

void cpu_adam_step(const AdamTensor* tensors, int64_t count, DType grad_dtype, DType lowp_dtype,
                   const AdamHyper& hyper, int num_threads) {
  run(pick<false>(grad_dtype, lowp_dtype), tensors, count, make_adam_scalars(hyper), num_threads);
}

void cpu_stream_probe(const AdamTensor* tensors, int64_t count, DType grad_dtype, DType lowp_dtype,
                      int num_threads) {
  run(pick<true>(grad_dtype, lowp_dtype), tensors, count, AdamScalars{}, num_threads);
}

}  // namespace slipstream
