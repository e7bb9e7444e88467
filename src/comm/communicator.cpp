// The one path every collective takes: validate, number, log, run on its stream,
// time, and turn transport failures into CommErrors that name rank, op and number.
#include "flatshard/communicator.h"

#include <c10/core/impl/VirtualGuardImpl.h>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <string>

#include <fmt/format.h>

#include "flatshard/errors.h"
#include "flatshard/shard.h"
#include "src/comm/backend.h"
#include "src/comm/wait_clock.h"
#include "src/errors.h"
#include "src/logging.h"

namespace flatshard {
namespace {

using comm::Collective;
using comm::OpKind;

// Microseconds on the host's steady clock, which every rank on one host shares: the debug
// log's times, comparable across ranks (bench/wait_trace.py).
std::int64_t steady_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string describe(const at::Tensor& t) {
  return fmt::format("{}[{}] on {}", c10::toString(t.scalar_type()), t.numel(), t.device().str());
}

std::string advice(CommError::Kind kind) {
  switch (kind) {
    case CommError::Kind::PeerLost:
      return "That rank exited or was killed: read its log for the first error. This communicator is "
             "aborted; restart the job (from the last checkpoint).";
    case CommError::Kind::Timeout:
      return "A rank is stuck, slow, or never issued this collective. Check that every rank runs the "
             "same code path, or raise CommunicatorOptions::timeout for long steps.";
    case CommError::Kind::Mismatch:
      return "The ranks issued different collectives (or sizes) at this point: every rank must issue "
             "the same ops in the same order on each stream.";
    case CommError::Kind::Aborted:
      return "An earlier collective failed; see the first error. Restart the job.";
  }
  return "";
}

}  // namespace

namespace comm {
namespace {

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::map<c10::DeviceType, BackendFactory>& registry() {
  static std::map<c10::DeviceType, BackendFactory> r;
  return r;
}

}  // namespace

void register_device_backend(c10::DeviceType type, BackendFactory factory) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  registry()[type] = factory;
}

std::string next_rendezvous_prefix(const World& world, const std::string& name) {
  if (!world.store) {  // nothing to meet: a count in this process
    static std::mutex mutex;
    static std::map<std::string, std::int64_t> created;
    std::lock_guard<std::mutex> lock(mutex);
    return fmt::format("flatshard/comm/{}/{}/", name, created[name]++);
  }
  std::int64_t n = 0;
  try {
    n = world.store->add(fmt::format("flatshard/comm/{}/created/{}", name, world.rank()), 1) - 1;
  } catch (const c10::Error& e) {  // the store is gone or does not answer
    throw RendezvousError(
        fmt::format("flatshard::Communicator::create (rank {}/{}, communicator '{}'): the world's "
                    "store did not answer ({}): check that rank 0 is running",
                    world.rank(), world.world_size(), name, e.what_without_backtrace()));
  }
  return fmt::format("flatshard/comm/{}/{}/", name, n);
}

// By element, as the rings move bytes: the ops take tensors of any shapes whose element
// counts fit (a [4, 5] gradient reduce-scattered into a [20] output), and both are contiguous.
void run_on_one_rank(const Collective& op) {
  switch (op.kind) {
    case OpKind::AllGather:
    case OpKind::ReduceScatter:
      if (op.output.data_ptr() != op.input.data_ptr()) op.output.view(-1).copy_(op.input.view(-1));
      break;
    case OpKind::NeighborExchange: {  // this rank is both its neighbours
      const auto out = op.output.view(-1), in = op.input.view(-1);
      out.narrow(0, 0, in.numel()).copy_(in);
      out.narrow(0, in.numel(), in.numel()).copy_(in);
      break;
    }
    default: break;  // all_reduce, broadcast and barrier are identities for one rank
  }
}

std::map<Transport, BackendFactory>& cpu_registry() {
  static std::map<Transport, BackendFactory> r;
  return r;
}

void register_cpu_transport(Transport transport, BackendFactory factory) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  cpu_registry()[transport] = factory;
}

BackendFactory cpu_transport(Transport transport) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = cpu_registry().find(transport);
  return it == cpu_registry().end() ? nullptr : it->second;
}

BackendFactory device_backend(c10::DeviceType type) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = registry().find(type);
  return it == registry().end() ? nullptr : it->second;
}

