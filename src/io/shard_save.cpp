// Sharded checkpoints: saving. Every rank writes the pieces of parameters and optimizer
// state it owns into its own file; rank 0 writes metadata.json, which says, for every
// tensor, which file holds which element range (with a CRC-32 per piece). Also the
// format's small helpers and the agreement every collective step ends with.
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <new>
#include <set>

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fmt/format.h>
#include <zlib.h>
#include <nlohmann/json.hpp>

#include "src/errors.h"
#include "src/io/files.h"
#include "src/io/shard_files.h"
#include "src/logging.h"

namespace flatshard::checkpoint::shards {

using json = nlohmann::json;
using io::errno_reason;
using io::exists;
using io::fsync_dir;
using io::list_dir;
using io::make_dirs;
using io::remove_tree;

// --- dtypes, checksums, names -------------------------------------------------------------

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default:
      throw InvalidArgument(fmt::format("flatshard::checkpoint: cannot save dtype {}", c10::toString(t)));
  }
}

std::optional<at::ScalarType> dtype_of(const std::string& name) {
  static const std::map<std::string, at::ScalarType> names = {
      {"float32", at::kFloat}, {"float64", at::kDouble}, {"float16", at::kHalf}, {"bfloat16", at::kBFloat16},
      {"int64", at::kLong},    {"int32", at::kInt},      {"int16", at::kShort},  {"int8", at::kChar},
      {"uint8", at::kByte},    {"bool", at::kBool}};
  auto it = names.find(name);
  if (it == names.end()) return std::nullopt;
  return it->second;
}

std::uint32_t crc32_of(const void* data, std::size_t n) {
  uLong crc = ::crc32(0L, Z_NULL, 0);
  const auto* p = static_cast<const Bytef*>(data);
  while (n > 0) {
    const auto chunk = static_cast<uInt>(std::min<std::size_t>(n, std::size_t{1} << 30));
    crc = ::crc32(crc, p, chunk);
    p += chunk;
    n -= chunk;
  }
  return static_cast<std::uint32_t>(crc);
}

std::string shard_file_name(int rank, int world_size) {
  return fmt::format("shard-{:05d}-of-{:05d}.bin", rank, world_size);
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw CheckpointError(path, "flatshard::checkpoint: " + what);
}

// --- agreement ---------------------------------------------------------------------------

// Note [Waiting for the other ranks' files]
// The agreements of a save or a load follow each rank's writing or reading of its files,
// and on a large model over a slow shared file system one rank can take minutes longer
// than another: the others wait for it there. Those waits have a deadline of their own,
// 30 minutes (or the communicator's deadline where that is longer; the environment
// variable FLATSHARD_IO_TIMEOUT_S sets it), not the training collectives' (5 minutes by
// default, sized for one step): a save is not failed for being slow, and a rank that hangs
// or dies is still found.
std::chrono::milliseconds file_wait(const Communicator& comm) {
  std::chrono::milliseconds wait = std::chrono::minutes(30);
  if (const char* set = std::getenv("FLATSHARD_IO_TIMEOUT_S"); set != nullptr && *set != '\0') {
    double seconds = 0;
    const auto [end, error] = std::from_chars(set, set + std::strlen(set), seconds);
    if (error != std::errc() || *end != '\0' || !(seconds > 0) || seconds > 1e9) {
      throw InvalidArgument(fmt::format(
          "flatshard::checkpoint (rank {}/{}): FLATSHARD_IO_TIMEOUT_S='{}' is not a positive number of "
          "seconds; set it to how long a rank may wait for the other ranks' checkpoint files (default 1800)",
          comm.rank(), comm.world_size(), set));
    }
    return std::chrono::milliseconds(static_cast<std::int64_t>(seconds * 1000.0));
  }
  return std::max(wait, comm.timeout());
}

