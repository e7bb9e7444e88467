// The safetensors format (include/flatshard/safetensors.h): a header checked on open, a
// read-only memory map for the data, and a writer that puts the header first and the
// tensors' bytes at their offsets.
#include "flatshard/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <string_view>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "src/errors.h"
#include "src/io/files.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian, as this host");

namespace flatshard::safetensors {

using json = nlohmann::json;
using checkpoint::CheckpointError;

namespace {

// A header larger than this is refused before it is read (the reference reader's limit).
constexpr std::uint64_t kMaxHeaderBytes = 100u << 20;

const std::vector<std::pair<const char*, at::ScalarType>>& dtype_table() {
  static const std::vector<std::pair<const char*, at::ScalarType>> table = {
      {"F64", at::kDouble},
      {"F32", at::kFloat},
      {"F16", at::kHalf},
      {"BF16", at::kBFloat16},
      {"I64", at::kLong},
      {"I32", at::kInt},
      {"I16", at::kShort},
      {"I8", at::kChar},
      {"U8", at::kByte},
      {"BOOL", at::kBool},
      {"U16", at::kUInt16},
      {"U32", at::kUInt32},
      {"U64", at::kUInt64},
      {"F8_E4M3", at::kFloat8_e4m3fn},
      {"F8_E5M2", at::kFloat8_e5m2},
  };
  return table;
}

[[noreturn]] void corrupt(const std::string& path, const std::string& what) {
  throw CheckpointError(path,
                        fmt::format("'{}' is not a readable safetensors file: {}. Write it again (Python: "
                                    "safetensors.torch.save_file, or save_pretrained)",
                                    path, what));
}

std::int64_t numel_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

// The bytes of `shape` elements of `element` bytes each; nullopt when a dimension is
// negative or the product overflows (a hostile or corrupt header).
std::optional<std::int64_t> bytes_of(const std::vector<std::int64_t>& shape, std::size_t element) {
  std::int64_t n = static_cast<std::int64_t>(element);
  for (auto d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return std::nullopt;
  }
  return n;
}

void require(bool ok, const std::string& message) {
  if (!ok) throw InvalidArgument("flatshard::safetensors: " + message);
}

std::string temp_name(const std::string& path) { return fmt::format("{}.tmp.{}", path, ::getpid()); }

void write_all(int fd, const char* data, std::size_t n, std::int64_t offset, const std::string& path) {
  std::size_t done = 0;
  while (done < n) {
    const ssize_t w = ::pwrite(fd, data + done, n - done, static_cast<off_t>(offset + done));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int err = w < 0 ? errno : ENOSPC;
      throw CheckpointError(path, fmt::format("writing '{}' failed: {}", path, io::errno_reason(err)));
    }
    done += static_cast<std::size_t>(w);
  }
}

}  // namespace

std::string dtype_name(at::ScalarType dtype) {
  for (const auto& [name, t] : dtype_table()) {
    if (t == dtype) return name;
  }
  throw InvalidArgument(fmt::format("safetensors has no dtype for {}", c10::toString(dtype)));
}

// --- File ----------------------------------------------------------------------------------

namespace {

// A header's array of integers (a shape, a tensor's data offsets): each element a JSON
// integer that fits int64 (the parser would otherwise truncate 2.7 to 2, read true as 1,
// or convert 1e19 with undefined behaviour).
std::vector<std::int64_t> integers(const std::string& path, const std::string& name, const json& array,
                                   const char* what) {
  if (!array.is_array()) corrupt(path, fmt::format("tensor '{}' has a {} that is not an array", name, what));
  std::vector<std::int64_t> out;
  for (const auto& v : array) {
    const bool fits =
        v.is_number_integer() &&
        (!v.is_number_unsigned() ||
         v.get<std::uint64_t>() <= static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()));
    if (!fits)
      corrupt(path, fmt::format("tensor '{}' has a {} holding {}, not an integer", name, what, v.dump()));
    out.push_back(v.get<std::int64_t>());
  }
  return out;
}

}  // namespace

