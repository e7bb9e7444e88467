// Sharded checkpoints: every rank writes the pieces of parameters and optimizer state it
// owns into its own file; rank 0 writes metadata.json, which says, for every tensor,
// which file holds which element range (with a CRC-32 per piece). Loading reads, for
// each element range this rank now holds, the overlapping pieces, whatever world size
// or mode wrote them. See Note [Checkpoint directories] for crash safety.
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <zlib.h>
#include <nlohmann/json.hpp>

#include "flatshard/checkpoint.h"
#include "flatshard/shard.h"
#include "flatshard/zero.h"
#include "sharding/ddp_engine.h"
#include "src/io/atomic_file.h"

namespace flatshard::checkpoint {

namespace detail {
// ZeroRedundancyOptimizer's slices and optimizer (it befriends this).
struct Access {
  static sharding::DdpEngine& engine(ZeroRedundancyOptimizer& z) { return *z.engine_; }
  static optim::ShardOptimizer& optimizer(ZeroRedundancyOptimizer& z) {
    z.ensure_slices();
    return *z.optimizer_;
  }
};
}  // namespace detail

namespace {

using json = nlohmann::json;
constexpr int kFormatVersion = 1;
constexpr const char* kFormat = "flatshard-sharded-checkpoint";

// --- what a rank holds -----------------------------------------------------------

// A tensor's place in a flat space: elements [offset, offset + numel).
struct Span {
  std::string key;  // "<parameter>", "<parameter>.<state>"
  std::vector<std::int64_t> shape;
  std::int64_t offset = 0;
  std::int64_t numel = 0;
};

// A 1-D tensor holding elements [begin, begin + values.numel()) of a flat space that
// spans lay out. On save this rank writes [write_begin, write_end) of it; on load it
// reads all of it.
struct Segment {
  at::Tensor values;
  std::int64_t begin = 0;
  std::int64_t write_begin = 0, write_end = 0;
  std::vector<Span> spans;
  std::string kind;  // "param", "state"
};

struct Holding {
  std::string mode;
  std::vector<Segment> segments;
  std::vector<std::pair<std::string, at::Tensor>> buffers;  // written whole by rank 0
  std::map<std::string, std::int64_t> steps;                // optimizer steps per parameter
  std::vector<std::string> state_names;                     // the optimizer's
  bool has_optimizer = false;
  std::vector<std::string> bucket_order;  // DDP's rebuilt bucket order, by name
};

std::vector<Span> spans_of(const std::vector<Span>& params, const std::string& suffix) {
  auto out = params;
  for (auto& s : out) s.key += suffix;
  return out;
}

void add_buffers(Holding& h, torch::nn::Module& model) {
  for (const auto& item : model.named_buffers(/*recurse=*/true))
    h.buffers.emplace_back(item.key(), item.value());
}

// --- dtypes, checksums, small I/O ----------------------------------------------------

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

std::string errno_reason(int err) {
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      return fmt::format("{} (the disk or quota is full: free space or save elsewhere)", std::strerror(err));
    case EFBIG: return fmt::format("{} (over the file-size limit, ulimit -f)", std::strerror(err));
    case EACCES:
    case EPERM:
    case EROFS: return fmt::format("{} (no permission: choose a writable directory)", std::strerror(err));
    default: return std::strerror(err);
  }
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

void fsync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

void make_dirs(const std::string& dir) {
  std::string sofar;
  std::size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    sofar = dir.substr(0, pos);
    if (sofar.empty() || exists(sofar)) continue;
    if (::mkdir(sofar.c_str(), 0755) != 0 && errno != EEXIST) {
      fail(dir, fmt::format("cannot create directory '{}': {}", sofar, errno_reason(errno)));
    }
  }
}

void remove_tree(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return;
  if (S_ISDIR(st.st_mode)) {
    if (DIR* d = ::opendir(path.c_str())) {
      while (dirent* e = ::readdir(d)) {
        const std::string name = e->d_name;
        if (name != "." && name != "..") remove_tree(path + "/" + name);
      }
      ::closedir(d);
    }
    ::rmdir(path.c_str());
  } else {
    ::unlink(path.c_str());
  }
}

std::vector<std::string> list_dir(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) out.emplace_back(e->d_name);
    ::closedir(d);
  }
  return out;
}

