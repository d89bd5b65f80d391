// Reader for serialized xla.HloModuleProto bytes.
//
// Plain C++17 with no dependency on protobuf or Python: the protobuf wire
// format is decoded by hand, only the fields the analyses need are kept, and
// every other field is skipped. Malformed input raises txe::hlo::ParseError
// (which carries the byte offset of the problem); it never reads out of
// bounds and recursion is bounded.
//
// Cost bounds for hostile input (`audit` reads untrusted files):
//
// - Memory. Every allocation a parse makes is charged against a byte budget of
//   kBudgetBytesPerInputByte (64) bytes per input byte plus kBudgetBaseBytes
//   (1 MiB). Charges are upper estimates (element sizes of the containers,
//   their growth, index entries, transient copies made while normalizing
//   shardings, printed text), made before the allocation (printed text:
//   right after, from lists already charged) and never credited back, so the
//   total also bounds the peak. Modules lowered by torch_xla use 11-18
//   bytes per input byte. Going over raises ParseError naming the byte offset
//   of the field being decoded. Lists derived from iota descriptions (device
//   lists, iota replica groups), whose length does not follow from the input
//   size, are charged with what the Python view makes of them too; they take
//   at most half of the budget and the device caps below, past which they
//   are left unexpanded, not an error.
// - Time. Decoding and every analysis are linear in the input size, up to
//   the log factor of sorting the lookups (sorted lists, not hash tables,
//   whose worst case the input could pick) and of searching them. The
//   while-body instruction count is computed when the module is parsed; its
//   walk of the call graph takes at most kWhileWalkStepsPerEdge steps per
//   computation and call edge, and a call graph that would need more
//   (deeply nested loops sharing callees, which XLA does not emit) raises
//   ParseError naming the while instruction.
//
// The reader's files, each readable top to bottom:
//   hlo_reader.h      this contract and the public records
//   hlo_fields.h      field numbers of the decoded messages, named
//   budget.h          the field path of error messages and the memory budget
//   wire.h            the wire-format cursor and field readers
//   hlo_decode.cc     message decoders, ParseModule, ParseSharding
//   sharding_text.cc  XLA's sharding normalization and printer
//   iota.h/.cc        iota device lists
//   backend_config.cc known_trip_count of while loops
//   hlo_analyses.cc   lookups, while-body counts, collectives, host transfers
//   hlo_types.cc      primitive types, shapes, sharding type names
//   module.cc         the pybind11 module torch_xla_ext._C
//
// Field numbers follow xla/service/hlo.proto and xla/xla_data.proto.

#ifndef TORCH_XLA_EXT_HLO_READER_H_
#define TORCH_XLA_EXT_HLO_READER_H_

#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace txe {
namespace hlo {

// Raised for bytes that are not a well-formed HloModuleProto. what() always
// contains "byte offset <N>".
class ParseError : public std::runtime_error {
 public:
  ParseError(const std::string& message, std::size_t offset);
  std::size_t offset() const { return offset_; }

 private:
  std::size_t offset_;
};

// Limits that keep hostile input cheap.
inline constexpr int kMaxNestingDepth = 100;  // nested messages and groups
// Largest device list a single sharding or replica-group list is expanded to.
inline constexpr int64_t kMaxExpandedDevices = int64_t{1} << 18;
// Total number of device ids expanded for one module (all instructions).
inline constexpr int64_t kMaxExpandedDevicesPerModule = int64_t{1} << 22;
// Memory budget of one parse: kBudgetBytesPerInputByte * input size +
// kBudgetBaseBytes (see the comment at the top).
inline constexpr std::size_t kBudgetBytesPerInputByte = 64;
inline constexpr std::size_t kBudgetBaseBytes = std::size_t{1} << 20;
// Step limit of the while-body walk, per computation and per call edge.
inline constexpr int64_t kWhileWalkStepsPerEdge = 64;

// xla.PrimitiveType values.
enum PrimitiveType : int32_t {
  kInvalidType = 0,
  kPred = 1,
  kS8 = 2,
  kS16 = 3,
  kS32 = 4,
  kS64 = 5,
  kU8 = 6,
  kU16 = 7,
  kU32 = 8,
  kU64 = 9,
  kF16 = 10,
  kF32 = 11,
  kF64 = 12,
  kTuple = 13,
  kOpaque = 14,
  kC64 = 15,
  kBF16 = 16,
  kToken = 17,
  kC128 = 18,
  kF8E5M2 = 19,
  kF8E4M3FN = 20,
  kS4 = 21,
  kU4 = 22,
  kF8E4M3B11FNUZ = 23,
  kF8E5M2FNUZ = 24,
  kF8E4M3FNUZ = 25,
  kS2 = 26,
  kU2 = 27,
  kF8E4M3 = 28,
  kF8E3M4 = 29,
  kS1 = 30,
  kU1 = 31,
  kF4E2M1FN = 32,
  kF8E8M0FNU = 33,
  kBuffer = 34,
};
// The largest PrimitiveType value this reader knows.
inline constexpr int32_t kMaxPrimitiveType = kBuffer;

// XLA's lowercase name of a primitive type ("f32", "bf16", "pred", "tuple",
// "token", "opaque", ...); "invalid" for values this reader does not know.
std::string_view PrimitiveTypeName(int32_t type);
// Bits per element of an array type; 0 for tuple/token/opaque/unknown.
int PrimitiveTypeBits(int32_t type);

// Dimension size XLA uses for an unbounded dynamic dimension (printed "?").
inline constexpr int64_t kUnboundedSize = INT64_MIN;

struct Shape {
  int32_t element_type = kInvalidType;
  std::vector<int64_t> dimensions;
  std::vector<bool> is_dynamic_dimension;
  std::vector<Shape> tuple_shapes;

