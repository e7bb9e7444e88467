// Every collective over real ranks (1 to 4 processes through flatshard-run): sizes 0,
// 1, primes and sizes not divisible by the world size; Sum and Avg; several dtypes;
// in place and out of place; concurrent streams; contract violations.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <pthread.h>
#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <thread>
#include <vector>

#include "flatshard/flatshard.h"
#include "tests/support/multirank.h"

namespace {

using flatshard::Communicator;
using flatshard::ReduceOp;
using flatshard::shard_range;

const std::vector<std::int64_t> kSizes = {0, 1, 2, 3, 5, 7, 12, 13, 97, 1009, 65537, 300007};
const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kDouble, at::kLong, at::kInt, at::kBFloat16};

struct Rank {
  flatshard::World world;
  std::unique_ptr<Communicator> comm;
  int rank() const { return world.rank(); }
  int size() const { return world.world_size(); }
};

Rank join(std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  Rank r;
  r.world = flatshard::init();
  flatshard::CommunicatorOptions options;
  options.timeout = timeout;
  r.comm = Communicator::create(r.world, options);
  return r;
}

// A value every rank can compute for (rank, index), exact in every tested dtype.
at::Tensor pattern(std::int64_t numel, int rank, at::ScalarType dtype) {
  const std::int64_t modulus = dtype == at::kBFloat16 ? 7 : 997;
  auto base = at::arange(numel, at::kLong).remainder(modulus);
  return (base + rank * (dtype == at::kBFloat16 ? 8 : 1000)).to(dtype);
}

at::Tensor pattern_sum(std::int64_t numel, int world, at::ScalarType dtype) {
  auto sum = at::zeros({numel}, at::kDouble);
  for (int r = 0; r < world; ++r) sum += pattern(numel, r, at::kDouble).to(at::kDouble);
  if (dtype == at::kBFloat16) {  // the ring adds in bf16: small integers stay exact
    sum = at::zeros({numel}, at::kDouble);
    for (int r = 0; r < world; ++r) sum += pattern(numel, r, dtype).to(at::kDouble);
  }
  return sum;
}

TEST(Collectives, AllGatherEverySizeAndDtype) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4});
  Rank r = join();
  for (auto dtype : kDtypes) {
    for (std::int64_t numel : kSizes) {
      SCOPED_TRACE(::testing::Message() << "numel " << numel << " dtype " << dtype);
      const auto slot = shard_range(numel, r.size(), r.rank());
      auto expected = at::empty({numel}, dtype);
      for (int q = 0; q < r.size(); ++q) {
        const auto s = shard_range(numel, r.size(), q);
        expected.narrow(0, s.offset, s.numel).copy_(pattern(numel, q, dtype).narrow(0, s.offset, s.numel));
      }
      // Out of place.
      auto output = at::full({numel}, -1, dtype);
      auto input = pattern(numel, r.rank(), dtype).narrow(0, slot.offset, slot.numel).clone();
      r.comm->all_gather(output, input).wait();
      EXPECT_TRUE(at::equal(output, expected));
      // In place: the input is this rank's slot of the output.
      auto inplace = at::full({numel}, -1, dtype);
      auto my_slot = inplace.narrow(0, slot.offset, slot.numel);
      my_slot.copy_(input);
      r.comm->all_gather(inplace, my_slot).wait();
      EXPECT_TRUE(at::equal(inplace, expected));
    }
  }
}

TEST(Collectives, ReduceScatterSumAndAvgEverySize) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4});
  Rank r = join();
  for (auto dtype : kDtypes) {
    for (std::int64_t numel : kSizes) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
        if (op == ReduceOp::Avg && !at::isFloatingType(dtype)) continue;
        SCOPED_TRACE(::testing::Message()
                     << "numel " << numel << " dtype " << dtype << " avg " << (op == ReduceOp::Avg));
        const auto slot = shard_range(numel, r.size(), r.rank());
        auto input = pattern(numel, r.rank(), dtype);
        const auto input_before = input.clone();
        auto expected = pattern_sum(numel, r.size(), dtype).narrow(0, slot.offset, slot.numel);
        if (op == ReduceOp::Avg) expected = expected / r.size();
        auto output = at::empty({slot.numel}, dtype);
        r.comm->reduce_scatter(output, input, op).wait();
        const double tol = dtype == at::kBFloat16 ? 1e-2 : 1e-12;
        EXPECT_TRUE(at::allclose(output.to(at::kDouble), expected, tol, tol));
        EXPECT_TRUE(at::equal(input, input_before)) << "reduce_scatter modified its input";
        // Output aliasing this rank's slot of the input.
        auto aliased = input.narrow(0, slot.offset, slot.numel);
        r.comm->reduce_scatter(aliased, input, op).wait();
        EXPECT_TRUE(at::allclose(aliased.to(at::kDouble), expected, tol, tol));
      }
    }
  }
}

