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
