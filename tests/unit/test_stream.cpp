#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include "flatshard/stream.h"

namespace {

using flatshard::Event;
using flatshard::Stream;
using namespace std::chrono_literals;

TEST(Stream, RunsWorkInSubmissionOrder) {
  Stream s("test");
  std::vector<int> seen;
  for (int i = 0; i < 100; ++i) s.submit([&seen, i] { seen.push_back(i); });
  s.synchronize();
  ASSERT_EQ(seen.size(), 100u);
  for (int i = 0; i < 100; ++i) EXPECT_EQ(seen[i], i);
}

TEST(Stream, SubmitDoesNotBlockTheHost) {
  Stream s("test");
  std::atomic<bool> release{false};
  auto e = s.submit([&] {
    while (!release) std::this_thread::sleep_for(1ms);
  });
  EXPECT_FALSE(e.query());
  release = true;
  e.synchronize();
  EXPECT_TRUE(e.query());
}

TEST(Stream, ErrorsLandInTheEventOfTheirWork) {
  Stream s("test");
  auto bad = s.submit([] { throw std::runtime_error("boom"); });
  auto good = s.submit([] {});
  EXPECT_THROW(bad.synchronize(), std::runtime_error);
  EXPECT_NO_THROW(good.synchronize());
}

TEST(Stream, WaitEventOrdersWorkAcrossStreams) {
  Stream producer("producer"), consumer("consumer");
  std::atomic<int> value{0};
  std::atomic<bool> release{false};
  auto produced = producer.submit([&] {
    while (!release) std::this_thread::sleep_for(1ms);
    value = 42;
  });
  consumer.wait_event(produced);
  int seen = -1;
  auto consumed = consumer.submit([&] { seen = value; });
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(consumed.query()) << "the consumer ran before the producer's event";
  release = true;
  consumed.synchronize();
  EXPECT_EQ(seen, 42);
}

// An event no stream recorded is complete, as a CUDA event never recorded is: a stream
// told to wait for it (CollectiveOptions::wait_for = {Event()}) goes on at once instead of
// waiting forever.
TEST(Stream, AnEventNoStreamRecordedIsComplete) {
  const Event none;
  EXPECT_TRUE(none.query());
  EXPECT_NO_THROW(none.synchronize());
  Stream s("test");
  s.wait_event(none);
  auto after = s.submit([] {});
  const auto until = std::chrono::steady_clock::now() + 5s;
  while (!after.query() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(1ms);
  EXPECT_TRUE(after.query()) << "the stream still waits for an event nothing will complete";
}

TEST(Stream, TwoStreamsRunConcurrently) {
  Stream a("a"), b("b");
  std::atomic<bool> b_ran{false}, a_saw_b{false};
  // a's work waits (up to a deadline) for b's work to run, and records whether it saw it
  // while a was still running: run one after the other, a would give up first.
  auto ea = a.submit([&] {
    const auto until = std::chrono::steady_clock::now() + 5s;
    while (!b_ran && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(1ms);
    a_saw_b = b_ran.load();
  });
  b.submit([&] { b_ran = true; }).synchronize();
  ea.synchronize();
  EXPECT_TRUE(a_saw_b) << "b's work ran only after a's finished: the streams did not run concurrently";
}

TEST(Stream, DestructorDrainsQueuedWork) {
  std::atomic<int> done{0};
  {
    Stream s("test");
    for (int i = 0; i < 10; ++i)
      s.submit([&] {
        std::this_thread::sleep_for(1ms);
        ++done;
      });
  }
  EXPECT_EQ(done, 10);
}

}  // namespace
