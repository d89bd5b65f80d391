// Iota device lists: XLA's compact description of a device order as
// iota(prod(reshape_dims)).reshape(reshape_dims).transpose(perm). Used for
// sharding tile assignments and for iota replica groups.

#ifndef TORCH_XLA_EXT_IOTA_H_
#define TORCH_XLA_EXT_IOTA_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace txe {
namespace hlo {
namespace internal {

// Whether `perm` is a permutation of 0..n-1.
bool IsPermutation(const std::vector<int32_t>& perm, std::size_t n);

// Flat list of iota(prod(reshape_dims)).reshape(reshape_dims)
// .transpose(perm), i.e. the row-major source offset of each element of the
// transposed array. `perm` must be a permutation of the dimensions and the
// product must fit: callers check sizes against the budget first. Linear in
// the result.
std::vector<int64_t> ExpandIota(const std::vector<int64_t>& reshape_dims,
                                const std::vector<int>& perm);

}  // namespace internal
}  // namespace hlo
}  // namespace txe

#endif  // TORCH_XLA_EXT_IOTA_H_
