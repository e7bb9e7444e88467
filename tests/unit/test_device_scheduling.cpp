// The scheduling path a device transport takes (the CUDA one in the CUDA build), checked
// on every machine with a recording transport registered for the "meta" device: events
// with a device half, the issue hook on the caller's thread, run on the stream's worker,
// wait_for events handed to the transport, Work::wait ordering the caller's stream
// rather than blocking the host, and errors keeping their types.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "flatshard/communicator.h"
#include "flatshard/errors.h"
#include "flatshard/stream.h"
#include "src/comm/backend.h"
#include "src/comm/in_flight.h"
#include "src/comm/launch_order.h"

namespace {

using flatshard::DeviceEvent;
using flatshard::Event;
using flatshard::Stream;
using namespace std::chrono_literals;

// A device half whose device finishes when told to.
struct FakeDeviceEvent final : DeviceEvent {
  std::atomic<bool> finished{false};
  mutable std::atomic<int> synchronized{0};
  mutable std::atomic<int> blocked_current{0};  // block(null): the caller's current stream
  mutable std::atomic<int> blocked_other{0};    // block(a given stream)

  bool query() const override { return finished.load(); }
  void synchronize() const override { ++synchronized; }
  void block(void* stream) const override { ++(stream == nullptr ? blocked_current : blocked_other); }
};

TEST(DeviceEvents, WaitOrdersTheCallerSynchronizeWaitsForTheDevice) {
  Stream s("device");
  auto device = std::make_shared<FakeDeviceEvent>();
  Event e = s.submit_device([device] { return device; });
  e.wait();  // the host half (the issue) is done; the caller's current stream waits once
  EXPECT_EQ(device->blocked_current.load(), 1);
  EXPECT_EQ(device->synchronized.load(), 0);
  EXPECT_EQ(e.device(), device);
  EXPECT_FALSE(e.query()) << "issued but not finished on the device";
  device->finished = true;
  EXPECT_TRUE(e.query());
  e.synchronize();
  EXPECT_EQ(device->synchronized.load(), 1);
}

TEST(DeviceEvents, AnIssueErrorIsRethrownAndHasNoDeviceHalf) {
  Stream s("device");
  Event bad =
      s.submit_device([]() -> std::shared_ptr<DeviceEvent> { throw std::runtime_error("issue failed"); });
  EXPECT_THROW(bad.wait(), std::runtime_error);
  EXPECT_THROW(bad.synchronize(), std::runtime_error);
  EXPECT_TRUE(bad.query());
  EXPECT_EQ(bad.device(), nullptr);
}

TEST(DeviceEvents, AHostOnlyEventWaitsOnTheHost) {
  Stream s("host");
  std::atomic<bool> ran{false};
  Event e = s.submit([&] {
    std::this_thread::sleep_for(20ms);
    ran = true;
  });
  e.wait();
  EXPECT_TRUE(ran.load());
  EXPECT_EQ(e.device(), nullptr);
}

// Records what the Communicator hands a device transport.
struct Recording {
  std::mutex mutex;
  std::vector<std::thread::id> issue_threads, run_threads;
  std::vector<std::uint64_t> issued_seqs, run_seqs;
  std::vector<int> channels;
  std::vector<std::size_t> after_counts;
  std::vector<std::shared_ptr<FakeDeviceEvent>> done;
  bool fail_next_run = false;
};
Recording* recording = nullptr;

class RecordingTransport final : public flatshard::comm::Backend {
 public:
  void issue(flatshard::comm::Collective& op) override {
    std::lock_guard<std::mutex> lock(recording->mutex);
    recording->issue_threads.push_back(std::this_thread::get_id());
    recording->issued_seqs.push_back(op.seq);
    op.ready = std::make_shared<FakeDeviceEvent>();
  }
  std::shared_ptr<DeviceEvent> run(const flatshard::comm::Collective& op, int channel) override {
    std::lock_guard<std::mutex> lock(recording->mutex);
    if (recording->fail_next_run) {
      recording->fail_next_run = false;
      throw flatshard::comm::TransportFailure(flatshard::CommError::Kind::PeerLost, 1, "the peer went away");
    }
    EXPECT_NE(op.ready, nullptr) << "run before issue";
    recording->run_threads.push_back(std::this_thread::get_id());
    recording->run_seqs.push_back(op.seq);
    recording->channels.push_back(channel);
    recording->after_counts.push_back(op.after.size());
    for (const Event& e : op.after) {
      EXPECT_NE(e.device(), nullptr) << "a wait_for event reached run before its issue completed";
    }
    auto done = std::make_shared<FakeDeviceEvent>();
    recording->done.push_back(done);
    return done;
  }
  void abort() override {}
};

std::unique_ptr<flatshard::comm::Backend> make_recording(const flatshard::World&,
                                                         const flatshard::CommunicatorOptions&, int) {
  return std::make_unique<RecordingTransport>();
}

TEST(DeviceScheduling, TheCommunicatorDrivesADeviceTransport) {
  Recording rec;
  recording = &rec;
  flatshard::comm::register_device_backend(c10::DeviceType::Meta, &make_recording);
  flatshard::World world;
  flatshard::CommunicatorOptions options;
  options.device = c10::Device(c10::kMeta);
  auto comm = flatshard::Communicator::create(world, options);
  EXPECT_EQ(comm->device(), c10::Device(c10::kMeta));

  const auto meta = at::TensorOptions().device(at::kMeta);
  auto full = at::empty({64}, meta);
  auto gather = comm->all_gather(full, full.narrow(0, 0, 64));
  flatshard::CollectiveOptions after;
  after.wait_for = {gather.event()};
  auto grad = at::empty({64}, meta), shard = at::empty({64}, meta);
  auto reduce = comm->reduce_scatter(shard, grad, flatshard::ReduceOp::Avg, after);

  // wait(): the caller's stream waits for the device half; the host is not held for it.
  reduce.wait();
  gather.wait();
  {
    std::lock_guard<std::mutex> lock(rec.mutex);
    ASSERT_EQ(rec.done.size(), 2u);
    EXPECT_EQ(rec.done[0]->blocked_current.load(), 1);
    EXPECT_EQ(rec.done[1]->blocked_current.load(), 1);
    EXPECT_EQ(rec.done[0]->synchronized.load(), 0);
    EXPECT_FALSE(gather.is_completed()) << "the device has not finished";
    rec.done[0]->finished = true;
    EXPECT_TRUE(gather.is_completed());

    EXPECT_EQ(rec.issued_seqs, (std::vector<std::uint64_t>{1, 2}));
    EXPECT_EQ(rec.run_seqs, (std::vector<std::uint64_t>{1, 2}));
    for (auto id : rec.issue_threads) EXPECT_EQ(id, std::this_thread::get_id()) << "issue on the caller";
    for (auto id : rec.run_threads) EXPECT_NE(id, std::this_thread::get_id()) << "run on a stream worker";
    EXPECT_EQ(rec.channels, (std::vector<int>{static_cast<int>(flatshard::StreamRole::AllGather),
                                              static_cast<int>(flatshard::StreamRole::ReduceScatter)}));
    EXPECT_EQ(rec.after_counts, (std::vector<std::size_t>{0, 1}));
  }
  reduce.synchronize();
  EXPECT_EQ(rec.done[1]->synchronized.load(), 1);

  // Tensors of another device are refused before anything is issued.
  EXPECT_THROW(comm->all_reduce(at::zeros({4}), flatshard::ReduceOp::Sum), flatshard::InvalidArgument);
  EXPECT_EQ(rec.issued_seqs.size(), 2u);

  // A transport failure becomes a CommError naming the op and its number.
  {
    std::lock_guard<std::mutex> lock(rec.mutex);
    rec.fail_next_run = true;
  }
  auto t = at::empty({8}, meta);
  try {
    comm->all_reduce(t, flatshard::ReduceOp::Sum).wait();
    ADD_FAILURE() << "the failure was lost";
  } catch (const flatshard::CommError& e) {
    EXPECT_EQ(e.kind(), flatshard::CommError::Kind::PeerLost);
    EXPECT_NE(std::string(e.what()).find("all_reduce #3"), std::string::npos) << e.what();
  }
  comm.reset();
  recording = nullptr;
}

// Note [Rendezvous keys per creation]: the n-th communicator of a name on a world gets the
// n-th prefix on every rank of it, so a second one never reads the first one's NCCL id or
// ring addresses; communicators of that name on a subworld (its store under a prefix) do
// not shift the world's count.
TEST(RendezvousKeys, EachCreationOfANameOnAWorldHasItsOwnPrefix) {
  const auto count = [](const std::string& prefix, const std::string& name) {
    const std::string head = "flatshard/comm/" + name + "/";
    EXPECT_EQ(prefix.rfind(head, 0), 0u) << prefix;
    return std::stoi(prefix.substr(head.size()));
  };
  using flatshard::comm::next_rendezvous_prefix;
  auto store = c10::make_intrusive<c10d::HashStore>();
  flatshard::World rank0, rank1, sub0;
  rank0.spec.world_size = rank1.spec.world_size = sub0.spec.world_size = 2;
  rank1.spec.rank = 1;
  rank0.store = rank1.store = store;
  sub0.store = c10::make_intrusive<c10d::PrefixStore>("flatshard/subworld/x", store);
  EXPECT_EQ(count(next_rendezvous_prefix(rank0, "a"), "a"), 0);
  EXPECT_EQ(count(next_rendezvous_prefix(sub0, "a"), "a"), 0) << "a subworld counts its own";
  EXPECT_EQ(count(next_rendezvous_prefix(sub0, "a"), "a"), 1);
  EXPECT_EQ(count(next_rendezvous_prefix(rank0, "a"), "a"), 1) << "the subworld's did not count here";
  EXPECT_EQ(count(next_rendezvous_prefix(rank1, "a"), "a"), 0) << "rank 1's first is rank 0's first";
  EXPECT_EQ(count(next_rendezvous_prefix(rank1, "a"), "a"), 1);
  EXPECT_EQ(count(next_rendezvous_prefix(rank0, "b"), "b"), 0) << "names count apart";
  const flatshard::World alone;  // no store: counted in this process
  const int first = count(next_rendezvous_prefix(alone, "c"), "c");
  EXPECT_EQ(count(next_rendezvous_prefix(alone, "c"), "c"), first + 1);
}

// Note [One launch order per device]: workers launch in ticket order whatever order
// they reach their turn in.
TEST(LaunchOrder, WorkersLaunchInTicketOrder) {
  flatshard::comm::LaunchOrder order;
  constexpr int kOps = 24;
  std::vector<std::uint64_t> tickets;
  for (int i = 0; i < kOps; ++i) tickets.push_back(order.take());
  std::mutex mutex;
  std::vector<std::uint64_t> launched;
  std::vector<std::thread> workers;
  const auto deadline = std::chrono::steady_clock::now() + 20s;
  for (int i = kOps - 1; i >= 0; --i) {  // the last ticket's worker starts first
    workers.emplace_back([&, t = tickets[i]] {
      flatshard::comm::LaunchTurn turn(order, t);
      ASSERT_TRUE(order.wait_turn(t, deadline, nullptr));
      std::lock_guard<std::mutex> lock(mutex);
      launched.push_back(t);
    });
  }
  for (auto& w : workers) w.join();
  ASSERT_EQ(launched.size(), static_cast<std::size_t>(kOps));
  EXPECT_TRUE(std::is_sorted(launched.begin(), launched.end()));
  EXPECT_EQ(order.next(), static_cast<std::uint64_t>(kOps));
}

// A ticket that will never launch is finished out of turn and holds nobody up; one that
// is never finished makes the next wait end at its deadline, or when told to stop.
TEST(LaunchOrder, AnAbandonedTicketHoldsNobodyUpAndAStuckOneEndsAtTheDeadline) {
  flatshard::comm::LaunchOrder order;
  const auto t0 = order.take(), t1 = order.take(), t2 = order.take();
  order.finish(t1);  // its op failed before launching
  EXPECT_EQ(order.next(), t0);
  order.finish(t0);
  EXPECT_EQ(order.next(), t2) << "the abandoned ticket is skipped";
  EXPECT_TRUE(order.wait_turn(t2, std::chrono::steady_clock::now() + 1s, nullptr));
  order.finish(t2);

  const auto stuck = order.take(), waiting = order.take();
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(order.wait_turn(waiting, start + 100ms, nullptr));
  EXPECT_GE(std::chrono::steady_clock::now() - start, 100ms);
  std::atomic<bool> stop{false};
  std::thread stopper([&] {
    std::this_thread::sleep_for(50ms);
    stop = true;
  });
  EXPECT_FALSE(order.wait_turn(waiting, std::chrono::steady_clock::now() + 20s, [&] { return stop.load(); }));
  stopper.join();
  order.finish(stuck);
  EXPECT_TRUE(order.wait_turn(waiting, std::chrono::steady_clock::now() + 1s, nullptr));
}

// Note [Buffers a collective touches]: an op's tensors outlive the caller's references
// until the op completes or a caller waited for it; bytes freed under an op in flight
// that nobody waited for are held until it completes; other bytes go at once.
TEST(InFlightBuffers, KeepWhatAnOpTouchesUntilItCompletesOrIsWaitedFor) {
  auto& buffers = flatshard::comm::InFlightBuffers::instance();
  buffers.release_completed();
  const std::size_t before = buffers.tracked();

  std::atomic<bool> input_freed{false};
  std::vector<float> block(1024);
  auto done = std::make_shared<FakeDeviceEvent>();
  {
    flatshard::comm::Collective op;
    op.kind = flatshard::comm::OpKind::AllReduce;
    op.input = at::from_blob(
        block.data(), {256}, [&](void*) { input_freed = true; }, at::kFloat);
    op.output = op.input;
    buffers.track(done, op);
  }  // the caller lets go of its tensors
  EXPECT_FALSE(input_freed) << "freed while the op may still write it";
  EXPECT_EQ(buffers.tracked(), before + 1);

  std::atomic<int> freed{0};
  auto data_ptr = [&](float* p) {
    return c10::DataPtr(
        p, &freed, [](void* ctx) { ++*static_cast<std::atomic<int>*>(ctx); }, c10::Device(c10::kCPU));
  };
  buffers.retire(data_ptr(block.data() + 512), 64);  // outside the op's bytes
  EXPECT_EQ(freed, 1);
  buffers.retire(data_ptr(block.data() + 128), 64);  // inside: held
  EXPECT_EQ(freed, 1);
  buffers.release_completed();
  EXPECT_EQ(freed, 1) << "released before the op completed";
  done->finished = true;
  buffers.release_completed();
  EXPECT_EQ(freed, 2);
  EXPECT_TRUE(input_freed);
  EXPECT_EQ(buffers.tracked(), before);

  // The op's Work dropped before the op completed (an exception path): its buffers are
  // still held until it completes; bytes freed under two ops in flight go with the last.
  {
    std::atomic<bool> dropped_freed{false};
    auto first = std::make_shared<FakeDeviceEvent>(), second = std::make_shared<FakeDeviceEvent>();
    FakeDeviceEvent* first_raw = first.get();
    flatshard::comm::Collective op;
    op.kind = flatshard::comm::OpKind::AllReduce;
    op.input = at::from_blob(
        block.data(), {256}, [&](void*) { dropped_freed = true; }, at::kFloat);
    op.output = op.input;
    buffers.track(first, op);
    flatshard::comm::Collective next = op;
    buffers.track(second, next);
    op = {};
    next = {};
    first.reset();  // the caller dropped its Work
    buffers.retire(data_ptr(block.data() + 64), 64);
    buffers.release_completed();
    EXPECT_FALSE(dropped_freed) << "a dropped op's buffer freed before it completed";
    second->finished = true;
    buffers.release_completed();
    EXPECT_EQ(freed, 2) << "freed while the other op still uses the bytes";
    first_raw->finished = true;  // kept alive by the buffers
    buffers.release_completed();
    EXPECT_EQ(freed, 3);
    EXPECT_TRUE(dropped_freed);
    EXPECT_EQ(buffers.tracked(), before);
  }

  // Once a caller's stream waited for the op, nothing is held: the allocator may hand
  // the bytes to later work on that stream.
  auto waited = std::make_shared<FakeDeviceEvent>();
  {
    flatshard::comm::Collective op;
    op.kind = flatshard::comm::OpKind::AllReduce;
    op.input = at::from_blob(block.data(), {256}, at::kFloat);
    op.output = op.input;
    buffers.track(waited, op);
  }
  Stream issuer("issue");
  const Event event = issuer.submit_device([&] { return waited; });
  event.wait();  // the caller's stream waits: Event::wait tells the buffers
  EXPECT_EQ(waited->blocked_current, 1);
  buffers.retire(data_ptr(block.data() + 128), 64);
  EXPECT_EQ(freed, 4);
  EXPECT_EQ(buffers.tracked(), before);
}

TEST(DeviceScheduling, NoTransportForADeviceIsATypedError) {
  flatshard::World world;
  flatshard::CommunicatorOptions options;
  options.device = c10::Device(c10::DeviceType::XLA);
  try {
    flatshard::Communicator::create(world, options);
    ADD_FAILURE() << "created a communicator with no transport";
  } catch (const flatshard::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("no transport for device xla"), std::string::npos) << e.what();
  }
  options.device = c10::Device(c10::kCPU);
  options.transport = flatshard::Transport::Nccl;
  EXPECT_THROW(flatshard::Communicator::create(world, options), flatshard::InvalidArgument);
}

}  // namespace