namespace {

// The calling thread's run delay so far: the nanoseconds it was ready to run and waited for
// a core (the second field of /proc/thread-self/schedstat); -1 where the kernel does not
// say. The file stays open per thread, read from its start each time.
std::int64_t thread_run_delay_ns() {
#ifdef __linux__
  struct File {
    int fd = ::open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    ~File() {
      if (fd >= 0) ::close(fd);
    }
  };
  thread_local File file;
  if (file.fd < 0) return -1;
  char text[96];
  const ssize_t got = ::pread(file.fd, text, sizeof(text) - 1, 0);
  if (got <= 0) return -1;
  text[got] = '\0';
  unsigned long long running = 0, delay = 0;
  if (std::sscanf(text, "%llu %llu", &running, &delay) != 2) return -1;
  return static_cast<std::int64_t>(delay);
#else
  return -1;
#endif
}

}  // namespace

// Note [Communication wait]
// A collective's Work is waited for where compute needs its result: before a unit's
// forward needs its gathered weights, before a gradient shard is used, before the step.
// How long the compute stalls there is the communication that the schedule did not hide
// behind compute, which is what prefetching and bucketing exist to shrink. Each Work
// issued while its communicator times waits carries the communicator's clock:
//  - On the CPU the caller's thread is the compute: the clock reads the steady clock
//    around the blocking wait (a wait on a completed op costs one query and counts 0),
//    and on Linux the thread's run delay too: the part of the wait it spent woken but
//    without a core (CommunicationWait::core_ms), which ranks that outnumber the cores
//    add to every wait and a rank with a device of its own does not.
//  - On CUDA the host does not block; the caller's current stream does, at the
//    cudaStreamWaitEvent that Event::wait() inserts. The clock records a timing event
//    on that stream just before the wait and one just after: nothing else runs on the
//    stream between them, so their distance is how long the stream sat at the wait (0
//    when the collective had finished by the time the stream got there). The events
//    are resolved when they have passed, or when the total is read.
// Waits on other streams (CollectiveOptions::wait_for) order communication only and
// are not counted; nor is a host synchronize(), which is not compute waiting.
void WaitClock::wait(const Event& event, std::uint64_t seq) {
  if (device_.is_cpu()) {
    double ms = 0, core_ms = 0;
    std::int64_t start_ns = 0, end_ns = 0;
    if (!event.query()) {
      // The run delay is read inside the timed span, so that what it counts lies in `ms`.
      const auto start = std::chrono::steady_clock::now();
      const std::int64_t delay_before = thread_run_delay_ns();
      event.wait();
      const std::int64_t delay_after = thread_run_delay_ns();
      const auto end = std::chrono::steady_clock::now();
      ms = std::chrono::duration<double, std::milli>(end - start).count();
      if (delay_before >= 0 && delay_after >= delay_before)
        core_ms = std::min(ms, static_cast<double>(delay_after - delay_before) * 1e-6);
      start_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(start.time_since_epoch()).count();
      end_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(end.time_since_epoch()).count();
      log::at(log::Level::Debug, "{}: waited for #{} {:.3f} ms, from {} to {} us", name_, seq, ms,
              start_ns / 1000, end_ns / 1000);
    } else {
      event.wait();  // rethrows the op's error
    }
    std::lock_guard<std::mutex> lock(mutex_);
    total_.ms += ms;
    total_.waits += 1;
    total_.core_ms += core_ms;
    if (end_ns > start_ns) {
      if (trace_.stalls.size() < kMaxTraced) {
        trace_.stalls.push_back({seq, start_ns, end_ns});
      } else {
        trace_.broken = "more stalled waits than it keeps";
      }
    }
    return;
  }
  const c10::impl::VirtualGuardImpl guard(device_.type());
  const c10::Stream stream = guard.getStream(device_);
  DeviceWait w{c10::Event(device_.type(), c10::EventFlag::BACKEND_DEFAULT),
               c10::Event(device_.type(), c10::EventFlag::BACKEND_DEFAULT)};
  w.before.record(stream);
  event.wait();
  w.after.record(stream);
  std::lock_guard<std::mutex> lock(mutex_);
  unresolved_.push_back(std::move(w));
  if (unresolved_.size() > 256) resolve(/*block=*/false);  // keeps the events few
}