// Every rank's string, on every rank (a collective). Carries indexes and failures, so
// that one rank's error reaches all of them instead of leaving them waiting.
// The bytes travel through tensors of the communicator's device (a GPU's, for a model
// sharded there) and are read back on the host.
std::vector<std::string> exchange_strings(Communicator& comm, const std::string& mine) {
  const int n = comm.world_size();
  const auto on_device = at::TensorOptions().device(comm.device());
  auto lengths = at::empty({n}, on_device.dtype(at::kLong));
  auto my_length = at::full({1}, static_cast<std::int64_t>(mine.size()), on_device.dtype(at::kLong));
  comm.all_gather(lengths, my_length).wait();
  lengths = lengths.cpu();
  std::int64_t most = 1;
  for (int r = 0; r < n; ++r) most = std::max(most, lengths[r].item<std::int64_t>());
  auto slot = at::zeros({most}, at::kByte);
  std::memcpy(slot.data_ptr(), mine.data(), mine.size());
  auto all = at::zeros({n * most}, on_device.dtype(at::kByte));
  comm.all_gather(all, slot.to(comm.device())).wait();
  all = all.cpu();
  std::vector<std::string> out;
  const auto* bytes = reinterpret_cast<const char*>(all.data_ptr());
  for (int r = 0; r < n; ++r)
    out.emplace_back(bytes + r * most, static_cast<std::size_t>(lengths[r].item<std::int64_t>()));
  return out;
}

// Throws on every rank when any rank failed (its message starts with "!").
void agree(Communicator& comm, const std::string& path, const std::string& what, const std::string& failure) {
  const auto all = exchange_strings(comm, failure.empty() ? std::string() : "!" + failure);
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    if (all[r].empty()) continue;
    if (r == comm.rank()) fail(path, all[r].substr(1));
    fail(path, fmt::format("{} failed on rank {}: {}", what, r, all[r].substr(1)));
  }
}

