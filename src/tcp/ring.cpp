// The CPU transport: for each stream, a ring of TCP connections (this rank sends to
// rank+1 and receives from rank-1). Ring algorithms move the minimum bytes per rank:
//   all_gather      (N-1)/N of the buffer
//   reduce_scatter  (N-1)/N of the buffer (never an all-reduce in disguise)
//   all_reduce      2(N-1)/N: reduce-scatter then all-gather
//   broadcast       the buffer once per rank, pipelined in slices
// Every message starts with a StepHead naming the op, its per-channel number and the
// body size; the receiver checks it before reading the body, so ranks that disagree
// on the next collective fail with Mismatch instead of corrupting each other.
// Between ranks on one machine the body does not go through the socket: see Note
// [Direct copies] (ring_links.h). The connections themselves are made in ring_links.cpp.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <sys/uio.h>
#include <unistd.h>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "flatshard/shard.h"
#include "optim/step_kernels_cpu.h"
#include "src/comm/backend.h"
#include "src/errors.h"
#include "src/tcp/ring_links.h"
#include "src/tcp/socket.h"

namespace flatshard::comm {
namespace {

using tcp::Clock;
using tcp::IoError;
using tcp::Socket;

constexpr std::uint32_t kStepMagic = 0x46534852;  // "FSHR"
constexpr std::size_t kBroadcastSliceBytes = std::size_t{1} << 20;
constexpr std::int64_t kReducePieceBytes = std::int64_t{512} << 10;
constexpr std::int64_t kDirectPieceBytes = std::int64_t{4} << 20;

struct StepHead {
  std::uint32_t magic;
  std::uint8_t op;
  std::uint8_t signature[3];  // dtype, reduce op, broadcast root (mod 256): see signature_of
  std::uint64_t channel_seq;  // 1, 2, ... per channel
  std::uint64_t body_bytes;
};
static_assert(sizeof(StepHead) == 24, "StepHead is sent as raw bytes");

std::size_t bytes_of(const at::Tensor& t, const ShardRange& r) {
  return static_cast<std::size_t>(r.numel) * t.element_size();
}

char* ptr_of(const at::Tensor& t, const ShardRange& r) {
  return static_cast<char*>(t.data_ptr()) + r.offset * t.element_size();
}

// dst[i] = a[i] + b[i], divided by `divisor` when it is not 1 (floating types: the sum is
// rounded to the type first, so the result is that of adding, then dividing in place).
// fp32 and bf16 run the step kernels' build for this CPU's vector width (optim/
// step_kernels_cpu.h): the same roundings as c10's types, so the same bits. A loop over
// c10::BFloat16 compiles to one conversion and rounding per value, which made bf16's sums
// 2-3 times fp32's time per byte: a bf16 communication hook's all-reduce took as long as
// fp32's of the same values. On the stream's own thread, with no thread pool.
void add(at::ScalarType dtype, void* dst, const void* a, const void* b, std::int64_t numel, int divisor = 1) {
  const auto& kernels = optim::kernels::cpu::chosen();
  if (dtype == at::kFloat) {
    kernels.add_f32(static_cast<float*>(dst), static_cast<const float*>(a), static_cast<const float*>(b),
                    numel, divisor);
    return;
  }
  if (dtype == at::kBFloat16) {
    kernels.add_bf16(static_cast<std::uint16_t*>(dst), static_cast<const std::uint16_t*>(a),
                     static_cast<const std::uint16_t*>(b), numel, divisor);
    return;
  }
  AT_DISPATCH_ALL_TYPES_AND(at::kHalf, dtype, "flatshard_ring_add", [&] {
    auto* d = static_cast<scalar_t*>(dst);
    const auto* x = static_cast<const scalar_t*>(a);
    const auto* y = static_cast<const scalar_t*>(b);
    if (divisor == 1) {
      for (std::int64_t i = 0; i < numel; ++i) d[i] = x[i] + y[i];
    } else {
      const auto n = static_cast<scalar_t>(divisor);
      for (std::int64_t i = 0; i < numel; ++i) d[i] = static_cast<scalar_t>(x[i] + y[i]) / n;
    }
  });
}

// Splits one ring step into pieces: the segment sent (`out_numel`) into pieces of up to
// `out_piece` elements, the one received (`in_numel`) into pieces of up to `in_piece`, and
// calls f(out_begin, out_count, sends, in_begin, in_count, receives) for each, in order.
// Both ends of a link split the segment it carries alike (the same segment, the link's
// own piece size), so a link carries as many messages as its receiver expects, whatever
// the sizes of the ranks' other segments and links; where one side has fewer pieces, the
// last calls only send or only receive. A segment is at least one message, if empty.
template <typename F>
void for_pieces(std::int64_t out_numel, std::int64_t out_piece, std::int64_t in_numel, std::int64_t in_piece,
                const F& f) {
  const auto count = [](std::int64_t numel, std::int64_t piece) {
    return std::max<std::int64_t>(1, (numel + piece - 1) / piece);
  };
  const std::int64_t outs = count(out_numel, out_piece), ins = count(in_numel, in_piece);
  for (std::int64_t p = 0; p < std::max(outs, ins); ++p) {
    const std::int64_t out_begin = std::min(out_numel, p * out_piece);
    const std::int64_t in_begin = std::min(in_numel, p * in_piece);
    f(out_begin, std::min(out_numel - out_begin, out_piece), p < outs, in_begin,
      std::min(in_numel - in_begin, in_piece), p < ins);
  }
}

// Direct links pay a round trip per message, so they move bigger pieces.
std::int64_t piece_numel(bool direct, std::int64_t element_size) {
  return std::max<std::int64_t>(1, (direct ? kDirectPieceBytes : kReducePieceBytes) / element_size);
}

class TcpRingBackend final : public Backend {
 public:
  TcpRingBackend(int rank, int world_size, std::vector<Channel> channels,
                 c10::intrusive_ptr<c10d::Store> store = {}, std::string failure_key = {})
      : rank_(rank),
        world_size_(world_size),
        channels_(std::move(channels)),
        store_(std::move(store)),
        failure_key_(std::move(failure_key)) {
    copies_directly_ = !channels_.empty() && std::all_of(channels_.begin(), channels_.end(),
                                                         [](const Channel& ch) { return ch.direct_in; });
  }