void WaitClock::resolve(bool block) {
  while (!unresolved_.empty()) {
    DeviceWait& w = unresolved_.front();
    if (block) {
      w.after.synchronize();
    } else if (!w.after.query()) {
      return;
    }
    total_.ms += std::max(0.0, w.before.elapsedTime(w.after));
    total_.waits += 1;
    unresolved_.pop_front();
  }
}

CommunicationWait WaitClock::total() {
  std::lock_guard<std::mutex> lock(mutex_);
  resolve(/*block=*/true);
  return total_;
}

void WaitClock::reset() {
  std::lock_guard<std::mutex> lock(mutex_);
  unresolved_.clear();
  total_ = {};
  trace_ = {};
}

void WaitClock::issued(std::uint64_t seq) {
  if (!device_.is_cpu()) return;
  const std::int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                               std::chrono::steady_clock::now().time_since_epoch())
                               .count();
  std::lock_guard<std::mutex> lock(mutex_);
  if (trace_.broken) return;
  if (trace_.issued_ns.empty()) {
    trace_.first_seq = seq;
  } else if (seq != trace_.first_seq + trace_.issued_ns.size()) {
    trace_.broken = "ops were issued untimed in between (time_waits was turned off and on)";
    return;
  } else if (trace_.issued_ns.size() >= kMaxTraced) {
    trace_.broken = "more ops than it keeps";
    return;
  }
  trace_.issued_ns.push_back(now);
}

WaitClock::Snapshot WaitClock::snapshot() {
  std::lock_guard<std::mutex> lock(mutex_);
  return {total_, trace_};
}

}  // namespace comm

void Work::wait() const {
  if (clock_) {
    clock_->wait(event_, seq_);
  } else {
    event_.wait();
  }
}

const char* to_string(StreamRole role) {
  switch (role) {
    case StreamRole::AllGather: return "all_gather";
    case StreamRole::ReduceScatter: return "reduce_scatter";
    case StreamRole::AllReduce: return "all_reduce";
  }
  return "unknown";
}

// What this rank sends of a `bytes`-byte op on a ring (src/tcp/ring.cpp; NCCL's rings
// send the same): an all-gather every segment but the next rank's, a reduce-scatter every
// segment but its own, an all-reduce both, a broadcast the buffer unless it ends the chain.
std::uint64_t Communicator::ring_bytes_sent(const comm::Collective& c, std::size_t bytes) const {
  if (world_size_ == 1 || bytes == 0) return 0;
  const std::int64_t numel = c.kind == OpKind::AllGather ? c.output.numel() : c.input.numel();
  const std::uint64_t element = bytes / std::max<std::int64_t>(1, numel);
  auto segment = [&](int r) {
    return static_cast<std::uint64_t>(shard_range(numel, world_size_, r).numel) * element;
  };
  const int next = (rank_ + 1) % world_size_;
  switch (c.kind) {
    case OpKind::AllGather: return bytes - segment(next);
    case OpKind::ReduceScatter: return bytes - segment(rank_);
    case OpKind::AllReduce: return 2 * bytes - segment(rank_) - segment(next);
    case OpKind::Broadcast:
      return (rank_ - c.root + world_size_) % world_size_ == world_size_ - 1 ? 0 : bytes;
    case OpKind::Barrier: return 0;
    case OpKind::NeighborExchange: return world_size_ == 2 ? bytes / 2 : bytes;  // bytes: the output's
  }
  return 0;
}

namespace {

// The CPU's transport: the one asked for, or under Auto FLATSHARD_TRANSPORT's (tcp, mpi),
// else the TCP rings.
Transport cpu_transport_for(const World& world, Transport asked) {
  if (asked != Transport::Auto) return asked;
  const char* env = std::getenv("FLATSHARD_TRANSPORT");
  const std::string v = env == nullptr ? "" : env;
  if (v.empty() || v == "tcp") return Transport::Tcp;
  if (v == "mpi") return Transport::Mpi;
  throw InvalidArgument(
      fmt::format("flatshard::Communicator::create (rank {}/{}): FLATSHARD_TRANSPORT is tcp or mpi, not '{}'",
                  world.rank(), world.world_size(), v));
}

}  // namespace