File::File(const std::string& path) : path_(path) {
  const io::Mapping map = io::map_file(path);
  data_ = map.data;
  bytes_ = map.bytes;
  // A clone made without git-lfs holds the pointer files in place of the weights.
  constexpr std::string_view kLfsPointer = "version https://git-lfs";
  if (bytes_ >= kLfsPointer.size() && std::memcmp(data_, kLfsPointer.data(), kLfsPointer.size()) == 0) {
    io::unmap_file(map);
    data_ = nullptr;
    throw CheckpointError(path,
                          fmt::format("'{}' is a Git LFS pointer, not the tensors: the model was cloned "
                                      "without git-lfs; run `git lfs pull` in its directory (or download "
                                      "it with huggingface-cli)",
                                      path));
  }
  if (bytes_ < 8) {
    io::unmap_file(map);
    data_ = nullptr;
    corrupt(path, fmt::format("it is {} bytes long, shorter than the 8-byte header length", bytes_));
  }
  try {
    std::uint64_t header_bytes = 0;
    std::memcpy(&header_bytes, data_, 8);
    if (header_bytes > kMaxHeaderBytes || header_bytes > bytes_ - 8) {
      corrupt(path, fmt::format("its header length {} exceeds the file ({} bytes)", header_bytes, bytes_));
    }
    const std::int64_t data_begin = 8 + static_cast<std::int64_t>(header_bytes);
    const std::int64_t data_bytes = static_cast<std::int64_t>(bytes_) - data_begin;
    json header;
    try {
      // A name listed twice would be read from whichever entry the parser kept: refused, as
      // the reference reader refuses it.
      std::set<std::string> names;
      const json::parser_callback_t once = [&](int depth, json::parse_event_t event, json& parsed) {
        if (depth == 1 && event == json::parse_event_t::key &&
            !names.insert(parsed.get<std::string>()).second)
          corrupt(path, fmt::format("its header lists '{}' twice", parsed.get<std::string>()));
        return true;
      };
      header = json::parse(data_ + 8, data_ + data_begin, once);
    } catch (const json::exception& e) {
      corrupt(path, fmt::format("its header is not JSON ({})", e.what()));
    }
    if (!header.is_object()) corrupt(path, "its header is not a JSON object");
    std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
    for (const auto& [name, entry] : header.items()) {
      if (name == "__metadata__") {
        if (!entry.is_object()) corrupt(path, "its __metadata__ is not a JSON object of strings");
        for (const auto& [k, v] : entry.items()) {
          if (!v.is_string()) corrupt(path, fmt::format("metadata '{}' is not a string", k));
          metadata_[k] = v.get<std::string>();
        }
        continue;
      }
      try {
        TensorInfo t;
        const auto dtype = entry.at("dtype").get<std::string>();
        auto it = std::find_if(dtype_table().begin(), dtype_table().end(),
                               [&](const auto& d) { return dtype == d.first; });
        if (it == dtype_table().end())
          corrupt(path,
                  fmt::format("tensor '{}' has dtype '{}', which FlatShard does not read", name, dtype));
        t.dtype = it->second;
        t.shape = integers(path, name, entry.at("shape"), "shape");
        const auto bytes = bytes_of(t.shape, c10::elementSize(t.dtype));
        if (!bytes) corrupt(path, fmt::format("tensor '{}' has a negative or impossibly large shape", name));
        t.numel = numel_of(t.shape);
        const auto offsets = integers(path, name, entry.at("data_offsets"), "data_offsets");
        if (offsets.size() != 2 || offsets[0] < 0 || offsets[1] < offsets[0] || offsets[1] > data_bytes) {
          corrupt(path,
                  fmt::format("tensor '{}' has data_offsets outside the file's {} data bytes (is the file "
                              "truncated?)",
                              name, data_bytes));
        }
        t.byte_offset = data_begin + offsets[0];
        t.nbytes = offsets[1] - offsets[0];
        if (t.nbytes != *bytes) {
          corrupt(path, fmt::format("tensor '{}' spans {} bytes, but {} elements of {} take {}", name,
                                    t.nbytes, t.numel, dtype, *bytes));
        }
        ranges.emplace_back(offsets[0], offsets[1]);
        tensors_.emplace(name, std::move(t));
      } catch (const json::exception& e) {
        corrupt(path, fmt::format("tensor '{}' has a malformed entry ({})", name, e.what()));
      }
    }
    // The tensors' bytes follow one another from the data's start to the file's end, with no
    // overlap and no gap (the format allows none, and the reference reader checks it): bytes
    // no tensor accounts for mean offsets that do not say what the writer wrote.
    std::sort(ranges.begin(), ranges.end());
    std::int64_t next = 0;
    for (const auto& [begin, end] : ranges) {
      if (begin < next) corrupt(path, "two tensors' data overlap");
      if (begin > next)
        corrupt(path,
                fmt::format("data bytes [{}, {}) belong to no tensor: its offsets are damaged", next, begin));
      next = end;
    }
    if (next != data_bytes)
      corrupt(path,
              fmt::format("its tensors hold {} of its {} data bytes: the rest belong to no tensor (is the "
                          "file damaged, or something appended to it?)",
                          next, data_bytes));
  } catch (...) {
    io::unmap_file({data_, bytes_});
    throw;
  }
}

File::~File() { io::unmap_file({data_, bytes_}); }

const TensorInfo& File::info(const std::string& name) const {
  auto it = tensors_.find(name);
  if (it == tensors_.end())
    throw CheckpointError(path_, fmt::format("'{}' holds no tensor named '{}'", path_, name));
  return it->second;
}

