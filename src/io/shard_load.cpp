// Sharded checkpoints: loading. Each rank reads, for every element range it now holds,
// the overlapping pieces of the files, whatever world size or mode wrote them, checking
// each piece's CRC-32.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "src/io/files.h"
#include "src/io/shard_files.h"

namespace flatshard::checkpoint::shards {

using json = nlohmann::json;
using io::exists;

namespace {

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  return s;
}

// A tensor's pieces (sorted by their first element) must tile it: each holds at least one
// element (an empty buffer's one piece holds none), the first begins at 0, each begins where the one before
// it ended, and the last ends at the shape's element count. Anything else (a piece listed twice, a gap, a
// count beyond the tensor) is a damaged index that would load some elements twice and leave others as they
// were.
void check_pieces(const std::string& meta_path, const std::string& key, const Entry& e) {
  std::int64_t numel = 1;
  for (const std::int64_t d : e.shape) {
    if (d < 0 || (d > 0 && numel > std::numeric_limits<std::int64_t>::max() / d))
      fail(meta_path, fmt::format("'{}': tensor '{}' has an impossible shape: the file is corrupt; load an "
                                  "earlier checkpoint",
                                  meta_path, key));
    numel *= d;
  }
  std::int64_t next = 0;
  for (const auto& part : e.parts) {
    if (part.numel == 0 && part.begin == next && part.byte_offset >= 0) continue;  // an empty tensor's piece
    if (part.begin != next || part.numel <= 0 || part.numel > numel - next || part.byte_offset < 0) {
      fail(meta_path,
           fmt::format("'{}': the pieces of tensor '{}' do not tile its {} elements (a piece of {} "
                       "at element {} where {} was next): the file is corrupt; load an earlier "
                       "checkpoint",
                       meta_path, key, numel, part.numel, part.begin, next));
    }
    next += part.numel;
  }
  if (next != numel) {
    fail(meta_path, fmt::format("'{}': the pieces of tensor '{}' hold {} of its {} elements: the file is "
                                "corrupt; load an earlier checkpoint",
                                meta_path, key, next, numel));
  }
}

// The step directory to load under `path`, as a name within it: none when `path` is a step
// directory, else the one its `latest` names.
std::string step_under(const std::string& path) {
  if (exists(path + "/metadata.json")) return {};
  if (!exists(path + "/latest")) {
    fail(path, fmt::format("no checkpoint at '{}': it holds neither metadata.json (a step directory) nor "
                           "latest (a checkpoint root)",
                           path));
  }
  const auto bytes = io::read_file(path + "/latest");
  const std::string name = trim(std::string(bytes.begin(), bytes.end()));
  // Note [Saving a step again] (shard_save.cpp): a save killed while it moved the step it
  // saved again aside leaves the complete older copy here.
  const std::string aside = "." + name + ".old";
  if (!exists(path + "/" + name + "/metadata.json") && exists(path + "/" + aside + "/metadata.json"))
    return aside;
  if (!exists(path + "/" + name + "/metadata.json")) {
    fail(path,
         fmt::format("'{}/latest' names '{}/{}', which holds no metadata.json: the checkpoint was removed",
                     path, path, name));
  }
  return name;
}

Checkpoint open_checkpoint(const std::string& dir) {
  const std::string meta_path = dir + "/metadata.json";
  const auto bytes = io::read_file(meta_path);
  // Its CRC-32, where the checkpoint has one (those saved before it did not): a flipped bit
  // that still parses (a step count, a learning rate) must not load.
  const std::string crc_path = dir + "/" + kMetadataChecksum;
  const bool checksummed = exists(crc_path);
  if (checksummed) {
    const auto want = io::read_file(crc_path);
    if (trim(std::string(want.begin(), want.end())) != std::to_string(crc32_of(bytes.data(), bytes.size()))) {
      fail(meta_path,
           fmt::format("'{}' does not match its checksum ({}): the file is corrupt; load an earlier "
                       "checkpoint",
                       meta_path, crc_path));
    }
  }
  Checkpoint c;
  c.dir = dir;
  try {
    const auto meta = json::parse(bytes.begin(), bytes.end());
    if (meta.value("format", "") != kFormat)
      fail(meta_path, fmt::format("'{}' is not a FlatShard checkpoint", meta_path));
    const int version = meta.at("version").get<int>();
    if (version > kFormatVersion) {
      fail(meta_path,
           fmt::format("'{}' has format version {}; this FlatShard reads up to {}: upgrade FlatShard",
                       meta_path, version, kFormatVersion));
    }
    if (version >= 2 && !checksummed) {
      fail(meta_path,
           fmt::format("'{}' is missing: a checkpoint of format version {} has one, so this one is "
                       "incomplete (copied without it?); copy it too, or load an earlier checkpoint",
                       crc_path, version));
    }
    c.world_size = meta.at("world_size").get<int>();
    c.mode = meta.at("mode").get<std::string>();
    c.step = meta.at("step").get<std::int64_t>();
    c.has_optimizer = !meta.at("optimizer_state").is_null();
    if (c.has_optimizer) {
      for (const auto& s : meta.at("optimizer_state")) c.state_names.insert(s.get<std::string>());
    }
    c.steps = meta.at("optimizer_steps").get<std::map<std::string, std::int64_t>>();
    c.bucket_order = meta.value("bucket_order", std::vector<std::string>{});
    if (meta.contains("training")) c.training = meta.at("training").dump();
    for (const auto& [key, t] : meta.at("tensors").items()) {
      Entry e;
      e.kind = t.at("kind").get<std::string>();
      e.shape = t.at("shape").get<std::vector<std::int64_t>>();
      const auto dtype = dtype_of(t.at("dtype").get<std::string>());
      if (!dtype) fail(meta_path, fmt::format("'{}': tensor '{}' has an unknown dtype", meta_path, key));
      e.dtype = *dtype;
      for (const auto& p : t.at("pieces")) {
        e.parts.push_back({p.at("file").get<std::string>(), p.at("byte_offset").get<std::int64_t>(),
                           p.at("begin").get<std::int64_t>(), p.at("numel").get<std::int64_t>(),
                           p.at("crc32").get<std::uint32_t>(),
                           p.value("chunk_crc32", std::vector<std::uint32_t>{})});
        // Note [Checksums per chunk]: one CRC for each chunk of the piece's bytes (a count
        // checked before it is multiplied: a damaged index may hold any number).
        const auto& part = e.parts.back();
        if (!part.chunk_crcs.empty()) {
          const auto element = static_cast<std::int64_t>(c10::elementSize(e.dtype));
          const bool counted =
              part.numel >= 0 && part.numel <= std::numeric_limits<std::int64_t>::max() / element;
          const std::int64_t bytes = counted ? part.numel * element : -1;
          if (!counted || static_cast<std::int64_t>(part.chunk_crcs.size()) !=
                              bytes / kCrcChunkBytes + (bytes % kCrcChunkBytes != 0 ? 1 : 0)) {
            fail(meta_path,
                 fmt::format("'{}': a piece of tensor '{}' lists {} chunk checksums for {} elements: "
                             "the file is corrupt; load an earlier checkpoint",
                             meta_path, key, part.chunk_crcs.size(), part.numel));
          }
        }
      }
      std::sort(e.parts.begin(), e.parts.end(),
                [](const auto& a, const auto& b) { return a.begin < b.begin; });
      check_pieces(meta_path, key, e);
      c.tensors.emplace(key, std::move(e));
    }
  } catch (const json::exception& e) {
    fail(meta_path, fmt::format("'{}' is corrupt ({}): load an earlier checkpoint", meta_path, e.what()));
  }
  return c;
}

std::string shape_str(const std::vector<std::int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// Names the first difference between what the model holds and what was saved.
void check_names_and_shapes(const Checkpoint& c, const Holding& h) {
  std::set<std::string> model_params;
  for (const auto& seg : h.segments) {
    if (seg.kind != "param") continue;
    for (const auto& span : seg.spans) {
      model_params.insert(span.key);
      auto it = c.tensors.find(span.key);
      if (it == c.tensors.end() || it->second.kind != "param") {
        fail(c.dir, fmt::format("the model's parameter '{}' is not in the checkpoint '{}' (saved under {} at "
                                "world size {}): is it the same model?",
                                span.key, c.dir, c.mode, c.world_size));
      }
      if (it->second.shape != span.shape) {
        fail(c.dir, fmt::format("parameter '{}' has shape {} in the model but {} in the checkpoint '{}'",
                                span.key, shape_str(span.shape), shape_str(it->second.shape), c.dir));
      }
    }
  }
  for (const auto& [key, e] : c.tensors) {
    if (e.kind == "param" && !model_params.count(key)) {
      fail(c.dir, fmt::format("the checkpoint '{}' has parameter '{}', which the model lacks", c.dir, key));
    }
  }
  for (const auto& [name, t] : h.buffers) {
    auto it = c.tensors.find(name);
    if (it == c.tensors.end())
      fail(c.dir, fmt::format("the model's buffer '{}' is not in the checkpoint '{}'", name, c.dir));
    if (it->second.shape != t.sizes().vec()) {
      fail(c.dir, fmt::format("buffer '{}' has shape {} in the model but {} in the checkpoint '{}'", name,
                              shape_str(t.sizes().vec()), shape_str(it->second.shape), c.dir));
    }
  }
}

std::atomic<std::uint64_t> g_bytes_read{0};

class Reader {
 public:
  explicit Reader(std::string dir) : dir_(std::move(dir)) {}
  ~Reader() {
    for (auto& [name, fd] : fds_) ::close(fd);
  }

  // Copies elements [lo, hi) of tensor `key` into dst (1-D, hi - lo elements).
  void read(const std::string& key, const Entry& e, std::int64_t lo, std::int64_t hi, const at::Tensor& dst) {
    std::int64_t covered = 0;
    for (const auto& part : e.parts) {
      const std::int64_t a = std::max(lo, part.begin), b = std::min(hi, part.begin + part.numel);
      if (a >= b) continue;
      if (part.chunk_crcs.empty()) {
        const at::Tensor& data = load_part(key, e, part);
        dst.narrow(0, a - lo, b - a).copy_(data.narrow(0, a - part.begin, b - a));
      } else {
        read_chunks(key, e, part, a, b, dst.narrow(0, a - lo, b - a));
      }
      covered += b - a;
    }
    if (covered != hi - lo) {
      fail(dir_, fmt::format("the checkpoint '{}' holds {} of elements [{}, {}) of '{}': files are missing "
                             "pieces; load an earlier checkpoint",
                             dir_, covered, lo, hi, key));
    }
  }

 private:
  int fd_of(const std::string& file) {
    auto it = fds_.find(file);
    if (it == fds_.end()) {
      const std::string path = dir_ + "/" + file;
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0)
        fail(path,
             fmt::format("cannot open '{}': {}; the checkpoint is incomplete", path, std::strerror(errno)));
      it = fds_.emplace(file, fd).first;
    }
    return it->second;
  }

  // n bytes of `part`'s file from byte `at` (the file's) into `out`.
  void pread_all(const std::string& key, const Entry::Part& part, char* out, std::size_t n, std::int64_t at) {
    const int fd = fd_of(part.file);
    if (at < 0 || at > std::numeric_limits<std::int64_t>::max() - static_cast<std::int64_t>(n)) {
      const std::string path = dir_ + "/" + part.file;
      fail(path,
           fmt::format("'{}': a piece of '{}' lies at byte {}, past any file: the index is corrupt; load "
                       "an earlier checkpoint",
                       path, key, part.byte_offset));
    }
    std::size_t done = 0;
    while (done < n) {
      const ssize_t r = ::pread(fd, out + done, n - done, static_cast<off_t>(at) + static_cast<off_t>(done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        const std::string path = dir_ + "/" + part.file;
        fail(path,
             fmt::format("'{}' is truncated: piece of '{}' at byte {} is missing; load an earlier checkpoint",
                         path, key, part.byte_offset));
      }
      done += static_cast<std::size_t>(r);
    }
    g_bytes_read.fetch_add(n, std::memory_order_relaxed);
  }

  // Note [Checksums per chunk]: elements [a, b) of `part` into dst, reading only the chunks
  // that hold them, a window of chunks at a time, each chunk checked against its CRC.
  void read_chunks(const std::string& key, const Entry& e, const Entry::Part& part, std::int64_t a,
                   std::int64_t b, const at::Tensor& dst) {
    const auto element = static_cast<std::int64_t>(c10::elementSize(e.dtype));
    const std::int64_t piece_bytes = part.numel * element;
    const std::int64_t first = (a - part.begin) * element / kCrcChunkBytes;
    const std::int64_t last = ((b - part.begin) * element - 1) / kCrcChunkBytes;  // inclusive
    constexpr std::int64_t kWindow = 64;                                          // chunks: 64 MiB
    for (std::int64_t c0 = first; c0 <= last; c0 += kWindow) {
      const std::int64_t c1 = std::min(last + 1, c0 + kWindow);
      const std::int64_t from = c0 * kCrcChunkBytes, to = std::min(piece_bytes, c1 * kCrcChunkBytes);
      auto window = at::empty({(to - from) / element}, at::TensorOptions().dtype(e.dtype));
      auto* bytes = static_cast<char*>(window.data_ptr());
      pread_all(key, part, bytes, static_cast<std::size_t>(to - from), part.byte_offset + from);
      for (std::int64_t c = c0; c < c1; ++c) {
        const std::int64_t begin = c * kCrcChunkBytes - from;
        const std::int64_t n = std::min(piece_bytes - c * kCrcChunkBytes, kCrcChunkBytes);
        if (crc32_of(bytes + begin, static_cast<std::size_t>(n)) !=
            part.chunk_crcs[static_cast<std::size_t>(c)]) {
          const std::string path = dir_ + "/" + part.file;
          fail(path,
               fmt::format("checksum mismatch in '{}' (bytes [{}, {}) of the piece of '{}' at element {}): "
                           "the file is corrupt; load an earlier checkpoint",
                           path, c * kCrcChunkBytes, c * kCrcChunkBytes + n, key, part.begin));
        }
      }
      // The window's elements, as the piece numbers them, that [a, b) wants.
      const std::int64_t w0 = part.begin + from / element, w1 = part.begin + to / element;
      const std::int64_t x0 = std::max(a, w0), x1 = std::min(b, w1);
      if (x0 < x1) dst.narrow(0, x0 - a, x1 - x0).copy_(window.narrow(0, x0 - w0, x1 - x0));
    }
  }

  const at::Tensor& load_part(const std::string& key, const Entry& e, const Entry::Part& part) {
    if (cached_key_ == key && cached_begin_ == part.begin && cached_file_ == part.file) return cached_;
    const std::string path = dir_ + "/" + part.file;
    auto data = at::empty({part.numel}, at::TensorOptions().dtype(e.dtype));
    auto* bytes = static_cast<char*>(data.data_ptr());
    const std::size_t n = data.nbytes();
    pread_all(key, part, bytes, n, part.byte_offset);
    if (crc32_of(bytes, n) != part.crc) {
      fail(path,
           fmt::format("checksum mismatch in '{}' (elements [{}, {}) of '{}'): the file is corrupt; load "
                       "an earlier checkpoint",
                       path, part.begin, part.begin + part.numel, key));
    }
    cached_ = data;
    cached_key_ = key;
    cached_begin_ = part.begin;
    cached_file_ = part.file;
    return cached_;
  }

  std::string dir_;
  std::map<std::string, int> fds_;
  at::Tensor cached_;
  std::string cached_key_, cached_file_;
  std::int64_t cached_begin_ = -1;
};

// Reads every segment (whole) and buffer. Parameters are all there
// (check_names_and_shapes); optimizer state the checkpoint lacks stays zero.
void read_holding(const Checkpoint& c, Holding& h) {
  at::NoGradGuard no_grad;
  Reader reader(c.dir);
  for_each_piece(h, [&](const Span& span, std::int64_t begin, const at::Tensor& dst) {
    auto it = c.tensors.find(span.key);
    if (it == c.tensors.end()) {  // optimizer state never created (its unit never stepped): zeros
      dst.zero_();
      return;
    }
    reader.read(span.key, it->second, begin, begin + dst.numel(), dst);
  });
  for (auto& [name, t] : h.buffers) {
    auto flat = at::empty({t.numel()}, t.options());
    reader.read(name, c.tensors.at(name), 0, t.numel(), flat);
    t.detach().copy_(flat.view(t.sizes()));
  }
}

}  // namespace

std::uint64_t shard_bytes_read() { return g_bytes_read.load(std::memory_order_relaxed); }

void for_each_piece(Holding& h, const std::function<void(const Span&, std::int64_t, const at::Tensor&)>& f) {
  for (auto& seg : h.segments) {
    const std::int64_t seg_end = seg.begin + seg.values.numel();
    for (const auto& span : seg.spans) {
      const std::int64_t lo = std::max(span.offset, seg.begin);
      const std::int64_t hi = std::min(span.offset + span.numel, seg_end);
      if (lo < hi) f(span, lo - span.offset, seg.values.narrow(0, lo - seg.begin, hi - lo));
    }
  }
}

// The optimizer state names to load: the checkpoint must hold every one the optimizer
// keeps (none when it was saved without optimizer state), and the optimizer must keep every
// one the checkpoint holds: an SGD made without momentum would drop a saved momentum buffer
// and then, its groups' momentum restored from the checkpoint, start a new one from zero.
std::vector<std::string> states_to_load(const Checkpoint& c, const std::vector<std::string>& wanted) {
  if (!c.has_optimizer) return {};
  for (const auto& name : c.state_names) {
    if (std::find(wanted.begin(), wanted.end(), name) == wanted.end()) {
      fail(c.dir,
           fmt::format("the checkpoint '{}' holds optimizer state '{}', which this optimizer does not keep "
                       "(it keeps: {}); make it with the options it was saved with (SGD's momentum, say), "
                       "or load without the optimizer to start one afresh",
                       c.dir, name,
                       wanted.empty() ? std::string("none") : fmt::format("{}", fmt::join(wanted, ", "))));
    }
  }
  for (const auto& name : wanted) {
    if (!c.state_names.count(name)) {
      fail(c.dir,
           fmt::format("the optimizer keeps '{}', which the checkpoint '{}' does not hold (it holds: {}); "
                       "load with the optimizer it was saved with",
                       name, c.dir, fmt::join(c.state_names, ", ")));
    }
  }
  return wanted;
}

std::int64_t steps_of(const Checkpoint& c, const std::string& param) {
  auto it = c.steps.find(param);
  return it == c.steps.end() ? 0 : it->second;
}

// Loads h on every rank; a failure on any rank fails all of them.
CheckpointInfo load(const std::string& path, Communicator& comm,
                    const std::function<Holding(const Checkpoint&)>& hold,
                    const std::function<void(const Checkpoint&)>& finish) {
  // Note [A failed load]: the values are read in place (a model near its memory's limit
  // has no room for a second copy), so a load that fails on any rank leaves every rank's
  // parameters and optimizer state partly loaded; the training state (steps, schedules,
  // the sampler's position) is restored only once every rank has read its values. The
  // error says so: load another checkpoint, or build the model afresh.
  std::string failure;
  // Note [One save at a time under a root]: agreed before any rank reads, so that a save in
  // flight seen by one rank stops every rank with its values untouched.
  std::string trimmed = path;
  while (trimmed.size() > 1 && trimmed.back() == '/') trimmed.pop_back();
  const std::string parent = std::filesystem::path(trimmed).parent_path().string();
  if (SaveUnderway::under(trimmed) || (!parent.empty() && SaveUnderway::under(parent))) {
    failure = fmt::format(
        "a save under '{}' is still in flight in this process (an AsyncSaver's?): wait for it "
        "(AsyncSaver::wait) before loading",
        path);
  }
  agree(comm, path, "loading", failure);
  // Note [One step for every rank]: rank 0 reads `latest` and every rank loads the step it
  // names, within its own `path` (a node may mount the checkpoints elsewhere): a save that
  // publishes another step meanwhile (another job under the root, one that outlived its
  // restart) cannot split the ranks between two steps.
  std::string step;
  if (comm.rank() == 0) {
    try {
      step = step_under(path);
    } catch (const std::exception& e) {
      failure = reason_of(e);
    }
  }
  const std::string named = exchange_strings(comm, failure.empty() ? step : "!" + failure)[0];
  if (!named.empty() && named[0] == '!')
    fail(path, fmt::format("loading failed on rank 0 of {}: {}", comm.world_size(), named.substr(1)));
  CheckpointInfo info;
  std::optional<Checkpoint> c;
  bool reading = false;
  try {
    c = open_checkpoint(named.empty() ? path : path + "/" + named);
    auto h = hold(*c);
    check_names_and_shapes(*c, h);
    reading = true;
    read_holding(*c, h);
    info = CheckpointInfo{c->dir, c->step, c->world_size, c->mode};
  } catch (const std::exception& e) {  // an Error, or the host out of memory: every rank must hear
    failure = reason_of(e);
    if (failure.empty()) failure = "an error with no message";
  }
  {
    // Every rank's failure, and whether it had begun reading its values: a rank that failed
    // early must still say that its peers' values were partly loaded.
    const auto all = exchange_strings(comm, (reading ? "r" : "-") + failure);
    bool any_read = false;
    for (const auto& a : all) any_read = any_read || a[0] == 'r';
    for (int r = 0; r < static_cast<int>(all.size()); ++r) {
      if (all[r].size() <= 1) continue;
      fail(path,
           fmt::format("loading failed on rank {} of {}: {}{}", r, all.size(), all[r].substr(1),
                       any_read ? "; the model's parameters and optimizer state are partly loaded: load "
                                  "another checkpoint or build the model afresh"
                                : ""));
    }
  }
  try {
    finish(*c);
  } catch (const std::exception& e) {
    failure = reason_of(e) +
              "; the model's parameters and optimizer state are loaded, its training state "
              "is not: load another checkpoint or build the model afresh";
  }
  agree(comm, path, "restoring the training state", failure);
  return info;
}

}  // namespace flatshard::checkpoint::shards