std::unique_ptr<Communicator> Communicator::create(const World& world, const CommunicatorOptions& options) {
  if (options.timeout.count() <= 0) {
    throw InvalidArgument(
        fmt::format("flatshard::Communicator::create (rank {}/{}): "
                    "CommunicatorOptions::timeout must be positive",
                    world.rank(), world.world_size()));
  }
  std::unique_ptr<comm::Backend> backend;
  if (options.device.is_cpu()) {
    const Transport transport = cpu_transport_for(world, options.transport);
    if (transport == Transport::Nccl) {
      throw InvalidArgument(
          fmt::format("flatshard::Communicator::create (rank {}/{}): Transport::Nccl "
                      "moves CUDA tensors; the CPU uses Transport::Tcp, Transport::Mpi (or Auto)",
                      world.rank(), world.world_size()));
    }
    if (transport == Transport::Mpi) {
      const comm::BackendFactory factory = comm::cpu_transport(Transport::Mpi);
      if (!factory) {
        throw InvalidArgument(fmt::format(
            "flatshard::Communicator::create (rank {}/{}): Transport::Mpi was asked for, but this program "
            "does not link flatshard::mpi (built where MPI is found: Debian's libopenmpi-dev)",
            world.rank(), world.world_size()));
      }
      backend = factory(world, options, kNumStreamRoles);
    } else {
      backend = comm::make_tcp_ring_backend(world, options, kNumStreamRoles);
    }
  } else {
    const comm::BackendFactory factory = comm::device_backend(options.device.type());
    if (!factory) {
      throw InvalidArgument(fmt::format(
          "flatshard::Communicator::create (rank {}/{}): no transport for device {} in this program; "
          "link flatshard::cuda (built where the CUDA toolkit is found) for CUDA devices",
          world.rank(), world.world_size(), options.device.str()));
    }
    backend = factory(world, options, kNumStreamRoles);
  }
  return std::unique_ptr<Communicator>(
      new Communicator(world.rank(), world.world_size(), options, std::move(backend)));
}

Communicator::Communicator(int rank, int world_size, CommunicatorOptions options,
                           std::unique_ptr<comm::Backend> backend)
    : rank_(rank),
      world_size_(world_size),
      options_(std::move(options)),
      backend_(std::move(backend)),
      clock_(std::make_shared<comm::WaitClock>(options_.device, options_.name)) {
  for (int i = 0; i < kNumStreamRoles; ++i) {
    streams_[i] = std::make_unique<Stream>(to_string(static_cast<StreamRole>(i)));
  }
}

Communicator::~Communicator() {
  // Let issued work finish (a failed peer makes it fail within its deadline) before
  // the transport goes away under it.
  for (auto& s : streams_) s.reset();
}

bool Communicator::copies_directly() const { return backend_->copies_directly(); }

void Communicator::time_waits(bool on) { time_waits_ = on; }

CommunicationWait Communicator::waited() { return clock_->total(); }

void Communicator::reset_waited() { clock_->reset(); }

// Note [Waiting for peers]
// A wait on a collective ends when the op has finished, and the op cannot finish before
// every rank has issued it. While waits are timed on the CPU, the clock keeps when this
// rank issued each op and when each stalled wait began and ended, on the host's steady
// clock. waited_for_peers() gathers every rank's issue times; the part of a stall before
// the last rank issued the op is time this rank spent waiting for a peer to get there,
// which no link could have saved: on a machine whose ranks drift apart between syncs (or
// take turns on fewer cores than ranks), much of communication_wait is that. The rest is
// the op's own time and the time of the ops queued ahead of it on its stream.
// A stall on an op issued before the window (before the reset) counts as the op's.
// The issue times are compared on one clock, so the ranks must share a host: the split
// checks that they run under one kernel (its boot id) and refuses otherwise.
namespace {

std::int64_t steady_clock_id() {
  std::string id;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::getline(boot, id);
  if (id.empty()) {
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    id = host;
  }
  std::uint64_t hash = 14695981039346656037ull;  // FNV-1a: the same in every binary
  for (unsigned char c : id) hash = (hash ^ c) * 1099511628211ull;
  return static_cast<std::int64_t>(hash);
}

}  // namespace

