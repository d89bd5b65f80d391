// Iota device lists (see iota.h).

#include "iota.h"

namespace txe {
namespace hlo {
namespace internal {

bool IsPermutation(const std::vector<int32_t>& perm, std::size_t n) {
  if (perm.size() != n) return false;
  std::vector<bool> seen(n, false);
  for (int32_t p : perm) {
    if (p < 0 || static_cast<std::size_t>(p) >= n || seen[p]) return false;
    seen[p] = true;
  }
  return true;
}

namespace {

// Row-major strides of `dims`.
std::vector<int64_t> Strides(const std::vector<int64_t>& dims) {
  std::vector<int64_t> strides(dims.size(), 1);
  for (std::size_t i = dims.size(); i-- > 1;) {
    strides[i - 1] = strides[i] * dims[i];
  }
  return strides;
}

}  // namespace

// Dimensions of size one do not change the order and are left out of the
// odometer below, so the work is linear in the result (a carry past a
// dimension of size >= 2 happens at most once per two steps, amortized).
std::vector<int64_t> ExpandIota(const std::vector<int64_t>& reshape_dims,
                                const std::vector<int>& perm) {
  int64_t total = 1;
  for (int64_t d : reshape_dims) total *= d;
  std::vector<int64_t> out;
  out.reserve(static_cast<std::size_t>(total));
  if (total == 0) return out;
  const std::vector<int64_t> strides = Strides(reshape_dims);
  std::vector<int64_t> tdims, tstrides;
  for (int axis : perm) {
    if (reshape_dims[axis] == 1) continue;
    tdims.push_back(reshape_dims[axis]);
    tstrides.push_back(strides[axis]);
  }
  const std::size_t n = tdims.size();
  std::vector<int64_t> index(n, 0);
  int64_t value = 0;
  for (int64_t count = 0; count < total; ++count) {
    out.push_back(value);
    for (std::size_t k = n; k-- > 0;) {
      if (++index[k] < tdims[k]) {
        value += tstrides[k];
        break;
      }
      value -= tstrides[k] * (tdims[k] - 1);
      index[k] = 0;
    }
  }
  return out;
}

}  // namespace internal
}  // namespace hlo
}  // namespace txe
