// Run-time choice of a kernel's instruction set, shared by the C++ operators.
//
// An operator lists its instruction sets best first, the last one portable (always supported).
// The choice is made once, on first use, and kept in an atomic slot that a setter may overwrite
// (tests and flags narrow it to a named path).
#pragma once

#include <atomic>

namespace airserve_isa {

// The index of the first of `count` instruction sets that `supported` accepts; the last index
// when none before it is.
template <typename Supported>
int best(int count, Supported supported) {
  for (int i = 0; i < count - 1; ++i)
    if (supported(i)) return i;
  return count - 1;
}

// `slot`'s instruction set, resolved with `best` the first time (slot < 0).
template <typename Supported>
int current(std::atomic<int>& slot, int count, Supported supported) {
  int isa = slot.load();
  if (isa < 0) {
    isa = best(count, supported);
    slot.store(isa);
  }
  return isa;
}

}  // namespace airserve_isa
