// Field numbers of the messages the reader decodes, in one place.
//
// They follow xla/service/hlo.proto, xla/xla_data.proto and
// xla/service/gpu/backend_configs.proto (WhileLoopBackendConfig). Only the
// fields the reader keeps are named; every other field is skipped. Each
// message gets a struct so that a decoder reads `case ShapeField::kDimensions:`.

#ifndef TORCH_XLA_EXT_HLO_FIELDS_H_
#define TORCH_XLA_EXT_HLO_FIELDS_H_

#include <cstdint>

namespace txe {
namespace hlo {
namespace internal {

// xla.HloModuleProto
struct ModuleField {
  enum : uint32_t {
    kName = 1,
    kEntryComputationName = 2,
    kComputations = 3,
    kEntryComputationId = 6,
  };
};

// xla.HloComputationProto (program_shape = 4 and newer fields are skipped)
struct ComputationField {
  enum : uint32_t {
    kName = 1,
    kInstructions = 2,
    kId = 5,
    kRootId = 6,
  };
};

// xla.HloInstructionProto
struct InstructionField {
  enum : uint32_t {
    kName = 1,
    kOpcode = 2,
    kShape = 3,
    kMetadata = 7,
    kLiteral = 8,
    kParameterNumber = 9,
    kTupleIndex = 13,
    kChannelId = 26,
    kCustomCallTarget = 28,
    kId = 35,
    kOperandIds = 36,
    kCalledComputationIds = 38,
    kSharding = 40,
    kBackendConfig = 43,
    kIsHostTransfer = 47,
    kReplicaGroups = 49,  // deprecated in favour of kCollectiveDeviceList
    kSourceTargetPairs = 52,
    kComparisonDirection = 63,
    kFrontendAttributes = 68,
    kCollectiveDeviceList = 87,
  };
};

// xla.OpMetadata (only the op name is read)
struct MetadataField {
  enum : uint32_t {
    kOpName = 2,
  };
};

// xla.LiteralProto (only integer values are read)
struct LiteralField {
  enum : uint32_t {
    kS32s = 4,
    kS64s = 5,
    kU32s = 6,
    kU64s = 7,
  };
};

// xla.ShapeProto (layout = 5 is skipped)
struct ShapeField {
  enum : uint32_t {
    kElementType = 2,
    kDimensions = 3,
    kTupleShapes = 4,
    kIsDynamicDimension = 6,
  };
};

// xla.OpSharding (tile_shape = 2, metadata = 7 and newer fields are skipped)
struct OpShardingField {
  enum : uint32_t {
    kType = 1,
    kTileAssignmentDimensions = 3,
    kTileAssignmentDevices = 4,
    kTupleShardings = 5,
    kReplicateOnLastTileDim = 6,
    kLastTileDims = 8,
    kIotaReshapeDims = 9,
    kIotaTransposePerm = 10,
    kIsShardGroup = 11,
    kShardGroupId = 12,
    kShardGroupType = 13,
  };
};

// xla.ReplicaGroup
struct ReplicaGroupField {
  enum : uint32_t { kReplicaIds = 1 };
};

// xla.CollectiveDeviceListProto
struct DeviceListField {
  enum : uint32_t {
    kReplicaGroups = 1,
    kIotaReplicaGroupList = 2,
  };
};

// xla.IotaReplicaGroupListProto
struct IotaGroupsField {
  enum : uint32_t {
    kNumReplicaGroups = 1,
    kNumDevicesPerGroup = 2,
    kIotaReshapeDims = 3,
    kIotaTransposePerm = 4,
  };
};

// xla.FrontendAttributes and its map entries (map<string, string>)
struct FrontendAttributesField {
  enum : uint32_t { kMap = 1 };
};
struct MapEntryField {
  enum : uint32_t {
    kKey = 1,
    kValue = 2,
  };
};

// xla.SourceTarget
struct SourceTargetField {
  enum : uint32_t {
    kSource = 1,
    kTarget = 2,
  };
};

// xla.WhileLoopBackendConfig and its KnownTripCount
struct WhileBackendConfigField {
  enum : uint32_t { kKnownTripCount = 1 };
};
struct KnownTripCountField {
  enum : uint32_t { kN = 1 };
};

}  // namespace internal
}  // namespace hlo
}  // namespace txe

#endif  // TORCH_XLA_EXT_HLO_FIELDS_H_
