// Hand-written decoder for xla.HloModuleProto and the analyses built on it.
// See hlo_reader.h for the contract.

#include "hlo_reader.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>

namespace txe {
namespace hlo {

ParseError::ParseError(const std::string& message, std::size_t offset)
    : std::runtime_error(message), offset_(offset) {}

namespace {

// ---------------------------------------------------------------------------
// Saturating arithmetic used for sizes.

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

int64_t SatAdd(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) return kInt64Max;
  return r;
}

int64_t SatMul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return kInt64Max;
  return r;
}

// Product of `dims`; nullopt when a factor is <= 0 or the product overflows.
std::optional<int64_t> PositiveProduct(const std::vector<int64_t>& dims) {
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

// ---------------------------------------------------------------------------
// Wire-format cursor.

enum WireType : int {
  kVarint = 0,
  kFixed64 = 1,
  kLengthDelimited = 2,
  kStartGroup = 3,
  kEndGroup = 4,
  kFixed32 = 5,
};

// A path through the message tree, printed in error messages.
struct Context {
  struct Frame {
    const char* field;
    int64_t index;  // -1 for singular fields
  };
  std::vector<Frame> frames;
  const char* root = "HloModuleProto";

  std::string Path() const {
    std::string out = root;
    for (const Frame& f : frames) {
      out += '.';
      out += f.field;
      if (f.index >= 0) {
        out += '[';
        out += std::to_string(f.index);
        out += ']';
      }
    }
    return out;
  }
};

class ScopedFrame {
 public:
  ScopedFrame(Context& ctx, const char* field, int64_t index = -1)
      : ctx_(ctx) {
    ctx_.frames.push_back({field, index});
  }
  ~ScopedFrame() { ctx_.frames.pop_back(); }
  ScopedFrame(const ScopedFrame&) = delete;
  ScopedFrame& operator=(const ScopedFrame&) = delete;

 private:
  Context& ctx_;
};

// Byte budget of one parse (see hlo_reader.h). Charges are upper estimates
// of what a step allocates, made before the allocation where the size is
// known up front; nothing is credited back.
class Budget {
 public:
  // `input_size` is the size of the bytes being read; `ctx` (may be null)
  // names the field in error messages.
  Budget(std::size_t input_size, const Context* ctx)
      : input_size_(input_size), ctx_(ctx) {
    std::size_t limit;
    if (__builtin_mul_overflow(input_size, kBudgetBytesPerInputByte, &limit) ||
        __builtin_add_overflow(limit, kBudgetBaseBytes, &limit)) {
      limit = std::numeric_limits<std::size_t>::max();
    }
    limit_ = limit;
  }

  // Charges decoded data; throws ParseError naming `offset` when the total
  // would pass the limit.
  void Charge(std::size_t bytes, std::size_t offset) {
    if (bytes > limit_ - used_) Fail(bytes, offset);
    used_ += bytes;
  }

  // Charges `count` items of `each` bytes (saturating).
  void ChargeItems(std::size_t count, std::size_t each, std::size_t offset) {
    std::size_t bytes;
    if (__builtin_mul_overflow(count, each, &bytes)) {
      bytes = std::numeric_limits<std::size_t>::max();
    }
    Charge(bytes, offset);
  }

  // Charges a list derived from an iota description (whose length does not
  // follow from the input size): true when it fits in what is left of half
  // the budget, false (nothing charged) otherwise.
  bool TryChargeExpansion(std::size_t bytes) {
    if (bytes > limit_ / 2 - expanded_ || bytes > limit_ - used_) return false;
    expanded_ += bytes;
    used_ += bytes;
    return true;
  }

  // Takes `n` device ids of an expansion, each charged `bytes_each`, within
  // the per-list and per-module device caps and the budget.
  bool TakeDevices(int64_t n, std::size_t bytes_each) {
    if (n < 0 || n > kMaxExpandedDevices || n > devices_remaining_) {
      return false;
    }
    // n <= 2^18 and bytes_each is a small constant: no overflow.
    if (!TryChargeExpansion(static_cast<std::size_t>(n) * bytes_each)) {
      return false;
    }
    devices_remaining_ -= n;
    return true;
  }

  std::size_t used() const { return used_; }
  std::size_t limit() const { return limit_; }

  // Text bytes already paid for by the charges of materialized iota lists
  // (the sharding printer takes its text charge from here first).
  std::size_t prepaid_text = 0;

 private:
  [[noreturn]] void Fail(std::size_t bytes, std::size_t offset) const {
    const char* root = ctx_ != nullptr ? ctx_->root : "input";
    std::string msg = std::string(root) +
                      " exceeds the reader's memory budget at byte offset " +
                      std::to_string(offset);
    if (ctx_ != nullptr) msg += " (in " + ctx_->Path() + ")";
    msg += ": decoding it would take more than " + std::to_string(limit_) +
           " bytes (" + std::to_string(used_) + " used, " +
           std::to_string(bytes) + " more needed), the limit for a " +
           std::to_string(input_size_) + "-byte input (" +
           std::to_string(kBudgetBytesPerInputByte) + " bytes per input byte + " +
           std::to_string(kBudgetBaseBytes) +
           "); the input describes far more data than its size holds";
    throw ParseError(msg, offset);
  }

  std::size_t input_size_;
  const Context* ctx_;
  std::size_t limit_ = 0;
  std::size_t used_ = 0;
  std::size_t expanded_ = 0;
  int64_t devices_remaining_ = kMaxExpandedDevicesPerModule;
};

// Bytes charged per element of a decoded repeated integer field: at least 8,
// so scratch copies of int32 lists (permutations, bit sets over their
// length) are covered by the field's own charge.
template <typename T>
constexpr std::size_t kChargePerInt = sizeof(T) < 8 ? 8 : sizeof(T);

// Makes room for `extra` more elements, growing the capacity geometrically
// and charging the new capacity.
template <typename T>
void ReserveCharged(std::vector<T>& v, std::size_t extra, Budget& budget,
                    std::size_t offset, std::size_t each = sizeof(T)) {
  if (v.capacity() - v.size() >= extra) return;
  const std::size_t cap = std::max(v.size() + extra, v.capacity() * 2);
  budget.ChargeItems(cap, each, offset);
  v.reserve(cap);
}

// Appends a default-constructed element, charging the growth.
template <typename T>
T& AppendCharged(std::vector<T>& v, Budget& budget, std::size_t offset,
                 std::size_t each = sizeof(T)) {
  ReserveCharged(v, 1, budget, offset, each);
  v.emplace_back();
  return v.back();
}

struct Tag {
  uint32_t field;
  int wire_type;
  std::size_t offset;  // where the tag starts
};

class Cursor {
 public:
  Cursor(const uint8_t* base, std::size_t begin, std::size_t end, int depth,
         Context* ctx)
      : base_(base), pos_(begin), end_(end), depth_(depth), ctx_(ctx) {}

  bool done() const { return pos_ >= end_; }
  std::size_t pos() const { return pos_; }

  [[noreturn]] void Fail(const std::string& what, std::size_t offset) const {
    std::string msg = "malformed HloModuleProto: " + what + " at byte offset " +
                      std::to_string(offset);
    if (ctx_ != nullptr) msg += " (in " + ctx_->Path() + ")";
    throw ParseError(msg, offset);
  }

  uint64_t ReadVarint() {
    const std::size_t start = pos_;
    uint64_t result = 0;
    for (int i = 0; i < 10; ++i) {
      if (pos_ >= end_) Fail("truncated varint", start);
      const uint8_t b = base_[pos_++];
      if (i == 9) {
        if (b & 0x80) Fail("varint longer than 10 bytes", start);
        if (b > 1) Fail("varint does not fit in 64 bits", start);
      }
      result |= static_cast<uint64_t>(b & 0x7f) << (7 * i);
      if ((b & 0x80) == 0) return result;
    }
    Fail("varint longer than 10 bytes", start);  // not reached
  }

  Tag ReadTag() {
    const std::size_t start = pos_;
    const uint64_t key = ReadVarint();
    if (key > 0xffffffffull) Fail("field tag out of range", start);
    const uint32_t field = static_cast<uint32_t>(key >> 3);
    const int wt = static_cast<int>(key & 7);
    if (field == 0) Fail("field number 0", start);
    if (wt == 6 || wt == 7) {
      Fail("invalid wire type " + std::to_string(wt) + " for field " +
               std::to_string(field),
           start);
    }
    return {field, wt, start};
  }

  // Reads a length prefix and returns a cursor over the payload, advancing
  // past it.
  Cursor ReadSub() {
    const std::size_t start = pos_;
    const uint64_t len = ReadVarint();
    const std::size_t left = end_ - pos_;
    if (len > left) {
      Fail("length " + std::to_string(len) + " exceeds the " +
               std::to_string(left) + " bytes left",
           start);
    }
    Cursor sub(base_, pos_, pos_ + static_cast<std::size_t>(len), depth_, ctx_);
    pos_ += static_cast<std::size_t>(len);
    return sub;
  }

  // A cursor for a nested message: same as ReadSub but one level deeper.
  Cursor ReadMessage() {
    const std::size_t start = pos_;
    if (depth_ + 1 > kMaxNestingDepth) {
      Fail("messages nested deeper than " + std::to_string(kMaxNestingDepth),
           start);
    }
    Cursor sub = ReadSub();
    sub.depth_ = depth_ + 1;
    return sub;
  }

  // Upper bound of the varints left: the bytes that end one.
  std::size_t CountVarints() const {
    std::size_t n = 0;
    for (std::size_t i = pos_; i < end_; ++i) n += (base_[i] & 0x80) == 0;
    return n;
  }

  std::string ReadBytes(Budget& budget) {
    const std::size_t start = pos_;
    Cursor sub = ReadSub();
    const std::size_t n = sub.end_ - sub.pos_;
    budget.Charge(n + 1, start);
    return std::string(reinterpret_cast<const char*>(base_ + sub.pos_), n);
  }

  std::string ReadString(Budget& budget) {
    const std::size_t start = pos_;
    Cursor sub = ReadSub();
    const uint8_t* p = base_ + sub.pos_;
    const std::size_t n = sub.end_ - sub.pos_;
    const std::size_t bad = FirstInvalidUtf8(p, n);
    if (bad != n) Fail("string field is not valid UTF-8", sub.pos_ + bad);
    budget.Charge(n + 1, start);
    return std::string(reinterpret_cast<const char*>(p), n);
  }

  uint64_t ReadFixed64() {
    if (end_ - pos_ < 8) Fail("truncated fixed64", pos_);
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(base_[pos_ + i]) << (8 * i);
    pos_ += 8;
    return v;
  }

  uint32_t ReadFixed32() {
    if (end_ - pos_ < 4) Fail("truncated fixed32", pos_);
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(base_[pos_ + i]) << (8 * i);
    pos_ += 4;
    return v;
  }

  // Skips the value of a field whose tag was just read.
  void Skip(const Tag& tag) {
    switch (tag.wire_type) {
      case kVarint:
        ReadVarint();
        return;
      case kFixed64:
        ReadFixed64();
        return;
      case kLengthDelimited:
        ReadSub();
        return;
      case kFixed32:
        ReadFixed32();
        return;
      case kStartGroup:
        SkipGroup(tag);
        return;
      case kEndGroup:
        Fail("end-group tag for field " + std::to_string(tag.field) +
                 " without a matching start-group",
             tag.offset);
      default:
        Fail("invalid wire type", tag.offset);
    }
  }

 private:
  // Skips a (deprecated) group, including nested groups, iteratively.
  void SkipGroup(const Tag& open) {
    std::vector<uint32_t> stack{open.field};
    while (!stack.empty()) {
      if (depth_ + static_cast<int>(stack.size()) > kMaxNestingDepth) {
        Fail("groups nested deeper than " + std::to_string(kMaxNestingDepth),
             pos_);
      }
      if (done()) Fail("truncated group (missing end-group tag)", pos_);
      const Tag tag = ReadTag();
      if (tag.wire_type == kStartGroup) {
        stack.push_back(tag.field);
      } else if (tag.wire_type == kEndGroup) {
        if (tag.field != stack.back()) {
          Fail("end-group tag for field " + std::to_string(tag.field) +
                   " does not match the open group " +
                   std::to_string(stack.back()),
               tag.offset);
        }
        stack.pop_back();
      } else {
        Skip(tag);
      }
    }
  }

  // Index of the first byte that breaks UTF-8 (as Python and protobuf
  // define it: no overlong forms, no surrogates, nothing above U+10FFFF);
  // n when the whole string is valid.
  static std::size_t FirstInvalidUtf8(const uint8_t* s, std::size_t n) {
    std::size_t i = 0;
    while (i < n) {
      const uint8_t c = s[i];
      if (c < 0x80) {
        ++i;
        continue;
      }
      int len;
      uint32_t cp;
      if (c >= 0xc2 && c <= 0xdf) {
        len = 2;
        cp = c & 0x1f;
      } else if (c >= 0xe0 && c <= 0xef) {
        len = 3;
        cp = c & 0x0f;
      } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4;
        cp = c & 0x07;
      } else {
        return i;
      }
      if (n - i < static_cast<std::size_t>(len)) return i;
      for (int k = 1; k < len; ++k) {
        const uint8_t cc = s[i + k];
        if ((cc & 0xc0) != 0x80) return i;
        cp = (cp << 6) | (cc & 0x3f);
      }
      if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
          (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff) {
        return i;
      }
      i += len;
    }
    return n;
  }

  const uint8_t* base_;
  std::size_t pos_;
  std::size_t end_;
  int depth_;
  Context* ctx_;
};

// Repeated scalar fields arrive packed (one length-delimited run) or one
// varint per tag; both are accepted. Other wire types are skipped as an
// unknown field would be.
template <typename T>
void ReadRepeatedVarint(Cursor& c, const Tag& tag, std::vector<T>& out,
                        Budget& budget) {
  if (tag.wire_type == kVarint) {
    const auto v = static_cast<T>(static_cast<int64_t>(c.ReadVarint()));
    AppendCharged(out, budget, tag.offset, kChargePerInt<T>) = v;
  } else if (tag.wire_type == kLengthDelimited) {
    Cursor packed = c.ReadSub();
    ReserveCharged(out, packed.CountVarints(), budget, tag.offset,
                   kChargePerInt<T>);
    while (!packed.done()) {
      out.push_back(static_cast<T>(static_cast<int64_t>(packed.ReadVarint())));
    }
  } else {
    c.Skip(tag);
  }
}

// std::vector<bool> packs bits; one byte per value covers its growth.
void ReadRepeatedBool(Cursor& c, const Tag& tag, std::vector<bool>& out,
                      Budget& budget) {
  if (tag.wire_type == kVarint) {
    budget.Charge(1, tag.offset);
    out.push_back(c.ReadVarint() != 0);
  } else if (tag.wire_type == kLengthDelimited) {
    Cursor packed = c.ReadSub();
    budget.Charge(packed.CountVarints(), tag.offset);
    while (!packed.done()) out.push_back(packed.ReadVarint() != 0);
  } else {
    c.Skip(tag);
  }
}

// Singular scalars: a mismatched wire type is skipped like an unknown field.
bool ReadInt64(Cursor& c, const Tag& tag, int64_t& out) {
  if (tag.wire_type != kVarint) {
    c.Skip(tag);
    return false;
  }
  out = static_cast<int64_t>(c.ReadVarint());
  return true;
}

void ReadInt32(Cursor& c, const Tag& tag, int32_t& out) {
  int64_t v;
  if (ReadInt64(c, tag, v)) out = static_cast<int32_t>(v);
}

void ReadBool(Cursor& c, const Tag& tag, bool& out) {
  int64_t v;
  if (ReadInt64(c, tag, v)) out = v != 0;
}

void ReadStringField(Cursor& c, const Tag& tag, std::string& out,
                     Budget& budget) {
  if (tag.wire_type != kLengthDelimited) {
    c.Skip(tag);
    return;
  }
  out = c.ReadString(budget);
}

// Number of length-delimited occurrences of `field` at the top level of the
// message under `c`, for reserving its elements at once. Stops quietly at
// malformed bytes (the decoding pass reports them).
std::size_t CountMessages(Cursor c, uint32_t field) {
  std::size_t n = 0;
  try {
    while (!c.done()) {
      const Tag tag = c.ReadTag();
      if (tag.field == field && tag.wire_type == kLengthDelimited) ++n;
      c.Skip(tag);
    }
  } catch (const ParseError&) {
  }
  return n;
}

// ---------------------------------------------------------------------------
// Message decoders. Each merges into its output, as protobuf does when a
// singular message field occurs more than once.

void DecodeShape(Cursor c, Shape& shape, Context& ctx, Budget& budget) {
  ReserveCharged(shape.tuple_shapes, CountMessages(c, 4), budget, c.pos());
  while (!c.done()) {
    const Tag tag = c.ReadTag();
    switch (tag.field) {
      case 2:  // element_type
        ReadInt32(c, tag, shape.element_type);
        break;
      case 3:  // dimensions
        ReadRepeatedVarint(c, tag, shape.dimensions, budget);
        break;
      case 4:  // tuple_shapes
        if (tag.wire_type != kLengthDelimited) {
          c.Skip(tag);
        } else {
          ScopedFrame f(ctx, "tuple_shapes",
                        static_cast<int64_t>(shape.tuple_shapes.size()));
          Cursor sub = c.ReadMessage();
          DecodeShape(sub, AppendCharged(shape.tuple_shapes, budget, tag.offset),
                      ctx, budget);
        }
        break;
      case 6:  // is_dynamic_dimension
        ReadRepeatedBool(c, tag, shape.is_dynamic_dimension, budget);
        break;
      default:  // layout (5) and anything newer
        c.Skip(tag);
    }
  }
}

void DecodeOpSharding(Cursor c, OpSharding& s, Context& ctx, Budget& budget) {
  ReserveCharged(s.tuple_shardings, CountMessages(c, 5), budget, c.pos());
  while (!c.done()) {
    const Tag tag = c.ReadTag();
    switch (tag.field) {
      case 1:
        ReadInt32(c, tag, s.type);
        break;
      case 3:
        ReadRepeatedVarint(c, tag, s.tile_assignment_dimensions, budget);
        break;
      case 4:
        ReadRepeatedVarint(c, tag, s.tile_assignment_devices, budget);
        break;
      case 5:
        if (tag.wire_type != kLengthDelimited) {
          c.Skip(tag);
        } else {
          ScopedFrame f(ctx, "tuple_shardings",
                        static_cast<int64_t>(s.tuple_shardings.size()));
          Cursor sub = c.ReadMessage();
          DecodeOpSharding(sub,
                           AppendCharged(s.tuple_shardings, budget, tag.offset),
                           ctx, budget);
        }
        break;
      case 6:
        ReadBool(c, tag, s.replicate_on_last_tile_dim);
        break;
      case 8:
        ReadRepeatedVarint(c, tag, s.last_tile_dims, budget);
        break;
      case 9:
        ReadRepeatedVarint(c, tag, s.iota_reshape_dims, budget);
        break;
      case 10:
        ReadRepeatedVarint(c, tag, s.iota_transpose_perm, budget);
        break;
      case 11:
        ReadBool(c, tag, s.is_shard_group);
        break;
      case 12:
        ReadInt64(c, tag, s.shard_group_id);
        break;
      case 13:
        ReadInt32(c, tag, s.shard_group_type);
        break;
      default:  // tile_shape (2), metadata (7), named_sharding, ...
        c.Skip(tag);
    }
  }
}

void DecodeReplicaGroup(Cursor c, std::vector<int64_t>& ids, Budget& budget) {
  while (!c.done()) {
    const Tag tag = c.ReadTag();
    if (tag.field == 1) {
      ReadRepeatedVarint(c, tag, ids, budget);
    } else {
      c.Skip(tag);
    }
  }
}

struct IotaGroups {
  int64_t num_groups = 0;
  int64_t group_size = 0;
  std::vector<int64_t> reshape_dims;
  std::vector<int32_t> transpose_perm;
};

struct DeviceList {
  std::vector<std::vector<int64_t>> groups;
  std::optional<IotaGroups> iota;
};

void DecodeIotaGroups(Cursor c, IotaGroups& g, Budget& budget) {
  while (!c.done()) {
    const Tag tag = c.ReadTag();
    switch (tag.field) {
      case 1:
        ReadInt64(c, tag, g.num_groups);
        break;
      case 2:
        ReadInt64(c, tag, g.group_size);
        break;
      case 3:
        ReadRepeatedVarint(c, tag, g.reshape_dims, budget);
        break;
      case 4:
        ReadRepeatedVarint(c, tag, g.transpose_perm, budget);
        break;
      default:
        c.Skip(tag);
    }
  }
}

void DecodeDeviceList(Cursor c, DeviceList& list, Context& ctx,
                      Budget& budget) {
  ReserveCharged(list.groups, CountMessages(c, 1), budget, c.pos());
  while (!c.done()) {
    const Tag tag = c.ReadTag();
    if (tag.field == 1 && tag.wire_type == kLengthDelimited) {
      ScopedFrame f(ctx, "replica_groups",
                    static_cast<int64_t>(list.groups.size()));
      Cursor sub = c.ReadMessage();
      DecodeReplicaGroup(sub, AppendCharged(list.groups, budget, tag.offset),
                         budget);
    } else if (tag.field == 2 && tag.wire_type == kLengthDelimited) {
      ScopedFrame f(ctx, "iota_replica_group_list");
      Cursor sub = c.ReadMessage();
      if (!list.iota) list.iota.emplace();
      DecodeIotaGroups(sub, *list.iota, budget);
    } else {
      c.Skip(tag);
    }
  }
}

// Bytes charged per frontend-attribute entry for merging repeated keys: its
// slots in the sort order and the kept list, and a slot in the merged list.
constexpr std::size_t kAttributeMergeBytes = 8 + 16 + 64;

void DecodeFrontendAttributes(
    Cursor c, std::vector<std::pair<std::string, std::string>>& out,
    Context& ctx, Budget& budget) {
  while (!c.done()) {
    const Tag tag = c.ReadTag();
    if (tag.field != 1 || tag.wire_type != kLengthDelimited) {
      c.Skip(tag);
      continue;
    }
    ScopedFrame f(ctx, "map");
    Cursor entry = c.ReadMessage();
    std::string key, value;
    while (!entry.done()) {
      const Tag t = entry.ReadTag();
      if (t.field == 1) {
        ReadStringField(entry, t, key, budget);
      } else if (t.field == 2) {
        ReadStringField(entry, t, value, budget);
      } else {
        entry.Skip(t);
      }
    }
    // Repeated keys are merged once the instruction is read.
    AppendCharged(out, budget, tag.offset, sizeof(out[0]) + kAttributeMergeBytes) =
        {std::move(key), std::move(value)};
  }
}

// Map entries in the order of their keys' first appearance, each with the
// value it was given last (protobuf's rule for a repeated key). Sorting
// rather than hashing: the keys come from the input.
void MergeFrontendAttributes(
    std::vector<std::pair<std::string, std::string>>& entries) {
  const std::size_t n = entries.size();
  if (n < 2) return;
  std::vector<std::size_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return entries[a].first < entries[b].first;
  });
  std::vector<std::pair<std::size_t, std::size_t>> kept;  // (first, last)
  for (std::size_t i = 0; i < n;) {
    std::size_t j = i + 1;
    while (j < n && entries[order[j]].first == entries[order[i]].first) ++j;
    kept.emplace_back(order[i], order[j - 1]);
    i = j;
  }
  if (kept.size() == n) return;
  std::sort(kept.begin(), kept.end());
  std::vector<std::pair<std::string, std::string>> merged;
  merged.reserve(kept.size());
  for (const auto& [first, last] : kept) {
    merged.emplace_back(std::move(entries[first].first),
                        std::move(entries[last].second));
  }
  entries = std::move(merged);
}

