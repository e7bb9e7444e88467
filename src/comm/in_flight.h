// What keeps a device buffer alive while a collective still reads or writes it.
#pragma once

#include <c10/core/Allocator.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

#include <ATen/core/Tensor.h>

#include "flatshard/stream.h"

namespace flatshard::comm {

struct Collective;

// Note [Buffers a collective touches]
// On a device a collective runs on its role's stream, after the host has moved on. A
// buffer it reads or writes may be handed back to the allocator only once the stream it
// was allocated on (the compute stream, where the engine allocates) is ordered after
// the collective: freeing earlier lets the caching allocator give the bytes to a kernel
// that runs while the collective still writes them. The rule, stated once:
//
//   A device buffer that a collective touches is owned by that collective until its
//   event has completed, or until the caller's stream has waited for it (Event::wait),
//   whichever comes first.
//
// It is enforced here, in one place, for both ways the engine lets go of a buffer:
//  - by reference: the op's tensors are kept here (track), so a tensor the engine drops
//    on an exception path (a pending reduction never waited for) outlives its op;
//  - by taking the bytes out from under the tensor (FlatParamGroup::free_storage, which
//    frees a gathered or gradient buffer while saved views keep its storage): the bytes
//    come through retire, which frees them at once unless ops in flight that no caller
//    waited for cover them, and then hands them to those ops (the last to finish frees).
// A caller's wait covers the ops its op waited for on the device too (wait_for: hybrid's
// all-reduce after its reduce-scatter). In the usual schedule the compute stream has
// waited for every collective whose buffer it frees (Engine::unshard, Engine::complete),
// so nothing is held and the allocator reuses the bytes at once, as it would without
// this; only exception paths and teardown keep bytes a little longer. No record_stream:
// the allocator's own tracking frees a block only after a later query finds the other
// stream's work done, which holds every gathered buffer longer in the usual schedule too.
// Not covered: bytes freed after an op was issued but before its worker launched it
// (track runs at launch); the op would then read a storage whose bytes are gone. No
// schedule of the engine frees a buffer before waiting for the ops issued on it, on any
// path but a failure that aborts the communicator.
//
// FLATSHARD_POISON_FREED=1 (a debugging switch) fills every buffer freed through
// FlatParamGroup with 0xFF bytes (NaN in fp32, bf16 and fp16) on the caller's stream
// before it goes (device bytes that an op in flight still holds are left alone, so the
// op's peers never receive poison): a use after free then shows as NaN in the loss or the
// weights rather than as a silent wrong number.
class InFlightBuffers {
 public:
  static InFlightBuffers& instance();

  // A device transport, after issuing `op`: its tensors are kept until `done` has
  // completed or a caller waited for it.
  void track(const std::shared_ptr<DeviceEvent>& done, const Collective& op);
  // A caller's stream now waits for `done`: what it held goes.
  void waited(const DeviceEvent* done);
  // Frees `data` (`bytes` long) now (first filled with 0xFF on the caller's stream when
  // `poison`), or hands it to every op in flight, not waited for, whose buffers overlap it.
  void retire(c10::DataPtr data, std::size_t bytes, bool poison = false);
  // Drops what completed ops hold (a transport calls it once its streams are drained).
  void release_completed();
  // Ops still tracked (tests).
  std::size_t tracked();

 private:
  struct Entry {
    std::shared_ptr<DeviceEvent> done;  // kept, so that dropping the op's Work keeps its buffers
    std::vector<std::pair<std::uintptr_t, std::uintptr_t>> ranges;  // [begin, end) bytes
    // What the op waited for on the device: kept alive, so that no later event can take the
    // address of one that completed and be taken for it.
    std::vector<std::shared_ptr<DeviceEvent>> after;
    std::vector<at::Tensor> tensors;
    std::vector<std::shared_ptr<c10::DataPtr>> retired;
  };
  // Removes the entries whose op completed, and returns them, so that
  // what they hold is released after the lock is let go.
  std::vector<Entry> prune_locked();

  std::mutex mutex_;
  std::vector<Entry> entries_;  // guarded by mutex_
};

// FLATSHARD_POISON_FREED is set to something other than 0.
bool poison_freed();

}  // namespace flatshard::comm
