// Python binding of the HloModuleProto reader: torch_xla_ext._C.
//
// Two kinds of objects cross the boundary:
//
// - Read-only views of the C++ records (Module, Computation, Instruction,
//   Shape, Sharding, Collective, HostTransfer, WhileLoop), for tests and
//   tools that want the reader's own view.
// - Plain records for torch_xla_ext.hlo, built in one pass: dicts whose keys
//   are the field names of the Python dataclasses (Module.records(),
//   Sharding.record()), so the Python side builds each dataclass with
//   keyword arguments and never indexes a tuple.
//
// Tables Python needs (bits per element type, the sharding type values,
// XLA's unbounded dimension size) come from here too, so they exist once.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "hlo_reader.h"

namespace py = pybind11;
using namespace txe::hlo;  // NOLINT

namespace {

// Bytes of any object that supports the buffer protocol, as one contiguous
// run. The buffer stays exported (so a bytearray cannot be resized) while the
// reader runs without the GIL.
class Bytes {
 public:
  explicit Bytes(const py::buffer& buffer) {
    // PyBUF_SIMPLE only succeeds for C-contiguous memory.
    if (PyObject_GetBuffer(buffer.ptr(), &view_, PyBUF_SIMPLE) != 0) {
      throw py::error_already_set();
    }
  }
  ~Bytes() { PyBuffer_Release(&view_); }
  Bytes(const Bytes&) = delete;
  Bytes& operator=(const Bytes&) = delete;

  const uint8_t* data() const { return static_cast<const uint8_t*>(view_.buf); }
  std::size_t size() const { return static_cast<std::size_t>(view_.len); }

 private:
  Py_buffer view_;
};

// ---------------------------------------------------------------------------
// Tables.

// {name: bits} of every array element type ("f32": 32, "s4": 4, ...).
py::dict PrimitiveTypeBitsTable() {
  py::dict table;
  for (int32_t type = 0; type <= kMaxPrimitiveType; ++type) {
    const int bits = PrimitiveTypeBits(type);
    if (bits > 0) table[py::str(std::string(PrimitiveTypeName(type)))] = bits;
  }
  return table;
}

// {name: value} of xla.OpSharding.Type ("replicated": 0, ...).
py::dict ShardingTypeTable() {
  py::dict table;
  for (int32_t type = 0; type <= kMaxShardingType; ++type) {
    table[py::str(ShardingTypeName(type))] = type;
  }
  return table;
}

int32_t ShardingTypeValue(const py::handle& name) {
  const std::string text = py::str(name);
  const auto value = ShardingTypeFromName(text);
  if (!value) {
    throw py::value_error("unknown sharding type '" + text +
                          "'; expected replicated, maximal, tuple, other, "
                          "manual, unknown, unreduced or type_<N>");
  }
  return *value;
}

// ---------------------------------------------------------------------------
// Records for torch_xla_ext.hlo.

// The dict keys of the records, made once: a module of 1,000 instructions
// would otherwise make 15,000 key strings per read. Interned strings, kept
// for the life of the process.
struct RecordKeys {
  py::str id{"id"}, name{"name"}, opcode{"opcode"}, shape{"shape"},
      operand_ids{"operand_ids"},
      called_computation_ids{"called_computation_ids"},
      parameter_number{"parameter_number"},
      custom_call_target{"custom_call_target"},
      is_host_transfer{"is_host_transfer"}, channel_id{"channel_id"},
      replica_groups{"replica_groups"}, sharding{"sharding"},
      frontend_attributes{"frontend_attributes"},
      source_target_pairs{"source_target_pairs"}, computation{"computation"},
      integer_value{"integer_value"},
      comparison_direction{"comparison_direction"};

  static const RecordKeys& Get() {
    static const RecordKeys* keys = new RecordKeys();  // never destroyed
    return *keys;
  }