// --- saving ----------------------------------------------------------------------------

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
  for (const auto& seg : h.segments) {
    for (const auto& span : seg.spans) {
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

// Writes this rank's pieces into `path` and returns its index (JSON).
json write_shard_file(const std::vector<Piece>& pieces, const std::string& path, const std::string& file) {
  ::signal(SIGXFSZ, SIG_IGN);  // a write past ulimit -f then fails with EFBIG
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(path, fmt::format("cannot create '{}': {}", path, errno_reason(errno)));
  json index = json::array();
  std::int64_t offset = 0;
  for (const auto& p : pieces) {
    const auto* bytes = static_cast<const char*>(p.data.data_ptr());
    const std::size_t n = p.data.nbytes();
    std::size_t done = 0;
    while (done < n) {
      const ssize_t w = ::write(fd, bytes + done, n - done);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) {
        const int err = w < 0 ? errno : ENOSPC;
        ::close(fd);
        fail(path, fmt::format("writing '{}' failed: {}", path, errno_reason(err)));
      }
      done += static_cast<std::size_t>(w);
    }
    index.push_back({{"key", p.key},
                     {"kind", p.kind},
                     {"shape", p.shape},
                     {"dtype", dtype_name(p.data.scalar_type())},
                     {"file", file},
                     {"byte_offset", offset},
                     {"begin", p.begin},
                     {"numel", p.data.numel()},
                     {"crc32", crc32_of(bytes, n)}});
    offset += static_cast<std::int64_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    fail(path, fmt::format("flushing '{}' failed: {}", path, errno_reason(err)));
  }
  ::close(fd);
  return index;
}

std::string step_dir_name(std::int64_t step) { return fmt::format("step-{:09d}", step); }

// Note [Checkpoint directories]
// root/step-<S>/ is written as root/.step-<S>.tmp/ (every rank's shard file, fsynced,
// then rank 0's metadata.json) and renamed into place when complete; then root/latest
// is replaced atomically by a file naming it, and only then are older checkpoints
// beyond keep_last removed. A process killed at any point leaves root/latest naming a
// complete checkpoint (the new one or the previous one).
CheckpointInfo save(const std::string& root, Communicator& comm, const Holding& h,
                    const SaveOptions& options) {
  const int rank = comm.rank(), n = comm.world_size();
  const std::string name = step_dir_name(options.step);
  const std::string tmp = fmt::format("{}/.{}.tmp", root, name);
  const std::string final_dir = root + "/" + name;
  std::string failure;
  if (rank == 0) {
    try {
      make_dirs(root);
      remove_tree(tmp);
      if (::mkdir(tmp.c_str(), 0755) != 0)
        fail(tmp, fmt::format("cannot create '{}': {}", tmp, errno_reason(errno)));
    } catch (const CheckpointError& e) {
      failure = e.what();
    }
  }
  agree(comm, root, "creating the checkpoint directory", failure);

  std::string index;
  try {
    const std::string file = shard_file_name(rank, n);
    index = write_shard_file(pieces_to_write(h, rank), tmp + "/" + file, file).dump();
  } catch (const Error& e) {
    failure = e.what();
  }
  if (!failure.empty()) index.clear();
  const auto indexes = exchange_strings(comm, failure.empty() ? index : "!" + failure);
  for (int r = 0; r < n; ++r) {
    if (!indexes[r].empty() && indexes[r][0] == '!') {
      if (rank == 0) remove_tree(tmp);
      if (r == rank) fail(root, indexes[r].substr(1));
      fail(root, fmt::format("saving step {} failed on rank {}: {}; the previous checkpoint is intact",
                             options.step, r, indexes[r].substr(1)));
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
      json tensors = json::object();
      for (int r = 0; r < n; ++r) {
        for (auto& piece : json::parse(indexes[r])) {
          auto& t = tensors[piece["key"].get<std::string>()];
          if (t.is_null())
            t = {{"kind", piece["kind"]},
                 {"shape", piece["shape"]},
                 {"dtype", piece["dtype"]},
                 {"pieces", json::array()}};
          t["pieces"].push_back({{"file", piece["file"]},
                                 {"byte_offset", piece["byte_offset"]},
                                 {"begin", piece["begin"]},
                                 {"numel", piece["numel"]},
                                 {"crc32", piece["crc32"]}});
        }
      }
      meta["tensors"] = std::move(tensors);
      const auto text = meta.dump(1);
      io::write_file_atomically(tmp + "/metadata.json", std::vector<char>(text.begin(), text.end()));
      fsync_dir(tmp);
      std::string old;
      if (exists(final_dir)) {  // saving the same step again: the older copy goes last
        old = fmt::format("{}/.{}.old", root, name);
        remove_tree(old);
        if (::rename(final_dir.c_str(), old.c_str()) != 0)
          fail(final_dir,
               fmt::format("cannot move the older '{}' aside: {}", final_dir, errno_reason(errno)));
      }
      if (::rename(tmp.c_str(), final_dir.c_str()) != 0)
        fail(final_dir, fmt::format("cannot rename '{}' to '{}': {}", tmp, final_dir, errno_reason(errno)));
      fsync_dir(root);
      const std::string latest = name + "\n";
      io::write_file_atomically(root + "/latest", std::vector<char>(latest.begin(), latest.end()));
      if (!old.empty()) remove_tree(old);
      if (options.keep_last > 0) {
        std::vector<std::string> steps;
        for (const auto& entry : list_dir(root)) {
          if (entry.rfind("step-", 0) == 0 && entry != name) steps.push_back(entry);
          if (entry.rfind(".step-", 0) == 0) remove_tree(root + "/" + entry);  // left by a killed save
        }
        std::sort(steps.begin(), steps.end());
        const int drop = static_cast<int>(steps.size()) - (options.keep_last - 1);
        for (int i = 0; i < drop; ++i) remove_tree(root + "/" + steps[i]);
      }
    } catch (const Error& e) {
      failure = e.what();
      remove_tree(tmp);
    }
  }
  agree(comm, root, "writing the checkpoint's metadata", failure);
  return CheckpointInfo{final_dir, options.step, n, h.mode};
}

// --- loading ---------------------------------------------------------------------------

struct Entry {
  std::string kind;
  std::vector<std::int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  struct Part {
    std::string file;
    std::int64_t byte_offset, begin, numel;
    std::uint32_t crc;
  };
  std::vector<Part> parts;  // by begin
};

struct Checkpoint {
  std::string dir;
  int world_size = 0;
  std::string mode;
  std::int64_t step = 0;
  bool has_optimizer = false;
  std::set<std::string> state_names;
  std::map<std::string, std::int64_t> steps;
  std::vector<std::string> bucket_order;
  std::map<std::string, Entry> tensors;
};

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  return s;
}