  bool is_tuple() const { return element_type == kTuple; }
  // Product of the dimensions (negative sizes count as 0), saturating at
  // INT64_MAX. 0 for tuples, tokens and opaque shapes.
  int64_t num_elements() const;
  // Bytes of the array (sub-byte types rounded up per array) or, for a
  // tuple, the sum over its leaves. Saturates at INT64_MAX.
  int64_t byte_size() const;
  // XLA's human string without layout: "f32[2,3]", "(f32[2], s32[])".
  std::string ToString() const;
};

// xla.OpSharding.Type values.
enum ShardingType : int32_t {
  kShardingReplicated = 0,
  kShardingMaximal = 1,
  kShardingTuple = 2,
  kShardingOther = 3,
  kShardingManual = 4,
  kShardingUnknown = 5,
  kShardingUnreduced = 6,
};
inline constexpr int32_t kMaxShardingType = kShardingUnreduced;

// Name of an OpSharding.Type in lowercase ("replicated", "maximal", "tuple",
// "other", "manual", "unknown", "unreduced"); "type_<N>" for other values.
std::string ShardingTypeName(int32_t type);
// The inverse of ShardingTypeName; nullopt for a name it never returns.
std::optional<int32_t> ShardingTypeFromName(std::string_view name);

// The decoded fields of one xla.OpSharding (metadata is skipped).
struct OpSharding {
  int32_t type = kShardingReplicated;
  std::vector<int64_t> tile_assignment_dimensions;
  std::vector<int64_t> tile_assignment_devices;
  std::vector<OpSharding> tuple_shardings;
  bool replicate_on_last_tile_dim = false;
  std::vector<int32_t> last_tile_dims;
  std::vector<int64_t> iota_reshape_dims;
  std::vector<int32_t> iota_transpose_perm;
  bool is_shard_group = false;
  int64_t shard_group_id = 0;
  int32_t shard_group_type = 0;  // 0 = AS, 1 = LIKE
};

// A sharding plus what the reader derives from it.
struct Sharding {
  OpSharding proto;
  // HloSharding::ToString() of HloSharding::FromProto(proto): the string
  // torch_xla's _get_xla_sharding_spec and the HLO text print.
  std::string text;
  // False when XLA's FromProto would reject the proto; `text` is then a
  // best-effort rendering of the raw fields.
  bool valid = true;
  // The device ids of the proto's tile assignment in row-major order:
  // tile_assignment_devices, or the iota list expanded. Empty when neither
  // is present, the iota description is invalid, or it exceeds the limits.
  std::vector<int64_t> devices;
  // Derived per tuple element, in the order of proto.tuple_shardings.
  std::vector<Sharding> tuple_elements;
};

struct Instruction {
  int64_t id = 0;
  std::string name;
  std::string opcode;
  Shape shape;
  std::vector<int64_t> operand_ids;
  std::vector<int64_t> called_computation_ids;
  int64_t parameter_number = 0;
  std::string custom_call_target;
  bool is_host_transfer = false;
  int64_t channel_id = 0;
  int64_t tuple_index = 0;
  // Explicit groups: field replica_groups, or collective_device_list (its
  // explicit groups or its iota description expanded) when that is present.
  std::vector<std::vector<int64_t>> replica_groups;
  std::vector<std::pair<int64_t, int64_t>> source_target_pairs;
  std::optional<Sharding> sharding;
  // Map entries in the order they appear; a repeated key keeps its last value.
  std::vector<std::pair<std::string, std::string>> frontend_attributes;
  std::string backend_config;
  // known_trip_count.n of a while loop's backend_config, JSON or binary.
  std::optional<int64_t> known_trip_count;
  // The value of an integer scalar constant (a literal holding exactly one
  // s32/s64/u32/u64 value that fits int64); nullopt for anything else.
  std::optional<int64_t> integer_value;
  std::string comparison_direction;  // "LT", "GE", ... of a compare
  std::string op_name;               // metadata.op_name

