// Streams and events on the CPU.
//
// A Stream is an ordered worker thread: work submitted to it runs one item at a time,
// in submission order, concurrently with the host and with other streams. An Event is
// a completion flag recorded on a stream; a consumer waits on it (the host through
// Event::synchronize, another stream through Stream::wait_event) instead of
// synchronizing everything.
//
// On a device (CUDA) the same scheduling code runs: a stream's worker issues work to a
// device stream and hands back a DeviceEvent (a CUDA event recorded after it). The
// Event then has two halves: the host half completes when the work has been issued,
// the device half when the device has finished it. Event::wait() makes the caller
// wait the way its own work is ordered: the host on the CPU, the caller's current
// device stream on a device (the host waits only for the issue, never for the device).
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

// The device half of an Event (a CUDA event in the CUDA build).
class DeviceEvent {
 public:
  virtual ~DeviceEvent() = default;
  // True once the device has finished the work.
  virtual bool query() const = 0;
  // Blocks the host until the device has finished the work; throws if the device work
  // failed (a CommError for a collective).
  virtual void synchronize() const = 0;
  // Makes later work on `device_stream` (a cudaStream_t; null: the calling thread's
  // current stream) wait for the work, without blocking the host.
  virtual void block(void* device_stream) const = 0;
};

class Event {
 public:
  // An event no stream recorded: already complete, as a CUDA event never recorded is (a
  // wait on it returns at once). Streams hand out the events of their work.
  Event();
  // True once the work it was recorded after has finished (successfully or not), on
  // the device too.
  bool query() const;
  // Blocks the host until complete, on the device too; rethrows the error of the work
  // it follows.
  void synchronize() const;
  // The caller waits for the work: on the CPU the host blocks (as synchronize()); with a
  // device half, the host waits only until the work is issued (rethrowing an issue
  // error) and the caller's current device stream waits for the device.
  void wait() const;
  // The device half, once the host half is complete (null on the CPU).
  std::shared_ptr<DeviceEvent> device() const;

 private:
  friend class Stream;
  struct State;
  std::shared_ptr<DeviceEvent> wait_host() const;
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
  // As submit, for work that `fn` issues to a device: the DeviceEvent it returns (null:
  // none) becomes the event's device half.
  Event submit_device(std::function<std::shared_ptr<DeviceEvent>()> fn);
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
