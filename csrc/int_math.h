// Integer helpers shared by the reader's files: saturating size arithmetic
// and the comma-joined integer lists the sharding printer writes.

#ifndef TORCH_XLA_EXT_INT_MATH_H_
#define TORCH_XLA_EXT_INT_MATH_H_

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace txe {
namespace hlo {
namespace internal {

inline constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

inline int64_t SatAdd(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) return kInt64Max;
  return r;
}

inline int64_t SatMul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return kInt64Max;
  return r;
}

// Product of `dims`; nullopt when a factor is <= 0 or the product overflows.
inline std::optional<int64_t> PositiveProduct(const std::vector<int64_t>& dims) {
  int64_t p = 1;
  for (int64_t d : dims) {
    if (d <= 0) return std::nullopt;
    if (__builtin_mul_overflow(p, d, &p)) return std::nullopt;
  }
  return p;
}

template <typename T>
std::string JoinInts(const std::vector<T>& v, const char* sep = ",") {
  std::string out;
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i) out += sep;
    out += std::to_string(v[i]);
  }
  return out;
}

}  // namespace internal
}  // namespace hlo
}  // namespace txe

#endif  // TORCH_XLA_EXT_INT_MATH_H_