at::Tensor File::read(const std::string& name) const {
  const auto& t = info(name);
  auto out = at::empty(t.shape, at::TensorOptions().dtype(t.dtype));
  read_into(name, 0, out.view({-1}));
  return out;
}

void File::read_into(const std::string& name, std::int64_t begin, const at::Tensor& dst) const {
  const auto& t = info(name);
  require(dst.dim() == 1 && dst.is_contiguous(), "File::read_into takes a 1-D contiguous destination");
  const std::int64_t n = dst.numel();
  if (begin < 0 || begin > t.numel - n) {
    throw InvalidArgument(
        fmt::format("elements [{}, {}) of '{}' in '{}': it has {}", begin, begin + n, name, path_, t.numel));
  }
  if (n == 0) return;  // an empty tensor has no bytes (and may have no storage to copy into)
  const std::size_t element = c10::elementSize(t.dtype);
  const char* src = data_ + t.byte_offset + begin * static_cast<std::int64_t>(element);
  // Copied out of the mapping first: the format does not promise aligned data, and the
  // destination may differ in dtype and device.
  if (dst.scalar_type() == t.dtype && dst.device().is_cpu()) {
    std::memcpy(dst.data_ptr(), src, static_cast<std::size_t>(n) * element);
    dst.unsafeGetTensorImpl()->bump_version();  // as a copy_ would: gathered copies refresh
    return;
  }
  auto staged = at::empty({n}, at::TensorOptions().dtype(t.dtype));
  std::memcpy(staged.data_ptr(), src, static_cast<std::size_t>(n) * element);
  dst.copy_(staged);
}

// --- Directory -------------------------------------------------------------------------

Directory::Directory(std::string dir) : dir_(std::move(dir)) {
  const std::string index = dir_ + "/model.safetensors.index.json";
  const std::string single = dir_ + "/model.safetensors";
  // transformers' order: model.safetensors when there is one, else the index.
  if (!io::exists(single) && io::exists(index)) {
    const auto bytes = io::read_file(index);
    try {
      const auto j = json::parse(bytes.begin(), bytes.end());
      for (const auto& [name, file] : j.at("weight_map").items()) {
        const auto f = file.get<std::string>();
        if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..") {
          throw CheckpointError(index,
                                fmt::format("'{}' names '{}' for '{}': the files of a model sit in its "
                                            "directory; write the model again",
                                            index, f, name));
        }
        file_names_[name] = f;
      }
    } catch (const json::exception& e) {
      throw CheckpointError(
          index, fmt::format("'{}' is not a safetensors index ({}): write the model again", index, e.what()));
    }
  } else if (!io::exists(single)) {
    throw CheckpointError(dir_,
                          fmt::format("'{}' holds neither model.safetensors nor "
                                      "model.safetensors.index.json: is it a Hugging Face model directory?",
                                      dir_));
  }
  std::set<std::string> files;
  for (const auto& [name, file] : file_names_) files.insert(file);
  if (file_names_.empty()) files.insert("model.safetensors");
  for (const auto& file : files) {
    auto f = std::make_unique<File>(dir_ + "/" + file);
    for (const auto& [name, info] : f->tensors()) {
      if (!file_names_.empty()) {
        auto it = file_names_.find(name);
        if (it == file_names_.end() || it->second != file) {
          throw CheckpointError(f->path(),
                                fmt::format("'{}' holds '{}', which the index names {}", f->path(), name,
                                            it == file_names_.end() ? "nowhere" : "in " + it->second));
        }
      }
      tensors_[name] = info;
    }
    files_[file] = std::move(f);
  }
  for (const auto& [name, file] : file_names_) {
    if (!tensors_.count(name)) {
      throw CheckpointError(dir_ + "/" + file,
                            fmt::format("the index names '{}' in '{}', which does not hold it", name, file));
    }
  }
  if (file_names_.empty()) {
    for (const auto& [name, info] : tensors_) file_names_[name] = "model.safetensors";
  }
}

Directory::~Directory() = default;

const File& Directory::file_of(const std::string& name) const {
  auto it = file_names_.find(name);
  if (it == file_names_.end())
    throw CheckpointError(dir_, fmt::format("the model in '{}' has no tensor named '{}'", dir_, name));
  return *files_.at(it->second);
}

// --- Writer ------------------------------------------------------------------------------

