// XLA's sharding normalization and printer (see sharding_text.h).
//
// HloSharding::FromProto canonicalizes what it reads (partially replicated
// groups are sorted, subgroup dimensions of size one are dropped and equal
// kinds merged, iota descriptions are simplified) and ToString prints the
// result. The code below reproduces those rules so that the strings agree.
//
// Reading order: tile assignments (Tiles: explicit or iota, and how each is
// transposed), the normalized form (Norm) built by PartialTile, Subgroup and
// Normalize, the printers, and Describe, which ties them together and falls
// back to a raw rendering for protos XLA would reject or that are too large.

#include "sharding_text.h"

#include <algorithm>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "int_math.h"
#include "iota.h"

namespace txe {
namespace hlo {
namespace internal {
namespace {

// ---------------------------------------------------------------------------
// Tile assignments.

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

// ---------------------------------------------------------------------------
// The normalized form: what HloSharding holds after FromProto.

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

// ---------------------------------------------------------------------------
// Printing.

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

}  // namespace

// ---------------------------------------------------------------------------
// Describe: normalize, print, or fall back to the raw rendering.

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
}  // namespace internal

Sharding DescribeSharding(const OpSharding& proto) {
  internal::FieldPath path;
  path.root = "OpSharding";
  internal::Budget budget(internal::InMemorySize(proto), &path);
  return internal::Describe(proto, budget, 0);
}

}  // namespace hlo
}  // namespace txe
