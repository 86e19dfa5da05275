// Shared helpers of the native CPU kernels: bfloat16 <-> float32 conversions written so the
// compiler can vectorise them (plain bit arithmetic, no calls, no branches).
#pragma once

#include <cstdint>
#include <cstring>

namespace ferrum {

inline float bf16_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, as torch does; NaN stays a (quiet) NaN.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(nan ? 0x7fc0u : rounded);
}

// exp(x) to about 1 ulp, written so loops over it vectorise (std::exp is a scalar libm call
// unless -ffast-math): x = n*ln2 + r with |r| <= ln2/2, e^r by a degree-6 polynomial, 2^n by
// building the exponent bits. Inputs below -87.3 flush to 0 and above 88.7 saturate to +inf.
inline float fast_exp(float x) {
  const float hi = 88.7228f, lo = -87.3365f;
  const bool over = x > hi, under = x < lo;
  x = x > hi ? hi : (x < lo ? lo : x);
  const float n = __builtin_rintf(x * 1.44269504088896341f);
  // ln2 split in two so n*ln2 is exact enough for the subtraction (Cody-Waite).
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.428606765330187045e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const float result = p * scale;
  return over ? __builtin_inff() : (under ? 0.f : result);
}

// Element access that reads and writes float32 or bfloat16 storage as float.
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  static inline float load(const float* p, int64_t i) { return p[i]; }
  static inline void store(float* p, int64_t i, float v) { p[i] = v; }
  // Rounding to the storage type (the identity for float32).
  static inline float round(float v) { return v; }
};

template <>
struct Elem<uint16_t> {
  static inline float load(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
  static inline void store(uint16_t* p, int64_t i, float v) { p[i] = float_to_bf16(v); }
  static inline float round(float v) { return bf16_to_float(float_to_bf16(v)); }
};

}  // namespace ferrum