// Every rank's string, on every rank (a collective). Carries indexes and failures, so
// that one rank's error reaches all of them instead of leaving them waiting.
// The bytes travel through tensors of the communicator's device (a GPU's, for a model
// sharded there) and are read back on the host. Each wait is file_wait's.
std::vector<std::string> exchange_strings(Communicator& comm, const std::string& mine) {
  CollectiveOptions waiting;
  waiting.timeout = file_wait(comm);
  const int n = comm.world_size();
  const auto on_device = at::TensorOptions().device(comm.device());
  auto lengths = at::empty({n}, on_device.dtype(at::kLong));
  auto my_length = at::full({1}, static_cast<std::int64_t>(mine.size()), on_device.dtype(at::kLong));
  comm.all_gather(lengths, my_length, waiting).wait();
  lengths = lengths.cpu();
  std::int64_t most = 1;
  for (int r = 0; r < n; ++r) most = std::max(most, lengths[r].item<std::int64_t>());
  auto slot = at::zeros({most}, at::kByte);
  std::memcpy(slot.data_ptr(), mine.data(), mine.size());
  auto all = at::zeros({n * most}, on_device.dtype(at::kByte));
  comm.all_gather(all, slot.to(comm.device()), waiting).wait();
  all = all.cpu();
  std::vector<std::string> out;
  const auto* bytes = reinterpret_cast<const char*>(all.data_ptr());
  for (int r = 0; r < n; ++r)
    out.emplace_back(bytes + r * most, static_cast<std::size_t>(lengths[r].item<std::int64_t>()));
  return out;
}

std::string reason_of(const std::exception& e) {
  std::string what = e.what();
  if (dynamic_cast<const Error*>(&e) == nullptr) {
    what = first_line(e.what());
    if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) what += " (this rank's host memory is exhausted)";
  }
  const std::string prefix = "flatshard::checkpoint: ";
  if (what.rfind(prefix, 0) == 0) what.erase(0, prefix.size());
  return what;
}

// Throws on every rank when any rank failed (its message starts with "!"), naming the
// first rank that failed, on that rank too.
void agree(Communicator& comm, const std::string& path, const std::string& what, const std::string& failure) {
  const auto all = exchange_strings(comm, failure.empty() ? std::string() : "!" + failure);
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    if (all[r].empty()) continue;
    fail(path, fmt::format("{} failed on rank {} of {}: {}", what, r, all.size(), all[r].substr(1)));
  }
}

// --- saving ----------------------------------------------------------------------------

namespace {
std::mutex& underway_mutex() {
  static std::mutex m;
  return m;
}
std::set<std::string>& underway() {
  static std::set<std::string> roots;
  return roots;
}
// One name for one directory: absolute, symbolic links resolved where they exist, no
// trailing separator.
std::string absolute_root(const std::string& root) {
  std::error_code failed;
  std::filesystem::path p = std::filesystem::weakly_canonical(root, failed);
  if (failed) p = std::filesystem::path(root).lexically_normal();
  std::string out = p.string();
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  return out;
}
}  // namespace

SaveUnderway::SaveUnderway(const std::string& root) : root_(absolute_root(root)) {
  std::lock_guard<std::mutex> lock(underway_mutex());
  clashes_ = !underway().insert(root_).second;
}

SaveUnderway::~SaveUnderway() {
  if (clashes_) return;
  std::lock_guard<std::mutex> lock(underway_mutex());
  underway().erase(root_);
}

bool SaveUnderway::under(const std::string& root) {
  std::lock_guard<std::mutex> lock(underway_mutex());
  return underway().count(absolute_root(root)) > 0;
}

