// Hugging Face's safetensors format, read through a memory map and written in a stream.
//
// A file is an 8-byte little-endian header length N, N bytes of JSON
//   {"<name>": {"dtype": "BF16", "shape": [4096, 4096], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"format": "pt"}}
// padded with spaces, then the tensors' bytes: little-endian, row-major, each at its
// [begin, end) from the end of the header. A model too large for one file is split into
// several, with model.safetensors.index.json mapping each name to its file.
//
//   flatshard::safetensors::File file("model.safetensors");
//   at::Tensor w = file.read("lm_head.weight");                // whole, in the file's dtype
//   file.read_into("lm_head.weight", begin, slice);            // elements [begin, ...) only
//
// Reading a slice touches only that slice's bytes: a rank that loads its shards of a
// model reads its shards, never the whole file. See docs/hugging-face.md.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "flatshard/checkpoint.h"

namespace flatshard::safetensors {

// A tensor's entry in a file's header.
struct TensorInfo {
  at::ScalarType dtype = at::kFloat;
  std::vector<std::int64_t> shape;
  std::int64_t numel = 0;
  std::int64_t byte_offset = 0;  // from the start of the file
  std::int64_t nbytes = 0;
};

// The format's name of a dtype ("F32", "BF16", ...); InvalidArgument for one it lacks.
std::string dtype_name(at::ScalarType dtype);

// One file, memory-mapped read-only. The header is checked when the file opens (offsets
// inside the file, sizes that match dtype and shape, no overlaps): a truncated or corrupt
// file throws checkpoint::CheckpointError naming it.
class File {
 public:
  explicit File(const std::string& path);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  // CheckpointError naming the file when it lacks `name`.
  const TensorInfo& info(const std::string& name) const;

  // The whole tensor, in the file's dtype and shape (a copy: it outlives the file).
  at::Tensor read(const std::string& name) const;
  // Copies elements [begin, begin + dst.numel()) of the flattened tensor into dst (1-D,
  // contiguous, any dtype: the values convert, as Tensor::copy_ converts them).
  void read_into(const std::string& name, std::int64_t begin, const at::Tensor& dst) const;

 private:
  std::string path_;
  const char* data_ = nullptr;  // the mapping
  std::size_t bytes_ = 0;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A model directory as Hugging Face writes it: model.safetensors, or the files that
// model.safetensors.index.json names. Every file is opened (mapped and its header checked)
// when the Directory is made: a missing or damaged file fails then, before any is read.
class Directory {
 public:
  explicit Directory(std::string dir);
  ~Directory();

  const std::string& dir() const { return dir_; }
  // Every tensor's name and entry, across the files.
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  bool contains(const std::string& name) const { return tensors_.count(name) != 0; }
  const File& file_of(const std::string& name) const;

 private:
  std::string dir_;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> file_names_;  // tensor -> file
  std::map<std::string, std::unique_ptr<File>> files_;
};

// Writes one file in a stream: the header first (every tensor's name, dtype and shape,
// in the order given), then each tensor's bytes as write() gives them, in any order. The
// file appears under `path` only at commit() (written to a temporary name, flushed,
// renamed: a crash leaves the old file or the new one); a Writer dropped before commit
// removes its temporary file.
class Writer {
 public:
  struct Entry {
    std::string name;
    at::ScalarType dtype = at::kFloat;
    std::vector<std::int64_t> shape;
  };
  Writer(std::string path, const std::vector<Entry>& entries,
         const std::map<std::string, std::string>& metadata = {{"format", "pt"}});
  ~Writer();
  Writer(const Writer&) = delete;
  Writer& operator=(const Writer&) = delete;

  // `values` is converted to the entry's dtype; its shape must be the entry's.
  void write(const std::string& name, const at::Tensor& values);
  // Every entry must have been written. commit() is sync() then publish(): the file
  // flushed to disk under its temporary name, then renamed into place (several files that
  // belong together: sync every one before publishing any).
  void commit();
  void sync();
  void publish();
  std::int64_t file_bytes() const { return file_bytes_; }

 private:
  std::string path_, temp_;
  int fd_ = -1;
  bool synced_ = false;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, bool> written_;
  std::int64_t file_bytes_ = 0;
};

// A whole dict in one file (through Writer), and one read back whole.
void save(const std::map<std::string, at::Tensor>& tensors, const std::string& path,
          const std::map<std::string, std::string>& metadata = {{"format", "pt"}});
std::map<std::string, at::Tensor> load(const std::string& path);

}  // namespace flatshard::safetensors