TEST(Collectives, AllReduceSumAndAvgEverySize) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4});
  Rank r = join();
  for (auto dtype : kDtypes) {
    for (std::int64_t numel : kSizes) {
      for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Avg}) {
        if (op == ReduceOp::Avg && !at::isFloatingType(dtype)) continue;
        SCOPED_TRACE(::testing::Message() << "numel " << numel << " dtype " << dtype);
        auto t = pattern(numel, r.rank(), dtype);
        auto expected = pattern_sum(numel, r.size(), dtype);
        if (op == ReduceOp::Avg) expected = expected / r.size();
        r.comm->all_reduce(t, op).wait();
        const double tol = dtype == at::kBFloat16 ? 1e-2 : 1e-12;
        EXPECT_TRUE(at::allclose(t.to(at::kDouble), expected, tol, tol));
      }
    }
  }
}

// Ops move elements: tensors of any shapes whose element counts fit give the results of
// their flat forms, at every world size (one rank too, where nothing is sent).
TEST(Collectives, TensorsOfAnyShapeWhoseCountsFit) {
  FLATSHARD_RUN_RANKS({1, 2});
  Rank r = join();
  const int n = r.size(), rank = r.rank();
  const auto values = [n](int q) { return at::arange(6 * n, at::kFloat) + 100 * q; };
  // reduce_scatter: an [n, 6] input into a [2, 3] output.
  auto output = at::empty({2, 3});
  r.comm->reduce_scatter(output, values(rank).view({n, 6}), ReduceOp::Sum).wait();
  auto want = at::zeros({6});
  for (int q = 0; q < n; ++q) want += values(q).narrow(0, 6 * rank, 6);
  EXPECT_TRUE(at::equal(output.view(-1), want)) << output;
  // all_gather: a [1, 6] input into an [n, 6] output.
  auto gathered = at::empty({n, 6});
  r.comm->all_gather(gathered, at::full({1, 6}, static_cast<float>(rank))).wait();
  for (int q = 0; q < n; ++q) EXPECT_TRUE(at::equal(gathered[q], at::full({6}, static_cast<float>(q)))) << q;
  // neighbor_exchange: a [3] input into a [2, 3] output.
  auto both = at::empty({2, 3});
  r.comm->neighbor_exchange(both, at::full({3}, static_cast<float>(rank))).wait();
  EXPECT_TRUE(at::equal(both[0], at::full({3}, static_cast<float>((rank + n - 1) % n)))) << both;
  EXPECT_TRUE(at::equal(both[1], at::full({3}, static_cast<float>((rank + 1) % n)))) << both;
}

TEST(Collectives, BroadcastFromEveryRoot) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4});
  Rank r = join();
  for (int root = 0; root < r.size(); ++root) {
    for (std::int64_t numel : kSizes) {
      SCOPED_TRACE(::testing::Message() << "root " << root << " numel " << numel);
      auto t = r.rank() == root ? pattern(numel, root, at::kFloat) : at::full({numel}, -1.0f);
      r.comm->broadcast(t, root).wait();
      EXPECT_TRUE(at::equal(t, pattern(numel, root, at::kFloat)));
    }
  }
}

TEST(Collectives, BarrierWaitsForTheLastRank) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4});
  Rank r = join();
  using Clock = std::chrono::system_clock;  // one machine: comparable across processes
  std::this_thread::sleep_for(std::chrono::milliseconds(150 * r.rank()));
  const double entered = std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
  r.comm->barrier().wait();
  const double left = std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
  auto times = at::zeros({r.size()}, at::kDouble);
  auto mine = times.narrow(0, r.rank(), 1);
  mine.fill_(entered);
  r.comm->all_gather(times, mine).wait();
  EXPECT_GE(left, times.max().item<double>()) << "left the barrier before the last rank entered it";
}