namespace {

struct Piece {
  std::string key, kind;
  std::vector<std::int64_t> shape;
  at::Tensor data;     // contiguous
  std::int64_t begin;  // first element within the tensor
};

// Note [Device shards]
// Pieces of a model sharded on a GPU are staged into page-locked host memory: every
// piece's copy is queued on the current stream, then the host waits once, so the device
// is held for the copies alone. Loading reads into host memory and copies into the
// device tensors.
void stage_on_host(std::vector<Piece>& pieces) {
  std::optional<c10::Device> device;
  for (auto& p : pieces) {
    if (p.data.device().is_cpu()) continue;
    device = p.data.device();
    auto host = at::empty(p.data.sizes(), p.data.options().device(at::kCPU).pinned_memory(true));
    host.copy_(p.data, /*non_blocking=*/true);
    p.data = std::move(host);
  }
  if (device) c10::impl::VirtualGuardImpl(device->type()).getStream(*device).synchronize();
}

std::vector<Piece> pieces_to_write(const Holding& h, int rank) {
  std::vector<Piece> out;
  std::set<std::string> empty_written;  // a span may be listed in several segments
  for (const auto& seg : h.segments) {
    for (const auto& span : seg.spans) {
      if (span.numel == 0) {  // no rank's range holds it: rank 0 writes its one empty piece
        if (rank == 0 && seg.values.defined() && empty_written.insert(span.key).second)
          out.push_back({span.key, seg.kind, span.shape, seg.values.narrow(0, 0, 0).contiguous(), 0});
        continue;
      }
      const std::int64_t lo = std::max(span.offset, seg.write_begin);
      const std::int64_t hi = std::min(span.offset + span.numel, seg.write_end);
      if (lo >= hi) continue;
      out.push_back({span.key, seg.kind, span.shape,
                     seg.values.narrow(0, lo - seg.begin, hi - lo).contiguous(), lo - span.offset});
    }
  }
  if (rank == 0) {
    for (const auto& [name, t] : h.buffers) {
      out.push_back({name, "buffer", t.sizes().vec(), t.detach().contiguous().reshape({-1}), 0});
    }
  }
  stage_on_host(out);
  return out;
}

}  // namespace

Holding snapshot(const Holding& h, int rank, std::vector<at::Tensor>* reuse) {
  Holding out = h;
  std::optional<c10::Device> device;
  std::size_t next = 0;  // in *reuse
  auto copy = [&](const at::Tensor& t) {
    const bool on_device = !t.device().is_cpu();
    if (on_device) device = t.device();
    at::Tensor host;
    if (reuse && next < reuse->size()) {
      const at::Tensor& old = (*reuse)[next];
      if (old.scalar_type() == t.scalar_type() && old.sizes() == t.sizes() && (!on_device || old.is_pinned()))
        host = old;
    }
    if (!host.defined()) host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(on_device));
    host.copy_(t.detach(), /*non_blocking=*/on_device);
    if (reuse) {
      if (next < reuse->size()) {
        (*reuse)[next] = host;
      } else {
        reuse->push_back(host);
      }
    }
    ++next;
    return host;
  };
  for (auto& seg : out.segments) {
    // Only the share this rank writes; the segment now begins where that share does.
    seg.values = copy(seg.values.narrow(0, seg.write_begin - seg.begin, seg.write_end - seg.write_begin));
    seg.begin = seg.write_begin;
  }
  out.buffers.clear();
  if (rank == 0) {
    for (const auto& [name, t] : h.buffers) out.buffers.emplace_back(name, copy(t));
  }
  if (device) c10::impl::VirtualGuardImpl(device->type()).getStream(*device).synchronize();
  return out;
}