Writer::Writer(std::string path, const std::vector<Entry>& entries,
               const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), temp_(temp_name(path_)) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  // The data in order of element size, largest first (the order listed within a size):
  // every tensor then starts aligned to its element size, as the Python package lays it
  // out, with no gap between tensors (the format allows none).
  std::vector<const Entry*> order;
  for (const auto& e : entries) order.push_back(&e);
  std::stable_sort(order.begin(), order.end(), [](const Entry* a, const Entry* b) {
    return c10::elementSize(a->dtype) > c10::elementSize(b->dtype);
  });
  std::int64_t offset = 0;
  for (const Entry* e : order) {
    require(!tensors_.count(e->name), fmt::format("Writer: '{}' is listed twice for '{}'", e->name, path_));
    TensorInfo t;
    t.dtype = e->dtype;
    t.shape = e->shape;
    t.numel = numel_of(e->shape);
    t.nbytes = t.numel * static_cast<std::int64_t>(c10::elementSize(e->dtype));
    header[e->name] = {
        {"dtype", dtype_name(e->dtype)}, {"shape", e->shape}, {"data_offsets", {offset, offset + t.nbytes}}};
    t.byte_offset = offset;  // from the data's start until the header's size is known
    offset += t.nbytes;
    tensors_[e->name] = t;
    written_[e->name] = false;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data starts 8-byte aligned
  const std::int64_t data_begin = 8 + static_cast<std::int64_t>(text.size());
  for (auto& [name, t] : tensors_) t.byte_offset += data_begin;
  file_bytes_ = data_begin + offset;

  ::signal(SIGXFSZ, SIG_IGN);  // a write past RLIMIT_FSIZE then fails with EFBIG
  fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    throw CheckpointError(path_, fmt::format("cannot create '{}': {}", temp_, io::errno_reason(errno)));
  }
  try {
    const std::uint64_t header_bytes = text.size();
    char length[8];
    std::memcpy(length, &header_bytes, 8);
    write_all(fd_, length, 8, 0, path_);
    write_all(fd_, text.data(), text.size(), 8, path_);
  } catch (...) {
    ::close(fd_);
    ::unlink(temp_.c_str());
    fd_ = -1;
    throw;
  }
}

Writer::~Writer() {
  if (fd_ >= 0) ::close(fd_);
  if (fd_ >= 0 || synced_) ::unlink(temp_.c_str());  // never published: nothing is left behind
}

void Writer::write(const std::string& name, const at::Tensor& values) {
  require(fd_ >= 0, fmt::format("Writer: '{}' is committed", path_));
  auto it = tensors_.find(name);
  require(it != tensors_.end(), fmt::format("Writer: '{}' was not listed for '{}'", name, path_));
  const auto& t = it->second;
  require(values.sizes().vec() == t.shape, fmt::format("Writer: '{}' has shape {}, listed as [{}]", name,
                                                       c10::str(values.sizes()), fmt::join(t.shape, ", ")));
  const at::Tensor bytes = values.detach().to(at::kCPU, t.dtype).contiguous();
  write_all(fd_, static_cast<const char*>(bytes.data_ptr()), static_cast<std::size_t>(t.nbytes),
            t.byte_offset, path_);
  written_[name] = true;
}

void Writer::commit() {
  sync();
  publish();
}

void Writer::sync() {
  require(fd_ >= 0 && !synced_, fmt::format("Writer: '{}' is synced already", path_));
  for (const auto& [name, done] : written_) {
    require(done, fmt::format("Writer: '{}' was never written to '{}'", name, path_));
  }
  const int fd = fd_;
  auto fail = [&](const char* what) {
    const int err = errno;
    ::close(fd);
    ::unlink(temp_.c_str());
    fd_ = -1;
    throw CheckpointError(path_, fmt::format("{} '{}' failed: {}", what, path_, io::errno_reason(err)));
  };
  // A file shorter than its header says (no tensor at the end) still gets its full length.
  if (::ftruncate(fd, static_cast<off_t>(file_bytes_)) != 0) fail("sizing");
  if (::fsync(fd) != 0) fail("flushing");
  ::close(fd);
  fd_ = -1;
  synced_ = true;
}

void Writer::publish() {
  require(synced_, fmt::format("Writer: '{}' is published before it is synced", path_));
  synced_ = false;
  if (::rename(temp_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(temp_.c_str());
    throw CheckpointError(path_, fmt::format("renaming onto '{}' failed: {}", path_, io::errno_reason(err)));
  }
  const auto slash = path_.find_last_of('/');
  io::fsync_dir(slash == std::string::npos ? "." : path_.substr(0, slash));
}

void save(const std::map<std::string, at::Tensor>& tensors, const std::string& path,
          const std::map<std::string, std::string>& metadata) {
  std::vector<Writer::Entry> entries;
  for (const auto& [name, t] : tensors) entries.push_back({name, t.scalar_type(), t.sizes().vec()});
  Writer writer(path, entries, metadata);
  for (const auto& [name, t] : tensors) writer.write(name, t);
  writer.commit();
}

std::map<std::string, at::Tensor> load(const std::string& path) {
  File file(path);
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, info] : file.tensors()) out[name] = file.read(name);
  return out;
}

}  // namespace flatshard::safetensors
