// Streams and events on the CPU.
//
// A Stream is an ordered worker thread: work submitted to it runs one item at a time,
// in submission order, concurrently with the host and with other streams. An Event is
// a completion flag recorded on a stream; a consumer waits on it (the host through
// Event::synchronize, another stream through Stream::wait_event) instead of
// synchronizing everything. The CUDA build has the same shapes over CUDA streams.
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace flatshard {

class Event {
 public:
  Event();
  // True once the work it was recorded after has finished (successfully or not).
  bool query() const;
  // Blocks the host until complete; rethrows the error of the work it follows.
  void synchronize() const;

 private:
  friend class Stream;
  struct State;
  std::shared_ptr<State> state_;
};

class Stream {
 public:
  explicit Stream(std::string name);
  ~Stream();  // drains the queue, then joins the worker
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  const std::string& name() const { return name_; }

  // Enqueues `fn`; returns an event that completes when it has run. An exception
  // thrown by `fn` is stored in that event (and rethrown by synchronize()).
  Event submit(std::function<void()> fn);
  // Later work on this stream starts only after `event` completes.
  void wait_event(const Event& event);
  // An event that completes when everything submitted so far has run.
  Event record();
  // Blocks the host until everything submitted so far has run.
  void synchronize();

 private:
  void run();

  std::string name_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;  // guarded by mutex_
  bool stopping_ = false;                    // guarded by mutex_; set by the destructor
  std::thread worker_;
};

}  // namespace flatshard
