// Proving a job's secret on a TCP connection: the rendezvous store's and the rings' links.
#pragma once

#include <optional>
#include <string>

#include "src/tcp/socket.h"

namespace flatshard::tcp {

// Note [Proving the job's secret]
// Whoever can reach a job's ports could otherwise read and set its store's keys (ring
// addresses, NCCL ids) or open a ring link. Every connection to the store and to a ring
// listener therefore starts with a mutual challenge: the listening side sends a magic and
// a fresh 32-byte nonce; the connecting side answers with its own nonce and
// HMAC-SHA256(secret, "client " purpose, both nonces); the listening side checks it in
// constant time and, only then, answers HMAC-SHA256(secret, "server " purpose, both
// nonces), which the connecting side checks in turn. The secret never crosses the wire,
// and a recorded exchange proves nothing later (fresh nonces). A connection that fails
// the check (the wrong or no secret, garbage, silence past a short deadline) is closed
// and logged with its address, and the listener goes on waiting for the job's own.
// The secret is FLATSHARD_JOB_SECRET: flatshard-run makes one for a job on one machine;
// a job across machines must be given one (init refuses to listen beyond loopback
// without it). With none (a job on one machine started by another launcher), the
// exchange runs with an empty key: it still refuses garbage and other protocols.

// What a proof is for: one for the store cannot be taken for a ring link.
inline constexpr const char* kStorePurpose = "rendezvous store";
inline constexpr const char* kRingPurpose = "ring link";

// FLATSHARD_JOB_SECRET, or "" when unset.
std::string job_secret();

// Whether the launcher's environment says every rank of the job runs on this machine
// (torchrun's GROUP_WORLD_SIZE=1, LOCAL_WORLD_SIZE equal to WORLD_SIZE, Open MPI's local
// size equal to its size, Slurm's node count of 1). Such a job's store and rings use the
// loopback interface whatever MASTER_ADDR names (torchrun sets it to the host's name), and
// need no secret.
bool job_on_one_machine();
// Whether the launcher's variables say the job spans machines (LOCAL_WORLD_SIZE below
// WORLD_SIZE, several torchrun agents or Slurm nodes in the step, Open MPI's local size
// below its size). Neither may hold: a job started by hand says nothing.
bool job_spans_machines();
// Whether `master` is a host name (not an address, nor localhost) that this machine
// resolves to a loopback address: its own name where /etc/hosts maps it to 127.0.1.1, as
// Debian's does. Rank 0 would then serve, and the ring advertise, where no other machine
// reaches. (A loopback address given as such, or localhost, says the job's "machines" are
// this one, as when nodes are simulated on one host.)
bool loopback_by_name(const std::string& master);

// A new secret: 32 bytes from the operating system's random source, in hex.
std::string make_secret();

// The connecting side: proves `secret` for `purpose` and checks the listener's proof.
// Throws IoError (Closed, naming the likely cause and with `refused` set, when the listener
// refused the proof, could not prove the secret back or speaks another protocol; without
// `refused` when the connection broke before the listener answered).
void prove_secret(Socket& s, const std::string& secret, const std::string& purpose,
                  Clock::time_point deadline);

// The listening side: nullopt when the peer proved `secret` for `purpose` (and has been
// sent the listener's proof), else why not. Never throws for what a peer sends or
// withholds; at most waits until `deadline`.
std::optional<std::string> check_secret(Socket& s, const std::string& secret, const std::string& purpose,
                                        Clock::time_point deadline);

// "address:port" of the socket's peer, for logs.
std::string peer_address(const Socket& s);

}  // namespace flatshard::tcp