Checkpoint open_checkpoint(const std::string& path) {
  std::string dir = path;
  if (!exists(dir + "/metadata.json")) {
    if (!exists(dir + "/latest")) {
      fail(path, fmt::format("no checkpoint at '{}': it holds neither metadata.json (a step directory) nor "
                             "latest (a checkpoint root)",
                             path));
    }
    const auto bytes = io::read_file(dir + "/latest");
    dir = path + "/" + trim(std::string(bytes.begin(), bytes.end()));
    if (!exists(dir + "/metadata.json")) {
      fail(path,
           fmt::format("'{}/latest' names '{}', which holds no metadata.json: the checkpoint was removed",
                       path, dir));
    }
  }
  const std::string meta_path = dir + "/metadata.json";
  const auto bytes = io::read_file(meta_path);
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
    c.world_size = meta.at("world_size").get<int>();
    c.mode = meta.at("mode").get<std::string>();
    c.step = meta.at("step").get<std::int64_t>();
    c.has_optimizer = !meta.at("optimizer_state").is_null();
    if (c.has_optimizer) {
      for (const auto& s : meta.at("optimizer_state")) c.state_names.insert(s.get<std::string>());
    }
    c.steps = meta.at("optimizer_steps").get<std::map<std::string, std::int64_t>>();
    c.bucket_order = meta.value("bucket_order", std::vector<std::string>{});
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
                           p.at("crc32").get<std::uint32_t>()});
      }
      std::sort(e.parts.begin(), e.parts.end(),
                [](const auto& a, const auto& b) { return a.begin < b.begin; });
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
      const at::Tensor& data = load_part(key, e, part);
      dst.narrow(0, a - lo, b - a).copy_(data.narrow(0, a - part.begin, b - a));
      covered += b - a;
    }
    if (covered != hi - lo) {
      fail(dir_, fmt::format("the checkpoint '{}' holds {} of elements [{}, {}) of '{}': files are missing "
                             "pieces; load an earlier checkpoint",
                             dir_, covered, lo, hi, key));
    }
  }

 private:
  const at::Tensor& load_part(const std::string& key, const Entry& e, const Entry::Part& part) {
    if (cached_key_ == key && cached_begin_ == part.begin && cached_file_ == part.file) return cached_;
    const std::string path = dir_ + "/" + part.file;
    auto it = fds_.find(part.file);
    if (it == fds_.end()) {
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0)
        fail(path,
             fmt::format("cannot open '{}': {}; the checkpoint is incomplete", path, std::strerror(errno)));
      it = fds_.emplace(part.file, fd).first;
    }
    auto data = at::empty({part.numel}, at::TensorOptions().dtype(e.dtype));
    auto* bytes = static_cast<char*>(data.data_ptr());
    const std::size_t n = data.nbytes();
    std::size_t done = 0;
    while (done < n) {
      const ssize_t r =
          ::pread(it->second, bytes + done, n - done, part.byte_offset + static_cast<off_t>(done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        fail(path,
             fmt::format("'{}' is truncated: piece of '{}' at byte {} is missing; load an earlier checkpoint",
                         path, key, part.byte_offset));
      }
      done += static_cast<std::size_t>(r);
    }
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
  for (auto& seg : h.segments) {
    const std::int64_t seg_end = seg.begin + seg.values.numel();
    for (const auto& span : seg.spans) {
      const std::int64_t lo = std::max(span.offset, seg.begin);
      const std::int64_t hi = std::min(span.offset + span.numel, seg_end);
      if (lo >= hi) continue;
      auto it = c.tensors.find(span.key);
      if (it == c.tensors.end()) continue;  // optimizer state never created (its unit never stepped): zeros
      reader.read(span.key, it->second, lo - span.offset, hi - span.offset,
                  seg.values.narrow(0, lo - seg.begin, hi - lo));
    }
  }
  for (auto& [name, t] : h.buffers) {
    auto flat = at::empty({t.numel()}, t.options());
    reader.read(name, c.tensors.at(name), 0, t.numel(), flat);
    t.detach().copy_(flat.view(t.sizes()));
  }
}