// Ops on different streams are independent: an all_gather completes while an
// all_reduce issued before it is still waiting for a late rank.
TEST(Collectives, StreamsRunConcurrently) {
  FLATSHARD_RUN_RANKS({2, 3});
  Rank r = join();
  const std::int64_t numel = 1 << 16;
  auto reduced = at::ones({numel});
  auto gathered = at::empty({numel});
  const auto slot = shard_range(numel, r.size(), r.rank());
  auto my_slot = gathered.narrow(0, slot.offset, slot.numel).fill_(static_cast<float>(r.rank()));
  if (r.rank() == 0) {
    auto ar = r.comm->all_reduce(reduced, ReduceOp::Sum);
    auto ag = r.comm->all_gather(gathered, my_slot);
    ag.wait();
    EXPECT_FALSE(ar.is_completed()) << "the all_gather waited for the all_reduce on another stream";
    ar.wait();
  } else {
    r.comm->all_gather(gathered, my_slot).wait();
    std::this_thread::sleep_for(std::chrono::milliseconds(1000));
    r.comm->all_reduce(reduced, ReduceOp::Sum).wait();
  }
  EXPECT_TRUE(at::equal(reduced, at::full({numel}, static_cast<float>(r.size()))));
  for (int q = 0; q < r.size(); ++q) {
    const auto s = shard_range(numel, r.size(), q);
    EXPECT_TRUE(at::all(gathered.narrow(0, s.offset, s.numel) == static_cast<float>(q)).item<bool>());
  }
  // A hand-off between streams: the reduce_scatter waits on the all_gather's event.
  auto source = at::empty({numel});
  auto source_slot = source.narrow(0, slot.offset, slot.numel).fill_(1.0f);
  auto gather = r.comm->all_gather(source, source_slot);
  auto out = at::empty({slot.numel});
  flatshard::CollectiveOptions after;
  after.wait_for = {gather.event()};
  r.comm->reduce_scatter(out, source, ReduceOp::Sum, after).wait();
  EXPECT_TRUE(at::equal(out, at::full({slot.numel}, static_cast<float>(r.size()))));
}

// Every op, over sizes that span several pieces, checked against its definition.
// `piece_numels`: fp32 sizes to add, each a number of elements per piece on some of the
// links (Note [Direct copies]): the ranks' segments are then a piece and one element more
// or less, differing by that element.
void check_every_op(const Rank& r, const std::vector<std::int64_t>& piece_numels = {}) {
  for (auto dtype : {at::kFloat, at::kLong, at::kBFloat16}) {
    std::vector<std::int64_t> numels = {0, 1, 13, 65537, 3000017};
    if (dtype == at::kFloat) {
      for (const std::int64_t piece : piece_numels) numels.push_back(r.size() * piece + 1);
    }
    for (std::int64_t numel : numels) {
      SCOPED_TRACE(::testing::Message() << "numel " << numel << " dtype " << dtype);
      const auto slot = shard_range(numel, r.size(), r.rank());
      const auto mine = pattern(numel, r.rank(), dtype);
      auto sum = pattern_sum(numel, r.size(), dtype);
      const double tol = dtype == at::kBFloat16 ? 1e-2 : 1e-12;
      auto gathered = at::full({numel}, -1, dtype);
      r.comm->all_gather(gathered, mine.narrow(0, slot.offset, slot.numel)).wait();
      for (int q = 0; q < r.size(); ++q) {
        const auto s = shard_range(numel, r.size(), q);
        EXPECT_TRUE(at::equal(gathered.narrow(0, s.offset, s.numel),
                              pattern(numel, q, dtype).narrow(0, s.offset, s.numel)));
      }
      auto scattered = at::empty({slot.numel}, dtype);
      r.comm->reduce_scatter(scattered, mine, ReduceOp::Sum).wait();
      EXPECT_TRUE(at::allclose(scattered.to(at::kDouble), sum.narrow(0, slot.offset, slot.numel), tol, tol));
      auto reduced = mine.clone();
      r.comm->all_reduce(reduced, ReduceOp::Sum).wait();
      EXPECT_TRUE(at::allclose(reduced.to(at::kDouble), sum, tol, tol));
      const int root = r.size() - 1;
      auto broadcast = r.rank() == root ? mine.clone() : at::full({numel}, -1, dtype);
      r.comm->broadcast(broadcast, root).wait();
      EXPECT_TRUE(at::equal(broadcast, pattern(numel, root, dtype)));
    }
  }
}

