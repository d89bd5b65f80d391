// Decoding of HloModuleProto bytes into the records of hlo_reader.h.
//
// One decoder per message, leaves first: shapes, shardings, replica groups
// and device lists, frontend attributes, then instructions, computations and
// the module (ParseModule, at the end). Each decoder merges into its output,
// as protobuf does when a singular message field occurs more than once, and
// charges what it keeps against the parse's Budget before allocating it.

#include <algorithm>
#include <numeric>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "budget.h"
#include "hlo_fields.h"
#include "hlo_reader.h"
#include "int_math.h"
#include "iota.h"
#include "sharding_text.h"
#include "wire.h"

namespace txe {
namespace hlo {
namespace internal {
namespace {

// Charges for the lookups BuildIndex makes and the call graph it walks: per
// instruction an index entry; per computation its lookup entries (and a copy
// of its name, charged separately) and the walk's per-node arrays; per call
// edge the walk's adjacency and stack entries.
constexpr std::size_t kIndexBytesPerInstruction = 48;
constexpr std::size_t kIndexBytesPerComputation = 256;
constexpr std::size_t kCallEdgeBytes = 32;

// Bytes charged per frontend-attribute entry for merging repeated keys: its
// slots in the sort order and the kept list, and a slot in the merged list.
constexpr std::size_t kAttributeMergeBytes = 8 + 16 + 64;

// ---------------------------------------------------------------------------
// Shapes and shardings.

void DecodeShape(Cursor c, Shape& shape, FieldPath& path, Budget& budget) {
  ReserveCharged(shape.tuple_shapes,
                 CountMessages(c, ShapeField::kTupleShapes), budget, c.pos());
  while (!c.done()) {
    const Tag tag = c.ReadTag();
    switch (tag.field) {
      case ShapeField::kElementType:
        ReadInt32(c, tag, shape.element_type);
        break;
      case ShapeField::kDimensions:
        ReadRepeatedVarint(c, tag, shape.dimensions, budget);
        break;
      case ShapeField::kTupleShapes:
        ReadMessageField(
            c, tag, path, "tuple_shapes",
            static_cast<int64_t>(shape.tuple_shapes.size()), [&](Cursor sub) {
              DecodeShape(sub,
                          AppendCharged(shape.tuple_shapes, budget, tag.offset),
                          path, budget);
            });
        break;
      case ShapeField::kIsDynamicDimension:
        ReadRepeatedBool(c, tag, shape.is_dynamic_dimension, budget);
        break;
      default:
        c.Skip(tag);
    }
  }
}

void DecodeOpSharding(Cursor c, OpSharding& s, FieldPath& path,
                      Budget& budget) {
  ReserveCharged(s.tuple_shardings,
                 CountMessages(c, OpShardingField::kTupleShardings), budget,
                 c.pos());
  while (!c.done()) {
    const Tag tag = c.ReadTag();
    switch (tag.field) {
      case OpShardingField::kType:
        ReadInt32(c, tag, s.type);
        break;
      case OpShardingField::kTileAssignmentDimensions:
        ReadRepeatedVarint(c, tag, s.tile_assignment_dimensions, budget);
        break;
      case OpShardingField::kTileAssignmentDevices:
        ReadRepeatedVarint(c, tag, s.tile_assignment_devices, budget);
        break;
      case OpShardingField::kTupleShardings:
        ReadMessageField(
            c, tag, path, "tuple_shardings",
            static_cast<int64_t>(s.tuple_shardings.size()), [&](Cursor sub) {
              DecodeOpSharding(
                  sub, AppendCharged(s.tuple_shardings, budget, tag.offset),
                  path, budget);
            });
        break;
      case OpShardingField::kReplicateOnLastTileDim:
        ReadBool(c, tag, s.replicate_on_last_tile_dim);
        break;
      case OpShardingField::kLastTileDims:
        ReadRepeatedVarint(c, tag, s.last_tile_dims, budget);
        break;
      case OpShardingField::kIotaReshapeDims:
        ReadRepeatedVarint(c, tag, s.iota_reshape_dims, budget);
        break;
      case OpShardingField::kIotaTransposePerm:
        ReadRepeatedVarint(c, tag, s.iota_transpose_perm, budget);
        break;
      case OpShardingField::kIsShardGroup:
        ReadBool(c, tag, s.is_shard_group);
        break;
      case OpShardingField::kShardGroupId:
        ReadInt64(c, tag, s.shard_group_id);
        break;
      case OpShardingField::kShardGroupType:
        ReadInt32(c, tag, s.shard_group_type);
        break;
      default:
        c.Skip(tag);
    }
  }
}

// ---------------------------------------------------------------------------
// Replica groups: explicit lists, or an iota description expanded here.

void DecodeReplicaGroup(Cursor c, std::vector<int64_t>& ids, Budget& budget) {
  while (!c.done()) {
    const Tag tag = c.ReadTag();
    if (tag.field == ReplicaGroupField::kReplicaIds) {
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
      case IotaGroupsField::kNumReplicaGroups:
        ReadInt64(c, tag, g.num_groups);
        break;
      case IotaGroupsField::kNumDevicesPerGroup:
        ReadInt64(c, tag, g.group_size);
        break;
      case IotaGroupsField::kIotaReshapeDims:
        ReadRepeatedVarint(c, tag, g.reshape_dims, budget);
        break;
      case IotaGroupsField::kIotaTransposePerm:
        ReadRepeatedVarint(c, tag, g.transpose_perm, budget);
        break;
      default:
        c.Skip(tag);
    }
  }
}

void DecodeDeviceList(Cursor c, DeviceList& list, FieldPath& path,
                      Budget& budget) {
  ReserveCharged(list.groups,
                 CountMessages(c, DeviceListField::kReplicaGroups), budget,
                 c.pos());
  while (!c.done()) {
    const Tag tag = c.ReadTag();
    switch (tag.field) {
      case DeviceListField::kReplicaGroups:
        ReadMessageField(
            c, tag, path, "replica_groups",
            static_cast<int64_t>(list.groups.size()), [&](Cursor sub) {
              DecodeReplicaGroup(
                  sub, AppendCharged(list.groups, budget, tag.offset), budget);
            });
        break;
      case DeviceListField::kIotaReplicaGroupList:
        ReadMessageField(c, tag, path, "iota_replica_group_list", -1,
                         [&](Cursor sub) {
                           if (!list.iota) list.iota.emplace();
                           DecodeIotaGroups(sub, *list.iota, budget);
                         });
        break;
      default:
        c.Skip(tag);
    }
  }
}

// The groups an iota description denotes; empty when the description is
// invalid or its expansion exceeds the device caps or half the budget.
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

void DecodeSourceTarget(Cursor c, std::pair<int64_t, int64_t>& st) {
  while (!c.done()) {
    const Tag tag = c.ReadTag();
    if (tag.field == SourceTargetField::kSource) {
      ReadInt64(c, tag, st.first);
    } else if (tag.field == SourceTargetField::kTarget) {
      ReadInt64(c, tag, st.second);
    } else {
      c.Skip(tag);
    }
  }
}

// ---------------------------------------------------------------------------
// Frontend attributes.

void DecodeFrontendAttributes(
    Cursor c, std::vector<std::pair<std::string, std::string>>& out,
    FieldPath& path, Budget& budget) {
  while (!c.done()) {
    const Tag tag = c.ReadTag();
    if (tag.field != FrontendAttributesField::kMap ||
        tag.wire_type != kLengthDelimited) {
      c.Skip(tag);
      continue;
    }
    ScopedFrame f(path, "map");
    Cursor entry = c.ReadMessage();
    std::string key, value;
    while (!entry.done()) {
      const Tag t = entry.ReadTag();
      if (t.field == MapEntryField::kKey) {
        ReadStringField(entry, t, key, budget);
      } else if (t.field == MapEntryField::kValue) {
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

// OpMetadata: the op name only.
void DecodeMetadata(Cursor c, std::string& op_name, Budget& budget) {
  while (!c.done()) {
    const Tag tag = c.ReadTag();
    if (tag.field == MetadataField::kOpName) {
      ReadStringField(c, tag, op_name, budget);
    } else {
      c.Skip(tag);
    }
  }
}

// LiteralProto: the value when the literal holds exactly one integer
// (s32/s64/u32/u64, packed or not) that fits int64. Values are counted, not
// stored, so a large constant costs no memory here.
std::optional<int64_t> DecodeIntegerLiteral(Cursor c) {
  int64_t count = 0;
  std::optional<int64_t> value;
  auto take = [&](uint64_t raw, uint32_t field) {
    ++count;
    switch (field) {
      case LiteralField::kS32s:  // int32 varints are sign-extended to 64 bits
        value = static_cast<int64_t>(static_cast<int32_t>(raw));
        break;
      case LiteralField::kU32s:
        value = static_cast<int64_t>(static_cast<uint32_t>(raw));
        break;
      case LiteralField::kS64s:
        value = static_cast<int64_t>(raw);
        break;
      default:  // kU64s
        if (raw > static_cast<uint64_t>(kInt64Max)) {
          value.reset();
        } else {
          value = static_cast<int64_t>(raw);
        }
    }
  };
  while (!c.done()) {
    const Tag tag = c.ReadTag();
    const bool integer = tag.field == LiteralField::kS32s || tag.field == LiteralField::kS64s ||
                         tag.field == LiteralField::kU32s || tag.field == LiteralField::kU64s;
    if (integer && tag.wire_type == kVarint) {
      take(c.ReadVarint(), tag.field);
    } else if (integer && tag.wire_type == kLengthDelimited) {
      Cursor packed = c.ReadSub();
      while (!packed.done()) take(packed.ReadVarint(), tag.field);
    } else {
      c.Skip(tag);
    }
  }
  if (count != 1) return std::nullopt;
  return value;
}

// ---------------------------------------------------------------------------
// Instructions, computations.

void DecodeInstruction(Cursor c, Instruction& ins, FieldPath& path,
                       Budget& budget) {
  ins.offset = c.pos();
  bool has_sharding = false;
  std::size_t sharding_offset = 0;
  OpSharding sharding;
  bool has_device_list = false;
  DeviceList device_list;
  std::vector<std::vector<int64_t>> legacy_groups;
  std::optional<int64_t> literal;

  while (!c.done()) {
    const Tag tag = c.ReadTag();
    switch (tag.field) {
      case InstructionField::kName:
        ReadStringField(c, tag, ins.name, budget);
        break;
      case InstructionField::kOpcode:
        ReadStringField(c, tag, ins.opcode, budget);
        break;
      case InstructionField::kShape:
        ReadMessageField(c, tag, path, "shape", -1, [&](Cursor sub) {
          DecodeShape(sub, ins.shape, path, budget);
        });
        break;
      case InstructionField::kMetadata:
        ReadMessageField(c, tag, path, "metadata", -1, [&](Cursor sub) {
          DecodeMetadata(sub, ins.op_name, budget);
        });
        break;
      case InstructionField::kLiteral:
        ReadMessageField(c, tag, path, "literal", -1, [&](Cursor sub) {
          literal = DecodeIntegerLiteral(sub);
        });
        break;
      case InstructionField::kComparisonDirection:
        ReadStringField(c, tag, ins.comparison_direction, budget);
        break;
      case InstructionField::kParameterNumber:
        ReadInt64(c, tag, ins.parameter_number);
        break;
      case InstructionField::kTupleIndex:
        ReadInt64(c, tag, ins.tuple_index);
        break;
      case InstructionField::kChannelId:
        ReadInt64(c, tag, ins.channel_id);
        break;
      case InstructionField::kCustomCallTarget:
        ReadStringField(c, tag, ins.custom_call_target, budget);
        break;
      case InstructionField::kId:
        ReadInt64(c, tag, ins.id);
        break;
      case InstructionField::kOperandIds:
        ReadRepeatedVarint(c, tag, ins.operand_ids, budget);
        break;
      case InstructionField::kCalledComputationIds: {
        // Each call is also an edge of the call graph BuildIndex walks.
        const std::size_t before = ins.called_computation_ids.size();
        ReadRepeatedVarint(c, tag, ins.called_computation_ids, budget);
        budget.ChargeItems(ins.called_computation_ids.size() - before,
                           kCallEdgeBytes, tag.offset);
        break;
      }
      case InstructionField::kSharding:
        ReadMessageField(c, tag, path, "sharding", -1, [&](Cursor sub) {
          has_sharding = true;
          sharding_offset = tag.offset;
          DecodeOpSharding(sub, sharding, path, budget);
        });
        break;
      case InstructionField::kBackendConfig:
        ReadBytesField(c, tag, ins.backend_config, budget);
        break;
      case InstructionField::kIsHostTransfer:
        ReadBool(c, tag, ins.is_host_transfer);
        break;
      case InstructionField::kReplicaGroups:
        ReadMessageField(
            c, tag, path, "replica_groups",
            static_cast<int64_t>(legacy_groups.size()), [&](Cursor sub) {
              DecodeReplicaGroup(
                  sub, AppendCharged(legacy_groups, budget, tag.offset), budget);
            });
        break;
      case InstructionField::kSourceTargetPairs:
        ReadMessageField(
            c, tag, path, "source_target_pairs",
            static_cast<int64_t>(ins.source_target_pairs.size()),
            [&](Cursor sub) {
              DecodeSourceTarget(sub, AppendCharged(ins.source_target_pairs,
                                                    budget, tag.offset));
            });
        break;
      case InstructionField::kFrontendAttributes:
        ReadMessageField(c, tag, path, "frontend_attributes", -1,
                         [&](Cursor sub) {
                           DecodeFrontendAttributes(
                               sub, ins.frontend_attributes, path, budget);
                         });
        break;
      case InstructionField::kCollectiveDeviceList:
        ReadMessageField(c, tag, path, "collective_device_list", -1,
                         [&](Cursor sub) {
                           has_device_list = true;
                           DecodeDeviceList(sub, device_list, path, budget);
                         });
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
  if (ins.opcode == "constant" && !ins.shape.is_tuple() &&
      ins.shape.dimensions.empty()) {
    ins.integer_value = literal;
  }
}

void DecodeComputation(Cursor c, Computation& comp, FieldPath& path,
                       Budget& budget) {
  // Instructions are the largest records: reserve them at once, with their
  // entries in the module's index.
  constexpr std::size_t kInstructionBytes =
      sizeof(Instruction) + kIndexBytesPerInstruction;
  ReserveCharged(comp.instructions,
                 CountMessages(c, ComputationField::kInstructions), budget,
                 c.pos(), kInstructionBytes);
  while (!c.done()) {
    const Tag tag = c.ReadTag();
    switch (tag.field) {
      case ComputationField::kName:
        ReadStringField(c, tag, comp.name, budget);
        break;
      case ComputationField::kInstructions:
        ReadMessageField(
            c, tag, path, "instructions",
            static_cast<int64_t>(comp.instructions.size()), [&](Cursor sub) {
              DecodeInstruction(sub,
                                AppendCharged(comp.instructions, budget,
                                              tag.offset, kInstructionBytes),
                                path, budget);
            });
        break;
      case ComputationField::kId:
        ReadInt64(c, tag, comp.id);
        break;
      case ComputationField::kRootId:
        ReadInt64(c, tag, comp.root_id);
        break;
      default:
        c.Skip(tag);
    }
  }
}

}  // namespace
}  // namespace internal

// ---------------------------------------------------------------------------
// Entry points.

Sharding ParseSharding(const uint8_t* data, std::size_t size) {
  using namespace internal;  // NOLINT
  static const uint8_t kEmpty = 0;
  if (data == nullptr) data = &kEmpty;
  FieldPath path;
  path.root = "OpSharding";
  Budget budget(size, &path);
  Cursor c(data, 0, size, 0, &path);
  OpSharding proto;
  DecodeOpSharding(c, proto, path, budget);
  return Describe(std::move(proto), budget, 0);
}

Module ParseModule(const uint8_t* data, std::size_t size) {
  using namespace internal;  // NOLINT
  static const uint8_t kEmpty = 0;
  if (data == nullptr) data = &kEmpty;
  FieldPath path;
  Budget budget(size, &path);
  Cursor c(data, 0, size, 0, &path);
  Module m;
  constexpr std::size_t kComputationBytes =
      sizeof(Computation) + kIndexBytesPerComputation;
  ReserveCharged(m.computations, CountMessages(c, ModuleField::kComputations),
                 budget, 0, kComputationBytes);
  while (!c.done()) {
    const Tag tag = c.ReadTag();
    switch (tag.field) {
      case ModuleField::kName:
        ReadStringField(c, tag, m.name, budget);
        break;
      case ModuleField::kEntryComputationName:
        ReadStringField(c, tag, m.entry_computation_name, budget);
        break;
      case ModuleField::kComputations:
        ReadMessageField(
            c, tag, path, "computations",
            static_cast<int64_t>(m.computations.size()), [&](Cursor sub) {
              Computation& comp = AppendCharged(m.computations, budget,
                                                tag.offset, kComputationBytes);
              DecodeComputation(sub, comp, path, budget);
              // The by-name index keeps a copy of the name.
              budget.Charge(comp.name.size() + 1, tag.offset);
            });
        break;
      case ModuleField::kEntryComputationId:
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

}  // namespace hlo
}  // namespace txe
