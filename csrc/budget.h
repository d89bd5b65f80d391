// What every decoding step carries: where it is in the message tree
// (FieldPath, printed in error messages) and what it has spent (Budget, the
// memory bound of hlo_reader.h), with the charged container helpers.

#ifndef TORCH_XLA_EXT_BUDGET_H_
#define TORCH_XLA_EXT_BUDGET_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "hlo_reader.h"

namespace txe {
namespace hlo {
namespace internal {

// A path through the message tree, printed in error messages.
struct FieldPath {
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

// Pushes a frame onto a FieldPath for the lifetime of the object.
class ScopedFrame {
 public:
  ScopedFrame(FieldPath& path, const char* field, int64_t index = -1)
      : path_(path) {
    path_.frames.push_back({field, index});
  }
  ~ScopedFrame() { path_.frames.pop_back(); }
  ScopedFrame(const ScopedFrame&) = delete;
  ScopedFrame& operator=(const ScopedFrame&) = delete;

 private:
  FieldPath& path_;
};

// Byte budget of one parse (see hlo_reader.h). Charges are upper estimates
// of what a step allocates, made before the allocation where the size is
// known up front; nothing is credited back.
class Budget {
 public:
  // `input_size` is the size of the bytes being read; `path` (may be null)
  // names the field in error messages.
  Budget(std::size_t input_size, const FieldPath* path)
      : input_size_(input_size), path_(path) {
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
    const char* root = path_ != nullptr ? path_->root : "input";
    std::string msg = std::string(root) +
                      " exceeds the reader's memory budget at byte offset " +
                      std::to_string(offset);
    if (path_ != nullptr) msg += " (in " + path_->Path() + ")";
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
  const FieldPath* path_;
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

// What an expanded device id or group costs: the C++ element plus what the
// Python view makes of it (an int object and a tuple slot; a tuple per group).
inline constexpr std::size_t kBytesPerExpandedDevice = 8 + 40;
inline constexpr std::size_t kBytesPerExpandedGroup =
    sizeof(std::vector<int64_t>) + 64;

}  // namespace internal
}  // namespace hlo
}  // namespace txe

#endif  // TORCH_XLA_EXT_BUDGET_H_
