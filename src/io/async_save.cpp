// Asynchronous sharded checkpoints (checkpoint::AsyncSaver): a host copy of what this rank
// writes, then save_sharded's writing and commit on a thread of the saver, over a
// communicator of its own.
#include <cerrno>
#include <chrono>
#include <functional>
#include <system_error>
#include <thread>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "flatshard/checkpoint.h"
#include "src/io/files.h"
#include "src/io/shard_files.h"
#include "src/logging.h"

namespace flatshard::checkpoint {

// Note [One writer thread, one communicator]: the thread that writes a save runs the
// commit's collectives (the shard files' indexes, the agreement on failures) on the saver's
// own communicator, which nothing else uses, while training's collectives run on the
// wrapper's. Each communicator sees its ops in the same order on every rank, so the two
// never interleave differently across ranks. At most one save is in flight: the next one
// (or wait()) joins the thread first.
struct AsyncSaver::State {
  std::unique_ptr<Communicator> comm;
  FullyShardBase* fsdp = nullptr;
  std::thread writer;
  // Written by the writer thread, read after joining it.
  std::string failure;      // empty: the last save succeeded
  std::string failed_root;  // the root it was saving under
  CheckpointInfo info;
  // The host copy's tensors, kept from one save to the next and copied into again.
  std::vector<at::Tensor> copies;
  double blocking_ms = 0;
  std::int64_t copy_bytes = 0;

  // Joins the writer; throws its failure (once).
  void join() {
    if (!writer.joinable()) return;
    writer.join();
    if (failure.empty()) return;
    const std::string what = std::move(failure);
    failure.clear();
    throw CheckpointError(failed_root, what);
  }
};

AsyncSaver::AsyncSaver(FullyShardBase& fsdp, const AsyncSaverOptions& options)
    : state_(std::make_unique<State>()) {
  CommunicatorOptions co;
  co.name = "async_checkpoint";
  co.timeout = options.timeout;
  state_->comm = Communicator::create(fsdp.world(), co);
  state_->fsdp = &fsdp;
}

AsyncSaver::~AsyncSaver() {
  try {
    state_->join();
  } catch (const std::exception& e) {
    log::at(log::Level::Error, "AsyncSaver: the last asynchronous save failed: {}", e.what());
  }
}

void AsyncSaver::save(const std::string& root, const optim::ShardOptimizer* optimizer,
                      const SaveOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  try {
    state_->join();
  } catch (const CheckpointError& e) {  // the save before this one failed in the background
    throw CheckpointError(e.path(), fmt::format("{}; the save of step {} under '{}' was not started: call "
                                                "save() again (on every rank) once the cause is dealt with",
                                                e.what(), options.step, root));
  }
  const int rank = state_->comm->rank();
  State* s = state_.get();
  s->failed_root = root;
  // Registered now, on this thread: a save or load under the root from here on is refused
  // until the writer is done (Note [One save at a time under a root]).
  auto underway = std::make_shared<const shards::SaveUnderway>(root);
  // Starts the writer thread. Out of threads, this rank answers the save's first agreement
  // here with the failure (the other ranks' writers wait in it), and throws what every rank
  // throws.
  // `make` builds the thread's work (its captures allocate): out of memory there too, the
  // rank answers the agreement rather than leave the others waiting in it.
  const auto start_writer = [&](const std::function<std::function<void()>()>& make) {
    try {
      if (io::fault_injected("thread")) throw std::system_error(EAGAIN, std::generic_category());
      s->writer = std::thread(make());
    } catch (const std::system_error& e) {
      shards::agree(*s->comm, root, shards::kStartingTheSave,
                    fmt::format("starting the writer thread: {}; the process is out of threads", e.what()));
    } catch (const std::exception& e) {
      shards::agree(*s->comm, root, shards::kStartingTheSave,
                    "starting the writer thread: " + shards::reason_of(e));
    }
  };
  shards::Holding copy;
  try {
    copy = shards::snapshot(shards::hold_for_save(*state_->fsdp, optimizer, options), rank, &state_->copies);
  } catch (const std::exception& e) {
    // The other ranks' writers are already at the save's first agreement: this rank's
    // writer answers it with the failure, which every rank then throws at its next call.
    const std::string why = "copying this rank's shard to the host: " + shards::reason_of(e);
    start_writer([&] {
      return std::function<void()>([s, root, why, underway] {
        try {
          shards::agree(*s->comm, root, shards::kStartingTheSave, why);
        } catch (const std::exception& failed) {
          s->failure = failed.what();
        }
      });
    });
    return;
  }
  std::int64_t bytes = 0;
  for (const auto& seg : copy.segments) bytes += static_cast<std::int64_t>(seg.values.nbytes());
  for (const auto& [name, t] : copy.buffers) bytes += static_cast<std::int64_t>(t.nbytes());
  state_->copy_bytes = bytes;
  start_writer([&] {
    SaveOptions background = options;  // the pointers were read into the copy's training state
    background.scheduler = nullptr;
    background.scaler = nullptr;
    background.sampler = nullptr;
    return std::function<void()>(
        [s, root, background, held = std::make_shared<shards::Holding>(std::move(copy)), underway] {
          try {
            s->info = shards::save(root, *s->comm, *held, background, underway);
          } catch (const CommError& e) {  // a rank died, or did not answer within the timeout
            s->failure =
                std::string(e.what()) +
                "; this saver's communicator is closed: build a new AsyncSaver on every rank (or restart the "
                "job)";
          } catch (const std::exception& e) {  // CheckpointError
            s->failure = e.what();
          }
        });
  });
  state_->blocking_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

CheckpointInfo AsyncSaver::wait() {
  state_->join();
  return state_->info;
}

bool AsyncSaver::in_flight() const { return state_->writer.joinable(); }
double AsyncSaver::last_blocking_ms() const { return state_->blocking_ms; }
std::int64_t AsyncSaver::last_copy_bytes() const { return state_->copy_bytes; }

}  // namespace flatshard::checkpoint