void DecodeSourceTarget(Cursor c, std::pair<int64_t, int64_t>& st) {
  while (!c.done()) {
    const Tag tag = c.ReadTag();
    if (tag.field == 1) {
      ReadInt64(c, tag, st.first);
    } else if (tag.field == 2) {
      ReadInt64(c, tag, st.second);
    } else {
      c.Skip(tag);
    }
  }
}

// Charges for the lookups BuildIndex makes and the call graph it walks: a hash
// node and bucket growth per instruction; per computation two hash nodes (and
// a copy of its name, charged separately) and the walk's per-node arrays; per
// call edge the walk's adjacency and stack entries.
constexpr std::size_t kIndexBytesPerInstruction = 48;
constexpr std::size_t kIndexBytesPerComputation = 256;
constexpr std::size_t kCallEdgeBytes = 32;

// What an expanded device id or group costs: the C++ element plus what the
// Python view makes of it (an int object and a tuple slot; a tuple per group).
constexpr std::size_t kBytesPerExpandedDevice = 8 + 40;
constexpr std::size_t kBytesPerExpandedGroup = sizeof(std::vector<int64_t>) + 64;

Sharding Describe(OpSharding proto, Budget& budget, std::size_t offset);
std::vector<int64_t> ExpandIota(const std::vector<int64_t>& reshape_dims,
                                const std::vector<int>& perm);
