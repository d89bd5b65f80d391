// The trip count XLA records in a while loop's backend_config: JSON text
// (`{"known_trip_count":{"n":"5"}}`, as the HLO text shows it) or a binary
// xla.WhileLoopBackendConfig. Anything else, or a malformed config, means
// "unknown", never an error: the config is advisory.

#include <optional>
#include <string_view>

#include "hlo_fields.h"
#include "hlo_reader.h"
#include "wire.h"

namespace txe {
namespace hlo {
namespace {

using internal::Cursor;
using internal::KnownTripCountField;
using internal::Tag;
using internal::WhileBackendConfigField;

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
      if (tag.field == WhileBackendConfigField::kKnownTripCount &&
          tag.wire_type == internal::kLengthDelimited) {
        Cursor known = c.ReadMessage();
        int64_t value = 0;  // proto3 default when the field is absent
        while (!known.done()) {
          const Tag t = known.ReadTag();
          if (t.field == KnownTripCountField::kN) {
            internal::ReadInt64(known, t, value);
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

}  // namespace

std::optional<int64_t> KnownTripCountFromBackendConfig(
    std::string_view config) {
  std::size_t i = 0;
  SkipSpaces(config, i);
  if (i >= config.size()) return std::nullopt;
  if (config[i] == '{') return TripCountFromJson(config);
  return TripCountFromBinary(config);
}

}  // namespace hlo
}  // namespace txe