  bool copies_directly() const override { return copies_directly_; }

  std::shared_ptr<DeviceEvent> run(const Collective& op, int channel) override {
    FLATSHARD_ASSERT((channel >= 0 && channel < static_cast<int>(channels_.size())) || world_size_ == 1,
                     "channel out of range");
    if (aborted_.load()) {
      throw TransportFailure(CommError::Kind::Aborted, -1,
                             "the communicator was aborted by an earlier failure");
    }
    if (world_size_ == 1) {
      run_on_one_rank(op);
      return nullptr;
    }
    Channel& ch = channels_[channel];
    ch.seq += 1;
    try {
      switch (op.kind) {
        case OpKind::AllGather: all_gather(ch, op, op.output); break;
        case OpKind::ReduceScatter: reduce_scatter(ch, op, op.input, op.output); break;
        case OpKind::AllReduce: all_reduce(ch, op); break;
        case OpKind::Broadcast: broadcast(ch, op); break;
        case OpKind::Barrier: barrier(ch, op); break;
        case OpKind::NeighborExchange: neighbor_exchange(ch, op); break;
      }
    } catch (const IoError& e) {
      // A failure on our own side (abort() shut the sockets) is not the peer's fault.
      if (aborted_.load()) {
        throw TransportFailure(CommError::Kind::Aborted, e.peer,
                               fmt::format("the communicator was aborted while this op ran ({})", e.detail));
      }
      const auto kind =
          e.kind == IoError::Kind::Timeout ? CommError::Kind::Timeout : CommError::Kind::PeerLost;
      const auto first =
          first_failure(e.peer, fmt::format("{} on rank {} in {} (op {} on its stream): {}", to_string(kind),
                                            rank_, to_string(op.kind), ch.seq, e.detail));
      if (first && first->second.rfind(to_string(CommError::Kind::Mismatch), 0) == 0) {
        // Our neighbour closed because the ranks issued different collectives: say that.
        throw TransportFailure(
            CommError::Kind::Mismatch, first->first,
            fmt::format("{}; rank {} then aborted and {}", first->second, e.peer, e.detail));
      }
      if (first && kind != CommError::Kind::Timeout &&
          first->second.rfind(to_string(CommError::Kind::Timeout), 0) == 0) {
        // Our neighbour closed because a rank timed out first, waiting for one that is alive
        // but stuck or slow: the cascade is that timeout, not a lost peer.
        throw TransportFailure(
            CommError::Kind::Timeout, first->first,
            fmt::format("{}; rank {} then aborted and {}", first->second, e.peer, e.detail));
      }
      if (first && first->first != e.peer && first->first != rank_) {
        // Our neighbour closed because it had lost another rank: name that one.
        throw TransportFailure(kind, first->first,
                               fmt::format("rank {} was lost first ({}); rank {} then aborted and {}",
                                           first->first, first->second, e.peer, e.detail));
      }
      throw TransportFailure(kind, e.peer, e.detail);
    } catch (const TransportFailure& f) {
      // A mismatch is recorded as the first failure too, so that the ranks failing in the
      // cascade it starts report the mismatch, not a lost peer that is alive.
      if (f.kind == CommError::Kind::Mismatch && !aborted_.load()) {
        first_failure(f.peer, fmt::format("{} seen by rank {} in {} (op {} on its stream): {}",
                                          to_string(f.kind), rank_, to_string(op.kind), ch.seq, f.what()));
      }
      throw;
    }
    return nullptr;
  }

