#include "flatshard/stream.h"

#include "src/comm/in_flight.h"

namespace flatshard {

struct Event::State {
  mutable std::mutex mutex;
  mutable std::condition_variable cv;
  bool done = false;                    // guarded by mutex
  std::exception_ptr error;             // guarded by mutex; set when the work threw
  std::shared_ptr<DeviceEvent> device;  // guarded by mutex; set with done

  void complete(std::exception_ptr e, std::shared_ptr<DeviceEvent> d = nullptr) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      done = true;
      error = std::move(e);
      device = std::move(d);
    }
    cv.notify_all();
  }
  void wait() const {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return done; });
  }
};

Event::Event() : state_(std::make_shared<State>()) { state_->done = true; }

bool Event::query() const {
  std::shared_ptr<DeviceEvent> device;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (!state_->done) return false;
    device = state_->device;
  }
  return !device || device->query();
}

// The host half: waits for it, rethrows its error, returns the device half.
std::shared_ptr<DeviceEvent> Event::wait_host() const {
  state_->wait();
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->error) std::rethrow_exception(state_->error);
  return state_->device;
}

void Event::wait() const {
  if (auto device = wait_host()) {
    device->block(nullptr);
    comm::InFlightBuffers::instance().waited(device.get());  // Note [Buffers a collective touches]
  }
}

void Event::synchronize() const {
  if (auto device = wait_host()) device->synchronize();
}

std::shared_ptr<DeviceEvent> Event::device() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->done ? state_->device : nullptr;
}

Stream::Stream(std::string name) : name_(std::move(name)), worker_([this] { run(); }) {}

Stream::~Stream() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

Event Stream::submit(std::function<void()> fn) {
  return submit_device([fn = std::move(fn)]() -> std::shared_ptr<DeviceEvent> {
    fn();
    return nullptr;
  });
}

Event Stream::submit_device(std::function<std::shared_ptr<DeviceEvent>()> fn) {
  Event event;
  auto state = event.state_;
  state->done = false;  // pending until `fn` has run (no thread has seen it yet)
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queue_.push_back([fn = std::move(fn), state] {
      try {
        auto device = fn();
        state->complete(nullptr, std::move(device));
      } catch (...) {
        state->complete(std::current_exception());
      }
    });
  }
  cv_.notify_one();
  return event;
}

void Stream::wait_event(const Event& event) {
  // Waiting does not fail this stream's work: the producer's error belongs to the
  // producer's Work, which its owner checks.
  auto state = event.state_;
  submit([state] { state->wait(); });
}

Event Stream::record() {
  return submit([] {});
}

void Stream::synchronize() { record().state_->wait(); }

void Stream::run() {
  for (;;) {
    std::function<void()> item;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping and drained
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    item();
  }
}

}  // namespace flatshard