bool IsPermutation(const std::vector<int32_t>& perm, std::size_t n);

std::vector<std::vector<int64_t>> ExpandIotaGroups(const IotaGroups& g,
                                                   Budget& budget) {
  if (g.num_groups < 0 || g.group_size < 0) return {};
  if (g.reshape_dims.size() != g.transpose_perm.size()) return {};
  if (!IsPermutation(g.transpose_perm, g.reshape_dims.size())) return {};
  int64_t total;
  if (__builtin_mul_overflow(g.num_groups, g.group_size, &total)) return {};
  // Every group is a list even when it has no members: count them as well
  // as the devices.
  if (g.num_groups > kMaxExpandedDevices) return {};
  if (total == 0) {
    if (!budget.TryChargeExpansion(static_cast<std::size_t>(g.num_groups) *
                                   kBytesPerExpandedGroup)) {
      return {};
    }
    return std::vector<std::vector<int64_t>>(
        static_cast<std::size_t>(g.num_groups));
  }
  const auto product = PositiveProduct(g.reshape_dims);
  if (!product || *product != total) return {};
  // The flat list is a transient copy: 8 more bytes per device.
  if (!budget.TakeDevices(total, kBytesPerExpandedDevice + 8)) return {};
  if (!budget.TryChargeExpansion(static_cast<std::size_t>(g.num_groups) *
                                 kBytesPerExpandedGroup)) {
    return {};
  }
  std::vector<int> perm(g.transpose_perm.begin(), g.transpose_perm.end());
  const std::vector<int64_t> flat = ExpandIota(g.reshape_dims, perm);
  std::vector<std::vector<int64_t>> groups(static_cast<std::size_t>(g.num_groups));
  for (int64_t i = 0; i < g.num_groups; ++i) {
    groups[i].assign(flat.begin() + i * g.group_size,
                     flat.begin() + (i + 1) * g.group_size);
  }
  return groups;
}

void DecodeInstruction(Cursor c, Instruction& ins, Context& ctx,
                       Budget& budget) {
  ins.offset = c.pos();
  bool has_sharding = false;
  std::size_t sharding_offset = 0;
  OpSharding sharding;
  bool has_device_list = false;
  DeviceList device_list;
  std::vector<std::vector<int64_t>> legacy_groups;

  while (!c.done()) {
    const Tag tag = c.ReadTag();
    switch (tag.field) {
      case 1:
        ReadStringField(c, tag, ins.name, budget);
        break;
      case 2:
        ReadStringField(c, tag, ins.opcode, budget);
        break;
      case 3:
        if (tag.wire_type != kLengthDelimited) {
          c.Skip(tag);
        } else {
          ScopedFrame f(ctx, "shape");
          DecodeShape(c.ReadMessage(), ins.shape, ctx, budget);
        }
        break;
      case 9:
        ReadInt64(c, tag, ins.parameter_number);
        break;
      case 13:
        ReadInt64(c, tag, ins.tuple_index);
        break;
      case 26:
        ReadInt64(c, tag, ins.channel_id);
        break;
      case 28:
        ReadStringField(c, tag, ins.custom_call_target, budget);
        break;
      case 35:
        ReadInt64(c, tag, ins.id);
        break;
      case 36:
        ReadRepeatedVarint(c, tag, ins.operand_ids, budget);
        break;
      case 38: {
        // Each call is also an edge of the call graph BuildIndex walks.
        const std::size_t before = ins.called_computation_ids.size();
        ReadRepeatedVarint(c, tag, ins.called_computation_ids, budget);
        budget.ChargeItems(ins.called_computation_ids.size() - before,
                           kCallEdgeBytes, tag.offset);
        break;
      }
      case 40:
        if (tag.wire_type != kLengthDelimited) {
          c.Skip(tag);
        } else {
          ScopedFrame f(ctx, "sharding");
          has_sharding = true;
          sharding_offset = tag.offset;
          DecodeOpSharding(c.ReadMessage(), sharding, ctx, budget);
        }
        break;
      case 43:
        if (tag.wire_type != kLengthDelimited) {
          c.Skip(tag);
        } else {
          ins.backend_config = c.ReadBytes(budget);
        }
        break;
      case 47:
        ReadBool(c, tag, ins.is_host_transfer);
        break;
      case 49:
        if (tag.wire_type != kLengthDelimited) {
          c.Skip(tag);
        } else {
          ScopedFrame f(ctx, "replica_groups",
                        static_cast<int64_t>(legacy_groups.size()));
          Cursor sub = c.ReadMessage();
          DecodeReplicaGroup(sub, AppendCharged(legacy_groups, budget, tag.offset),
                             budget);
        }
        break;
      case 52:
        if (tag.wire_type != kLengthDelimited) {
          c.Skip(tag);
        } else {
          ScopedFrame f(ctx, "source_target_pairs",
                        static_cast<int64_t>(ins.source_target_pairs.size()));
          Cursor sub = c.ReadMessage();
          DecodeSourceTarget(
              sub, AppendCharged(ins.source_target_pairs, budget, tag.offset));
        }
        break;
      case 68:
        if (tag.wire_type != kLengthDelimited) {
          c.Skip(tag);
        } else {
          ScopedFrame f(ctx, "frontend_attributes");
          DecodeFrontendAttributes(c.ReadMessage(), ins.frontend_attributes,
                                   ctx, budget);
        }
        break;
      case 87:
        if (tag.wire_type != kLengthDelimited) {
          c.Skip(tag);
        } else {
          ScopedFrame f(ctx, "collective_device_list");
          has_device_list = true;
          DecodeDeviceList(c.ReadMessage(), device_list, ctx, budget);
        }
        break;
      default:
        c.Skip(tag);
    }
  }

  MergeFrontendAttributes(ins.frontend_attributes);
  if (has_sharding) {
    ins.sharding = Describe(std::move(sharding), budget, sharding_offset);
  }
  // XLA prefers collective_device_list over the deprecated field.
  if (has_device_list) {
    if (device_list.iota) {
      ins.replica_groups = ExpandIotaGroups(*device_list.iota, budget);
    } else {
      ins.replica_groups = std::move(device_list.groups);
    }
  } else {
    ins.replica_groups = std::move(legacy_groups);
  }
  if (ins.opcode == "while") {
    ins.known_trip_count = KnownTripCountFromBackendConfig(ins.backend_config);
  }
}