  // Note [The first failure]
  // When a rank dies, its neighbours see it; the rest only see their neighbours abort.
  // The first rank to see a failure records "<lost rank>|<what>" in the store before it
  // aborts, so that ranks failing in the cascade can name the lost rank too (or, where the
  // first failure was a mismatch, report the mismatch). Bounded by a short wait: the store
  // may live in the process that died, or in rank 0's, which may have exited since.
  std::optional<std::pair<int, std::string>> first_failure(int peer, const std::string& what) {
    if (!store_ || failure_key_.empty()) return std::nullopt;
    struct Shared {
      std::mutex mu;
      std::condition_variable cv;
      bool done = false;
      std::string value;
    };
    auto shared = std::make_shared<Shared>();
    auto store = store_;
    const std::string key = failure_key_, mine = fmt::format("{}|{}", peer, what);
    std::thread([shared, store, key, mine] {
      std::string value;
      try {
        const auto v = store->compareSet(key, {}, std::vector<std::uint8_t>(mine.begin(), mine.end()));
        value.assign(v.begin(), v.end());
      } catch (...) {
      }
      std::lock_guard<std::mutex> lock(shared->mu);
      shared->value = value;
      shared->done = true;
      shared->cv.notify_all();
    }).detach();
    std::unique_lock<std::mutex> lock(shared->mu);
    if (!shared->cv.wait_for(lock, std::chrono::seconds(2), [&] { return shared->done; }) ||
        shared->value.empty()) {
      return std::nullopt;
    }
    const auto bar = shared->value.find('|');
    if (bar == std::string::npos) return std::nullopt;
    try {
      return std::make_pair(std::stoi(shared->value.substr(0, bar)), shared->value.substr(bar + 1));
    } catch (...) {
      return std::nullopt;
    }
  }

  void abort() override {
    std::lock_guard<std::mutex> lock(abort_mutex_);
    if (aborted_.exchange(true)) return;
    // Shutting the sockets wakes every blocked op here and, through closed
    // connections, our neighbours: the failure travels round the ring at once
    // instead of each rank waiting out its deadline.
    for (Channel& ch : channels_) {
      ch.to_next.shutdown();
      ch.from_prev.shutdown();
    }
  }

 private:
  int next() const { return (rank_ + 1) % world_size_; }
  int prev() const { return (rank_ + world_size_ - 1) % world_size_; }
  int mod(int i) const { return ((i % world_size_) + world_size_) % world_size_; }

