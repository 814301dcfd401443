// What portep._C shares with portep._ll_torch (the LL fast path, built apart and possibly as another C++ standard):
// a Buffer's lockstep counters and its LL plan table, handed over once as a capsule named kLLSharedCapsule whose
// LLShared starts with a magic, a version and the sizes of everything it points to. The fast path checks them all
// when a Buffer installs it (ll_shared_check) and refuses a capsule of another layout, naming both.
//
// LockstepState lives here, in one native object, because both call paths read and advance it: the Python path
// through its binding (python/portep/lockstep.py keeps the protocol around it), the fast path directly.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <string>

namespace portep::cuda {
struct LLPlanTable;  // gpu_kernels/cuda/ll_plan.h
}

namespace portep {

// The counters of a Buffer's call protocol (python/portep/lockstep.py, Lockstep, says what each means).
struct LockstepState {
  uint64_t seq = 0;       // collective calls this rank made or refused since the last resync
  uint64_t refused = 0;   // this rank's refusals
  uint64_t resolved = 0;  // ... of which every peer is known to have refused too
  uint8_t sent = 0;       // the current call sent something
  uint8_t broken = 0;     // this rank is out of step (Lockstep.broken says why)
  uint8_t reserved[6] = {};

  // Nothing stops a call here: in step, and no refusal of this rank's that peers have not matched.
  bool in_step() const { return !broken && refused == resolved; }
  void begin() {
    ++seq;
    sent = 0;
  }
  // A call that began, passed the checks and launched in one step.
  void made_call() {
    ++seq;
    sent = 1;
  }
};
static_assert(sizeof(LockstepState) == 32 && offsetof(LockstepState, sent) == 24, "LockstepState's layout");

constexpr const char* kLLSharedCapsule = "portep._C.LLShared";

struct LLShared {
  static constexpr uint32_t kMagic = 0x534C4C50;  // "PLLS" in memory
  static constexpr uint32_t kVersion = 1;         // bump on any change to this struct or to what it points to
  uint32_t magic = kMagic;
  uint32_t version = kVersion;
  uint32_t size = sizeof(LLShared);
  uint32_t lockstep_size = sizeof(LockstepState);
  uint64_t table_size = 0;             // sizeof(cuda::LLPlanTable) as portep._C was built (0: no table)
  cuda::LLPlanTable* table = nullptr;  // null: no GPU kernels, every fast call declines
  LockstepState* lockstep = nullptr;   // never null
};
static_assert(sizeof(LLShared) == 40 && offsetof(LLShared, table) == 24 && offsetof(LLShared, lockstep) == 32,
              "LLShared's layout (kVersion)");

// Empty if `s` is what this build expects (table_size: sizeof(LLPlanTable) here), else what differs.
inline std::string ll_shared_check(const LLShared* s, uint64_t table_size) {
  auto mismatch = [](const char* what, uint64_t got, uint64_t want) {
    return std::string(what) + " " + std::to_string(got) + ", expected " + std::to_string(want);
  };
  if (!s) return "no LLShared";
  if (s->magic != LLShared::kMagic) return mismatch("magic", s->magic, LLShared::kMagic);
  if (s->version != LLShared::kVersion) return mismatch("version", s->version, LLShared::kVersion);
  if (s->size != sizeof(LLShared)) return mismatch("size", s->size, sizeof(LLShared));
  if (s->lockstep_size != sizeof(LockstepState))
    return mismatch("LockstepState size", s->lockstep_size, sizeof(LockstepState));
  if (!s->lockstep) return "no LockstepState";
  if (s->table && s->table_size != table_size) return mismatch("LLPlanTable size", s->table_size, table_size);
  return "";
}

}  // namespace portep