// The optimizer state names to load: the checkpoint must hold every one the optimizer
// keeps (none when it was saved without optimizer state).
std::vector<std::string> states_to_load(const Checkpoint& c, const std::vector<std::string>& wanted) {
  if (!c.has_optimizer) return {};
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
  std::string failure;
  CheckpointInfo info;
  try {
    const auto c = open_checkpoint(path);
    auto h = hold(c);
    check_names_and_shapes(c, h);
    read_holding(c, h);
    finish(c);
    info = CheckpointInfo{c.dir, c.step, c.world_size, c.mode};
  } catch (const Error& e) {
    failure = e.what();
  }
  agree(comm, path, "loading", failure);
  return info;
}

// --- the modes ---------------------------------------------------------------------------

std::vector<Span> unit_spans(const ShardLayout& layout) {
  std::vector<Span> out;
  for (const auto& p : layout.params) out.push_back({p.name, p.shape, p.offset, p.numel});
  return out;
}

std::vector<Span> bucket_spans(sharding::DdpEngine& e, int b) {
  std::vector<Span> out;
  for (int i : e.buckets()[b].params) {
    const auto& p = e.params()[i];
    out.push_back({p.name, p.shape, p.offset, p.numel});
  }
  return out;
}

// FullyShard: shard i of unit i holds [rank * shard_numel, (rank + 1) * shard_numel), rank
// being this rank's place in its shard group. Under HybridShard every group holds the
// same shards: the first group writes them, and every group reads its own.
Holding hold_fully_shard(FullyShardBase& fsdp, optim::ShardOptimizer* opt, bool loading,
                         const std::vector<std::string>& load_states) {
  Holding h;
  h.mode = "fully_shard";
  const auto layout = fsdp.layout();
  const auto shards = fsdp.shards();
  const ShardGroup group = fsdp.shard_group();
  for (std::size_t i = 0; i < layout.size(); ++i) {
    const std::int64_t begin = group.rank * layout[i].shard_numel;
    const std::int64_t end = group.replica == 0 ? begin + layout[i].shard_numel : begin;  // written
    const auto spans = unit_spans(layout[i]);
    h.segments.push_back({shards[i].detach(), begin, begin, end, spans, "param"});
    if (!opt) continue;
    std::vector<std::pair<std::string, at::Tensor>> states;
    if (loading) {
      for (const auto& name : load_states) states.emplace_back(name, opt->mutable_state(i, name));
    } else {
      states = opt->named_state(i);
    }
    for (const auto& [name, t] : states) {
      if (!t.defined()) continue;
      h.segments.push_back({t, begin, begin, end, spans_of(spans, "." + name), "state"});
    }
    for (const auto& s : spans) h.steps[s.key] = opt->steps(i);
  }
  if (opt) {
    h.state_names = opt->state_names();
    h.has_optimizer = loading || std::any_of(h.segments.begin(), h.segments.end(),
                                             [](const Segment& s) { return s.kind == "state"; });
  }
  add_buffers(h, fsdp.root_module());
  return h;
}

