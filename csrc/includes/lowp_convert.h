// Scalar float <-> bfloat16 / float16 conversions, bit-exact with torch's `tensor.to(dtype)`:
// round to nearest even, subnormals kept, NaN stays NaN. Used for tails and the scalar kernel.
#pragma once

#include <cstdint>
#include <cstring>

namespace slipstream {

inline float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
  if (f != f) return 0x7FC0;  // canonical quiet NaN, as c10::BFloat16
  const uint32_t u = float_to_bits(f);
  const uint32_t rounding_bias = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu;
  uint32_t mantissa = h & 0x3FFu;
  if (exponent == 0x1F) return bits_to_float(sign | 0x7F800000u | (mantissa << 13));  // inf, NaN
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_to_float(sign);
  // Subnormal half: shift the leading one up to the implicit-bit position.
  int shift = 0;
  while ((mantissa & 0x400u) == 0) {
    mantissa <<= 1;
    ++shift;
  }
  return bits_to_float(sign | (static_cast<uint32_t>(113 - shift) << 23) | ((mantissa & 0x3FFu) << 13));
}

inline uint16_t float_to_fp16(float f) {
  uint32_t x = float_to_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7FFFFFFFu;
  if (x >= 0x7F800000u) {  // inf stays inf; NaN keeps its top payload bits and is made quiet
    return x == 0x7F800000u ? (sign | 0x7C00u) : static_cast<uint16_t>(sign | 0x7E00u | ((x >> 13) & 0x3FFu));
  }
  if (x >= 0x477FF000u) return sign | 0x7C00u;  // at or above 65520 rounds to inf
  if (x < 0x38800000u) {                         // below the smallest normal half: subnormal or zero
    const uint32_t exponent = x >> 23;
    const int shift = 126 - static_cast<int>(exponent);
    if (shift > 24) return sign;
    const uint32_t mantissa = (x & 0x7FFFFFu) | 0x800000u;
    uint32_t h = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    if (rest > half || (rest == half && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = (x >> 13) - (112u << 10);
  const uint32_t rest = x & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
  return static_cast<uint16_t>(sign | h);
}

}  // namespace slipstream