  // Byte offset of the instruction's message in the input (for diagnostics).
  std::size_t offset = 0;

  const std::string* FrontendAttribute(std::string_view key) const;
};

struct Computation {
  int64_t id = 0;
  std::string name;
  int64_t root_id = 0;
  std::vector<Instruction> instructions;
};

struct Collective {
  std::string kind;    // all-gather, all-reduce, reduce-scatter, all-to-all, ...
  int computation = 0;  // index into Module::computations
  int instruction = 0;  // index into that computation's instructions
  int64_t operand_bytes = 0;
};

struct HostTransfer {
  std::string reason;
  int computation = 0;
  int instruction = 0;
};

struct WhileLoop {
  int computation = 0;
  int instruction = 0;
  int64_t condition_id = -1;  // -1 when missing
  int64_t body_id = -1;
  std::optional<int64_t> known_trip_count;
  // The trip count read from the loop itself when it has the counted form
  // (see InferTripCount in hlo_analyses.cc); nullopt otherwise.
  std::optional<int64_t> inferred_trip_count;
  // Instructions of the body and of every computation reachable from it
  // through called computations, each computation counted once.
  int64_t body_instruction_count = 0;
  std::string op_name;  // the while instruction's metadata.op_name
  // The integer scalar constants of the condition computation, in order:
  // what the loop's bound became after a compiler rewrote the condition.
  std::vector<int64_t> condition_constants;
};

struct Module {
  std::string name;
  std::string entry_computation_name;
  int64_t entry_computation_id = 0;
  std::vector<Computation> computations;

  // Index of the entry computation, or -1 when it cannot be found (by id,
  // then by name).
  int entry_index = -1;

  // Lookups; -1 / nullptr when absent. For duplicated ids or names the first
  // occurrence wins.
  int ComputationIndexById(int64_t id) const;
  int ComputationIndexByName(std::string_view name) const;
  // Returns {computation index, instruction index} or {-1, -1}.
  std::pair<int, int> InstructionLocation(int64_t id) const;
  // The same, looking in computation `computation` first.
  std::pair<int, int> InstructionLocation(int64_t id, int computation) const;
  const Instruction* InstructionById(int64_t id) const;

  int64_t NumInstructions() const;
  // Entry parameters ordered by parameter number (ties keep input order).
  std::vector<const Instruction*> EntryParameters() const;
  std::vector<Collective> Collectives() const;
  std::vector<HostTransfer> HostTransfers() const;
  std::vector<WhileLoop> WhileLoops() const;
  int64_t ConstantsBytes() const;

  // Built by BuildIndex(). Sorted lists searched by bisection rather than
  // hash tables, whose worst case hostile ids and names could pick:
  // computations by (id, index) and by (name, index), instructions by
  // (id, computation, position), so the first occurrence comes first.
  struct InstructionKey {
    int64_t id;
    int computation;
    int instruction;
  };
  std::vector<std::pair<int64_t, int>> computation_by_id;
  std::vector<int> computation_by_name;
  std::vector<InstructionKey> instruction_by_id;
  // Per computation: when it is the body of a while loop, its instructions
  // plus those of every computation reachable from it (each computation
  // counted once, saturating at INT64_MAX); -1 otherwise.
  std::vector<int64_t> body_instruction_counts;

  // Bookkeeping of the parse, for tests of the cost bounds: bytes charged
  // against the memory budget and the budget itself, and the steps the
  // while-body walk took.
  std::size_t budget_used = 0;
  std::size_t budget_limit = 0;
  int64_t while_walk_steps = 0;

  // Builds the lookups above (sorting them) and body_instruction_counts
  // (linear in the computations, instructions and call edges); throws
  // ParseError (at the offset of a while instruction) when the while-body
  // walk would take more than kWhileWalkStepsPerEdge steps per computation
  // and call edge.
  void BuildIndex();

 private:
  void CountWhileBodies();
};

// Parses serialized HloModuleProto bytes. Throws ParseError.
Module ParseModule(const uint8_t* data, std::size_t size);
inline Module ParseModule(std::string_view bytes) {
  return ParseModule(reinterpret_cast<const uint8_t*>(bytes.data()),
                     bytes.size());
}

// Decodes one serialized xla.OpSharding and derives its string. Throws
// ParseError.
Sharding ParseSharding(const uint8_t* data, std::size_t size);

// Derives text/valid/devices of a sharding from its proto fields.
Sharding DescribeSharding(const OpSharding& proto);

// The trip count recorded in a while loop's backend_config (JSON text
// `{"known_trip_count":{"n":"5"}}` or a binary WhileLoopBackendConfig).
std::optional<int64_t> KnownTripCountFromBackendConfig(std::string_view config);

}  // namespace hlo
}  // namespace txe

#endif  // TORCH_XLA_EXT_HLO_READER_H_