// DDP's buckets are replicated: on save each rank writes its balanced share of every
// bucket; on load each rank reads whole buckets.
void hold_buckets(Holding& h, sharding::DdpEngine& e, int rank, int n) {
  for (int i : e.rebuilt_order()) h.bucket_order.push_back(e.params()[i].name);
  for (int b = 0; b < static_cast<int>(e.buckets().size()); ++b) {
    const auto share = shard_range(e.buckets()[b].padded_numel, n, rank);
    h.segments.push_back(
        {e.step_values(b), 0, share.offset, share.offset + share.numel, bucket_spans(e, b), "param"});
  }
}

// torch::optim's per-parameter state, by the kinds FlatShard knows.
struct TorchState {
  std::vector<std::string> names;
  std::function<std::vector<std::pair<std::string, at::Tensor>>(torch::optim::OptimizerParamState*)> get;
  std::function<std::unique_ptr<torch::optim::OptimizerParamState>(const std::vector<at::Tensor>&,
                                                                   std::int64_t)>
      make;
  std::function<std::int64_t(torch::optim::OptimizerParamState*)> steps;
};

template <typename State, typename Options>
TorchState adam_like(torch::optim::Optimizer& opt) {
  if (static_cast<const Options&>(opt.param_groups().at(0).options()).amsgrad()) {
    throw InvalidArgument(
        "flatshard::checkpoint: sharded checkpoints do not support amsgrad's max_exp_avg_sq");
  }
  TorchState s;
  s.names = {"exp_avg", "exp_avg_sq"};
  s.get = [](auto* st) -> std::vector<std::pair<std::string, at::Tensor>> {
    auto* a = static_cast<State*>(st);
    return {{"exp_avg", a->exp_avg()}, {"exp_avg_sq", a->exp_avg_sq()}};
  };
  s.make = [](const std::vector<at::Tensor>& t, std::int64_t steps) {
    auto st = std::make_unique<State>();
    st->exp_avg(t[0]);
    st->exp_avg_sq(t[1]);
    st->step(steps);
    return std::unique_ptr<torch::optim::OptimizerParamState>(std::move(st));
  };
  s.steps = [](auto* st) { return static_cast<State*>(st)->step(); };
  return s;
}

TorchState torch_state_of(torch::optim::Optimizer& opt) {
  TorchState s;
  if (dynamic_cast<torch::optim::SGD*>(&opt)) {
    const auto& o = static_cast<const torch::optim::SGDOptions&>(opt.param_groups().at(0).options());
    if (o.momentum() != 0) s.names = {"momentum_buffer"};
    s.get = [](auto* st) -> std::vector<std::pair<std::string, at::Tensor>> {
      return {{"momentum_buffer", static_cast<torch::optim::SGDParamState*>(st)->momentum_buffer()}};
    };
    s.make = [](const std::vector<at::Tensor>& t, std::int64_t) {
      auto st = std::make_unique<torch::optim::SGDParamState>();
      st->momentum_buffer(t[0]);
      return std::unique_ptr<torch::optim::OptimizerParamState>(std::move(st));
    };
    s.steps = [](auto*) { return std::int64_t{0}; };
    return s;
  }
  if (dynamic_cast<torch::optim::Adam*>(&opt))
    return adam_like<torch::optim::AdamParamState, torch::optim::AdamOptions>(opt);
  if (dynamic_cast<torch::optim::AdamW*>(&opt))
    return adam_like<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(opt);
  throw InvalidArgument(
      "flatshard::checkpoint: sharded checkpoints of torch::optim optimizers support SGD, Adam and AdamW");
}