 private:
  RecordKeys() {
    for (py::str* key : {&id, &name, &opcode, &shape, &operand_ids,
                         &called_computation_ids, &parameter_number,
                         &custom_call_target, &is_host_transfer, &channel_id,
                         &replica_groups, &sharding, &frontend_attributes,
                         &source_target_pairs, &computation, &integer_value,
                         &comparison_direction}) {
      PyObject* raw = key->release().ptr();
      PyUnicode_InternInPlace(&raw);
      *key = py::reinterpret_steal<py::str>(raw);
    }
  }
};

template <typename T>
py::tuple IntTuple(const std::vector<T>& v) {
  py::tuple t(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    t[i] = py::int_(static_cast<int64_t>(v[i]));
  }
  return t;
}

py::tuple SubgroupNames(const std::vector<int32_t>& types) {
  py::tuple t(types.size());
  for (std::size_t i = 0; i < types.size(); ++i) {
    t[i] = py::str(ShardingTypeName(types[i]));
  }
  return t;
}

// The fields of torch_xla_ext.hlo.Sharding: type names instead of values,
// the expanded device list, the derived text.
py::dict ShardingRecord(const Sharding& s) {
  py::tuple elements(s.tuple_elements.size());
  for (std::size_t i = 0; i < s.tuple_elements.size(); ++i) {
    elements[i] = ShardingRecord(s.tuple_elements[i]);
  }
  py::dict d;
  d["type"] = ShardingTypeName(s.proto.type);
  d["tile_assignment_dimensions"] = IntTuple(s.proto.tile_assignment_dimensions);
  d["tile_assignment_devices"] = IntTuple(s.devices);
  d["replicate_on_last_tile_dim"] = s.proto.replicate_on_last_tile_dim;
  d["last_tile_dims"] = SubgroupNames(s.proto.last_tile_dims);
  d["tuple_shardings"] = elements;
  d["iota_reshape_dims"] = IntTuple(s.proto.iota_reshape_dims);
  d["iota_transpose_perm"] = IntTuple(s.proto.iota_transpose_perm);
  d["valid"] = s.valid;
  d["text"] = s.text;
  return d;
}

// The distinct shapes of a module, each once, children before their tuples:
// a record per shape with the fields of torch_xla_ext.hlo.Shape, except
// that tuple_shapes holds indices into the same list.
class ShapeTable {
 public:
  // Index of `s` in records(), adding it (and its elements) when new.
  int64_t Add(const Shape& s) {
    std::vector<int64_t> children;
    children.reserve(s.tuple_shapes.size());
    for (const Shape& t : s.tuple_shapes) children.push_back(Add(t));
    bool any_dynamic = false;
    for (bool d : s.is_dynamic_dimension) any_dynamic |= d;
    // The key is everything the record holds.
    std::vector<int64_t> key;
    key.reserve(4 + s.dimensions.size() + children.size() +
                (any_dynamic ? s.is_dynamic_dimension.size() : 0));
    key.push_back(s.element_type);
    key.push_back(static_cast<int64_t>(s.dimensions.size()));
    key.insert(key.end(), s.dimensions.begin(), s.dimensions.end());
    key.push_back(static_cast<int64_t>(children.size()));
    key.insert(key.end(), children.begin(), children.end());
    if (any_dynamic) {
      key.insert(key.end(), s.is_dynamic_dimension.begin(),
                 s.is_dynamic_dimension.end());
    }
    const auto [it, added] =
        index_.emplace(std::move(key), static_cast<int64_t>(records_.size()));
    if (!added) return it->second;
    py::tuple dynamic(any_dynamic ? s.is_dynamic_dimension.size() : 0);
    if (any_dynamic) {
      for (std::size_t i = 0; i < s.is_dynamic_dimension.size(); ++i) {
        dynamic[i] = py::bool_(s.is_dynamic_dimension[i]);
      }
    }
    py::dict d;
    d["element_type"] = std::string(PrimitiveTypeName(s.element_type));
    d["dimensions"] = IntTuple(s.dimensions);
    d["tuple_shapes"] = IntTuple(children);
    d["is_dynamic_dimension"] = dynamic;
    records_.append(d);
    return it->second;
  }

