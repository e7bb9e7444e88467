// Files and directories for checkpoints: crash-safe replacement, reading, and the POSIX
// helpers the sharded checkpoint's directories need.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace flatshard::io {

// Note [Injected checkpoint faults]
// FLATSHARD_CHECKPOINT_FAULT=SITE[,SITE...] makes this process fail at each named site as
// the system would there: `hold` (reading this rank's shards to save, an AsyncSaver's host
// copy among them: out of memory), `thread` (an AsyncSaver's writer thread cannot start:
// out of threads), `fsync` (a shard file's fsync: EIO), `slow` (a shard file's fsync
// takes 5 seconds more: a slow disk). Tests set it on one rank to prove that every rank
// hears the failure at once, that nothing is left half-written, that the next save works,
// and that the others wait for a slow rank (Note [Waiting for the other ranks' files]).
bool fault_injected(const char* site);

// Writes `bytes` to a temporary file beside `path`, fsyncs it, renames it over `path`
// and fsyncs the directory. On failure the temporary file is removed, `path` keeps its
// old content, and CheckpointError says why (a full disk, a file-size limit, no
// permission, a missing directory) and what to do.
void write_file_atomically(const std::string& path, const std::vector<char>& bytes);

// Note [Writing around the page cache]
// A shard file is hundreds of megabytes written once and not read again until a resume.
// Written through the page cache, the kernel copies every byte into cache pages it then
// writes back: measured on a 2-core host, 1.5 s of system time per 586 MB, taken from the
// ranks that train beside an asynchronous save. Opened with O_DIRECT the device reads the
// bytes from our buffer (0.03 s of system time, and sooner on the disk). O_DIRECT wants
// the buffer, the file offset and the length aligned to the device's block (4 KiB here).
// Bytes whose address sits within its block as the file's end does (align_with pads the
// file to make it so) go from the caller's memory to the device in whole blocks; the rest
// is copied into an aligned staging buffer and written from there. The last, partial
// block is written padded and the file truncated to its length. A file system that refuses O_DIRECT (at open
// or at a write) is written through the page cache as before, and so is every file when
// FLATSHARD_CHECKPOINT_DIRECT=0. finish() fsyncs either way.
class SequentialFile {
 public:
  // Creates (or truncates) `path`; CheckpointError naming it when it cannot.
  explicit SequentialFile(const std::string& path);
  ~SequentialFile();
  SequentialFile(const SequentialFile&) = delete;
  SequentialFile& operator=(const SequentialFile&) = delete;
  // Appends n bytes; CheckpointError (a full disk, ulimit -f, ...) when writing fails.
  void append(const void* data, std::size_t n);
  // Appends zeros (fewer than a block) so that appending from `data` next can skip the
  // staging copy; returns how many (0 when the file is written through the page cache).
  std::int64_t align_with(const void* data);
  // Writes what is staged, sets the file's length, fsyncs and closes.
  void finish();
  std::int64_t size() const { return size_; }
  bool direct() const { return direct_; }

 private:
  void write_out(const char* data, std::size_t bytes);  // whole blocks, unless at the end
  void stage(const char* data, std::size_t n);          // through the staging buffer
  [[noreturn]] void fail(const char* step, int err);

  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  char* staging_ = nullptr;
  std::size_t staged_ = 0;
  std::int64_t size_ = 0;     // bytes appended
  std::int64_t written_ = 0;  // bytes in the file (a padded tail included)
};

// Reads a whole file; CheckpointError if it cannot.
std::vector<char> read_file(const std::string& path);

// strerror(err) with what to do about the common causes (a full disk, ulimit -f, no
// permission).
std::string errno_reason(int err);
bool exists(const std::string& path);
void fsync_dir(const std::string& dir);
// mkdir -p; CheckpointError naming the directory that could not be made.
void make_dirs(const std::string& dir);
// rm -rf; silent about what is not there.
void remove_tree(const std::string& path);
// A whole file mapped read-only: its bytes and their count (nullptr and 0 for an empty
// file); CheckpointError naming the file when it cannot be opened, read or mapped. Give it
// back with unmap_file.
struct Mapping {
  const char* data = nullptr;
  std::size_t bytes = 0;
};
Mapping map_file(const std::string& path);
void unmap_file(const Mapping& m);
// The names in a directory ("." and ".." included); empty when it cannot be read.
std::vector<std::string> list_dir(const std::string& dir);

}  // namespace flatshard::io