// A run resumed from a checkpoint builds its buckets as the saving run had rebuilt them
// (same summation order in the all-reduce: bit-identical resumption).
void restore_bucket_order(const Checkpoint& c, sharding::DdpEngine& e) {
  if (c.bucket_order.size() != e.params().size()) return;
  std::map<std::string, int> index;
  for (int i = 0; i < static_cast<int>(e.params().size()); ++i) index[e.params()[i].name] = i;
  std::vector<int> order;
  for (const auto& name : c.bucket_order) {
    auto it = index.find(name);
    if (it == index.end()) return;
    order.push_back(it->second);
  }
  e.restore_order(order);
}

at::Tensor optimizer_tensor(const sharding::DdpEngine& e, const sharding::DdpParam& p) {
  return e.mixed() ? p.master : p.param;
}

}  // namespace

// --- public entry points ---------------------------------------------------------------------

CheckpointInfo save_sharded(const std::string& root, FullyShardBase& fsdp,
                            const optim::ShardOptimizer* optimizer, const SaveOptions& options) {
  auto h = hold_fully_shard(fsdp, const_cast<optim::ShardOptimizer*>(optimizer), false, {});
  return save(root, fsdp.comm(), h, options);
}

CheckpointInfo load_sharded(const std::string& path, FullyShardBase& fsdp, optim::ShardOptimizer* optimizer) {
  return load(
      path, fsdp.comm(),
      [&](const Checkpoint& c) {
        const auto states =
            optimizer ? states_to_load(c, optimizer->state_names()) : std::vector<std::string>{};
        return hold_fully_shard(fsdp, optimizer && c.has_optimizer ? optimizer : nullptr, true, states);
      },
      [&](const Checkpoint& c) {
        if (!optimizer || !c.has_optimizer) return;
        const auto layout = fsdp.layout();
        for (std::size_t i = 0; i < layout.size(); ++i) {
          std::int64_t steps = 0;
          for (const auto& p : layout[i].params) steps = std::max(steps, steps_of(c, p.name));
          optimizer->set_steps(i, steps);
        }
      });
}

CheckpointInfo save_sharded(const std::string& root, DDPBase& ddp, torch::optim::Optimizer* optimizer,
                            const SaveOptions& options) {
  auto& e = ddp.engine();
  Holding h;
  h.mode = "ddp";
  const int rank = ddp.world().rank(), n = ddp.world().world_size();
  hold_buckets(h, e, rank, n);
  if (optimizer && !optimizer->state().empty()) {
    const auto kind = torch_state_of(*optimizer);
    h.has_optimizer = true;
    h.state_names = kind.names;
    for (const auto& p : e.params()) {
      auto it = optimizer->state().find(optimizer_tensor(e, p).unsafeGetTensorImpl());
      if (it == optimizer->state().end()) continue;
      h.steps[p.name] = kind.steps(it->second.get());
      const auto share = shard_range(p.numel, n, rank);
      for (const auto& [name, t] : kind.get(it->second.get())) {
        if (!t.defined()) continue;
        h.segments.push_back({t.detach().reshape({-1}),
                              0,
                              share.offset,
                              share.offset + share.numel,
                              {Span{p.name + "." + name, p.shape, 0, p.numel}},
                              "state"});
      }
    }
  }
  add_buffers(h, ddp.root_module());
  return save(root, ddp.comm(), h, options);
}

