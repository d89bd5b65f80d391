// libFuzzer entry point for the HloModuleProto reader.
//
// Every input must either parse or raise txe::hlo::ParseError; anything else
// (a crash, a sanitizer report, another exception, a hang) is a bug. A parsed
// module is also run through every analysis and printer, and the first bytes
// are tried as a standalone OpSharding, so those paths see hostile data too.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "hlo_reader.h"

namespace {

void Exercise(const txe::hlo::Module& m, std::size_t size) {
  // The cost bounds of hlo_reader.h.
  const std::size_t limit =
      txe::hlo::kBudgetBytesPerInputByte * size + txe::hlo::kBudgetBaseBytes;
  if (m.budget_limit != limit || m.budget_used > limit) std::abort();
  int64_t edges = 0;
  for (const auto& comp : m.computations) {
    for (const auto& ins : comp.instructions) {
      edges += static_cast<int64_t>(ins.called_computation_ids.size());
    }
  }
  if (m.while_walk_steps >
      txe::hlo::kWhileWalkStepsPerEdge *
          (static_cast<int64_t>(m.computations.size()) + edges)) {
    std::abort();
  }
  std::size_t sink = 0;
  sink += static_cast<std::size_t>(m.NumInstructions());
  sink += m.EntryParameters().size();
  for (const auto& c : m.Collectives()) sink += c.kind.size();
  for (const auto& h : m.HostTransfers()) sink += h.reason.size();
  for (const auto& w : m.WhileLoops()) {
    sink += static_cast<std::size_t>(w.body_instruction_count);
  }
  sink += static_cast<std::size_t>(m.ConstantsBytes());
  for (int ci = 0; ci < static_cast<int>(m.computations.size()); ++ci) {
    const auto& comp = m.computations[ci];
    for (const auto& ins : comp.instructions) {
      sink += ins.shape.ToString().size();
      sink += static_cast<std::size_t>(ins.shape.byte_size());
      if (ins.sharding) sink += ins.sharding->text.size();
      // Every id resolves, in its own computation first.
      if (m.InstructionById(ins.id) == nullptr) std::abort();
      if (m.InstructionLocation(ins.id, ci).first != ci) std::abort();
    }
    if (m.ComputationIndexByName(comp.name) < 0) std::abort();
    if (m.ComputationIndexById(comp.id) < 0) std::abort();
  }
  // Keep the work observable.
  if (sink == static_cast<std::size_t>(-1)) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, std::size_t size) {
  try {
    const txe::hlo::Module m = txe::hlo::ParseModule(data, size);
    Exercise(m, size);
  } catch (const txe::hlo::ParseError& e) {
    // Malformed input is expected; the message must name the offset.
    if (std::string(e.what()).find("byte offset") == std::string::npos) {
      std::abort();
    }
    if (e.offset() > size) std::abort();
  }
  try {
    const txe::hlo::Sharding s = txe::hlo::ParseSharding(data, size);
    if (s.text.empty()) std::abort();
  } catch (const txe::hlo::ParseError& e) {
    if (e.offset() > size) std::abort();
  }
  return 0;
}