PeerWait Communicator::waited_for_peers() {
  auto invalid = [&](const std::string& what) {
    return InvalidArgument(
        fmt::format("flatshard: waited_for_peers on rank {}/{}: {}", rank_, world_size_, what));
  };
  if (!options_.device.is_cpu()) {
    throw invalid(
        fmt::format("a communicator on {} times its waits on the device's clock, which the ranks do "
                    "not share; the split is measured on the CPU (read waited())",
                    options_.device.str()));
  }
  const auto [total, trace] = clock_->snapshot();
  PeerWait split{total.ms, 0, total.waits};
  if (world_size_ == 1) return split;

  // The split's own all-gathers: their waits are not timed, but while timing is on they
  // join the record of issued ops (every rank's at the same place), so that the window
  // stays whole and the split can be read again.
  struct Untimed {
    bool& on;
    const bool was;
    explicit Untimed(bool& flag) : on(flag), was(flag) { on = false; }
    ~Untimed() { on = was; }
  } untimed(time_waits_);
  auto gather = [&](const at::Tensor& output, const at::Tensor& input) {
    Work work = all_gather(output, input);
    if (untimed.was) clock_->issued(work.seq());
    work.wait();
  };

  // Each rank's header: the first op of its window, how many, its clock, whether it stopped.
  enum : int { kFirst, kOps, kClock, kStopped, kHeader };
  const std::int64_t n = static_cast<std::int64_t>(trace.issued_ns.size());
  auto header = at::tensor({static_cast<std::int64_t>(trace.first_seq), n, steady_clock_id(),
                            static_cast<std::int64_t>(trace.broken != nullptr)},
                           at::kLong);
  auto headers = at::empty({kHeader * world_size_}, at::kLong);
  gather(headers, header);
  const auto h = headers.view({world_size_, kHeader});
  const auto of = h.accessor<std::int64_t, 2>();
  for (int q = 0; q < world_size_; ++q) {
    if (of[q][kStopped] != 0) {
      throw invalid(
          fmt::format("rank {}'s record of its waits stopped ({}); call reset_waited() at the start "
                      "of each window you split",
                      q, q == rank_ ? trace.broken : "its error says why"));
    }
    if (of[q][kClock] != of[rank_][kClock]) {
      throw invalid(
          fmt::format("rank {} runs under another kernel than this rank: the split compares the "
                      "ranks' issue times on one steady clock, so it is measured where they share "
                      "a host (read waited() elsewhere)",
                      q));
    }
    if (of[q][kFirst] != of[rank_][kFirst] || of[q][kOps] != of[rank_][kOps]) {
      throw invalid(
          fmt::format("rank {} timed {} ops from #{} and this rank {} from #{}: call reset_waited() and "
                      "time_waits() at the same point on every rank",
                      q, of[q][kOps], of[q][kFirst], n, trace.first_seq));
    }
  }
  if (n == 0) return split;

  auto everyone = at::empty({n * world_size_}, at::kLong);
  gather(everyone, at::tensor(trace.issued_ns, at::kLong));
  const auto last_issued = everyone.view({world_size_, n}).amax(0);
  const auto last = last_issued.accessor<std::int64_t, 1>();
  for (const comm::WaitClock::Stall& stall : trace.stalls) {
    if (stall.seq < trace.first_seq || stall.seq >= trace.first_seq + static_cast<std::uint64_t>(n)) continue;
    const std::int64_t reached = last[static_cast<std::int64_t>(stall.seq - trace.first_seq)];
    const std::int64_t peer =
        std::clamp(reached - stall.start_ns, std::int64_t{0}, stall.end_ns - stall.start_ns);
    split.peer_ms += static_cast<double>(peer) / 1e6;
  }
  return split;
}

Stream& Communicator::stream(StreamRole role) { return *streams_[static_cast<int>(role)]; }

Work Communicator::all_gather(const at::Tensor& output, const at::Tensor& input,
                              const CollectiveOptions& options) {
  Collective c;
  c.kind = OpKind::AllGather;
  c.input = input;
  c.output = output;
  return enqueue(std::move(c), StreamRole::AllGather, options);
}

