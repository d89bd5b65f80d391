// The protobuf wire format, read by hand: a bounds-checked cursor over
// varints, fixed-width values and length-delimited runs, and the field
// readers the decoders are written with. Nothing here knows HLO; field
// numbers live in hlo_fields.h.
//
// Every read is checked against the end of its message; a problem raises
// ParseError naming the byte offset and the field path. Unknown fields, and
// known fields with an unexpected wire type, are skipped as protobuf does.

#ifndef TORCH_XLA_EXT_WIRE_H_
#define TORCH_XLA_EXT_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "budget.h"
#include "hlo_reader.h"

namespace txe {
namespace hlo {
namespace internal {

enum WireType : int {
  kVarint = 0,
  kFixed64 = 1,
  kLengthDelimited = 2,
  kStartGroup = 3,
  kEndGroup = 4,
  kFixed32 = 5,
};

struct Tag {
  uint32_t field;
  int wire_type;
  std::size_t offset;  // where the tag starts
};

class Cursor {
 public:
  Cursor(const uint8_t* base, std::size_t begin, std::size_t end, int depth,
         FieldPath* path)
      : base_(base), pos_(begin), end_(end), depth_(depth), path_(path) {}

  bool done() const { return pos_ >= end_; }
  std::size_t pos() const { return pos_; }

  [[noreturn]] void Fail(const std::string& what, std::size_t offset) const {
    std::string msg = "malformed HloModuleProto: " + what + " at byte offset " +
                      std::to_string(offset);
    if (path_ != nullptr) msg += " (in " + path_->Path() + ")";
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
    Cursor sub(base_, pos_, pos_ + static_cast<std::size_t>(len), depth_, path_);
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
  FieldPath* path_;
};

// ---------------------------------------------------------------------------
// Field readers. Each takes the cursor just past `tag`.

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
inline void ReadRepeatedBool(Cursor& c, const Tag& tag,
                             std::vector<bool>& out, Budget& budget) {
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
inline bool ReadInt64(Cursor& c, const Tag& tag, int64_t& out) {
  if (tag.wire_type != kVarint) {
    c.Skip(tag);
    return false;
  }
  out = static_cast<int64_t>(c.ReadVarint());
  return true;
}

inline void ReadInt32(Cursor& c, const Tag& tag, int32_t& out) {
  int64_t v;
  if (ReadInt64(c, tag, v)) out = static_cast<int32_t>(v);
}

inline void ReadBool(Cursor& c, const Tag& tag, bool& out) {
  int64_t v;
  if (ReadInt64(c, tag, v)) out = v != 0;
}

inline void ReadStringField(Cursor& c, const Tag& tag, std::string& out,
                            Budget& budget) {
  if (tag.wire_type != kLengthDelimited) {
    c.Skip(tag);
    return;
  }
  out = c.ReadString(budget);
}

// A bytes field (no UTF-8 check).
inline void ReadBytesField(Cursor& c, const Tag& tag, std::string& out,
                           Budget& budget) {
  if (tag.wire_type != kLengthDelimited) {
    c.Skip(tag);
    return;
  }
  out = c.ReadBytes(budget);
}

// Number of length-delimited occurrences of `field` at the top level of the
// message under `c`, for reserving its elements at once. Stops quietly at
// malformed bytes (the decoding pass reports them).
inline std::size_t CountMessages(Cursor c, uint32_t field) {
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

// A singular or repeated message field: `decode(sub)` gets a cursor one
// level deeper over its payload; any other wire type is skipped. `name` and
// `index` (-1 for a singular field) extend the path while the payload's
// length is checked and while it is decoded.
template <typename Decode>
void ReadMessageField(Cursor& c, const Tag& tag, FieldPath& path,
                      const char* name, int64_t index, Decode&& decode) {
  if (tag.wire_type != kLengthDelimited) {
    c.Skip(tag);
    return;
  }
  ScopedFrame frame(path, name, index);
  decode(c.ReadMessage());
}

}  // namespace internal
}  // namespace hlo
}  // namespace txe

#endif  // TORCH_XLA_EXT_WIRE_H_