  // The previous rank's buffer into the first half of the output, the next rank's into
  // the second: one step with the ring (direct copies apply), one against it. Of two
  // ranks each is the other's both neighbours: one step, and the half copied.
  void neighbor_exchange(Channel& ch, const Collective& op) {
    const std::size_t bytes = op.input.nbytes();
    char* out = static_cast<char*>(op.output.data_ptr());
    step(ch, op, op.input.data_ptr(), bytes, true, out, bytes, true);
    if (world_size_ == 2) {
      std::memcpy(out + bytes, out, bytes);
      return;
    }
    step(ch, op, op.input.data_ptr(), bytes, true, out + bytes, bytes, true, /*forward=*/false);
  }

  // What else besides kind and size the ranks must agree on: element type, reduction
  // and root. A difference is a user bug that sizes alone would not reveal (float vs
  // int32 of one size, Sum on one rank and Avg on another).
  static std::array<std::uint8_t, 3> signature_of(const Collective& op) {
    const at::Tensor& t = op.output.defined() ? op.output : op.input;
    const bool reduces = op.kind == OpKind::ReduceScatter || op.kind == OpKind::AllReduce;
    return {static_cast<std::uint8_t>(t.defined() ? static_cast<int>(t.scalar_type()) + 1 : 0),
            static_cast<std::uint8_t>(reduces ? static_cast<int>(op.reduce) + 1 : 0),
            static_cast<std::uint8_t>(op.kind == OpKind::Broadcast ? op.root % 256 : 0)};
  }

  static std::string describe_signature(const std::uint8_t* s) {
    return fmt::format("{}{}{}", s[0] ? c10::toString(static_cast<at::ScalarType>(s[0] - 1)) : "no data",
                       s[1] ? (s[1] == 1 ? ", sum" : ", avg") : "",
                       s[2] ? fmt::format(", root {}", s[2]) : std::string());
  }

  // One ring step: send `send_bytes` to the next rank while receiving `recv_bytes`
  // from the previous one, each message led by a StepHead that the receiver checks.
  // Against the ring (`forward` false: to the previous rank, from the next) the same
  // connections carry the bodies the other way, always through the sockets.
  void step(Channel& ch, const Collective& op, const void* send, std::size_t send_bytes, bool do_send,
            void* recv, std::size_t recv_bytes, bool do_recv, bool forward = true) {
    const auto sig = signature_of(op);
    StepHead out{
        kStepMagic, static_cast<std::uint8_t>(op.kind), {sig[0], sig[1], sig[2]}, ch.seq, send_bytes};
    StepHead in{};
    const bool direct_out = forward && ch.direct_out, direct_in = forward && ch.direct_in;
    Socket* out_socket = forward ? &ch.to_next : &ch.from_prev;
    Socket* in_socket = forward ? &ch.from_prev : &ch.to_next;
    const int sender = forward ? prev() : next();
    // Direct links carry the body's address in place of the body (Note [Direct copies]).
    std::uint64_t out_address = reinterpret_cast<std::uintptr_t>(send), in_address = 0;
    const tcp::Parts out_parts = direct_out ? tcp::Parts{&out, sizeof(out), &out_address, sizeof(out_address)}
                                            : tcp::Parts{&out, sizeof(out), send, send_bytes};
    const tcp::MutableParts in_parts =
        direct_in ? tcp::MutableParts{&in, sizeof(in), &in_address, sizeof(in_address)}
                  : tcp::MutableParts{&in, sizeof(in), recv, recv_bytes};
    tcp::exchange(
        do_send ? out_socket : nullptr, out_parts, do_recv ? in_socket : nullptr, in_parts, op.deadline, [&] {
          if (in.magic != kStepMagic || in.op != static_cast<std::uint8_t>(op.kind) ||
              in.channel_seq != ch.seq || in.body_bytes != recv_bytes) {
            const char* their_op = in.magic == kStepMagic ? to_string(static_cast<OpKind>(in.op)) : "garbage";
            throw TransportFailure(
                CommError::Kind::Mismatch, sender,
                fmt::format("rank {} sent {} (op {} on this stream, {} bytes) where this rank expected "
                            "{} (op {} on this stream, {} bytes): the ranks issued different "
                            "collectives or sizes",
                            sender, their_op, in.channel_seq, in.body_bytes, to_string(op.kind), ch.seq,
                            recv_bytes));
          }
          if (std::memcmp(in.signature, sig.data(), sig.size()) != 0) {
            throw TransportFailure(
                CommError::Kind::Mismatch, sender,
                fmt::format(
                    "rank {} issued {} (op {} on this stream) with {} where this rank used {}: the ranks "
                    "issued different collectives",
                    sender, to_string(op.kind), ch.seq, describe_signature(in.signature),
                    describe_signature(sig.data())));
          }
        });
    if (!forward) return;
    if (do_recv && ch.direct_in) {
      copy_from_prev(ch, recv, in_address, recv_bytes);
      const std::uint64_t ack = ch.seq;
      ch.from_prev.send_all(&ack, sizeof(ack), op.deadline);
    }
    if (do_send && ch.direct_out) {
      std::uint64_t ack = 0;
      ch.to_next.recv_all(&ack, sizeof(ack), op.deadline);
      if (ack != ch.seq) {
        throw TransportFailure(CommError::Kind::Mismatch, next(),
                               fmt::format("rank {} acknowledged op {} on this stream where this rank sent "
                                           "op {}: the ranks issued different collectives",
                                           next(), ack, ch.seq));
      }
    }
  }