void DecodeComputation(Cursor c, Computation& comp, Context& ctx,
                       Budget& budget) {
  // Instructions are the largest records: reserve them at once, with their
  // entries in the module's index.
  ReserveCharged(comp.instructions, CountMessages(c, 2), budget, c.pos(),
                 sizeof(Instruction) + kIndexBytesPerInstruction);
  while (!c.done()) {
    const Tag tag = c.ReadTag();
    switch (tag.field) {
      case 1:
        ReadStringField(c, tag, comp.name, budget);
        break;
      case 2:
        if (tag.wire_type != kLengthDelimited) {
          c.Skip(tag);
        } else {
          ScopedFrame f(ctx, "instructions",
                        static_cast<int64_t>(comp.instructions.size()));
          Cursor sub = c.ReadMessage();
          DecodeInstruction(sub,
                            AppendCharged(comp.instructions, budget, tag.offset,
                                          sizeof(Instruction) +
                                              kIndexBytesPerInstruction),
                            ctx, budget);
        }
        break;
      case 5:
        ReadInt64(c, tag, comp.id);
        break;
      case 6:
        ReadInt64(c, tag, comp.root_id);
        break;
      default:  // program_shape (4), is_fusion_computation, ...
        c.Skip(tag);
    }
  }
}

// ---------------------------------------------------------------------------
// Tile assignments and XLA's sharding normalization.
//
// HloSharding::FromProto canonicalizes what it reads (partially replicated
// groups are sorted, subgroup dimensions of size one are dropped and equal
// kinds merged, iota descriptions are simplified) and ToString prints the
// result. The code below reproduces those rules so that the strings agree.

bool IsPermutation(const std::vector<int32_t>& perm, std::size_t n) {
  if (perm.size() != n) return false;
  std::vector<bool> seen(n, false);
  for (int32_t p : perm) {
    if (p < 0 || static_cast<std::size_t>(p) >= n || seen[p]) return false;
    seen[p] = true;
  }
  return true;
}

// Row-major strides of `dims`.
std::vector<int64_t> Strides(const std::vector<int64_t>& dims) {
  std::vector<int64_t> strides(dims.size(), 1);
  for (std::size_t i = dims.size(); i-- > 1;) {
    strides[i - 1] = strides[i] * dims[i];
  }
  return strides;
}

// Flat list of iota(prod(reshape_dims)).reshape(reshape_dims)
// .transpose(perm), i.e. the row-major source offset of each element of the
// transposed array. Callers check sizes against the budget first.
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

// Simplifies an iota description without changing the device order it
// denotes: dimensions of size one are dropped and runs of dimensions that stay
// adjacent and in order after the transpose are fused. An empty result
// becomes [1] with perm [0].
void CanonicalizeIota(std::vector<int64_t>& dims, std::vector<int>& perm) {
  if (dims.size() > 1) {
    bool changed = true;
    while (changed) {
      changed = false;
      // Drop dimensions of size one.
      std::vector<int> new_index(dims.size(), -1);
      std::vector<int64_t> kept_dims;
      for (std::size_t i = 0; i < dims.size(); ++i) {
        if (dims[i] != 1) {
          new_index[i] = static_cast<int>(kept_dims.size());
          kept_dims.push_back(dims[i]);
        }
      }
      if (kept_dims.size() != dims.size()) {
        std::vector<int> kept_perm;
        for (int p : perm) {
          if (new_index[p] >= 0) kept_perm.push_back(new_index[p]);
        }
        dims = std::move(kept_dims);
        perm = std::move(kept_perm);
      }
      // Fuse runs p, p+1, ..., p+k that appear consecutively in perm.
      std::size_t run_start = 0;
      for (std::size_t i = 1; i < perm.size(); ++i) {
        const int head = perm[run_start];
        if (perm[i] == head + static_cast<int>(i - run_start)) {
          dims[head] *= dims[perm[i]];
          dims[perm[i]] = 1;
          changed = true;
        } else {
          run_start = i;
        }
      }
    }
  }
  if (dims.empty()) {
    dims = {1};
    perm = {0};
  }
}

struct Tiles {
  std::vector<int64_t> dims;
  bool iota = false;
  std::vector<int64_t> reshape;  // iota only, canonical
  std::vector<int> perm;          // iota only, canonical
  std::vector<int64_t> values;    // explicit only

  int64_t num_elements() const {
    int64_t p = 1;
    for (int64_t d : dims) p *= d;
    return p;
  }
};

Tiles MakeIotaTiles(std::vector<int64_t> dims, std::vector<int64_t> reshape,
                    std::vector<int> perm) {
  CanonicalizeIota(reshape, perm);
  Tiles t;
  t.dims = std::move(dims);
  t.iota = true;
  t.reshape = std::move(reshape);
  t.perm = std::move(perm);
  return t;
}

Tiles MakeExplicitTiles(std::vector<int64_t> dims,
                        std::vector<int64_t> values) {
  Tiles t;
  t.dims = std::move(dims);
  t.values = std::move(values);
  return t;
}

// Thrown internally when a step would need more device ids than the budget
// allows; the caller falls back to the raw rendering.
struct OverBudget {};

// Charge per device id of a tile assignment that normalization works on as
// an explicit list: the list and up to three transient copies (sorting
// groups, transposing), and 16 bytes of printed text.
constexpr std::size_t kBytesPerNormalizedDevice = 4 * 8 + 16;

const std::vector<int64_t>& Materialize(Tiles& t, Budget& budget) {
  if (t.iota) {
    if (!budget.TakeDevices(t.num_elements(), kBytesPerNormalizedDevice)) {
      throw OverBudget{};
    }
    budget.prepaid_text += static_cast<std::size_t>(t.num_elements()) * 16;
    t.values = ExpandIota(t.reshape, t.perm);
    t.iota = false;
    t.reshape.clear();
    t.perm.clear();
  }
  return t.values;
}

enum class TransposeKind { kNoop, kReshape, kTranspose };

TransposeKind GetTransposeKind(const std::vector<int64_t>& dims,
                               const std::vector<int>& perm) {
  TransposeKind kind = TransposeKind::kNoop;
  int last_moved = -1;
  for (std::size_t i = 0; i < perm.size(); ++i) {
    const int d = perm[i];
    if (dims[d] == 1) {
      if (d != static_cast<int>(i) && dims[i] != 1) kind = TransposeKind::kReshape;
      continue;
    }
    if (d <= last_moved) return TransposeKind::kTranspose;
    last_moved = d;
  }
  return kind;
}

// Transposes an iota tile assignment while staying in iota form; nullopt when
// the permutation mixes dimensions in a way the iota form cannot express.
std::optional<Tiles> TransposeIota(const Tiles& t, const std::vector<int>& perm) {
  const std::vector<int64_t>& dims = t.dims;
  const TransposeKind kind = GetTransposeKind(dims, perm);
  if (kind == TransposeKind::kNoop) return t;
  std::vector<int64_t> new_dims(dims.size());
  for (std::size_t i = 0; i < dims.size(); ++i) new_dims[i] = dims[perm[i]];
  if (kind == TransposeKind::kReshape) {
    return MakeIotaTiles(new_dims, t.reshape, t.perm);
  }
  if (t.reshape.size() == 1) {
    return MakeIotaTiles(new_dims, dims, perm);
  }
  // A pure transpose: the non-trivial tile dimensions line up one to one with
  // the transposed reshape dimensions. `to_reshape_axis` numbers the
  // non-trivial tile dimensions.
  std::vector<int> to_reshape_axis(dims.size(), -1);
  std::size_t matched = 0;
  bool pure = true;
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (dims[i] == 1) continue;
    if (matched >= t.reshape.size() || t.reshape[t.perm[matched]] != dims[i]) {
      pure = false;
    }
    to_reshape_axis[i] = static_cast<int>(matched);
    ++matched;
  }
  if (pure && matched != t.reshape.size()) return std::nullopt;
  if (pure) {
    std::vector<int> new_perm;
    for (std::size_t i = 0; i < dims.size(); ++i) {
      if (dims[perm[i]] == 1) continue;
      new_perm.push_back(t.perm[to_reshape_axis[perm[i]]]);
    }
    return MakeIotaTiles(new_dims, t.reshape, new_perm);
  }
  // Otherwise split every reshape dimension into prime factors and try to
  // cover each non-trivial tile dimension with a run of consecutive factors
  // (in transposed order); the runs then move as blocks.
  std::vector<int64_t> factors;
  std::vector<std::size_t> first_factor(t.reshape.size() + 1, 0);
  for (std::size_t i = 0; i < t.reshape.size(); ++i) {
    int64_t rest = t.reshape[i];
    while (rest % 2 == 0) {
      factors.push_back(2);
      rest /= 2;
    }
    for (int64_t q = 3; q <= rest / q; q += 2) {
      while (rest % q == 0) {
        factors.push_back(q);
        rest /= q;
      }
    }
    if (rest > 1) factors.push_back(rest);
    first_factor[i + 1] = factors.size();
  }
  std::vector<int> factor_perm;
  for (int axis : t.perm) {
    for (std::size_t j = first_factor[axis]; j < first_factor[axis + 1]; ++j) {
      factor_perm.push_back(static_cast<int>(j));
    }
  }
  std::vector<std::vector<int>> runs(matched);
  std::size_t next = 0;
  for (std::size_t i = 0; i < dims.size() && next < factor_perm.size(); ++i) {
    if (dims[i] == 1) continue;
    std::vector<int>& run = runs[to_reshape_axis[i]];
    int64_t target = dims[i];
    while (next < factor_perm.size() && target % factors[factor_perm[next]] == 0) {
      target /= factors[factor_perm[next]];
      run.push_back(factor_perm[next]);
      ++next;
    }
    if (target != 1) return std::nullopt;
  }
  std::vector<int> moved;
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (dims[perm[i]] == 1) continue;
    const std::vector<int>& run = runs[to_reshape_axis[perm[i]]];
    moved.insert(moved.end(), run.begin(), run.end());
  }
  if (moved.size() != factor_perm.size()) return std::nullopt;
  return MakeIotaTiles(new_dims, factors, moved);
}