// Note [Direct copies] in src/tcp/ring_links.h: ranks of one machine copy each message out
// of the sender's memory; a link whose sender or receiver turns that off goes through
// its socket. Every op gives the same result with all links direct, none, or a mix
// (rank 1 turns it off, so the links into and out of it use the socket; at world 4 rank
// 3's links are all direct and rank 0 has one of each).
TEST(Collectives, DirectCopiesAndSocketsGiveTheSameResultsInAnyMix) {
  FLATSHARD_RUN_RANKS({2, 3, 4}, std::chrono::seconds(240));
  const flatshard::World world = flatshard::init();
  const int rank = world.rank(), size = world.world_size();
  for (int mix = 0; mix < 3; ++mix) {
    SCOPED_TRACE(::testing::Message() << "mix " << mix);
    flatshard::CommunicatorOptions options;
    options.timeout = std::chrono::seconds(60);
    options.name = "mix" + std::to_string(mix);
    options.direct_copy = mix == 0 || (mix == 2 && rank != 1);
    Rank r{world, Communicator::create(world, options)};
    const int prev = (rank + size - 1) % size;
    const bool expect_direct = mix == 0 || (mix == 2 && rank != 1 && prev != 1);
    EXPECT_EQ(r.comm->copies_directly(), expect_direct)
        << "(all direct: the kernel refused process_vm_readv between these ranks)";
    // fp32 pieces: 512 KiB on socket links, 4 MiB on direct ones.
    check_every_op(r, mix == 0 ? std::vector<std::int64_t>{1048576} : std::vector<std::int64_t>{131072});
  }
}

// Note [Rendezvous keys per creation]: ranks 0 and 1 make a communicator of a name on their
// subworld, then every rank makes one of that name on the world. It forms and reduces: the
// subworld's did not shift ranks 0 and 1's count of the world's (where it did, their keys
// and rank 2's differed, and creation waited out its deadline).
TEST(Collectives, ASubworldsCommunicatorDoesNotShiftTheWorldsKeys) {
  FLATSHARD_RUN_RANKS({3});
  const flatshard::World world = flatshard::init();
  flatshard::CommunicatorOptions options;
  options.timeout = std::chrono::seconds(20);
  options.name = "one-name";
  if (world.rank() < 2) {
    auto pair = Communicator::create(flatshard::subworld(world, {0, 1}, "pair"), options);
    auto t = at::ones({4});
    pair->all_reduce(t, ReduceOp::Sum).wait();
    EXPECT_EQ(t[0].item<float>(), 2.0f);
  }
  auto all = Communicator::create(world, options);
  auto t = at::ones({4});
  all->all_reduce(t, ReduceOp::Sum).wait();
  EXPECT_EQ(t[0].item<float>(), 3.0f);
}

// Communicator::bytes_sent counts what the rings send: over all ranks, an all-gather, a
// reduce-scatter and a broadcast of N bytes send (W-1)N, an all-reduce 2(W-1)N.
TEST(Collectives, BytesSentAddUpToTheRingTotals) {
  FLATSHARD_RUN_RANKS({1, 2, 3});
  Rank r = join();
  const std::int64_t numel = 1001;
  const double n_bytes = numel * 4.0, w = r.size();
  auto sent_by_all = [&](const std::function<void()>& op) {
    const auto before = r.comm->bytes_sent();
    op();
    auto mine = at::full({1}, static_cast<double>(r.comm->bytes_sent() - before), at::kDouble);
    r.comm->all_reduce(mine, ReduceOp::Sum).wait();
    return mine.item<double>();
  };
  const auto slot = shard_range(numel, r.size(), r.rank());
  auto full = at::ones({numel});
  auto part = at::ones({slot.numel});
  EXPECT_EQ(sent_by_all([&] { r.comm->all_gather(full, part).wait(); }), (w - 1) * n_bytes);
  EXPECT_EQ(sent_by_all([&] { r.comm->reduce_scatter(part, full, ReduceOp::Sum).wait(); }),
            (w - 1) * n_bytes);
  EXPECT_EQ(sent_by_all([&] { r.comm->all_reduce(full, ReduceOp::Sum).wait(); }), 2 * (w - 1) * n_bytes);
  EXPECT_EQ(sent_by_all([&] { r.comm->broadcast(full, r.size() - 1).wait(); }), (w - 1) * n_bytes);
}