  // Copies `bytes` at `address` in the previous rank's memory to `dst`.
  void copy_from_prev(Channel& ch, void* dst, std::uint64_t address, std::size_t bytes) {
    std::size_t done = 0;
    while (done < bytes) {
      iovec local{static_cast<char*>(dst) + done, bytes - done};
      iovec remote{reinterpret_cast<void*>(static_cast<std::uintptr_t>(address + done)), bytes - done};
      const ssize_t got = ::process_vm_readv(ch.prev_pid, &local, 1, &remote, 1, 0);
      if (got > 0) {
        done += static_cast<std::size_t>(got);
      } else if (got < 0 && errno == EINTR) {
        continue;
      } else {
        const int error = got < 0 ? errno : EIO;
        throw IoError{IoError::Kind::Closed, prev(),
                      fmt::format("copying {} bytes out of rank {} (pid {}) failed: {}", bytes, prev(),
                                  ch.prev_pid, std::strerror(error))};
      }
    }
  }

  // Ring all-gather over `buffer` (segments by shard_range); this rank's segment is
  // already in place.
  // all_reduce runs it from its second step (`first_step` 1), having done the first.
  void all_gather(Channel& ch, const Collective& op, const at::Tensor& buffer, int first_step = 0) {
    const std::int64_t numel = buffer.numel();
    if (op.kind == OpKind::AllGather) {
      const ShardRange mine = shard_range(numel, world_size_, rank_);
      char* slot = ptr_of(buffer, mine);
      if (slot != op.input.data_ptr() && mine.numel > 0) {
        std::memcpy(slot, op.input.data_ptr(), bytes_of(buffer, mine));
      }
    }
    for (int s = first_step; s < world_size_ - 1; ++s) {
      const ShardRange out = shard_range(numel, world_size_, mod(rank_ - s));
      const ShardRange in = shard_range(numel, world_size_, mod(rank_ - s - 1));
      step(ch, op, ptr_of(buffer, out), bytes_of(buffer, out), true, ptr_of(buffer, in), bytes_of(buffer, in),
           true);
    }
  }

  // Ring reduce-scatter: at step s this rank sends the partial sum of segment
  // (rank-s-1) and receives the partial sum of segment (rank-s-2); after N-1 steps
  // it holds the full sum of its own segment. `input` is only read, each segment
  // once, and only this rank's segment of `output` is written, so output may alias
  // input (all_reduce runs it in place).
  //
  // Each step moves its segment in pieces: the piece to send is summed just before
  // it goes, so the additions overlap the kernel's sending of earlier pieces.
  // Received partial sums ping-pong between two scratch buffers owned by the channel.
  void reduce_scatter(Channel& ch, const Collective& op, const at::Tensor& input, const at::Tensor& output) {
    const char* partial = reduce_scatter_steps(ch, op, input);
    const ShardRange mine = shard_range(input.numel(), world_size_, rank_);
    const auto dtype = input.scalar_type();
    const bool fused_avg = op.reduce == ReduceOp::Avg && at::isFloatingType(dtype);
    add(dtype, output.data_ptr(), partial, ptr_of(input, mine), mine.numel, fused_avg ? world_size_ : 1);
    if (op.reduce == ReduceOp::Avg && !fused_avg) output.div_(world_size_);
  }