  const py::list& records() const { return records_; }

 private:
  std::map<std::vector<int64_t>, int64_t> index_;
  py::list records_;
};

// The fields of torch_xla_ext.hlo.HloInstruction, in the Python view's
// terms: parameter_number is None unless the opcode is "parameter",
// channel_id None when not positive (XLA's "unset"), `shape` an index into
// the module's shape records, `sharding` a sharding record or None.
py::dict InstructionRecord(const Instruction& ins, const py::str& computation,
                           ShapeTable& shapes) {
  const RecordKeys& k = RecordKeys::Get();
  py::tuple groups(ins.replica_groups.size());
  for (std::size_t g = 0; g < ins.replica_groups.size(); ++g) {
    groups[g] = IntTuple(ins.replica_groups[g]);
  }
  py::tuple pairs(ins.source_target_pairs.size());
  for (std::size_t p = 0; p < ins.source_target_pairs.size(); ++p) {
    pairs[p] = py::make_tuple(ins.source_target_pairs[p].first,
                              ins.source_target_pairs[p].second);
  }
  py::dict attributes;
  for (const auto& kv : ins.frontend_attributes) {
    attributes[py::str(kv.first)] = py::str(kv.second);
  }
  py::dict d;
  d[k.id] = ins.id;
  d[k.name] = ins.name;
  d[k.opcode] = ins.opcode;
  d[k.shape] = shapes.Add(ins.shape);
  d[k.operand_ids] = IntTuple(ins.operand_ids);
  d[k.called_computation_ids] = IntTuple(ins.called_computation_ids);
  d[k.parameter_number] = ins.opcode == "parameter"
                              ? py::object(py::int_(ins.parameter_number))
                              : py::object(py::none());
  d[k.custom_call_target] = ins.custom_call_target;
  d[k.is_host_transfer] = ins.is_host_transfer;
  d[k.channel_id] = ins.channel_id > 0 ? py::object(py::int_(ins.channel_id))
                                       : py::object(py::none());
  d[k.replica_groups] = groups;
  d[k.sharding] = ins.sharding ? py::object(ShardingRecord(*ins.sharding))
                               : py::object(py::none());
  d[k.frontend_attributes] = attributes;
  d[k.computation] = computation;
  d[k.source_target_pairs] = pairs;
  d[k.integer_value] = ins.integer_value
                           ? py::object(py::int_(*ins.integer_value))
                           : py::object(py::none());
  d[k.comparison_direction] = ins.comparison_direction;
  return d;
}

// {"shapes": [shape records], "computations": [{"id", "name", "root_id",
// "instructions": [instruction records]}]}.
py::dict ModuleRecords(const Module& m) {
  ShapeTable shapes;
  py::list computations;
  for (const Computation& comp : m.computations) {
    const py::str name(comp.name);
    py::list instructions(comp.instructions.size());
    for (std::size_t k = 0; k < comp.instructions.size(); ++k) {
      instructions[k] = InstructionRecord(comp.instructions[k], name, shapes);
    }
    py::dict c;
    c["id"] = comp.id;
    c["name"] = name;
    c["root_id"] = comp.root_id;
    c["instructions"] = instructions;
    computations.append(c);
  }
  py::dict d;
  d["shapes"] = shapes.records();
  d["computations"] = computations;
  return d;
}

// ---------------------------------------------------------------------------
// Python sharding -> OpSharding, for format_sharding.

std::vector<int64_t> Int64s(const py::handle& obj, const char* name) {
  return obj.attr(name).cast<std::vector<int64_t>>();
}

std::vector<int32_t> Int32s(const py::handle& obj, const char* name) {
  return obj.attr(name).cast<std::vector<int32_t>>();
}

// Reads the attributes of a torch_xla_ext.hlo.Sharding (or any object with
// them): type and last_tile_dims by name, the integer lists, and
// tuple_shardings recursively. tile_assignment_devices is ignored when
// iota_reshape_dims is set: the Python view holds the iota's expansion there.
OpSharding ShardingFromObject(const py::handle& obj, int depth) {
  if (depth > kMaxNestingDepth) {
    throw py::value_error("sharding nested deeper than " +
                          std::to_string(kMaxNestingDepth) + " levels");
  }
  OpSharding s;
  s.type = ShardingTypeValue(obj.attr("type"));
  s.tile_assignment_dimensions = Int64s(obj, "tile_assignment_dimensions");
  s.iota_reshape_dims = Int64s(obj, "iota_reshape_dims");
  s.iota_transpose_perm = Int32s(obj, "iota_transpose_perm");
  if (s.iota_reshape_dims.empty()) {
    s.tile_assignment_devices = Int64s(obj, "tile_assignment_devices");
  }
  s.replicate_on_last_tile_dim =
      obj.attr("replicate_on_last_tile_dim").cast<bool>();
  for (const py::handle& name : obj.attr("last_tile_dims")) {
    s.last_tile_dims.push_back(ShardingTypeValue(name));
  }
  for (const py::handle& child : obj.attr("tuple_shardings")) {
    s.tuple_shardings.push_back(ShardingFromObject(child, depth + 1));
  }
  return s;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() =
      "Dependency-free reader of serialized xla.HloModuleProto bytes and "
      "analyses over it (collectives, host transfers, while loops, "
      "constants). Nothing here touches a device.";

  py::register_exception<ParseError>(m, "HloParseError", PyExc_ValueError);

  m.attr("MAX_NESTING_DEPTH") = kMaxNestingDepth;
  m.attr("MAX_EXPANDED_DEVICES") = kMaxExpandedDevices;
  m.attr("MAX_EXPANDED_DEVICES_PER_MODULE") = kMaxExpandedDevicesPerModule;
  m.attr("BUDGET_BYTES_PER_INPUT_BYTE") = kBudgetBytesPerInputByte;
  m.attr("BUDGET_BASE_BYTES") = kBudgetBaseBytes;
  m.attr("WHILE_WALK_STEPS_PER_EDGE") = kWhileWalkStepsPerEdge;
  m.attr("UNBOUNDED_SIZE") = kUnboundedSize;
  m.attr("PRIMITIVE_TYPE_BITS") = PrimitiveTypeBitsTable();
  m.attr("SHARDING_TYPES") = ShardingTypeTable();

  m.def(
      "primitive_type_name",
      [](int32_t type) { return std::string(PrimitiveTypeName(type)); },
      py::arg("type"), "XLA's lowercase name of a PrimitiveType value.");
  m.def("sharding_type_name", &ShardingTypeName, py::arg("type"),
        "Lowercase name of an OpSharding.Type value.");

  py::class_<Shape>(m, "Shape")
      .def_readonly("element_type", &Shape::element_type)
      .def_property_readonly(
          "element_type_name",
          [](const Shape& s) {
            return std::string(PrimitiveTypeName(s.element_type));
          })
      .def_readonly("dimensions", &Shape::dimensions)
      .def_readonly("is_dynamic_dimension", &Shape::is_dynamic_dimension)
      .def_readonly("tuple_shapes", &Shape::tuple_shapes)
      .def_property_readonly("num_elements", &Shape::num_elements)
      .def_property_readonly("byte_size", &Shape::byte_size)
      .def("__str__", &Shape::ToString);

  py::class_<Sharding>(m, "Sharding")
      .def_property_readonly("type",
                             [](const Sharding& s) { return s.proto.type; })
      .def_property_readonly(
          "tile_assignment_dimensions",
          [](const Sharding& s) { return s.proto.tile_assignment_dimensions; })
      .def_readonly("devices", &Sharding::devices)
      .def_property_readonly(
          "replicate_on_last_tile_dim",
          [](const Sharding& s) { return s.proto.replicate_on_last_tile_dim; })
      .def_property_readonly(
          "last_tile_dims",
          [](const Sharding& s) { return s.proto.last_tile_dims; })
      .def_property_readonly(
          "iota_reshape_dims",
          [](const Sharding& s) { return s.proto.iota_reshape_dims; })
      .def_property_readonly(
          "iota_transpose_perm",
          [](const Sharding& s) { return s.proto.iota_transpose_perm; })
      .def_property_readonly(
          "is_shard_group",
          [](const Sharding& s) { return s.proto.is_shard_group; })
      .def_property_readonly(
          "shard_group_id",
          [](const Sharding& s) { return s.proto.shard_group_id; })
      .def_property_readonly(
          "shard_group_type",
          [](const Sharding& s) { return s.proto.shard_group_type; })
      .def_readonly("tuple_elements", &Sharding::tuple_elements)
      .def_readonly("text", &Sharding::text)
      .def_readonly("valid", &Sharding::valid)
      .def("record", &ShardingRecord,
           "The fields of torch_xla_ext.hlo.Sharding as a dict (type names, "
           "the expanded device list, nested records for tuple elements).")
      .def("__str__", [](const Sharding& s) { return s.text; });

  py::class_<Instruction>(m, "Instruction")
      .def_readonly("id", &Instruction::id)
      .def_readonly("name", &Instruction::name)
      .def_readonly("opcode", &Instruction::opcode)
      .def_readonly("shape", &Instruction::shape)
      .def_readonly("operand_ids", &Instruction::operand_ids)
      .def_readonly("called_computation_ids",
                    &Instruction::called_computation_ids)
      .def_readonly("parameter_number", &Instruction::parameter_number)
      .def_readonly("custom_call_target", &Instruction::custom_call_target)
      .def_readonly("is_host_transfer", &Instruction::is_host_transfer)
      .def_readonly("channel_id", &Instruction::channel_id)
      .def_readonly("tuple_index", &Instruction::tuple_index)
      .def_readonly("replica_groups", &Instruction::replica_groups)
      .def_readonly("source_target_pairs", &Instruction::source_target_pairs)
      .def_readonly("sharding", &Instruction::sharding)
      .def_property_readonly("frontend_attributes",
                             [](const Instruction& ins) {
                               py::dict d;
                               for (const auto& kv : ins.frontend_attributes) {
                                 d[py::str(kv.first)] = py::str(kv.second);
                               }
                               return d;
                             })
      .def_property_readonly(
          "backend_config",
          [](const Instruction& ins) { return py::bytes(ins.backend_config); })
      .def_readonly("known_trip_count", &Instruction::known_trip_count)
      .def_readonly("integer_value", &Instruction::integer_value)
      .def_readonly("comparison_direction", &Instruction::comparison_direction)
      .def_readonly("op_name", &Instruction::op_name)
      .def_readonly("offset", &Instruction::offset);

  py::class_<Computation>(m, "Computation")
      .def_readonly("id", &Computation::id)
      .def_readonly("name", &Computation::name)
      .def_readonly("root_id", &Computation::root_id)
      .def_readonly("instructions", &Computation::instructions);

  py::class_<Collective>(m, "Collective")
      .def_readonly("kind", &Collective::kind)
      .def_readonly("computation", &Collective::computation)
      .def_readonly("instruction", &Collective::instruction)
      .def_readonly("operand_bytes", &Collective::operand_bytes);

  py::class_<HostTransfer>(m, "HostTransfer")
      .def_readonly("reason", &HostTransfer::reason)
      .def_readonly("computation", &HostTransfer::computation)
      .def_readonly("instruction", &HostTransfer::instruction);

  py::class_<WhileLoop>(m, "WhileLoop")
      .def_readonly("computation", &WhileLoop::computation)
      .def_readonly("instruction", &WhileLoop::instruction)
      .def_readonly("condition_id", &WhileLoop::condition_id)
      .def_readonly("body_id", &WhileLoop::body_id)
      .def_readonly("known_trip_count", &WhileLoop::known_trip_count)
      .def_readonly("inferred_trip_count", &WhileLoop::inferred_trip_count)
      .def_readonly("body_instruction_count",
                    &WhileLoop::body_instruction_count)
      .def_readonly("op_name", &WhileLoop::op_name)
      .def_readonly("condition_constants", &WhileLoop::condition_constants);

  py::class_<Module, std::shared_ptr<Module>>(m, "Module")
      .def_readonly("name", &Module::name)
      .def_readonly("entry_computation_name", &Module::entry_computation_name)
      .def_readonly("entry_computation_id", &Module::entry_computation_id)
      .def_readonly("entry_index", &Module::entry_index)
      .def_readonly("computations", &Module::computations)
      .def("num_instructions", &Module::NumInstructions)
      .def("records", &ModuleRecords,
           "Every computation and instruction as dicts keyed by the field "
           "names of torch_xla_ext.hlo's HloComputation, HloInstruction, "
           "Shape and Sharding, built in one pass: {'shapes': [...], "
           "'computations': [{'id', 'name', 'root_id', 'instructions': "
           "[...]}]}. Equal shapes are listed once; an instruction's 'shape' "
           "and a shape's 'tuple_shapes' are indices into 'shapes', which "
           "lists elements before their tuples.")
      .def(
          "entry_parameter_indices",
          [](const Module& mod) {
            std::vector<int64_t> indices;
            if (mod.entry_index < 0) return indices;
            const auto& instructions = mod.computations[mod.entry_index].instructions;
            for (const Instruction* p : mod.EntryParameters()) {
              indices.push_back(p - instructions.data());
            }
            return indices;
          },
          "Indices (into the entry computation's instructions) of its "
          "parameters, ordered by parameter number.")
      .def("collectives", &Module::Collectives)
      .def("host_transfers", &Module::HostTransfers)
      .def("while_loops", &Module::WhileLoops)
      .def("constants_bytes", &Module::ConstantsBytes)
      .def_readonly("budget_used", &Module::budget_used,
                    "Bytes the parse charged against its memory budget.")
      .def_readonly("budget_limit", &Module::budget_limit,
                    "The memory budget of the parse: BUDGET_BYTES_PER_INPUT_BYTE "
                    "per input byte plus BUDGET_BASE_BYTES.")
      .def_readonly("while_walk_steps", &Module::while_walk_steps,
                    "Steps the while-body instruction count took (bounded by "
                    "WHILE_WALK_STEPS_PER_EDGE per computation and call edge).");

  m.def(
      "read_module",
      [](const py::buffer& data) {
        Bytes bytes(data);
        std::shared_ptr<Module> module;
        {
          py::gil_scoped_release release;
          module =
              std::make_shared<Module>(ParseModule(bytes.data(), bytes.size()));
        }
        return module;
      },
      py::arg("data"),
      "Parses serialized HloModuleProto bytes (any contiguous buffer). "
      "Raises HloParseError (a ValueError) with the byte offset of the "
      "problem for malformed input.");

  m.def(
      "format_sharding",
      [](const py::object& sharding) {
        return DescribeSharding(ShardingFromObject(sharding, 0)).text;
      },
      py::arg("sharding"),
      "XLA's string for a torch_xla_ext.hlo.Sharding (any object with its "
      "attributes: type and last_tile_dims as names, the integer lists, "
      "tuple_shardings). Raises ValueError for an unknown type name.");

  m.def(
      "read_sharding",
      [](const py::buffer& data) {
        Bytes bytes(data);
        return ParseSharding(bytes.data(), bytes.size());
      },
      py::arg("data"),
      "Parses one serialized xla.OpSharding and derives XLA's string for it.");
}