TEST(Collectives, ContractViolationsThrowAndSendNothing) {
  FLATSHARD_RUN_RANKS({2});
  Rank r = join();
  auto bad_input = at::zeros({5});
  auto output = at::zeros({12});
  EXPECT_THROW(r.comm->all_gather(output, bad_input), flatshard::InvalidArgument);
  EXPECT_THROW(r.comm->reduce_scatter(at::zeros({5}), output, ReduceOp::Sum), flatshard::InvalidArgument);
  EXPECT_THROW(r.comm->all_reduce(at::zeros({4}, at::kLong), ReduceOp::Avg), flatshard::InvalidArgument);
  EXPECT_THROW(r.comm->broadcast(output, 7), flatshard::InvalidArgument);
  EXPECT_THROW(r.comm->all_reduce(at::zeros({4, 4}).t(), ReduceOp::Sum), flatshard::InvalidArgument);
  EXPECT_THROW(r.comm->all_gather(output, at::zeros({6}, at::kDouble)), flatshard::InvalidArgument);
  // The rings cannot sum booleans or complex numbers: refused before anything moves.
  EXPECT_THROW(r.comm->all_reduce(at::zeros({4}, at::kBool), ReduceOp::Sum), flatshard::InvalidArgument);
  EXPECT_THROW(r.comm->reduce_scatter(at::zeros({6}, at::kComplexFloat), at::zeros({12}, at::kComplexFloat),
                                      ReduceOp::Sum),
               flatshard::InvalidArgument);
  try {
    r.comm->broadcast(output, -1);
    FAIL() << "no error";
  } catch (const flatshard::InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("broadcast #1 on rank"), std::string::npos) << e.what();
  }
  // Nothing was sent: the communicator still works and numbering went on from 1.
  auto t = at::ones({12});
  auto w = r.comm->all_reduce(t, ReduceOp::Sum);
  w.wait();
  EXPECT_EQ(w.seq(), 1u);
  EXPECT_TRUE(at::equal(t, at::full({12}, 2.0f)));
}