// Generic transpose of an explicit array of shape `dims`.
// `values` has the row-major layout of `dims`.
std::vector<int64_t> TransposeValues(const std::vector<int64_t>& values,
                                     const std::vector<int64_t>& dims,
                                     const std::vector<int>& perm) {
  const std::vector<int64_t> offsets = ExpandIota(dims, perm);
  std::vector<int64_t> out;
  out.reserve(offsets.size());
  for (int64_t src : offsets) out.push_back(values[static_cast<std::size_t>(src)]);
  return out;
}

struct Norm {
  enum Kind { kReplicated, kManual, kUnknown, kUnreduced, kMaximal, kTiled, kTuple };
  Kind kind = kReplicated;
  int64_t device = 0;
  Tiles tiles;
  bool replicate_on_last = false;
  std::vector<int32_t> subgroups;
  std::vector<Norm> elements;
};

Norm Simple(Norm::Kind kind) {
  Norm n;
  n.kind = kind;
  return n;
}

Norm TiledNorm(Tiles tiles, bool replicate_on_last,
               std::vector<int32_t> subgroups = {}) {
  Norm n;
  n.kind = Norm::kTiled;
  n.tiles = std::move(tiles);
  n.replicate_on_last = replicate_on_last;
  n.subgroups = std::move(subgroups);
  return n;
}

// For an iota whose minor `group_size` devices form the replication group,
// rewrites the description so that each group lists its devices in
// increasing order. False when the group does not split the transposed
// dimensions evenly.
bool SortMinorIotaGroup(const std::vector<int64_t>& dims,
                        const std::vector<int>& perm, int64_t group_size,
                        std::vector<int64_t>& out_dims,
                        std::vector<int>& out_perm) {
  int grouped = 0;
  int split_axis = -1;
  int64_t split_major = 0;
  for (std::size_t i = perm.size(); i-- > 0;) {
    const int axis = perm[i];
    const int64_t size = dims[axis];
    if (size <= group_size) {
      if (group_size % size != 0) return false;
      group_size /= size;
      ++grouped;
    } else {
      if (size % group_size != 0) return false;
      split_axis = axis;
      split_major = size / group_size;
      ++grouped;
      group_size = 1;
      break;
    }
  }
  if (split_axis < 0) {
    out_dims = dims;
    out_perm = perm;
  } else {
    // Split reshape axis `split_axis` into (major, minor); axes after it
    // shift by one, and the minor half follows the major half in the perm.
    out_dims.clear();
    for (int i = 0; i < static_cast<int>(dims.size()); ++i) {
      if (i == split_axis) {
        out_dims.push_back(split_major);
        out_dims.push_back(dims[i] / split_major);
      } else {
        out_dims.push_back(dims[i]);
      }
    }
    out_perm.clear();
    for (int p : perm) {
      if (p == split_axis) {
        out_perm.push_back(p);
        out_perm.push_back(p + 1);
      } else {
        out_perm.push_back(p < split_axis ? p : p + 1);
      }
    }
  }
  std::stable_sort(out_perm.end() - grouped, out_perm.end());
  return true;
}

// HloSharding::PartialTile: the last tile dimension lists replicas.
Norm PartialTile(Tiles tiles, Budget& budget) {
  const int64_t num = tiles.num_elements();
  if (tiles.dims.size() <= 1 || tiles.dims.back() == num) {
    return Simple(Norm::kReplicated);
  }
  if (tiles.dims.back() == 1) {
    tiles.dims.pop_back();
    return TiledNorm(std::move(tiles), false);
  }
  const int64_t group = tiles.dims.back();
  if (tiles.iota) {
    if (tiles.reshape[tiles.perm.back()] == group) {
      return TiledNorm(std::move(tiles), true);
    }
    std::vector<int64_t> d;
    std::vector<int> p;
    if (SortMinorIotaGroup(tiles.reshape, tiles.perm, group, d, p)) {
      return TiledNorm(MakeIotaTiles(tiles.dims, d, p), true);
    }
  }
  std::vector<int64_t> values = Materialize(tiles, budget);
  for (std::size_t i = 0; i + static_cast<std::size_t>(group) <= values.size();
       i += static_cast<std::size_t>(group)) {
    std::sort(values.begin() + i, values.begin() + i + group);
  }
  return TiledNorm(MakeExplicitTiles(tiles.dims, std::move(values)), true);
}

// Order in which XLA lays out merged subgroup kinds.
constexpr int32_t kSubgroupOrder[] = {
    kShardingMaximal, kShardingTuple,     kShardingOther,  kShardingManual,
    kShardingUnreduced, kShardingReplicated, kShardingUnknown};

Norm MakeSubgroupSharding(Tiles tiles, const std::vector<int32_t>& types,
                          Budget& budget) {
  if (types.size() == 1 && types.back() == kShardingReplicated) {
    return PartialTile(std::move(tiles), budget);
  }
  if (types.size() == 1 && types.back() == kShardingManual &&
      !tiles.dims.empty() && tiles.num_elements() == tiles.dims.back()) {
    return Simple(Norm::kManual);
  }
  if (!types.empty() && types.back() == kShardingReplicated) {
    Norm n = PartialTile(std::move(tiles), budget);
    if (n.kind == Norm::kTiled) {
      n.replicate_on_last = false;
      n.subgroups = types;
    }
    return n;
  }
  return TiledNorm(std::move(tiles), false, types);
}

// HloSharding::Subgroup.
Norm Subgroup(Tiles tiles, const std::vector<int32_t>& types, Budget& budget) {
  const std::size_t ndims = tiles.dims.size();
  const std::size_t data_dims = ndims - types.size();
  if (types.empty()) return TiledNorm(std::move(tiles), false);
  const bool all_same = std::all_of(types.begin(), types.end(),
                                    [&](int32_t t) { return t == types[0]; });
  int64_t data_product = 1;
  for (std::size_t i = 0; i < data_dims; ++i) data_product *= tiles.dims[i];
  if (all_same && data_product == 1) {
    if (types[0] == kShardingManual) return Simple(Norm::kManual);
    if (types[0] == kShardingReplicated) return Simple(Norm::kReplicated);
    if (types[0] == kShardingUnreduced) return Simple(Norm::kUnreduced);
  }
  std::vector<std::vector<int>> dims_of_type(7);
  std::vector<int> removed;
  bool needs_merging = false;
  int distinct = 0;
  for (std::size_t i = 0; i < types.size(); ++i) {
    const int axis = static_cast<int>(data_dims + i);
    if (tiles.dims[axis] == 1) {
      removed.push_back(axis);
      needs_merging = true;
      continue;
    }
    std::vector<int>& bucket = dims_of_type[types[i]];
    if (!bucket.empty()) {
      needs_merging = true;
    } else {
      ++distinct;
    }
    bucket.push_back(axis);
  }
  if (distinct > 1) needs_merging = true;
  if (!needs_merging) return MakeSubgroupSharding(std::move(tiles), types, budget);

  std::vector<int> perm(data_dims);
  std::iota(perm.begin(), perm.end(), 0);
  std::vector<int64_t> merged_shape(tiles.dims.begin(),
                                    tiles.dims.begin() + data_dims);
  std::vector<int64_t> transposed_shape = merged_shape;
  std::vector<int32_t> merged_types;
  for (int32_t type : kSubgroupOrder) {
    const std::vector<int>& axes = dims_of_type[type];
    if (axes.empty()) continue;
    int64_t size = 1;
    for (int axis : axes) {
      perm.push_back(axis);
      size *= tiles.dims[axis];
      transposed_shape.push_back(tiles.dims[axis]);
    }
    merged_shape.push_back(size);
    merged_types.push_back(type);
  }
  std::optional<Tiles> merged;
  if (tiles.iota) {
    std::vector<int> full_perm = perm;
    full_perm.insert(full_perm.end(), removed.begin(), removed.end());
    std::optional<Tiles> transposed = TransposeIota(tiles, full_perm);
    if (transposed) {
      merged = MakeIotaTiles(merged_shape, transposed->reshape, transposed->perm);
    }
  }
  if (!merged) {
    // Move the kept axes into `perm` order; removed axes have size one and
    // go last, so the flat order equals that of the merged shape.
    std::vector<int> full_perm = perm;
    full_perm.insert(full_perm.end(), removed.begin(), removed.end());
    const std::vector<int64_t>& values = Materialize(tiles, budget);
    merged = MakeExplicitTiles(merged_shape,
                               TransposeValues(values, tiles.dims, full_perm));
  }
  return MakeSubgroupSharding(std::move(*merged), merged_types, budget);
}

struct Derived {
  bool valid = false;
  Norm norm;
};

