#include "coll/reduce.hpp"

#include <algorithm>
#include <cstring>
#include <type_traits>

namespace stellar::coll::detail {
namespace {

// Integer sums and products wrap around (two's complement), as NCCL's and
// MPI's do in practice; computed unsigned because signed overflow is
// undefined in C++.
template <typename T>
struct Sum {
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;
      return T(U(a) + U(b));
    } else {
      return a + b;
    }
  }
};
template <typename T>
struct Prod {
  static T apply(T a, T b) {
    if constexpr (std::is_integral_v<T>) {
      using U = std::make_unsigned_t<T>;
      return T(U(a) * U(b));
    } else {
      return a * b;
    }
  }
};
template <typename T>
struct Min {
  static T apply(T a, T b) { return b < a ? b : a; }
};
template <typename T>
struct Max {
  static T apply(T a, T b) { return a < b ? b : a; }
};

// Bitwise reductions exist for integer types only (checked at the call).
template <typename T>
struct BitAnd {
  static T apply(T a, T b) { return T(a & b); }
};
template <typename T>
struct BitOr {
  static T apply(T a, T b) { return T(a | b); }
};
template <typename T>
struct BitXor {
  static T apply(T a, T b) { return T(a ^ b); }
};

template <typename T, typename Op>
void loop(T* out, const T* a, const T* b, size_t n) {
  // No __restrict: out may alias a or b exactly (in-place). GCC still
  // vectorises, guarding the vector path with a runtime overlap check.
  for (size_t i = 0; i < n; ++i) out[i] = Op::apply(a[i], b[i]);
}

template <typename T>
void typed(ReduceOp op, void* out, const void* a, const void* b, size_t n) {
  auto* o = static_cast<T*>(out);
  auto* x = static_cast<const T*>(a);
  auto* y = static_cast<const T*>(b);
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: loop<T, Sum<T>>(o, x, y, n); break;
    case ReduceOp::prod: loop<T, Prod<T>>(o, x, y, n); break;
    case ReduceOp::min: loop<T, Min<T>>(o, x, y, n); break;
    case ReduceOp::max: loop<T, Max<T>>(o, x, y, n); break;
    case ReduceOp::band:
    case ReduceOp::bor:
    case ReduceOp::bxor:
      if constexpr (std::is_integral_v<T>) {
        if (op == ReduceOp::band) loop<T, BitAnd<T>>(o, x, y, n);
        else if (op == ReduceOp::bor) loop<T, BitOr<T>>(o, x, y, n);
        else loop<T, BitXor<T>>(o, x, y, n);
      }
      break;
  }
}

// 16-bit floats: widen a block to float, reduce, narrow.
template <float (*widen)(uint16_t), uint16_t (*narrow)(float)>
void sixteen(ReduceOp op, void* out, const void* a, const void* b, size_t n) {
  constexpr size_t block = 256;
  float fa[block], fb[block], fo[block];
  auto* o = static_cast<uint16_t*>(out);
  auto* x = static_cast<const uint16_t*>(a);
  auto* y = static_cast<const uint16_t*>(b);
  for (size_t at = 0; at < n; at += block) {
    const size_t m = std::min(block, n - at);
    for (size_t i = 0; i < m; ++i) fa[i] = widen(x[at + i]), fb[i] = widen(y[at + i]);
    typed<float>(op, fo, fa, fb, m);
    for (size_t i = 0; i < m; ++i) o[at + i] = narrow(fo[i]);
  }
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace

float bfloat16_to_float(uint16_t h) { return float_of(uint32_t(h) << 16); }

uint16_t float_to_bfloat16(float f) {
  const uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1f;
  uint32_t mantissa = h & 0x3ff;
  if (exponent == 0x1f) return float_of(sign | 0x7f800000u | (mantissa << 13));  // inf / NaN
  if (exponent == 0) {
    if (mantissa == 0) return float_of(sign);
    // Subnormal half: value = mantissa * 2^-24, exact in float.
    const float value = float(mantissa) * 0x1p-24f;
    return sign ? -value : value;
  }
  return float_of(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

uint16_t float_to_half(float f) {
  const uint32_t u = bits_of(f);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000);
  const uint32_t magnitude = u & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return uint16_t(sign | 0x7e00);      // NaN
  if (magnitude >= 0x477ff000u) return uint16_t(sign | 0x7c00);     // rounds to >= 65520: infinity
  if (magnitude < 0x38800000u) {                                    // below the smallest normal half (2^-14)
    // Subnormal: round magnitude / 2^-24 to nearest even integer.
    const float scaled = float_of(magnitude) * 0x1p24f;
    float rounded = __builtin_nearbyintf(scaled);  // default rounding mode: nearest even
    return uint16_t(sign | uint16_t(rounded));
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even.
  const uint32_t rebased = magnitude - (112u << 23);
  const uint32_t rounded = rebased + 0xfffu + ((rebased >> 13) & 1);
  return uint16_t(sign | (rounded >> 13));
}

void reduce(DataType type, ReduceOp op, void* out, const void* a, const void* b, size_t count) {
  switch (type) {
    case DataType::float32: typed<float>(op, out, a, b, count); break;
    case DataType::float64: typed<double>(op, out, a, b, count); break;
    case DataType::int32: typed<int32_t>(op, out, a, b, count); break;
    case DataType::int64: typed<int64_t>(op, out, a, b, count); break;
    case DataType::uint8: typed<uint8_t>(op, out, a, b, count); break;
    case DataType::int8: typed<int8_t>(op, out, a, b, count); break;
    case DataType::float16: sixteen<half_to_float, float_to_half>(op, out, a, b, count); break;
    case DataType::bfloat16: sixteen<bfloat16_to_float, float_to_bfloat16>(op, out, a, b, count); break;
  }
}

namespace {
template <typename T>
void divide_typed(void* buffer, size_t n, int divisor) {
  auto* p = static_cast<T*>(buffer);
  const T d = T(divisor);
  for (size_t i = 0; i < n; ++i) p[i] = p[i] / d;
}
template <float (*widen)(uint16_t), uint16_t (*narrow)(float)>
void divide_sixteen(void* buffer, size_t n, int divisor) {
  auto* p = static_cast<uint16_t*>(buffer);
  const float d = float(divisor);
  for (size_t i = 0; i < n; ++i) p[i] = narrow(widen(p[i]) / d);
}
}  // namespace

void divide(DataType type, void* buffer, size_t count, int divisor) {
  switch (type) {
    case DataType::float32: divide_typed<float>(buffer, count, divisor); break;
    case DataType::float64: divide_typed<double>(buffer, count, divisor); break;
    case DataType::int32: divide_typed<int32_t>(buffer, count, divisor); break;
    case DataType::int64: divide_typed<int64_t>(buffer, count, divisor); break;
    case DataType::uint8: divide_typed<uint8_t>(buffer, count, divisor); break;
    case DataType::int8: divide_typed<int8_t>(buffer, count, divisor); break;
    case DataType::float16: divide_sixteen<half_to_float, float_to_half>(buffer, count, divisor); break;
    case DataType::bfloat16: divide_sixteen<bfloat16_to_float, float_to_bfloat16>(buffer, count, divisor); break;
  }
}

}  // namespace stellar::coll::detail
