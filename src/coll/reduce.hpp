// Element-wise reduction kernels of the collectives. Internal header.
// Plain loops the compiler vectorises (reduce.cpp is built with -O3);
// float16 and bfloat16 are widened to float in blocks, reduced, and rounded
// back to nearest-even, as NCCL and Gloo do.
#pragma once

#include <cstddef>
#include <cstdint>

#include "stellar/coll.hpp"

namespace stellar::coll::detail {

// out[i] = a[i] op b[i] for i < count; out may alias a or b. avg reduces as
// sum (the division by the rank count is divide()'s job, done once).
void reduce(DataType, ReduceOp, void* out, const void* a, const void* b, size_t count);
// buffer[i] /= divisor (integer division for integer types).
void divide(DataType, void* buffer, size_t count, int divisor);

// Scalar conversions, exposed for tests and reference implementations.
float half_to_float(uint16_t);
uint16_t float_to_half(float);  // round to nearest even; overflow to infinity; NaN stays NaN
float bfloat16_to_float(uint16_t);
uint16_t float_to_bfloat16(float);  // round to nearest even; NaN stays NaN

}  // namespace stellar::coll::detail