namespace {

// Writes this rank's pieces into `path` and returns its index (JSON).
json write_shard_file(const std::vector<Piece>& pieces, const std::string& path, const std::string& file) {
  io::SequentialFile out(path);
  json index = json::array();
  for (const auto& p : pieces) {
    const auto* bytes = static_cast<const char*>(p.data.data_ptr());
    const std::size_t n = p.data.nbytes();
    // A large piece goes to the disk from where it lies, after at most 4 KiB of padding
    // (Note [Writing around the page cache]); the index says where each piece begins.
    if (n >= (std::size_t{1} << 20)) out.align_with(bytes);
    const std::int64_t offset = out.size();
    // Each chunk is checksummed and then written: a few large writes per piece, each read
    // soon after its checksum (Note [Checksums per chunk]); the piece's CRC combines them.
    uLong crc = ::crc32(0L, Z_NULL, 0);
    json chunk_crcs = json::array();
    for (std::size_t done = 0; done < n;) {
      const std::size_t chunk = std::min<std::size_t>(n - done, static_cast<std::size_t>(kCrcChunkBytes));
      const uLong c = ::crc32(::crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(bytes + done),
                              static_cast<uInt>(chunk));
      crc = ::crc32_combine(crc, c, static_cast<z_off_t>(chunk));
      chunk_crcs.push_back(static_cast<std::uint32_t>(c));
      out.append(bytes + done, chunk);
      done += chunk;
    }
    json entry = {{"key", p.key},
                  {"kind", p.kind},
                  {"shape", p.shape},
                  {"dtype", dtype_name(p.data.scalar_type())},
                  {"file", file},
                  {"byte_offset", offset},
                  {"begin", p.begin},
                  {"numel", p.data.numel()},
                  {"crc32", static_cast<std::uint32_t>(crc)}};
    if (chunk_crcs.size() > 1) entry["chunk_crc32"] = std::move(chunk_crcs);
    index.push_back(std::move(entry));
  }
  out.finish();
  return index;
}

std::string step_dir_name(std::int64_t step) { return fmt::format("step-{:09d}", step); }

// Swaps two directories in one rename (Linux's renameat2 with RENAME_EXCHANGE); false where
// the kernel or the file system cannot.
bool swap_dirs(const std::string& a, const std::string& b) {
  constexpr unsigned kExchange = 1U << 1;  // RENAME_EXCHANGE
  if (::syscall(SYS_renameat2, AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), kExchange) == 0) return true;
  const int err = errno;
  if (err == EINVAL || err == ENOSYS || err == ENOTSUP || err == EPERM) return false;
  fail(b, fmt::format("cannot swap '{}' with '{}': {}", a, b, errno_reason(err)));
}

}  // namespace