Work Communicator::reduce_scatter(const at::Tensor& output, const at::Tensor& input, ReduceOp op,
                                  const CollectiveOptions& options) {
  Collective c;
  c.kind = OpKind::ReduceScatter;
  c.input = input;
  c.output = output;
  c.reduce = op;
  return enqueue(std::move(c), StreamRole::ReduceScatter, options);
}

Work Communicator::all_reduce(const at::Tensor& tensor, ReduceOp op, const CollectiveOptions& options) {
  Collective c;
  c.kind = OpKind::AllReduce;
  c.input = tensor;
  c.output = tensor;
  c.reduce = op;
  return enqueue(std::move(c), StreamRole::AllReduce, options);
}

Work Communicator::broadcast(const at::Tensor& tensor, int root, const CollectiveOptions& options) {
  Collective c;
  c.kind = OpKind::Broadcast;
  c.input = tensor;
  c.output = tensor;
  c.root = root;
  return enqueue(std::move(c), StreamRole::AllReduce, options);
}

Work Communicator::neighbor_exchange(const at::Tensor& output, const at::Tensor& input,
                                     const CollectiveOptions& options) {
  Collective c;
  c.kind = OpKind::NeighborExchange;
  c.input = input;
  c.output = output;
  return enqueue(std::move(c), StreamRole::AllGather, options);
}

Work Communicator::barrier(const CollectiveOptions& options) {
  Collective c;
  c.kind = OpKind::Barrier;
  return enqueue(std::move(c), StreamRole::AllReduce, options);
}

