// The reader's value types: primitive types and their sizes, shapes,
// sharding type names, and small accessors of the records in hlo_reader.h.

#include <charconv>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "hlo_reader.h"
#include "int_math.h"

namespace txe {
namespace hlo {

using internal::SatAdd;
using internal::SatMul;

ParseError::ParseError(const std::string& message, std::size_t offset)
    : std::runtime_error(message), offset_(offset) {}

std::string_view PrimitiveTypeName(int32_t type) {
  switch (type) {
    case kPred: return "pred";
    case kS1: return "s1";
    case kS2: return "s2";
    case kS4: return "s4";
    case kS8: return "s8";
    case kS16: return "s16";
    case kS32: return "s32";
    case kS64: return "s64";
    case kU1: return "u1";
    case kU2: return "u2";
    case kU4: return "u4";
    case kU8: return "u8";
    case kU16: return "u16";
    case kU32: return "u32";
    case kU64: return "u64";
    case kF16: return "f16";
    case kF32: return "f32";
    case kBF16: return "bf16";
    case kF64: return "f64";
    case kF8E5M2: return "f8e5m2";
    case kF8E4M3: return "f8e4m3";
    case kF8E4M3FN: return "f8e4m3fn";
    case kF8E4M3B11FNUZ: return "f8e4m3b11fnuz";
    case kF8E3M4: return "f8e3m4";
    case kF8E5M2FNUZ: return "f8e5m2fnuz";
    case kF8E4M3FNUZ: return "f8e4m3fnuz";
    case kF4E2M1FN: return "f4e2m1fn";
    case kF8E8M0FNU: return "f8e8m0fnu";
    case kC64: return "c64";
    case kC128: return "c128";
    case kTuple: return "tuple";
    case kOpaque: return "opaque";
    case kToken: return "token";
    case kBuffer: return "buffer";
    default: return "invalid";
  }
}

int PrimitiveTypeBits(int32_t type) {
  switch (type) {
    case kS1:
    case kU1:
      return 1;
    case kS2:
    case kU2:
      return 2;
    case kS4:
    case kU4:
    case kF4E2M1FN:
      return 4;
    case kPred:
    case kS8:
    case kU8:
    case kF8E5M2:
    case kF8E4M3:
    case kF8E4M3FN:
    case kF8E4M3B11FNUZ:
    case kF8E3M4:
    case kF8E5M2FNUZ:
    case kF8E4M3FNUZ:
    case kF8E8M0FNU:
      return 8;
    case kS16:
    case kU16:
    case kF16:
    case kBF16:
      return 16;
    case kS32:
    case kU32:
    case kF32:
      return 32;
    case kS64:
    case kU64:
    case kF64:
    case kC64:
      return 64;
    case kC128:
      return 128;
    default:
      return 0;
  }
}

int64_t Shape::num_elements() const {
  if (element_type == kTuple || element_type == kToken ||
      element_type == kOpaque) {
    return 0;
  }
  int64_t n = 1;
  for (int64_t d : dimensions) n = SatMul(n, d > 0 ? d : 0);
  return n;
}

int64_t Shape::byte_size() const {
  if (element_type == kTuple) {
    int64_t total = 0;
    // Iterative walk: tuple nesting is bounded by the parser, but keep the
    // size computation itself free of recursion limits.
    std::vector<const Shape*> stack;
    for (const Shape& s : tuple_shapes) stack.push_back(&s);
    while (!stack.empty()) {
      const Shape* s = stack.back();
      stack.pop_back();
      if (s->element_type == kTuple) {
        for (const Shape& t : s->tuple_shapes) stack.push_back(&t);
      } else {
        total = SatAdd(total, s->byte_size());
      }
    }
    return total;
  }
  const int bits = PrimitiveTypeBits(element_type);
  if (bits == 0) return 0;
  const int64_t n = num_elements();
  if (bits % 8 == 0) return SatMul(n, bits / 8);
  // Sub-byte types: round up per array.
  const int64_t per_byte = 8 / bits;
  return n / per_byte + (n % per_byte != 0 ? 1 : 0);
}

std::string Shape::ToString() const {
  if (element_type == kTuple) {
    std::string out = "(";
    for (std::size_t i = 0; i < tuple_shapes.size(); ++i) {
      if (i) out += ", ";
      out += tuple_shapes[i].ToString();
    }
    return out + ")";
  }
  std::string out(PrimitiveTypeName(element_type));
  if (element_type == kToken || element_type == kOpaque) return out;
  out += '[';
  for (std::size_t i = 0; i < dimensions.size(); ++i) {
    if (i) out += ',';
    const bool dynamic =
        i < is_dynamic_dimension.size() && is_dynamic_dimension[i];
    if (dimensions[i] == kUnboundedSize) {
      out += '?';
    } else {
      if (dynamic) out += "<=";
      out += std::to_string(dimensions[i]);
    }
  }
  return out + ']';
}

std::string ShardingTypeName(int32_t type) {
  switch (type) {
    case kShardingReplicated: return "replicated";
    case kShardingMaximal: return "maximal";
    case kShardingTuple: return "tuple";
    case kShardingOther: return "other";
    case kShardingManual: return "manual";
    case kShardingUnknown: return "unknown";
    case kShardingUnreduced: return "unreduced";
    default: return "type_" + std::to_string(type);
  }
}

const std::string* Instruction::FrontendAttribute(std::string_view key) const {
  for (const auto& kv : frontend_attributes) {
    if (kv.first == key) return &kv.second;
  }
  return nullptr;
}

std::optional<int32_t> ShardingTypeFromName(std::string_view name) {
  for (int32_t type = 0; type <= kMaxShardingType; ++type) {
    if (ShardingTypeName(type) == name) return type;
  }
  static constexpr std::string_view kPrefix = "type_";
  if (name.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  const char* first = name.data() + kPrefix.size();
  const char* last = name.data() + name.size();
  int32_t value = 0;
  const auto [end, error] = std::from_chars(first, last, value);
  if (error != std::errc() || end != last) return std::nullopt;
  return value;
}

}  // namespace hlo
}  // namespace txe
