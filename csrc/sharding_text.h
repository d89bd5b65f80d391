// XLA's sharding string for a decoded OpSharding: HloSharding::FromProto's
// normalization followed by HloSharding::ToString, re-implemented so the
// text agrees with torch_xla's _get_xla_sharding_spec and the HLO text.

#ifndef TORCH_XLA_EXT_SHARDING_TEXT_H_
#define TORCH_XLA_EXT_SHARDING_TEXT_H_

#include <cstddef>

#include "budget.h"
#include "hlo_reader.h"

namespace txe {
namespace hlo {
namespace internal {

// Derives text, valid and devices of a sharding (and of each tuple element)
// from its proto fields, charging the lists and text it makes to `budget`.
// `offset` is where the proto starts in the input, for budget errors.
Sharding Describe(OpSharding proto, Budget& budget, std::size_t offset);

}  // namespace internal
}  // namespace hlo
}  // namespace txe

#endif  // TORCH_XLA_EXT_SHARDING_TEXT_H_