TEST(Collectives, DifferentCollectivesAcrossRanksAreDetected) {
  FLATSHARD_RUN_RANKS({2, 3});
  Rank r = join(std::chrono::seconds(20));
  // Rank 0 all-reduces 10 elements, the others 12: a user bug.
  auto t = at::ones({r.rank() == 0 ? 10 : 12});
  const auto start = std::chrono::steady_clock::now();
  try {
    r.comm->all_reduce(t, ReduceOp::Sum).wait();
    FAIL() << "mismatched all_reduce completed";
  } catch (const flatshard::CommError& e) {
    EXPECT_EQ(e.op(), "all_reduce");
    EXPECT_EQ(e.seq(), 1u);
    EXPECT_EQ(e.rank(), r.rank());
    // Every rank reports the mismatch, also those that only saw a neighbour abort (Note
    // [The first failure]): none blames a lost peer that is alive.
    EXPECT_EQ(e.kind(), flatshard::CommError::Kind::Mismatch) << e.what();
    EXPECT_NE(std::string(e.what()).find("issued different collectives"), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  // The communicator is aborted: later ops fail at once.
  EXPECT_THROW(r.comm->barrier().wait(), flatshard::CommError);
  // Every rank has read the first failure before rank 0, whose process serves the store
  // that holds it, may exit.
  flatshard::CommunicatorOptions after;
  after.name = "after";
  Communicator::create(r.world, after)->barrier().wait();
}

// Same kind and size, different element type, reduction or broadcast root, or ops in
// another order: each names the diverging op on every rank instead of adding garbage (or,
// for the roots, instead of each rank keeping its own values as if broadcast).
TEST(Collectives, DifferentSignaturesOrOrderAcrossRanksAreNamed) {
  FLATSHARD_RUN_RANKS({2, 3});
  auto world = flatshard::init();
  for (int variant = 0; variant < 4; ++variant) {
    Rank r;
    r.world = world;
    flatshard::CommunicatorOptions options;
    options.timeout = std::chrono::seconds(20);
    options.name = "variant" + std::to_string(variant);
    r.comm = Communicator::create(world, options);
    const bool odd = r.rank() == 1;
    try {
      if (variant == 0) {  // float32 vs int32: the same bytes
        auto t = odd ? at::ones({12}, at::kInt) : at::ones({12});
        r.comm->all_reduce(t, ReduceOp::Sum).wait();
      } else if (variant == 1) {  // Sum vs Avg
        r.comm->all_reduce(at::ones({12}), odd ? ReduceOp::Avg : ReduceOp::Sum).wait();
      } else if (variant == 3) {  // every rank its own root: each would only send
        auto t = at::full({12}, static_cast<float>(r.rank()));
        r.comm->broadcast(t, r.rank()).wait();
      } else {  // on one stream: all_gather then reduce_scatter on rank 1, the reverse elsewhere
        auto full = at::ones({12 * r.size()}), mine = at::ones({12});
        flatshard::CollectiveOptions one_stream;
        one_stream.stream = flatshard::StreamRole::AllGather;
        if (odd) {
          r.comm->all_gather(full, mine, one_stream).wait();
          r.comm->reduce_scatter(mine, full, ReduceOp::Sum, one_stream).wait();
        } else {
          r.comm->reduce_scatter(mine, full, ReduceOp::Sum, one_stream).wait();
          r.comm->all_gather(full, mine, one_stream).wait();
        }
      }
      FAIL() << "variant " << variant << ": the mismatched collective completed";
    } catch (const flatshard::CommError& e) {
      EXPECT_EQ(e.seq(), 1u) << e.what();
      EXPECT_NE(e.kind(), flatshard::CommError::Kind::Timeout) << e.what();
      const std::string what = e.what();
      // Every rank, also one whose neighbour closed on it (the mismatch is the first
      // failure recorded, and the cascade reports it).
      EXPECT_EQ(e.kind(), flatshard::CommError::Kind::Mismatch) << what;
      EXPECT_NE(what.find("issued different collectives"), std::string::npos) << what;
      if (variant == 0) EXPECT_NE(what.find("Int"), std::string::npos) << what;
      if (variant == 1) EXPECT_NE(what.find("avg"), std::string::npos) << what;
      if (variant == 3) EXPECT_NE(what.find("root"), std::string::npos) << what;
    }
  }
}

// Note [Communication wait]: a rank that reaches a collective early waits for the late
// one; the clock charges that stall to the rank that waited, counts every timed wait,
// and counts nothing while off or after a reset.
TEST(Collectives, WaitTimeIsTheStallOfTheRankThatWaited) {
  FLATSHARD_RUN_RANKS({2, 3});
  Rank r = join();
  const auto late_ms = std::chrono::milliseconds(300);
  const bool late = r.rank() == r.size() - 1;

  auto t = at::ones({4096});
  r.comm->all_reduce(t, ReduceOp::Sum).wait();  // not timed
  EXPECT_EQ(r.comm->waited().waits, 0);

  r.comm->time_waits(true);
  for (int step = 0; step < 2; ++step) {
    if (late) std::this_thread::sleep_for(late_ms);
    r.comm->all_reduce(t, ReduceOp::Sum).wait();
  }
  // An op that completed before the wait: counted, with no stall to speak of.
  auto done = r.comm->barrier();
  done.synchronize();
  done.wait();
  const flatshard::CommunicationWait w = r.comm->waited();
  EXPECT_EQ(w.waits, 3);
  if (late) {
    EXPECT_LT(w.ms, 150.0) << "the late rank found the others waiting";
  } else {
    EXPECT_GE(w.ms, 0.8 * 2 * late_ms.count()) << "rank " << r.rank() << " waited for the late rank";
    EXPECT_LT(w.ms, 2 * late_ms.count() + 2000.0);
  }

  r.comm->reset_waited();
  EXPECT_EQ(r.comm->waited().waits, 0);
  EXPECT_EQ(r.comm->waited().ms, 0.0);
  r.comm->time_waits(false);
  if (late) std::this_thread::sleep_for(late_ms);
  r.comm->all_reduce(t, ReduceOp::Sum).wait();
  EXPECT_EQ(r.comm->waited().waits, 0);
  // A Work issued while timing was on stays timed (it carries the clock).
  r.comm->time_waits(true);
  auto timed = r.comm->all_reduce(t, ReduceOp::Sum);
  r.comm->time_waits(false);
  timed.wait();
  EXPECT_EQ(r.comm->waited().waits, 1);
}

// CommunicationWait::core_ms: the part of a wait the thread spent woken with no core to run
// on. Rank 0 waits 300 ms for a late rank three times: with a core of its own; pinned, at
// nice 19, to a CPU that four threads spinning at nice 0 take from a third of the way
// through the wait, so that once the op completes it waits there for a turn; and with the
// spinners gone. The first and last waits are nearly all blocking; in the second the wait
// for the CPU is counted, and is part of the wait.
TEST(Collectives, WaitingForACoreIsToldFromWaitingForTheOp) {
  FLATSHARD_RUN_RANKS({2});
  Rank r = join();
  const auto late_ms = std::chrono::milliseconds(300);
  auto t = at::ones({1024});
  r.comm->all_reduce(t, ReduceOp::Sum).wait();
  r.comm->time_waits(true);
  if (r.rank() == 1) std::this_thread::sleep_for(late_ms);
  r.comm->all_reduce(t, ReduceOp::Sum).wait();
  const flatshard::CommunicationWait free = r.comm->waited();
  if (r.rank() == 0) {
    EXPECT_GE(free.ms, 0.8 * late_ms.count());
    EXPECT_GE(free.core_ms, 0.0);
    EXPECT_LT(free.core_ms, 0.25 * free.ms) << "a thread with a core waits for the op, not for a core";
  }
  r.comm->barrier().wait();
  r.comm->reset_waited();

  if (r.rank() == 1) {
    for (int wait = 0; wait < 2; ++wait) {  // the starved wait, then one with a core again
      std::this_thread::sleep_for(late_ms);
      r.comm->all_reduce(t, ReduceOp::Sum).wait();
      r.comm->barrier().wait();
    }
    return;
  }
  auto work = r.comm->all_reduce(t, ReduceOp::Sum);
  cpu_set_t mine;
  ASSERT_EQ(pthread_getaffinity_np(pthread_self(), sizeof(mine), &mine), 0);
  int cpu = 0;
  while (!CPU_ISSET(cpu, &mine)) ++cpu;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpu, &one);
  std::atomic<bool> spin{true};
  std::vector<std::thread> spinners;
  struct Stop {  // the spinners stop however the test ends
    std::atomic<bool>& spin;
    std::vector<std::thread>& spinners;
    void now() {
      spin = false;
      for (auto& s : spinners) s.join();
      spinners.clear();
    }
    ~Stop() { now(); }
  } stop{spin, spinners};
  for (int i = 0; i < 4; ++i) {
    spinners.emplace_back([&] {  // from a third of the way through the wait
      pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
      std::this_thread::sleep_for(late_ms / 3);
      while (spin.load(std::memory_order_relaxed)) {
      }
    });
  }
  ASSERT_EQ(pthread_setaffinity_np(pthread_self(), sizeof(one), &one), 0);
  ASSERT_EQ(setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), 19), 0);
  work.wait();
  const flatshard::CommunicationWait starved = r.comm->waited();
  stop.now();
  EXPECT_EQ(pthread_setaffinity_np(pthread_self(), sizeof(mine), &mine), 0);
  EXPECT_EQ(starved.waits, 1);
  EXPECT_GE(starved.ms, 0.8 * late_ms.count());
  EXPECT_GT(starved.core_ms, 1.0) << "woken on a CPU four threads hold, it waited for a turn";
  EXPECT_LE(starved.core_ms, starved.ms);
  EXPECT_GE(starved.ms - starved.core_ms, 0.8 * late_ms.count()) << "the rest is the wait for the late rank";
  // The spinners gone, a wait counts only its own turn in the queue, not the thread's delay
  // so far.
  r.comm->barrier().wait();
  r.comm->reset_waited();
  r.comm->all_reduce(t, ReduceOp::Sum).wait();
  const flatshard::CommunicationWait after = r.comm->waited();
  r.comm->barrier().wait();
  EXPECT_EQ(after.waits, 1);
  EXPECT_GE(after.ms, 0.8 * late_ms.count());
  EXPECT_LT(after.core_ms, 0.25 * after.ms);
}

