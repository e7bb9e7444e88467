// The rendezvous store of a job started without torchrun's agent: served by rank 0,
// reached by every rank over TCP, and joined only by those who prove the job's secret
// (Note [Proving the job's secret]).
#pragma once

#include <chrono>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace flatshard::tcp {

// Note [The job's store]
// LibTorch's TCPStore accepts whoever connects, so a job serves its own: rank 0 listens on
// the master port (on that loopback address only when the master is one, or a name for
// one) and runs one
// thread per connection that has proved the secret; a get or wait for a missing key
// waits there, on the server, until the key is set or the client's timeout passes. Every
// rank (rank 0 too) is a client: one connection per store object, one request at a time
// (a mutex), each answered in full. Values added by `add` are kept as decimal text, as
// TCPStore keeps them, so a get reads them the same way. Under torchrun the agent's
// TCPStore serves instead (TORCHELASTIC_USE_AGENT_STORE): only the rings' links prove the
// secret then.

// Serves the store on `port` (rank 0 only) and connects to it; or connects to host:port.
// Throws IoError when rank 0 cannot bind the port or a client cannot reach it, or the
// handshake fails, before `timeout`.
c10::intrusive_ptr<c10d::Store> make_job_store(const std::string& host, int port, bool serve,
                                               const std::string& secret, std::chrono::milliseconds timeout);

}  // namespace flatshard::tcp