// HloSharding::FromProto, for a non-tuple proto.
Derived Normalize(const OpSharding& p, Budget& budget, std::size_t offset) {
  Derived out;
  switch (p.type) {
    case kShardingReplicated:
      out.valid = true;
      out.norm = Simple(Norm::kReplicated);
      return out;
    case kShardingManual:
      out.valid = true;
      out.norm = Simple(Norm::kManual);
      return out;
    case kShardingUnknown:
      out.valid = true;
      out.norm = Simple(Norm::kUnknown);
      return out;
    case kShardingUnreduced:
      out.valid = true;
      out.norm = Simple(Norm::kUnreduced);
      return out;
    default:
      break;
  }
  if (p.tile_assignment_devices.size() == 1) {
    out.valid = true;
    out.norm = Simple(Norm::kMaximal);
    out.norm.device = p.tile_assignment_devices[0];
    return out;
  }
  if (!p.iota_reshape_dims.empty() &&
      std::all_of(p.iota_reshape_dims.begin(), p.iota_reshape_dims.end(),
                  [](int64_t d) { return d == 1; })) {
    out.valid = true;
    out.norm = Simple(Norm::kMaximal);
    out.norm.device = 0;
    return out;
  }
  if (p.type == kShardingMaximal) return out;
  const bool use_iota = !p.iota_reshape_dims.empty();
  if (use_iota) {
    if (!p.tile_assignment_devices.empty()) return out;
    if (!IsPermutation(p.iota_transpose_perm, p.iota_reshape_dims.size())) {
      return out;
    }
  } else if (p.tile_assignment_devices.size() < 2) {
    return out;
  }
  if (p.tile_assignment_dimensions.empty()) return out;
  const auto tiles_product = PositiveProduct(p.tile_assignment_dimensions);
  if (!tiles_product) return out;
  // Normalizing may factor, transpose or expand the device list; keep that
  // work bounded.
  if (*tiles_product > kMaxExpandedDevices) throw OverBudget{};
  if (use_iota) {
    const auto iota_product = PositiveProduct(p.iota_reshape_dims);
    if (!iota_product || *iota_product != *tiles_product) return out;
  } else if (static_cast<uint64_t>(*tiles_product) !=
             p.tile_assignment_devices.size()) {
    return out;
  }
  if (p.last_tile_dims.size() > p.tile_assignment_dimensions.size()) return out;
  for (int32_t t : p.last_tile_dims) {
    if (t < 0 || t > kShardingUnreduced) return out;
  }
  if (!p.last_tile_dims.empty() && p.replicate_on_last_tile_dim) return out;

  if (!use_iota) {
    budget.ChargeItems(p.tile_assignment_devices.size(),
                       kBytesPerNormalizedDevice, offset);
  }
  Tiles tiles =
      use_iota
          ? MakeIotaTiles(p.tile_assignment_dimensions, p.iota_reshape_dims,
                          std::vector<int>(p.iota_transpose_perm.begin(),
                                           p.iota_transpose_perm.end()))
          : MakeExplicitTiles(p.tile_assignment_dimensions,
                              p.tile_assignment_devices);
  out.valid = true;
  if (!p.last_tile_dims.empty()) {
    out.norm = Subgroup(std::move(tiles), p.last_tile_dims, budget);
  } else if (p.replicate_on_last_tile_dim) {
    out.norm = PartialTile(std::move(tiles), budget);
  } else {
    out.norm = TiledNorm(std::move(tiles), false);
  }
  return out;
}

std::string SubgroupName(int32_t type) {
  switch (type) {
    case kShardingManual:
      return "manual";
    case kShardingMaximal:
      return "maximal";
    case kShardingReplicated:
      return "replicated";
    case kShardingUnreduced:
      return "unreduced";
    default:
      return "error_type.";
  }
}

std::string ShardGroupSuffix(const OpSharding& p) {
  if (!p.is_shard_group) return "";
  return (p.shard_group_type == 0 ? " shard_as " : " shard_like ") +
         std::to_string(p.shard_group_id);
}

std::string PrintTiles(const Tiles& t) {
  std::string out = "devices=[" + JoinInts(t.dims) + "]";
  if (t.iota) {
    out += "<=[" + JoinInts(t.reshape) + "]";
    if (t.reshape.size() > 1) out += "T(" + JoinInts(t.perm) + ")";
  } else {
    out += JoinInts(t.values);
  }
  return out;
}

std::string PrintNorm(const Norm& n, const std::string& group) {
  switch (n.kind) {
    case Norm::kReplicated:
      return "{replicated" + group + "}";
    case Norm::kManual:
      return "{manual" + group + "}";
    case Norm::kUnknown:
      return "{unknown" + group + "}";
    case Norm::kUnreduced:
      return "{unreduced" + group + "}";
    case Norm::kMaximal:
      return "{maximal device=" + std::to_string(n.device) + group + "}";
    case Norm::kTuple:
      return "{}";  // tuples are printed by the caller
    case Norm::kTiled:
      break;
  }
  std::string out = "{" + PrintTiles(n.tiles);
  if (n.replicate_on_last) out += " last_tile_dim_replicate";
  if (!n.subgroups.empty()) {
    out += " last_tile_dims={";
    for (std::size_t i = 0; i < n.subgroups.size(); ++i) {
      if (i) out += ", ";
      out += SubgroupName(n.subgroups[i]);
    }
    out += "}";
  }
  return out + group + "}";
}

// Rendering of a proto XLA would not accept (or one too large to normalize).
std::string PrintRaw(const OpSharding& p, bool valid) {
  std::string out = valid ? "{" : "{invalid " + ShardingTypeName(p.type) + " ";
  out += "devices=[" + JoinInts(p.tile_assignment_dimensions) + "]";
  if (!p.iota_reshape_dims.empty()) {
    out += "<=[" + JoinInts(p.iota_reshape_dims) + "]";
    if (!p.iota_transpose_perm.empty()) {
      out += "T(" + JoinInts(p.iota_transpose_perm) + ")";
    }
  } else {
    out += JoinInts(p.tile_assignment_devices);
  }
  if (p.replicate_on_last_tile_dim) out += " last_tile_dim_replicate";
  if (!p.last_tile_dims.empty()) {
    out += " last_tile_dims={";
    for (std::size_t i = 0; i < p.last_tile_dims.size(); ++i) {
      if (i) out += ", ";
      out += SubgroupName(p.last_tile_dims[i]);
    }
    out += "}";
  }
  return out + ShardGroupSuffix(p) + "}";
}

std::vector<int64_t> RawDevices(const OpSharding& p, Budget& budget,
                                std::size_t offset) {
  if (!p.tile_assignment_devices.empty()) {
    budget.ChargeItems(p.tile_assignment_devices.size(),
                       kBytesPerExpandedDevice, offset);
    return p.tile_assignment_devices;
  }
  if (p.iota_reshape_dims.empty()) return {};
  if (!IsPermutation(p.iota_transpose_perm, p.iota_reshape_dims.size())) {
    return {};
  }
  const auto product = PositiveProduct(p.iota_reshape_dims);
  if (!product || !budget.TakeDevices(*product, kBytesPerExpandedDevice)) {
    return {};
  }
  return ExpandIota(p.iota_reshape_dims,
                    std::vector<int>(p.iota_transpose_perm.begin(),
                                     p.iota_transpose_perm.end()));
}

// Charges printed text: twice its length (the printer builds it from
// temporaries), less what materialized iota lists prepaid.
void ChargeText(const std::string& text, Budget& budget, std::size_t offset) {
  std::size_t bytes = 2 * text.size();
  const std::size_t prepaid = std::min(bytes, budget.prepaid_text);
  budget.prepaid_text -= prepaid;
  budget.Charge(bytes - prepaid, offset);
}

// Derives a Sharding; `offset` is where its proto starts, for budget errors.
Sharding Describe(OpSharding proto, Budget& budget, std::size_t offset) {
  Sharding s;
  if (proto.type == kShardingTuple) {
    const std::size_t n = proto.tuple_shardings.size();
    budget.ChargeItems(n, sizeof(Sharding), offset);
    s.tuple_elements.reserve(n);
    for (OpSharding& element : proto.tuple_shardings) {
      s.tuple_elements.push_back(Describe(std::move(element), budget, offset));
    }
    proto.tuple_shardings.clear();
    // Every element's text is copied into the tuple's: size it first.
    std::size_t length = 2;
    for (std::size_t i = 0; i < n; ++i) {
      length += s.tuple_elements[i].text.size() + 32;  // + separator
    }
    budget.Charge(2 * length, offset);
    std::string text = "{";
    text.reserve(length);
    for (std::size_t i = 0; i < n; ++i) {
      if (i != 0) {
        text += (i % 5 == 0) ? ", /*index=" + std::to_string(i) + "*/" : ", ";
      }
      text += s.tuple_elements[i].text;
      if (!s.tuple_elements[i].valid) s.valid = false;
    }
    s.text = text + "}";
    s.proto = std::move(proto);
    return s;
  }
  // Tuple elements of a non-tuple sharding are ignored by XLA.
  proto.tuple_shardings.clear();
  s.devices = RawDevices(proto, budget, offset);
  Derived d;
  bool over_budget = false;
  budget.prepaid_text = 0;
  try {
    d = Normalize(proto, budget, offset);
  } catch (const OverBudget&) {
    over_budget = true;
  }
  s.valid = over_budget || d.valid;
  if (over_budget || !d.valid) {
    s.text = PrintRaw(proto, s.valid);
  } else {
    s.text = PrintNorm(d.norm, ShardGroupSuffix(proto));
  }
  ChargeText(s.text, budget, offset);
  budget.prepaid_text = 0;
  s.proto = std::move(proto);
  return s;
}

// ---------------------------------------------------------------------------
// backend_config of while loops.

std::optional<int64_t> ParseDecimal(std::string_view s, std::size_t& i) {
  bool negative = false;
  if (i < s.size() && (s[i] == '-' || s[i] == '+')) {
    negative = s[i] == '-';
    ++i;
  }
  if (i >= s.size() || s[i] < '0' || s[i] > '9') return std::nullopt;
  int64_t v = 0;
  while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
    if (__builtin_mul_overflow(v, 10, &v) ||
        __builtin_add_overflow(v, s[i] - '0', &v)) {
      return std::nullopt;
    }
    ++i;
  }
  return negative ? -v : v;
}

void SkipSpaces(std::string_view s, std::size_t& i) {
  while (i < s.size() &&
         (s[i] == ' ' || s[i] == '\n' || s[i] == '\t' || s[i] == '\r')) {
    ++i;
  }
}

bool Consume(std::string_view s, std::size_t& i, std::string_view token) {
  SkipSpaces(s, i);
  if (s.substr(i, token.size()) != token) return false;
  i += token.size();
  return true;
}

std::optional<int64_t> TripCountFromJson(std::string_view s) {
  static constexpr std::string_view kKey = "\"known_trip_count\"";
  std::size_t i = s.find(kKey);
  if (i == std::string_view::npos) return std::nullopt;
  i += kKey.size();
  if (!Consume(s, i, ":") || !Consume(s, i, "{") || !Consume(s, i, "\"n\"") ||
      !Consume(s, i, ":")) {
    return std::nullopt;
  }
  SkipSpaces(s, i);
  const bool quoted = i < s.size() && s[i] == '"';
  if (quoted) ++i;
  std::optional<int64_t> v = ParseDecimal(s, i);
  if (!v) return std::nullopt;
  if (quoted && !Consume(s, i, "\"")) return std::nullopt;
  return v;
}