// Note [Waiting for peers]: a rank that reaches an op before the last rank has issued it
// waits for that peer; ranks that issue a large op together wait for the op itself. The
// split is a collective call that refuses, on every rank, windows the ranks timed
// differently or a record with a gap in it.
TEST(Collectives, WaitingForALateRankIsToldFromWaitingForTheOp) {
  FLATSHARD_RUN_RANKS({2, 3});
  Rank r = join();
  const auto late_ms = std::chrono::milliseconds(300);
  const bool late = r.rank() == r.size() - 1;
  auto small = at::ones({1024});

  r.comm->time_waits(true);
  for (int step = 0; step < 2; ++step) {
    if (late) std::this_thread::sleep_for(late_ms);
    r.comm->all_reduce(small, ReduceOp::Sum).wait();
  }
  flatshard::PeerWait w = r.comm->waited_for_peers();
  const flatshard::CommunicationWait total = r.comm->waited();
  EXPECT_EQ(w.ms, total.ms);
  EXPECT_EQ(w.waits, 2);
  EXPECT_LE(w.peer_ms, w.ms);
  EXPECT_GE(w.peer_ms, 0.0);
  if (late) {
    EXPECT_LT(w.ms, 150.0) << "the late rank found the others waiting";
  } else {
    EXPECT_GE(w.peer_ms, 0.8 * 2 * late_ms.count()) << "rank " << r.rank() << " waited for the late rank";
    EXPECT_LT(w.op_ms(), 150.0) << "a 4 KiB all-reduce takes well under a millisecond once every rank is in";
  }

  // Read again, with a timed op in between that found every rank there: the window goes on
  // past the split's own collectives.
  r.comm->all_reduce(small, ReduceOp::Sum).wait();
  const flatshard::PeerWait again = r.comm->waited_for_peers();
  EXPECT_GE(again.peer_ms, w.peer_ms);
  EXPECT_LT(again.peer_ms, w.peer_ms + 0.5 * late_ms.count());
  EXPECT_EQ(again.waits, 3);

  // Every rank issues three 32 MiB all-reduces in a row, together: the waits are the ops'.
  r.comm->time_waits(false);
  r.comm->reset_waited();
  auto large = at::ones({8 << 20});
  r.comm->barrier().wait();
  r.comm->time_waits(true);
  for (int i = 0; i < 3; ++i) r.comm->all_reduce(large, ReduceOp::Sum).wait();
  w = r.comm->waited_for_peers();
  EXPECT_EQ(large[0].item<float>(), std::pow(static_cast<float>(r.size()), 3.0f));
  EXPECT_GT(w.op_ms(), 5.0) << "the ranks moved 3 x 32 MiB each";
  EXPECT_GT(w.op_ms(), 2 * w.peer_ms) << "rank " << r.rank() << " split " << w.peer_ms << " ms of " << w.ms
                                      << " ms to peers that issued the ops together";

  // Windows the ranks timed differently, or a record with a gap: InvalidArgument everywhere,
  // and the communicator goes on.
  auto refused = [&](const char* says) {
    try {
      r.comm->waited_for_peers();
      ADD_FAILURE() << "rank " << r.rank() << ": the split was not refused (" << says << ")";
    } catch (const flatshard::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("rank " + std::to_string(r.rank())), std::string::npos)
          << e.what();
    }
  };
  r.comm->time_waits(false);
  r.comm->reset_waited();
  r.comm->time_waits(r.rank() == 0);
  r.comm->all_reduce(small, ReduceOp::Sum).wait();
  refused("time_waits() at the same point on every rank");
  r.comm->time_waits(true);
  r.comm->reset_waited();
  r.comm->all_reduce(small, ReduceOp::Sum).wait();
  r.comm->time_waits(false);
  r.comm->all_reduce(small, ReduceOp::Sum).wait();
  r.comm->time_waits(true);
  r.comm->all_reduce(small, ReduceOp::Sum).wait();
  refused("stopped");
  r.comm->barrier().wait();
}

}  // namespace
