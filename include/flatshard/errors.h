// FlatShard's typed errors.
//
// Two kinds of failure (see docs/errors.md):
//  - a user or environment problem throws one of the types below; its message names
//    the rank and world size, the operation (and its sequence number for collectives)
//    and what to do;
//  - a broken internal invariant is FLATSHARD_ASSERT (src/errors.h), never caught.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace flatshard {

// Base of every error FlatShard throws on purpose.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The launch environment or init options are missing, malformed or contradictory.
// `variable()` names the setting to fix (an environment variable or an option).
class InitError : public Error {
 public:
  InitError(std::string variable, const std::string& message)
      : Error(message), variable_(std::move(variable)) {}
  const std::string& variable() const noexcept { return variable_; }

 private:
  std::string variable_;
};

// Rendezvous failed: the store could not be created or reached (port in use,
// unreachable master, peers that never arrived).
class RendezvousError : public Error {
 public:
  using Error::Error;
};

// A collective was called with arguments that break its contract (shapes, dtypes,
// devices, root). Nothing was sent.
class InvalidArgument : public Error {
 public:
  using Error::Error;
};

// Training this model in the chosen mode needs more memory per rank than the budget
// it was given (FullyShardOptions::memory_budget). Nothing was allocated.
class MemoryBudgetError : public Error {
 public:
  MemoryBudgetError(std::int64_t need_bytes, std::int64_t budget_bytes, const std::string& message)
      : Error(message), need_(need_bytes), budget_(budget_bytes) {}
  std::int64_t need_bytes() const noexcept { return need_; }
  std::int64_t budget_bytes() const noexcept { return budget_; }

 private:
  std::int64_t need_, budget_;
};

// Gradients held NaN or Inf after backward, with NonFiniteGrads::Raise. Every rank
// throws it (the check is collective); ranks() are the ranks whose gradients were not
// finite.
class NonFiniteGradError : public Error {
 public:
  NonFiniteGradError(std::vector<int> ranks, std::int64_t backward, const std::string& message)
      : Error(message), ranks_(std::move(ranks)), backward_(backward) {}
  const std::vector<int>& ranks() const noexcept { return ranks_; }
  std::int64_t backward() const noexcept { return backward_; }  // 1 for the first backward

 private:
  std::vector<int> ranks_;
  std::int64_t backward_;
};

// A collective failed after it started: a peer died or closed its connection, the
// ranks disagreed about which collective came next, or the deadline passed.
// Once a communicator has thrown this, every later call on it throws too.
class CommError : public Error {
 public:
  enum class Kind { PeerLost, Timeout, Mismatch, Aborted };
  CommError(Kind kind, int rank, int world_size, std::string op, std::uint64_t seq, int peer,
            const std::string& message)
      : Error(message),
        kind_(kind),
        rank_(rank),
        world_size_(world_size),
        op_(std::move(op)),
        seq_(seq),
        peer_(peer) {}

  Kind kind() const noexcept { return kind_; }
  int rank() const noexcept { return rank_; }
  int world_size() const noexcept { return world_size_; }
  const std::string& op() const noexcept { return op_; }
  std::uint64_t seq() const noexcept { return seq_; }
  // The rank whose connection failed or who was being waited for; -1 when unknown.
  int peer() const noexcept { return peer_; }

 private:
  Kind kind_;
  int rank_;
  int world_size_;
  std::string op_;
  std::uint64_t seq_;
  int peer_;
};

const char* to_string(CommError::Kind kind);

}  // namespace flatshard