CheckpointInfo load_sharded(const std::string& path, DDPBase& ddp, torch::optim::Optimizer* optimizer) {
  auto& e = ddp.engine();
  std::vector<std::pair<const sharding::DdpParam*, std::vector<at::Tensor>>> loaded;
  return load(
      path, ddp.comm(),
      [&](const Checkpoint& c) {
        restore_bucket_order(c, e);
        Holding h;
        h.mode = "ddp";
        hold_buckets(h, e, ddp.world().rank(), ddp.world().world_size());
        if (optimizer && c.has_optimizer) {
          const auto names = states_to_load(c, torch_state_of(*optimizer).names);
          for (const auto& p : e.params()) {
            if (names.empty() || !c.tensors.count(p.name + "." + names.front())) continue;  // never stepped
            std::vector<at::Tensor> states;
            for (const auto& name : names) {
              states.push_back(at::zeros(p.shape, at::kFloat));
              h.segments.push_back({states.back().view({-1}),
                                    0,
                                    0,
                                    0,
                                    {Span{p.name + "." + name, p.shape, 0, p.numel}},
                                    "state"});
            }
            loaded.emplace_back(&p, std::move(states));
          }
        }
        add_buffers(h, ddp.root_module());
        return h;
      },
      [&](const Checkpoint& c) {
        if (!optimizer) return;
        const auto kind = torch_state_of(*optimizer);
        for (auto& [p, states] : loaded) {
          optimizer->state()[optimizer_tensor(e, *p).unsafeGetTensorImpl()] =
              kind.make(states, steps_of(c, p->name));
        }
      });
}

CheckpointInfo save_sharded(const std::string& root, ZeroRedundancyOptimizer& zero,
                            const SaveOptions& options) {
  auto& e = detail::Access::engine(zero);
  auto& opt = detail::Access::optimizer(zero);
  Holding h;
  h.mode = "zero";
  const int rank = e.rank(), n = e.world_size();
  hold_buckets(h, e, rank, n);
  h.has_optimizer = opt.state_bytes() > 0 || opt.state_names().empty();
  h.state_names = opt.state_names();
  for (int b = 0; b < static_cast<int>(e.buckets().size()); ++b) {
    const auto share = shard_range(e.buckets()[b].padded_numel, n, rank);
    const auto spans = bucket_spans(e, b);
    for (const auto& [name, t] : opt.named_state(b)) {
      if (!t.defined()) continue;
      h.segments.push_back(
          {t, share.offset, share.offset, share.offset + share.numel, spans_of(spans, "." + name), "state"});
    }
    for (const auto& s : spans) h.steps[s.key] = opt.steps(b);
  }
  add_buffers(h, e.model());
  return save(root, e.comm(), h, options);
}

CheckpointInfo load_sharded(const std::string& path, ZeroRedundancyOptimizer& zero) {
  auto& e = detail::Access::engine(zero);
  optim::ShardOptimizer* optimizer = nullptr;
  return load(
      path, e.comm(),
      [&](const Checkpoint& c) {
        restore_bucket_order(c, e);
        optimizer = &detail::Access::optimizer(zero);
        auto& opt = *optimizer;
        Holding h;
        h.mode = "zero";
        hold_buckets(h, e, e.rank(), e.world_size());
        const auto names = states_to_load(c, opt.state_names());
        for (int b = 0; b < static_cast<int>(e.buckets().size()); ++b) {
          const auto share = e.slice(b);
          const auto spans = bucket_spans(e, b);
          for (const auto& name : names) {
            h.segments.push_back(
                {opt.mutable_state(b, name), share.offset, 0, 0, spans_of(spans, "." + name), "state"});
          }
        }
        add_buffers(h, e.model());
        return h;
      },
      [&](const Checkpoint& c) {
        if (!c.has_optimizer) return;
        for (int b = 0; b < static_cast<int>(e.buckets().size()); ++b) {
          std::int64_t steps = 0;
          for (int i : e.buckets()[b].params) steps = std::max(steps, steps_of(c, e.params()[i].name));
          optimizer->set_steps(b, steps);
        }
      });
}

}  // namespace flatshard::checkpoint