  // The reduce-scatter's N-1 steps; returns the scratch holding the other ranks' partial
  // sum of this rank's segment (this rank's own values not yet added).
  const char* reduce_scatter_steps(Channel& ch, const Collective& op, const at::Tensor& input) {
    const std::int64_t numel = input.numel();
    const auto dtype = input.scalar_type();
    const std::int64_t elem = input.element_size();
    const std::int64_t out_piece = piece_numel(ch.direct_out, elem),
                       in_piece = piece_numel(ch.direct_in, elem);
    const std::size_t max_bytes = static_cast<std::size_t>(shard_range(numel, world_size_, 0).numel * elem);
    char* got_prev = ch.scratch(0, max_bytes);  // partial sums received at the previous step
    char* got_now = ch.scratch(1, max_bytes);   // partial sums arriving at this step
    char* piece_buf = ch.scratch(2, static_cast<std::size_t>(out_piece * elem));
    for (int s = 0; s < world_size_ - 1; ++s) {
      const ShardRange out = shard_range(numel, world_size_, mod(rank_ - s - 1));
      const ShardRange in = shard_range(numel, world_size_, mod(rank_ - s - 2));
      for_pieces(
          out.numel, out_piece, in.numel, in_piece,
          [&](std::int64_t out_begin, std::int64_t out_count, bool sends, std::int64_t in_begin,
              std::int64_t in_count, bool receives) {
            const char* send = ptr_of(input, out) + out_begin * elem;
            if (s > 0 && out_count > 0) {  // what arrived last step is the partial sum of `out`: add ours
              add(dtype, piece_buf, got_prev + out_begin * elem, send, out_count);
              send = piece_buf;
            }
            step(ch, op, send, static_cast<std::size_t>(out_count * elem), sends, got_now + in_begin * elem,
                 static_cast<std::size_t>(in_count * elem), receives);
          });
      std::swap(got_prev, got_now);
    }
    return got_prev;
  }

  // Reduce-scatter, then all-gather, in place. The reduce-scatter's last addition (and the
  // average) is done piece by piece just before each piece of this rank's segment goes out
  // in the all-gather's first step, so it overlaps the kernel's sending of earlier pieces
  // instead of being a pass of its own between the two.
  void all_reduce(Channel& ch, const Collective& op) {
    const at::Tensor& t = op.output;
    const std::int64_t numel = t.numel();
    const ShardRange mine = shard_range(numel, world_size_, rank_);
    const auto dtype = t.scalar_type();
    const int divisor = op.reduce == ReduceOp::Avg ? world_size_ : 1;
    if (divisor != 1 && !at::isFloatingType(dtype)) {  // an integer average: divide as a pass
      reduce_scatter(ch, op, t, t.narrow(0, mine.offset, mine.numel));
      all_gather(ch, op, t);
      return;
    }
    const char* partial = reduce_scatter_steps(ch, op, t);  // the others' sums of this rank's segment
    const std::int64_t elem = t.element_size();
    const ShardRange in = shard_range(numel, world_size_, mod(rank_ - 1));
    char* own = ptr_of(t, mine);
    for_pieces(mine.numel, piece_numel(ch.direct_out, elem), in.numel, piece_numel(ch.direct_in, elem),
               [&](std::int64_t out_begin, std::int64_t out_count, bool sends, std::int64_t in_begin,
                   std::int64_t in_count, bool receives) {
                 char* piece = own + out_begin * elem;
                 if (out_count > 0) add(dtype, piece, partial + out_begin * elem, piece, out_count, divisor);
                 step(ch, op, piece, static_cast<std::size_t>(out_count * elem), sends,
                      ptr_of(t, in) + in_begin * elem, static_cast<std::size_t>(in_count * elem), receives);
               });
    all_gather(ch, op, t, /*first_step=*/1);  // the all-gather's other steps
  }