Work Communicator::enqueue(Collective c, StreamRole default_role, const CollectiveOptions& options) {
  const std::uint64_t seq = next_seq_;
  const char* name = comm::to_string(c.kind);
  auto invalid = [&](const std::string& what) {
    return InvalidArgument(
        fmt::format("flatshard: {} #{} on rank {}/{}: {}", name, seq, rank_, world_size_, what));
  };

  // --- validation: nothing is sent for a call that breaks the contract ----------
  if (c.kind != OpKind::Barrier) {
    for (const at::Tensor* t : {&c.input, &c.output}) {
      if (!t->defined()) throw invalid("tensor is undefined");
      if (!t->is_contiguous())
        throw invalid(fmt::format("tensor {} is not contiguous; pass .contiguous()", describe(*t)));
      if (t->device() != options_.device) {
        throw invalid(fmt::format("tensor {} is not on {}, the device this communicator moves tensors of",
                                  describe(*t), options_.device.str()));
      }
    }
    if (c.input.scalar_type() != c.output.scalar_type()) {
      throw invalid(
          fmt::format("input {} and output {} differ in dtype", describe(c.input), describe(c.output)));
    }
    const bool reduces = c.kind == OpKind::AllReduce || c.kind == OpKind::ReduceScatter;
    const at::ScalarType dtype = c.input.scalar_type();
    const bool summable = dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
                          dtype == at::kBFloat16 || dtype == at::kByte || dtype == at::kChar ||
                          dtype == at::kShort || dtype == at::kInt || dtype == at::kLong;
    if (reduces && !summable && options_.device.is_cpu()) {  // the CPU rings' sums (tcp/ring.cpp)
      throw invalid(
          fmt::format("tensor {} cannot be summed: reductions take floating-point or integer "
                      "tensors (convert bool to uint8, complex to its real view)",
                      describe(c.input)));
    }
  }
  const ShardRange mine = shard_range(c.kind == OpKind::AllGather ? c.output.numel()
                                      : c.kind == OpKind::Barrier ? 0
                                                                  : c.input.numel(),
                                      world_size_, rank_);
  if (c.kind == OpKind::AllGather && c.input.numel() != mine.numel) {
    throw invalid(
        fmt::format("input has {} elements but this rank's slot of an output of {} elements "
                    "has {} (shard_range)",
                    c.input.numel(), c.output.numel(), mine.numel));
  }
  if (c.kind == OpKind::ReduceScatter && c.output.numel() != mine.numel) {
    throw invalid(
        fmt::format("output has {} elements but this rank's slot of an input of {} elements "
                    "has {} (shard_range)",
                    c.output.numel(), c.input.numel(), mine.numel));
  }
  if (c.kind == OpKind::NeighborExchange && c.output.numel() != 2 * c.input.numel()) {
    throw invalid(
        fmt::format("output has {} elements; it must have twice the input's {} (the previous "
                    "rank's, then the next rank's)",
                    c.output.numel(), c.input.numel()));
  }
  if (c.kind == OpKind::NeighborExchange && c.output.data_ptr() == c.input.data_ptr() &&
      c.input.numel() > 0) {
    throw invalid("output and input overlap; the output receives the neighbours' inputs");
  }
  if ((c.kind == OpKind::ReduceScatter || c.kind == OpKind::AllReduce) && c.reduce == ReduceOp::Avg &&
      !at::isFloatingType(c.input.scalar_type())) {
    throw invalid(fmt::format("ReduceOp::Avg needs a floating dtype, got {}; use Sum and divide yourself",
                              c10::toString(c.input.scalar_type())));
  }
  if (c.kind == OpKind::Broadcast && (c.root < 0 || c.root >= world_size_)) {
    throw invalid(fmt::format("root {} is outside [0, {})", c.root, world_size_));
  }
  const auto timeout = options.timeout.value_or(options_.timeout);
  if (timeout.count() <= 0) throw invalid("timeout must be positive");

  // --- numbering and submission -----------------------------------------------
  next_seq_ += 1;
  c.seq = seq;
  if (time_waits_) clock_->issued(seq);  // Note [Waiting for peers]
  if (log::enabled(log::Level::Debug))
    log::at(log::Level::Debug, "{}: {} #{} issued at {} us", options_.name, name, seq, steady_us());
  const StreamRole role = options.stream.value_or(default_role);
  Stream& stream = *streams_[static_cast<int>(role)];
  for (const Event& e : options.wait_for) stream.wait_event(e);
  c.after = options.wait_for;
  backend_->issue(c);
  const std::size_t bytes = c.kind == OpKind::Barrier ? 0 : std::max(c.input.nbytes(), c.output.nbytes());
  bytes_sent_ += ring_bytes_sent(c, bytes);
  const int rank = rank_;
  const int world_size = world_size_;
  comm::Backend* backend = backend_.get();
  Event done = stream.submit_device(
      [c = std::move(c), role, timeout, bytes, rank, world_size, backend, name,
       comm_name = log::enabled(log::Level::Debug) ? options_.name : std::string()]() mutable {
        const auto start = std::chrono::steady_clock::now();
        c.deadline = start + timeout;
        std::shared_ptr<DeviceEvent> device;
        try {
          device = backend->run(c, static_cast<int>(role));
        } catch (const comm::TransportFailure& f) {
          backend->abort();  // the other streams' ops fail at once instead of at their deadlines
          const std::string peer = f.peer >= 0 ? fmt::format(" (peer rank {})", f.peer) : "";
          CommError error(f.kind, rank, world_size, name, c.seq, f.peer,
                          fmt::format("flatshard: {} #{} failed on rank {}/{}: {}{}: {}. {}", name, c.seq,
                                      rank, world_size, to_string(f.kind), peer, f.what(), advice(f.kind)));
          log::at(log::Level::Error, "{}", error.what());
          throw error;
        } catch (const InvalidArgument&) {
          throw;  // refused before anything moved (MPI's counts and types): the communicator still works
        } catch (const std::exception& e) {
          // Anything else (the host out of memory for a channel's scratch, a kernel that
          // refused) after bytes may have moved: the ranks can no longer be trusted to agree,
          // so the communicator is aborted as for a lost peer, and the error is typed.
          backend->abort();
          const std::string what = first_line(e.what());
          CommError error(CommError::Kind::Aborted, rank, world_size, name, c.seq, -1,
                          fmt::format("flatshard: {} #{} failed on rank {}/{}: {}. This communicator is "
                                      "aborted; fix the cause and restart the job.",
                                      name, c.seq, rank, world_size, what));
          log::at(log::Level::Error, "{}", error.what());
          throw error;
        }
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
        log::at(log::Level::Debug, "{}: {} #{} {} B on stream {}: {:.3f} ms{}, from {} us", comm_name, name,
                c.seq, bytes, to_string(role), ms, device ? " to issue" : "",
                std::chrono::duration_cast<std::chrono::microseconds>(start.time_since_epoch()).count());
        return device;
      });
  return Work(std::move(done), seq, time_waits_ ? clock_ : nullptr);
}

}  // namespace flatshard
