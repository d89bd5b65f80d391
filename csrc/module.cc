// Python binding of the HloModuleProto reader: torch_xla_ext._C.
//
// The classes here are thin read-only views over the C++ structures;
// torch_xla_ext/hlo.py turns them into frozen dataclasses once per module.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

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

// (type, dims, devices, replicate_on_last_tile_dim, last_tile_dims,
//  iota_reshape_dims, iota_transpose_perm, [children...]) -> OpSharding.
OpSharding ShardingFromPlain(const py::handle& obj, int depth) {
  if (depth > kMaxNestingDepth) {
    throw py::value_error("sharding nested deeper than " +
                          std::to_string(kMaxNestingDepth) + " levels");
  }
  const py::tuple t = py::reinterpret_borrow<py::object>(obj).cast<py::tuple>();
  if (t.size() != 8) {
    throw py::value_error("expected an 8-tuple describing an OpSharding");
  }
  OpSharding s;
  s.type = t[0].cast<int32_t>();
  s.tile_assignment_dimensions = t[1].cast<std::vector<int64_t>>();
  s.tile_assignment_devices = t[2].cast<std::vector<int64_t>>();
  s.replicate_on_last_tile_dim = t[3].cast<bool>();
  s.last_tile_dims = t[4].cast<std::vector<int32_t>>();
  s.iota_reshape_dims = t[5].cast<std::vector<int64_t>>();
  s.iota_transpose_perm = t[6].cast<std::vector<int32_t>>();
  for (const py::handle& child : t[7].cast<py::list>()) {
    s.tuple_shardings.push_back(ShardingFromPlain(child, depth + 1));
  }
  return s;
}

template <typename T>
py::tuple IntTuple(const std::vector<T>& v) {
  py::tuple t(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    t[i] = py::int_(static_cast<int64_t>(v[i]));
  }
  return t;
}

// (element_type_name, dimensions, tuple_shapes, is_dynamic_dimension) with
// nested tuples only, so Python can use it as a dictionary key.
py::tuple ShapeRecord(const Shape& s) {
  py::tuple tuples(s.tuple_shapes.size());
  for (std::size_t i = 0; i < s.tuple_shapes.size(); ++i) {
    tuples[i] = ShapeRecord(s.tuple_shapes[i]);
  }
  bool any_dynamic = false;
  for (bool d : s.is_dynamic_dimension) any_dynamic |= d;
  py::tuple dynamic(any_dynamic ? s.is_dynamic_dimension.size() : 0);
  if (any_dynamic) {
    for (std::size_t i = 0; i < s.is_dynamic_dimension.size(); ++i) {
      dynamic[i] = py::bool_(s.is_dynamic_dimension[i]);
    }
  }
  return py::make_tuple(std::string(PrimitiveTypeName(s.element_type)),
                        IntTuple(s.dimensions), tuples, dynamic);
}

py::dict FrontendAttributes(const Instruction& ins) {
  py::dict d;
  for (const auto& kv : ins.frontend_attributes) {
    d[py::str(kv.first)] = py::str(kv.second);
  }
  return d;
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
      .def_property_readonly("frontend_attributes", &FrontendAttributes)
      .def_property_readonly(
          "backend_config",
          [](const Instruction& ins) { return py::bytes(ins.backend_config); })
      .def_readonly("known_trip_count", &Instruction::known_trip_count)
      .def_readonly("offset", &Instruction::offset);

  py::class_<Computation>(m, "Computation")
      .def_readonly("id", &Computation::id)
      .def_readonly("name", &Computation::name)
      .def_readonly("root_id", &Computation::root_id)
      .def_readonly("instructions", &Computation::instructions)
      .def(
          "instruction_records",
          [](const Computation& comp) {
            // One tuple per instruction, built in a single pass: (id, name,
            // opcode, shape record, operand_ids, called_computation_ids,
            // parameter_number, custom_call_target, is_host_transfer,
            // channel_id, replica_groups, has_sharding,
            // frontend_attributes, source_target_pairs).
            py::list out(comp.instructions.size());
            for (std::size_t k = 0; k < comp.instructions.size(); ++k) {
              const Instruction& ins = comp.instructions[k];
              py::tuple groups(ins.replica_groups.size());
              for (std::size_t g = 0; g < ins.replica_groups.size(); ++g) {
                groups[g] = IntTuple(ins.replica_groups[g]);
              }
              py::tuple pairs(ins.source_target_pairs.size());
              for (std::size_t p = 0; p < ins.source_target_pairs.size(); ++p) {
                pairs[p] = py::make_tuple(ins.source_target_pairs[p].first,
                                          ins.source_target_pairs[p].second);
              }
              py::tuple rec(14);
              rec[0] = py::int_(ins.id);
              rec[1] = py::str(ins.name);
              rec[2] = py::str(ins.opcode);
              rec[3] = ShapeRecord(ins.shape);
              rec[4] = IntTuple(ins.operand_ids);
              rec[5] = IntTuple(ins.called_computation_ids);
              rec[6] = py::int_(ins.parameter_number);
              rec[7] = py::str(ins.custom_call_target);
              rec[8] = py::bool_(ins.is_host_transfer);
              rec[9] = py::int_(ins.channel_id);
              rec[10] = groups;
              rec[11] = py::bool_(ins.sharding.has_value());
              rec[12] = FrontendAttributes(ins);
              rec[13] = pairs;
              out[k] = rec;
            }
            return out;
          },
          "Plain-tuple records of all instructions (fast bulk conversion).");

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
      .def_readonly("body_instruction_count",
                    &WhileLoop::body_instruction_count);

  py::class_<Module, std::shared_ptr<Module>>(m, "Module")
      .def_readonly("name", &Module::name)
      .def_readonly("entry_computation_name", &Module::entry_computation_name)
      .def_readonly("entry_computation_id", &Module::entry_computation_id)
      .def_readonly("entry_index", &Module::entry_index)
      .def_readonly("computations", &Module::computations)
      .def("num_instructions", &Module::NumInstructions)
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
      [](const py::object& plain) {
        return DescribeSharding(ShardingFromPlain(plain, 0)).text;
      },
      py::arg("plain"),
      "XLA's string for a sharding given as (type, dims, devices, "
      "replicate_on_last_tile_dim, last_tile_dims, iota_reshape_dims, "
      "iota_transpose_perm, [children]).");

  m.def(
      "read_sharding",
      [](const py::buffer& data) {
        Bytes bytes(data);
        return ParseSharding(bytes.data(), bytes.size());
      },
      py::arg("data"),
      "Parses one serialized xla.OpSharding and derives XLA's string for it.");
}