std::optional<int64_t> TripCountFromBinary(std::string_view s) {
  try {
    Cursor c(reinterpret_cast<const uint8_t*>(s.data()), 0, s.size(), 0,
             nullptr);
    std::optional<int64_t> n;
    while (!c.done()) {
      const Tag tag = c.ReadTag();
      if (tag.field == 1 && tag.wire_type == kLengthDelimited) {
        Cursor known = c.ReadMessage();
        int64_t value = 0;  // proto3 default when the field is absent
        while (!known.done()) {
          const Tag t = known.ReadTag();
          if (t.field == 1) {
            ReadInt64(known, t, value);
          } else {
            known.Skip(t);
          }
        }
        n = value;
      } else {
        c.Skip(tag);
      }
    }
    return n;
  } catch (const ParseError&) {
    return std::nullopt;
  }
}

bool HostMemoryTarget(const std::string& value) {
  return value.find("host") != std::string::npos;
}

bool Contains(const std::string& s, std::string_view what) {
  return s.find(what) != std::string::npos;
}

}  // namespace

// ---------------------------------------------------------------------------
// Public helpers.

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

std::optional<int64_t> KnownTripCountFromBackendConfig(
    std::string_view config) {
  std::size_t i = 0;
  SkipSpaces(config, i);
  if (i >= config.size()) return std::nullopt;
  if (config[i] == '{') return TripCountFromJson(config);
  return TripCountFromBinary(config);
}

namespace {

// The size of a proto built in memory, standing in for the input size of
// its budget: 8 bytes per integer and per message.
std::size_t InMemorySize(const OpSharding& p) {
  std::size_t n = 8 * (1 + p.tile_assignment_dimensions.size() +
                       p.tile_assignment_devices.size() +
                       p.last_tile_dims.size() + p.iota_reshape_dims.size() +
                       p.iota_transpose_perm.size());
  for (const OpSharding& t : p.tuple_shardings) n += InMemorySize(t);
  return n;
}

}  // namespace

Sharding DescribeSharding(const OpSharding& proto) {
  Context ctx;
  ctx.root = "OpSharding";
  Budget budget(InMemorySize(proto), &ctx);
  return Describe(proto, budget, 0);
}

Sharding ParseSharding(const uint8_t* data, std::size_t size) {
  static const uint8_t kEmpty = 0;
  if (data == nullptr) data = &kEmpty;
  Context ctx;
  ctx.root = "OpSharding";
  Budget budget(size, &ctx);
  Cursor c(data, 0, size, 0, &ctx);
  OpSharding proto;
  DecodeOpSharding(c, proto, ctx, budget);
  return Describe(std::move(proto), budget, 0);
}

Module ParseModule(const uint8_t* data, std::size_t size) {
  static const uint8_t kEmpty = 0;
  if (data == nullptr) data = &kEmpty;
  Context ctx;
  Budget budget(size, &ctx);
  Cursor c(data, 0, size, 0, &ctx);
  Module m;
  ReserveCharged(m.computations, CountMessages(c, 3), budget, 0,
                 sizeof(Computation) + kIndexBytesPerComputation);
  while (!c.done()) {
    const Tag tag = c.ReadTag();
    switch (tag.field) {
      case 1:
        ReadStringField(c, tag, m.name, budget);
        break;
      case 2:
        ReadStringField(c, tag, m.entry_computation_name, budget);
        break;
      case 3:
        if (tag.wire_type != kLengthDelimited) {
          c.Skip(tag);
        } else {
          ScopedFrame f(ctx, "computations",
                        static_cast<int64_t>(m.computations.size()));
          Cursor sub = c.ReadMessage();
          Computation& comp =
              AppendCharged(m.computations, budget, tag.offset,
                            sizeof(Computation) + kIndexBytesPerComputation);
          DecodeComputation(sub, comp, ctx, budget);
          // The by-name index keeps a copy of the name.
          budget.Charge(comp.name.size() + 1, tag.offset);
        }
        break;
      case 6:
        ReadInt64(c, tag, m.entry_computation_id);
        break;
      default:
        c.Skip(tag);
    }
  }
  m.BuildIndex();
  m.budget_used = budget.used();
  m.budget_limit = budget.limit();
  return m;
}

// ---------------------------------------------------------------------------
// Module lookups and analyses.

namespace {

bool InstructionKeyLess(const Module::InstructionKey& a,
                        const Module::InstructionKey& b) {
  if (a.id != b.id) return a.id < b.id;
  if (a.computation != b.computation) return a.computation < b.computation;
  return a.instruction < b.instruction;
}

}  // namespace

void Module::BuildIndex() {
  const int n = static_cast<int>(computations.size());
  computation_by_id.clear();
  computation_by_name.clear();
  instruction_by_id.clear();
  computation_by_id.reserve(n);
  computation_by_name.reserve(n);
  instruction_by_id.reserve(static_cast<std::size_t>(NumInstructions()));
  for (int ci = 0; ci < n; ++ci) {
    const Computation& comp = computations[ci];
    computation_by_id.emplace_back(comp.id, ci);
    computation_by_name.push_back(ci);
    for (int ii = 0; ii < static_cast<int>(comp.instructions.size()); ++ii) {
      instruction_by_id.push_back({comp.instructions[ii].id, ci, ii});
    }
  }
  std::sort(computation_by_id.begin(), computation_by_id.end());
  std::sort(computation_by_name.begin(), computation_by_name.end(),
            [this](int a, int b) {
              const int c = computations[a].name.compare(computations[b].name);
              return c != 0 ? c < 0 : a < b;
            });
  std::sort(instruction_by_id.begin(), instruction_by_id.end(),
            InstructionKeyLess);

  entry_index = -1;
  // Protos written before entry_computation_id existed only carry the name.
  const int by_id = ComputationIndexById(entry_computation_id);
  if (by_id >= 0 && (entry_computation_name.empty() ||
                     computations[by_id].name == entry_computation_name)) {
    entry_index = by_id;
  } else {
    const int by_name = ComputationIndexByName(entry_computation_name);
    entry_index = by_name >= 0 ? by_name : by_id;
  }
  CountWhileBodies();
}

// body_instruction_counts without walking the call graph once per loop,
// which is quadratic for nested loops. The call graph is condensed into its
// strongly connected components (recursion is invalid HLO, but must not
// hang), each weighted by its instructions; Tarjan's algorithm numbers them
// callees first. A component whose callees are each called from it alone,
// all the way down, reaches a tree: its count is its weight plus its
// callees' counts. Only a body that reaches a shared callee is walked, and
// that walk stops at such tree roots, adding their counts. The walks are
// bounded by kWhileWalkStepsPerEdge per computation and call edge.
void Module::CountWhileBodies() {
  const int n = static_cast<int>(computations.size());
  body_instruction_counts.assign(n, -1);
  while_walk_steps = 0;
  // The bodies, each with the first while loop naming it.
  std::vector<std::pair<int, std::pair<int, int>>> bodies;
  std::vector<char> is_body(n, 0);
  for (int ci = 0; ci < n; ++ci) {
    const Computation& comp = computations[ci];
    for (int ii = 0; ii < static_cast<int>(comp.instructions.size()); ++ii) {
      const Instruction& ins = comp.instructions[ii];
      if (ins.opcode != "while" || ins.called_computation_ids.empty()) continue;
      const int body = ComputationIndexById(ins.called_computation_ids[0]);
      if (body >= 0 && !is_body[body]) {
        is_body[body] = 1;
        bodies.push_back({body, {ci, ii}});
      }
    }
  }
  if (bodies.empty()) return;

  // Call graph over computation indices, duplicate edges dropped.
  std::vector<int> first(n + 1, 0), callees, seen(n, -1);
  for (int ci = 0; ci < n; ++ci) {
    first[ci] = static_cast<int>(callees.size());
    for (const Instruction& ins : computations[ci].instructions) {
      for (int64_t id : ins.called_computation_ids) {
        const int callee = ComputationIndexById(id);
        if (callee >= 0 && seen[callee] != ci) {
          seen[callee] = ci;
          callees.push_back(callee);
        }
      }
    }
  }
  first[n] = static_cast<int>(callees.size());

  // Tarjan's strongly connected components, iteratively.
  std::vector<int> order(n, -1), low(n, 0), component(n, -1), stack;
  std::vector<std::pair<int, int>> frames;  // (computation, next edge)
  int next_order = 0, components = 0;
  for (int root = 0; root < n; ++root) {
    if (order[root] >= 0) continue;
    frames.push_back({root, first[root]});
    order[root] = low[root] = next_order++;
    stack.push_back(root);
    while (!frames.empty()) {
      const int v = frames.back().first;
      int& edge = frames.back().second;
      if (edge < first[v + 1]) {
        const int w = callees[edge++];
        if (order[w] < 0) {
          order[w] = low[w] = next_order++;
          stack.push_back(w);
          frames.push_back({w, first[w]});
        } else if (component[w] < 0) {
          low[v] = std::min(low[v], order[w]);
        }
        continue;
      }
      frames.pop_back();
      if (!frames.empty()) {
        const int parent = frames.back().first;
        low[parent] = std::min(low[parent], low[v]);
      }
      if (low[v] == order[v]) {
        int w;
        do {
          w = stack.back();
          stack.pop_back();
          component[w] = components;
        } while (w != v);
        ++components;
      }
    }
  }

  // The condensed graph: weights, distinct callee components, callers.
  std::vector<int64_t> weight(components, 0);
  for (int ci = 0; ci < n; ++ci) {
    weight[component[ci]] =
        SatAdd(weight[component[ci]],
               static_cast<int64_t>(computations[ci].instructions.size()));
  }
  std::vector<int> members_first(components + 1, 0), members(n);
  for (int ci = 0; ci < n; ++ci) ++members_first[component[ci] + 1];
  for (int k = 0; k < components; ++k) members_first[k + 1] += members_first[k];
  {
    std::vector<int> fill(members_first.begin(), members_first.end() - 1);
    for (int ci = 0; ci < n; ++ci) members[fill[component[ci]]++] = ci;
  }
  std::vector<int> cfirst(components + 1, 0), ccallees, callers(components, 0);
  std::vector<int> cseen(components, -1);
  for (int k = 0; k < components; ++k) {
    cfirst[k] = static_cast<int>(ccallees.size());
    for (int m = members_first[k]; m < members_first[k + 1]; ++m) {
      const int ci = members[m];
      for (int e = first[ci]; e < first[ci + 1]; ++e) {
        const int t = component[callees[e]];
        if (t != k && cseen[t] != k) {
          cseen[t] = k;
          ccallees.push_back(t);
          ++callers[t];
        }
      }
    }
  }
  cfirst[components] = static_cast<int>(ccallees.size());

  // Components are numbered callees first, so one pass in order finds the
  // tree roots and their counts.
  std::vector<char> tree(components, 0);
  std::vector<int64_t> count(components, 0);
  for (int k = 0; k < components; ++k) {
    bool is_tree = true;
    int64_t total = weight[k];
    for (int e = cfirst[k]; e < cfirst[k + 1]; ++e) {
      const int t = ccallees[e];
      if (callers[t] != 1 || !tree[t]) {
        is_tree = false;
        break;
      }
      total = SatAdd(total, count[t]);
    }
    tree[k] = is_tree;
    if (is_tree) count[k] = total;
  }

  const int64_t limit =
      kWhileWalkStepsPerEdge * (static_cast<int64_t>(n) + first[n]);
  std::vector<int> mark(components, -1), walk;
  std::vector<int64_t> memo(components, -1);
  for (const auto& [body, loop] : bodies) {
    const int k = component[body];
    if (tree[k]) {
      body_instruction_counts[body] = count[k];
      continue;
    }
    if (memo[k] < 0) {
      int64_t total = 0;
      walk.assign(1, k);
      mark[k] = k;
      while (!walk.empty()) {
        const int x = walk.back();
        walk.pop_back();
        ++while_walk_steps;
        if (tree[x]) {
          total = SatAdd(total, count[x]);
          continue;
        }
        total = SatAdd(total, weight[x]);
        for (int e = cfirst[x]; e < cfirst[x + 1]; ++e) {
          ++while_walk_steps;
          const int t = ccallees[e];
          if (mark[t] != k) {
            mark[t] = k;
            walk.push_back(t);
          }
        }
        if (while_walk_steps > limit) {
          const Instruction& w =
              computations[loop.first].instructions[loop.second];
          throw ParseError(
              "HloModuleProto exceeds the reader's work limit at byte offset " +
                  std::to_string(w.offset) + " (while instruction '" + w.name +
                  "' in computation '" + computations[loop.first].name +
                  "'): counting the instructions its body reaches would take "
                  "more than " + std::to_string(limit) + " steps (" +
                  std::to_string(kWhileWalkStepsPerEdge) +
                  " per computation and call edge); nested while loops share "
                  "callees far more often than XLA's modules do",
              w.offset);
        }
      }
      memo[k] = total;
    }
    body_instruction_counts[body] = memo[k];
  }
}

