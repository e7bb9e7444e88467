// The links of a TCP ring: for each channel a connection to the next rank and one from
// the previous, made through the world's store, and whether each link copies message
// bodies directly (Note [Direct copies]). The ring algorithms that use them are in ring.cpp.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flatshard/communicator.h"
#include "flatshard/world.h"
#include "src/tcp/socket.h"

namespace flatshard::comm {

// Note [Direct copies]
// Through a socket every byte is copied twice (into the kernel by the sender, out of it
// by the receiver) in 64 KiB packets. Between two processes of one machine the
// receiver can instead copy the body once, straight out of the sender's memory, with
// process_vm_readv. The socket still carries each StepHead, followed by the address of
// the body in the sender instead of the body; the receiver copies, then answers with
// an 8-byte acknowledgement (the op's number on the channel), and the sender waits for
// it before the step returns, since the caller may reuse the buffer as soon as it does.
// Every check, deadline and failure path stays that of the socket: a peer that dies
// closes its connections (or its memory vanishes under the copy: ESRCH), and abort()
// still wakes every wait by shutting the sockets.
// Whether a link copies directly is agreed once per link at creation: the sender
// offers its pid and the address of a random 16-byte nonce, and the receiver accepts
// only if it reads the nonce back. That one test covers other machines, other pid
// namespaces, and kernels or sandboxes that refuse the call (Yama's ptrace_scope 1, for
// one, lets a process read only its descendants; such links stay on the socket).
// The connections of one stream, and its scratch memory. Touched only by that
// stream's worker, one op at a time.
struct Channel {
  tcp::Socket to_next;
  tcp::Socket from_prev;
  std::uint64_t seq = 0;    // ops run on this channel so far
  bool direct_out = false;  // the next rank copies our bodies out of our memory
  bool direct_in = false;   // we copy the previous rank's bodies out of its memory
  pid_t prev_pid = 0;
  // Reduction scratch, kept between ops so that steady-state steps allocate (and
  // fault in) nothing; it grows to the largest segment seen.
  std::unique_ptr<char[]> scratch_[3];
  std::size_t scratch_bytes_[3] = {0, 0, 0};

  char* scratch(int index, std::size_t bytes) {
    if (scratch_bytes_[index] < bytes) {
      scratch_[index].reset(new char[bytes]);  // uninitialized: every byte is written before it is read
      scratch_bytes_[index] = bytes;
    }
    return scratch_[index].get();
  }
};

// Connects this rank's `num_channels` links (each channel: to the next rank, from the
// previous), publishing this rank's address under `prefix` in the world's store, and
// agrees on direct copies. Throws RendezvousError naming the rank, the communicator and
// what failed. World size above 1.
std::vector<Channel> connect_ring(const World& world, const CommunicatorOptions& options, int num_channels,
                                  const std::string& prefix);

}  // namespace flatshard::comm