  // Pipelined chain from the root round the ring: each rank forwards slice k while
  // receiving slice k+1.
  void broadcast(Channel& ch, const Collective& op) {
    char* data = static_cast<char*>(op.output.data_ptr());
    const std::size_t bytes = op.output.nbytes();
    const std::size_t slices =
        std::max<std::size_t>(1, (bytes + kBroadcastSliceBytes - 1) / kBroadcastSliceBytes);
    auto slice = [&](std::size_t k) {
      return std::min(kBroadcastSliceBytes, bytes - std::min(bytes, k * kBroadcastSliceBytes));
    };
    // A first step of heads alone, every rank to the next: the chain below has the last
    // rank receive only and the root send only, so ranks that disagree on the root (each
    // its own, say) would otherwise never compare heads, and small slices would sit in the
    // kernel's buffers as if delivered. Each rank checks its predecessor's root; round the
    // ring, every rank's.
    step(ch, op, nullptr, 0, true, nullptr, 0, true);
    const int position = mod(rank_ - op.root);
    const bool sends = position != world_size_ - 1;
    const bool receives = position != 0;
    // Step k sends slice k-1 (slice k at the root) and receives slice k.
    for (std::size_t k = 0; k <= slices; ++k) {
      const bool send_now = sends && (receives ? k >= 1 : k < slices);
      const bool recv_now = receives && k < slices;
      if (!send_now && !recv_now) continue;
      // Pointers only for the slices that move (k - 1 wraps at k = 0 on a receiver).
      const std::size_t send_index = receives ? k - 1 : k;
      char* send_at = send_now ? data + send_index * kBroadcastSliceBytes : nullptr;
      char* recv_at = recv_now ? data + k * kBroadcastSliceBytes : nullptr;
      step(ch, op, send_at, send_now ? slice(send_index) : 0, send_now, recv_at, recv_now ? slice(k) : 0,
           recv_now);
    }
  }

  // N-1 empty steps: the message received at step N-2 was sent after its sender
  // heard from everyone further back, so every rank has entered the barrier.
  void barrier(Channel& ch, const Collective& op) {
    for (int s = 0; s < world_size_ - 1; ++s) step(ch, op, nullptr, 0, true, nullptr, 0, true);
  }

  int rank_;
  int world_size_;
  std::vector<Channel> channels_;
  std::atomic<bool> aborted_{false};
  std::mutex abort_mutex_;
  c10::intrusive_ptr<c10d::Store> store_;
  std::string failure_key_;
  bool copies_directly_ = false;
};

}  // namespace

const char* to_string(OpKind kind) {
  switch (kind) {
    case OpKind::AllGather: return "all_gather";
    case OpKind::ReduceScatter: return "reduce_scatter";
    case OpKind::AllReduce: return "all_reduce";
    case OpKind::Broadcast: return "broadcast";
    case OpKind::Barrier: return "barrier";
    case OpKind::NeighborExchange: return "neighbor_exchange";
  }
  return "unknown op";
}

std::unique_ptr<Backend> make_tcp_ring_backend(const World& world, const CommunicatorOptions& options,
                                               int num_channels) {
  const int rank = world.rank();
  const int world_size = world.world_size();
  std::vector<Channel> channels;
  if (world_size == 1) return std::make_unique<TcpRingBackend>(rank, world_size, std::move(channels));
  FLATSHARD_ASSERT(world.store, "a multi-rank world has a store");
  const std::string prefix =
      next_rendezvous_prefix(world, options.name);  // Note [Rendezvous keys per creation]
  const std::string failure_key = prefix + "first_failure";
  channels = connect_ring(world, options, num_channels, prefix);
  return std::make_unique<TcpRingBackend>(rank, world_size, std::move(channels), world.store, failure_key);
}

}  // namespace flatshard::comm