int Module::ComputationIndexById(int64_t id) const {
  auto it = std::lower_bound(computation_by_id.begin(), computation_by_id.end(),
                             std::make_pair(id, std::numeric_limits<int>::min()));
  return it != computation_by_id.end() && it->first == id ? it->second : -1;
}

int Module::ComputationIndexByName(std::string_view name) const {
  auto it = std::lower_bound(
      computation_by_name.begin(), computation_by_name.end(), name,
      [this](int c, std::string_view key) { return computations[c].name < key; });
  return it != computation_by_name.end() && computations[*it].name == name
             ? *it
             : -1;
}

std::pair<int, int> Module::InstructionLocation(int64_t id) const {
  return InstructionLocation(id, -1);
}

std::pair<int, int> Module::InstructionLocation(int64_t id,
                                                int computation) const {
  const InstructionKey key{id, computation, -1};
  auto it = std::lower_bound(instruction_by_id.begin(), instruction_by_id.end(),
                             key, InstructionKeyLess);
  if (it != instruction_by_id.end() && it->id == id &&
      it->computation == computation) {
    return {it->computation, it->instruction};
  }
  if (computation >= 0) {
    // Not in that computation: the first occurrence anywhere.
    it = std::lower_bound(instruction_by_id.begin(), instruction_by_id.end(),
                          InstructionKey{id, -1, -1}, InstructionKeyLess);
  }
  if (it != instruction_by_id.end() && it->id == id) {
    return {it->computation, it->instruction};
  }
  return {-1, -1};
}

const Instruction* Module::InstructionById(int64_t id) const {
  const auto loc = InstructionLocation(id);
  if (loc.first < 0) return nullptr;
  return &computations[loc.first].instructions[loc.second];
}

int64_t Module::NumInstructions() const {
  int64_t n = 0;
  for (const Computation& c : computations) n += c.instructions.size();
  return n;
}

std::vector<const Instruction*> Module::EntryParameters() const {
  std::vector<const Instruction*> params;
  if (entry_index < 0) return params;
  for (const Instruction& ins : computations[entry_index].instructions) {
    if (ins.opcode == "parameter") params.push_back(&ins);
  }
  std::stable_sort(params.begin(), params.end(),
                   [](const Instruction* a, const Instruction* b) {
                     return a->parameter_number < b->parameter_number;
                   });
  return params;
}

namespace {

// Collective family of an opcode; empty when it is not a collective, or when
// it is the -done half of an async pair (counted at its -start).
std::string_view CollectiveKind(std::string_view opcode) {
  static constexpr std::string_view kFamilies[] = {
      "all-gather",         "all-reduce",           "reduce-scatter",
      "all-to-all",         "ragged-all-to-all",    "collective-permute",
      "collective-broadcast"};
  static constexpr std::string_view kStart = "-start";
  for (std::string_view f : kFamilies) {
    if (opcode == f) return f;
    if (opcode.size() == f.size() + kStart.size() &&
        opcode.substr(0, f.size()) == f && opcode.substr(f.size()) == kStart) {
      return f;
    }
  }
  return {};
}

}  // namespace

std::vector<Collective> Module::Collectives() const {
  std::vector<Collective> out;
  // Byte sizes of operand shapes, each computed once (a tuple shape's size
  // walks the whole tuple; many operands may name one instruction).
  std::vector<std::size_t> first(computations.size() + 1, 0);
  for (std::size_t ci = 0; ci < computations.size(); ++ci) {
    first[ci + 1] = first[ci] + computations[ci].instructions.size();
  }
  std::vector<int64_t> bytes_of;
  for (int ci = 0; ci < static_cast<int>(computations.size()); ++ci) {
    const Computation& comp = computations[ci];
    for (int ii = 0; ii < static_cast<int>(comp.instructions.size()); ++ii) {
      const Instruction& ins = comp.instructions[ii];
      const std::string_view kind = CollectiveKind(ins.opcode);
      if (kind.empty()) continue;
      if (bytes_of.empty()) bytes_of.assign(first.back(), -1);
      int64_t bytes = 0;
      for (int64_t operand : ins.operand_ids) {
        // Operands are looked up in the same computation first: ids are
        // unique per module in protos XLA writes, but only per computation
        // in some hand-written ones.
        const auto [oc, oi] = InstructionLocation(operand, ci);
        if (oc < 0) continue;
        int64_t& size = bytes_of[first[oc] + oi];
        if (size < 0) size = computations[oc].instructions[oi].shape.byte_size();
        bytes = SatAdd(bytes, size);
      }
      out.push_back({std::string(kind), ci, ii, bytes});
    }
  }
  return out;
}

std::vector<HostTransfer> Module::HostTransfers() const {
  std::vector<HostTransfer> out;
  for (int ci = 0; ci < static_cast<int>(computations.size()); ++ci) {
    const Computation& comp = computations[ci];
    for (int ii = 0; ii < static_cast<int>(comp.instructions.size()); ++ii) {
      const Instruction& ins = comp.instructions[ii];
      const std::string& op = ins.opcode;
      std::string reason;
      if (op == "infeed") {
        reason = "infeed from the host";
      } else if (op == "outfeed") {
        reason = "outfeed to the host";
      } else if ((op == "send" || op == "send-done" || op == "recv" ||
                  op == "recv-done") &&
                 ins.is_host_transfer) {
        reason = op + " with is_host_transfer";
      } else if (op == "custom-call") {
        const std::string& target = ins.custom_call_target;
        if (target == "MoveToHost" || target == "MoveToDevice") {
          reason = "host offload custom-call " + target;
        } else if (target == "annotate_device_placement") {
          const std::string* placement =
              ins.FrontendAttribute("_xla_buffer_placement");
          if (placement != nullptr && HostMemoryTarget(*placement)) {
            reason = "annotate_device_placement to " + *placement;
          }
        } else if (Contains(target, "python_cpu_callback") ||
                   Contains(target, "python_gpu_callback") ||
                   Contains(target, "host_callback")) {
          reason = "host callback custom-call " + target;
        }
      }
      if (reason.empty()) {
        const std::string* compute = ins.FrontendAttribute("_xla_compute_type");
        if (compute != nullptr && *compute == "host") {
          reason = "_xla_compute_type=host";
        }
      }
      if (!reason.empty()) out.push_back({std::move(reason), ci, ii});
    }
  }
  return out;
}

std::vector<WhileLoop> Module::WhileLoops() const {
  std::vector<WhileLoop> out;
  for (int ci = 0; ci < static_cast<int>(computations.size()); ++ci) {
    const Computation& comp = computations[ci];
    for (int ii = 0; ii < static_cast<int>(comp.instructions.size()); ++ii) {
      const Instruction& ins = comp.instructions[ii];
      if (ins.opcode != "while") continue;
      WhileLoop w;
      w.computation = ci;
      w.instruction = ii;
      // XLA serializes a while's called computations as {body, condition}.
      if (ins.called_computation_ids.size() >= 1) {
        w.body_id = ins.called_computation_ids[0];
      }
      if (ins.called_computation_ids.size() >= 2) {
        w.condition_id = ins.called_computation_ids[1];
      }
      w.known_trip_count = ins.known_trip_count;
      // Counted by BuildIndex.
      const int body = ComputationIndexById(w.body_id);
      if (body >= 0 && body < static_cast<int>(body_instruction_counts.size()) &&
          body_instruction_counts[body] >= 0) {
        w.body_instruction_count = body_instruction_counts[body];
      }
      out.push_back(w);
    }
  }
  return out;
}

int64_t Module::ConstantsBytes() const {
  int64_t total = 0;
  for (const Computation& c : computations) {
    for (const Instruction& ins : c.instructions) {
      if (ins.opcode == "constant") total = SatAdd(total, ins.shape.byte_size());
    }
  }
  return total;
}

}  // namespace hlo
}  // namespace txe