// Note [Checkpoint directories]
// root/step-<S>/ is written as root/.step-<S>.tmp/ (every rank's shard file, fsynced,
// then rank 0's metadata.json) and renamed into place when complete; then root/latest
// is replaced atomically by a file naming it, and only then are older checkpoints
// beyond keep_last removed. A process killed at any point leaves root/latest naming a
// complete checkpoint (the new one or the previous one).
// Note [Keeping checkpoints after a rewind]
// keep_last keeps the newest checkpoints by step. A job that went back to an earlier step
// (loaded step-100 by its path after a loss spike, with step-110 to step-150 under the
// root) saves steps below ones already there. Pruning by step then would keep the run it
// left and delete the one it is on, its own saves first. So while any checkpoint of a later
// step than the one saved exists, nothing is pruned (a warning names them); each save of
// the new run replaces the old one of its step, and once its step is the highest again,
// keep_last prunes as before. A checkpoint of the run left behind whose step the new run
// never saves (it saves at other intervals) is pruned then by its step like any other.
CheckpointInfo save(const std::string& root, Communicator& comm, const Holding& h, const SaveOptions& options,
                    std::shared_ptr<const SaveUnderway> underway) {
  const int rank = comm.rank(), n = comm.world_size();
  const std::string name = step_dir_name(options.step);
  const std::string tmp = fmt::format("{}/.{}.tmp", root, name);
  const std::string final_dir = root + "/" + name;
  if (!underway)
    underway = std::make_shared<const SaveUnderway>(root);  // Note [One save at a time under a root]
  if (options.on_stage) options.on_stage(SaveStage::Copied);
  std::string failure;
  if (underway->clashes()) {
    failure = fmt::format(
        "another save under '{}' is still in flight in this process (an AsyncSaver's?): wait "
        "for it (AsyncSaver::wait) before saving again",
        root);
  } else if (rank == 0) {
    try {
      make_dirs(root);
      remove_tree(tmp);
      if (::mkdir(tmp.c_str(), 0755) != 0)
        fail(tmp, fmt::format("cannot create '{}': {}", tmp, errno_reason(errno)));
    } catch (const std::exception& e) {
      failure = reason_of(e);
    }
  }
  try {
    agree(comm, root, kStartingTheSave, failure);
  } catch (const std::exception&) {
    if (rank == 0) remove_tree(tmp);  // made here while another rank failed
    throw;
  }

  // Note [Indexes beside the shards]: each rank writes where its pieces lie (its index)
  // beside its shard file, and only rank 0, which writes metadata.json, reads them; the
  // ranks exchange only their failures. Exchanged, every rank would receive every rank's
  // index (tens of kilobytes each for an 8B model): tens of megabytes per rank at a
  // thousand ranks, growing with the square of the world.
  const auto index_path = [&](int r) { return fmt::format("{}/{}.index.json", tmp, shard_file_name(r, n)); };
  try {
    const std::string file = shard_file_name(rank, n);
    const std::string index = write_shard_file(pieces_to_write(h, rank), tmp + "/" + file, file).dump();
    io::write_file_atomically(index_path(rank), std::vector<char>(index.begin(), index.end()));
  } catch (const std::exception& e) {  // an Error, or the host out of memory: every rank must hear
    failure = reason_of(e);
  }
  const auto reached = [&](SaveStage stage) {
    if (options.on_stage) options.on_stage(stage);
  };
  if (failure.empty()) reached(SaveStage::ShardWritten);
  const auto failures = exchange_strings(comm, failure.empty() ? std::string() : "!" + failure);
  for (int r = 0; r < n; ++r) {
    if (!failures[r].empty()) {
      if (rank == 0) remove_tree(tmp);
      fail(root, fmt::format("saving step {} failed on rank {} of {}: {}; the previous checkpoint is intact",
                             options.step, r, n, failures[r].substr(1)));
    }
  }

  if (rank == 0) {
    try {
      json meta;
      meta["format"] = kFormat;
      meta["version"] = kFormatVersion;
      meta["world_size"] = n;
      meta["mode"] = h.mode;
      meta["step"] = options.step;
      meta["optimizer_state"] = h.has_optimizer ? json(h.state_names) : json(nullptr);
      meta["optimizer_steps"] = h.steps;
      meta["bucket_order"] = h.bucket_order;
      if (!h.training.empty()) meta["training"] = json::parse(h.training);
      json tensors = json::object();
      for (int r = 0; r < n; ++r) {
        // Every rank's files must be where rank 0 renames the directory: a root on each
        // node's own disk would publish a checkpoint without the other nodes' shards.
        const std::string shard = tmp + "/" + shard_file_name(r, n);
        if (!exists(index_path(r)) || !exists(shard)) {
          fail(shard, fmt::format("rank {} wrote '{}', which rank 0 cannot see: is the root on a file system "
                                  "every rank shares? (a directory on each node's own disk is not)",
                                  r, shard));
        }
        const auto bytes = io::read_file(index_path(r));
        json index;
        try {
          index = json::parse(bytes.begin(), bytes.end());
        } catch (const json::exception& e) {
          fail(index_path(r),
               fmt::format("rank {}'s index '{}' cannot be read back ({}): is the root on a file "
                           "system every rank shares?",
                           r, index_path(r), e.what()));
        }
        std::int64_t end = 0;  // of the pieces' bytes in the file
        for (const auto& piece : index) {
          const auto dtype = dtype_of(piece["dtype"].get<std::string>());
          const auto element = dtype ? static_cast<std::int64_t>(c10::elementSize(*dtype)) : 1;
          end = std::max(
              end, piece["byte_offset"].get<std::int64_t>() + piece["numel"].get<std::int64_t>() * element);
        }
        const auto size = static_cast<std::int64_t>(std::filesystem::file_size(shard));
        if (size < end) {
          fail(shard,
               fmt::format("rank {}'s '{}' holds {} bytes where its pieces end at byte {}: its writes did "
                           "not all reach the shared file system",
                           r, shard, size, end));
        }
        for (auto& piece : index) {
          auto& t = tensors[piece["key"].get<std::string>()];
          if (t.is_null())
            t = {{"kind", piece["kind"]},
                 {"shape", piece["shape"]},
                 {"dtype", piece["dtype"]},
                 {"pieces", json::array()}};
          json part = {{"file", piece["file"]},
                       {"byte_offset", piece["byte_offset"]},
                       {"begin", piece["begin"]},
                       {"numel", piece["numel"]},
                       {"crc32", piece["crc32"]}};
          if (piece.contains("chunk_crc32")) part["chunk_crc32"] = piece["chunk_crc32"];
          t["pieces"].push_back(std::move(part));
        }
      }
      meta["tensors"] = std::move(tensors);
      for (int r = 0; r < n; ++r) ::unlink(index_path(r).c_str());  // metadata.json holds them now
      const auto text = meta.dump(1);
      // Its CRC-32 first: metadata.json's presence is what marks the directory complete.
      const std::string crc = fmt::format("{}\n", crc32_of(text.data(), text.size()));
      io::write_file_atomically(tmp + "/" + kMetadataChecksum, std::vector<char>(crc.begin(), crc.end()));
      io::write_file_atomically(tmp + "/metadata.json", std::vector<char>(text.begin(), text.end()));
      fsync_dir(tmp);
      reached(SaveStage::MetadataWritten);
      // Note [Saving a step again]: a step directory that exists (a job resumed at its last
      // save saves that step again) is swapped with the new one in one rename, so that
      // step-S is complete at every moment; the old copy is then in .step-S.tmp, removed
      // once `latest` is written. Where the file system cannot swap, the old copy is moved
      // to .step-S.old first, and a load that finds step-S missing reads .step-S.old.
      std::string old;
      const bool again = exists(final_dir);
      if (again && swap_dirs(tmp, final_dir)) {
        old = tmp;
      } else {
        if (again) {
          old = fmt::format("{}/.{}.old", root, name);
          remove_tree(old);
          if (::rename(final_dir.c_str(), old.c_str()) != 0)
            fail(final_dir,
                 fmt::format("cannot move the older '{}' aside: {}", final_dir, errno_reason(errno)));
        }
        if (::rename(tmp.c_str(), final_dir.c_str()) != 0) {
          const int err = errno;
          if (again) (void)::rename(old.c_str(), final_dir.c_str());  // the older copy back in place
          fail(final_dir, fmt::format("cannot rename '{}' to '{}': {}", tmp, final_dir, errno_reason(err)));
        }
      }
      fsync_dir(root);
      reached(SaveStage::Renamed);
      const std::string latest = name + "\n";
      io::write_file_atomically(root + "/latest", std::vector<char>(latest.begin(), latest.end()));
      reached(SaveStage::Published);
      if (!old.empty()) remove_tree(old);
      // In step order, by number: names sort as text only up to nine digits.
      std::vector<std::pair<std::int64_t, std::string>> found;
      for (const auto& entry : list_dir(root)) {
        if (entry.rfind("step-", 0) == 0 && entry != name) {
          std::int64_t number = 0;
          const char* digits = entry.c_str() + 5;
          const auto [end, error] = std::from_chars(digits, entry.c_str() + entry.size(), number);
          if (error == std::errc() && *end == '\0') found.emplace_back(number, entry);  // others are not ours
        }
        // Left by a killed save, whatever keep_last: a checkpoint's worth of files each.
        if (entry.rfind(".step-", 0) == 0) remove_tree(root + "/" + entry);
      }
      if (options.keep_last > 0) {
        std::sort(found.begin(), found.end());
        std::vector<std::string> steps;
        std::size_t earlier = 0;  // of this save's step
        for (const auto& [number, entry] : found) {
          if (number < options.step) ++earlier;
          steps.push_back(entry);
        }
        const auto later = steps.begin() + static_cast<std::ptrdiff_t>(earlier);
        if (later != steps.end()) {
          // Note [Keeping checkpoints after a rewind]
          log::at(
              log::Level::Warn,
              "checkpoint: kept every checkpoint under '{}': {} of them ({} to {}) are of later steps than "
              "{}, saved before the job went back to an earlier one; its saves replace those as they reach "
              "their steps, and keep_last prunes again once this run's step is the latest",
              root, steps.end() - later, *later, steps.back(), name);
        } else {
          const int drop = static_cast<int>(steps.size()) - (options.keep_last - 1);
          for (int i = 0; i < drop; ++i) remove_tree(root + "/" + steps[i]);
        }
      }
    } catch (const std::exception& e) {
      failure = reason_of(e);
      remove_tree(tmp);
    }
  }
  agree(comm, root, "writing the checkpoint's metadata", failure);
  return CheckpointInfo{final_dir, options.step, n, h.mode};
}

}  // namespace flatshard::checkpoint::shards
