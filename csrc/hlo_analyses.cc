// Lookups and analyses over a decoded Module: the sorted id and name
// indexes, the while-body instruction counts (computed once, when the module
// is parsed), entry parameters, collectives, host transfers, while loops and
// constant bytes. All linear in the module, up to the log factor of the
// sorted lookups.

#include <algorithm>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "hlo_reader.h"
#include "int_math.h"

namespace txe {
namespace hlo {

using internal::SatAdd;

namespace {

bool InstructionKeyLess(const Module::InstructionKey& a,
                        const Module::InstructionKey& b) {
  if (a.id != b.id) return a.id < b.id;
  if (a.computation != b.computation) return a.computation < b.computation;
  return a.instruction < b.instruction;
}

}  // namespace

// ---------------------------------------------------------------------------
// The index and the while-body counts, built once per parse.

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

// ---------------------------------------------------------------------------
// Lookups.

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

// ---------------------------------------------------------------------------
// Analyses.

namespace {

bool HostMemoryTarget(const std::string& value) {
  return value.find("host") != std::string::npos;
}

bool Contains(const std::string& s, std::string_view what) {
  return s.find(what) != std::string::npos;
}

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

namespace {

// Instruction `id` of computation `comp`; nullptr when `comp` holds none.
const Instruction* Local(const Module& m, int64_t id, int comp) {
  const auto loc = m.InstructionLocation(id, comp);
  if (loc.first != comp) return nullptr;
  return &m.computations[comp].instructions[loc.second];
}

// The element k when instruction `id` of `comp` reads element k of the
// computation's parameter 0 (the loop state); nullopt otherwise.
std::optional<int64_t> StateElement(const Module& m, int64_t id, int comp) {
  const Instruction* ins = Local(m, id, comp);
  if (ins == nullptr || ins->opcode != "get-tuple-element" || ins->operand_ids.size() != 1) {
    return std::nullopt;
  }
  const Instruction* param = Local(m, ins->operand_ids[0], comp);
  if (param == nullptr || param->opcode != "parameter" || param->parameter_number != 0) return std::nullopt;
  return ins->tuple_index;
}

std::optional<int64_t> ConstantOperand(const Module& m, int64_t id, int comp) {
  const Instruction* ins = Local(m, id, comp);
  if (ins == nullptr) return std::nullopt;
  return ins->integer_value;
}

// The trip count of a loop in the counted form a scan lowers to (XLA's own
// analysis matches the same form): state element k starts at a constant c0
// (element k of a tuple of the while's own computation), the body's root
// tuple sets it to k + s with a constant s > 0, and the condition's root
// compares it with a constant bound: k < c, k <= c, k != c (c0 <= c and
// (c - c0) divisible by s), or the same written with the constant first.
std::optional<int64_t> InferTripCount(const Module& m, int ci, const Instruction& w, int body,
                                      int cond) {
  if (body < 0 || cond < 0 || w.operand_ids.size() != 1) return std::nullopt;
  const Instruction* test = Local(m, m.computations[cond].root_id, cond);
  if (test == nullptr || test->opcode != "compare" || test->operand_ids.size() != 2) {
    return std::nullopt;
  }
  std::string direction = test->comparison_direction;
  std::optional<int64_t> k, bound;
  for (int side = 0; side < 2 && !k; ++side) {
    k = StateElement(m, test->operand_ids[side], cond);
    if (k) {
      bound = ConstantOperand(m, test->operand_ids[1 - side], cond);
      if (side == 1) {  // bound OP k: mirror the direction
        if (direction == "GT") direction = "LT";
        else if (direction == "GE") direction = "LE";
        else if (direction != "NE") return std::nullopt;
      }
    }
  }
  if (!k || !bound) return std::nullopt;

  const Instruction* init = Local(m, w.operand_ids[0], ci);
  if (init == nullptr || init->opcode != "tuple" || *k < 0 ||
      *k >= static_cast<int64_t>(init->operand_ids.size())) {
    return std::nullopt;
  }
  const std::optional<int64_t> start = ConstantOperand(m, init->operand_ids[*k], ci);

  const Instruction* next = Local(m, m.computations[body].root_id, body);
  if (!start || next == nullptr || next->opcode != "tuple" ||
      *k >= static_cast<int64_t>(next->operand_ids.size())) {
    return std::nullopt;
  }
  const Instruction* add = Local(m, next->operand_ids[*k], body);
  if (add == nullptr || add->opcode != "add" || add->operand_ids.size() != 2) return std::nullopt;
  std::optional<int64_t> step;
  for (int side = 0; side < 2 && !step; ++side) {
    if (StateElement(m, add->operand_ids[side], body) == k) {
      step = ConstantOperand(m, add->operand_ids[1 - side], body);
    }
  }
  if (!step || *step <= 0) return std::nullopt;

  // Trips while the counter, from *start by *step, stays below `limit`.
  int64_t limit;
  if (direction == "LT") {
    limit = *bound;
  } else if (direction == "LE") {
    if (__builtin_add_overflow(*bound, 1, &limit)) return std::nullopt;
  } else if (direction == "NE") {
    int64_t span;
    if (*bound < *start || __builtin_sub_overflow(*bound, *start, &span) || span % *step != 0) {
      return std::nullopt;
    }
    limit = *bound;
  } else {
    return std::nullopt;
  }
  if (limit <= *start) return 0;
  // The values start, start + step, ... below limit: ceil((limit - start) / step).
  int64_t span;
  if (__builtin_sub_overflow(limit, *start, &span)) return std::nullopt;
  return span / *step + (span % *step != 0 ? 1 : 0);
}

}  // namespace

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
      w.op_name = ins.op_name;
      // Counted by BuildIndex.
      const int body = ComputationIndexById(w.body_id);
      const int cond = ComputationIndexById(w.condition_id);
      w.inferred_trip_count = InferTripCount(*this, ci, ins, body, cond);
      if (cond >= 0) {
        for (const Instruction& c : computations[cond].instructions) {
          if (c.integer_value) w.condition_constants.push_back(*c.integer_value);
        }
      }
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
