// Files and directories for checkpoints: crash-safe replacement, reading, and the POSIX
// helpers the sharded checkpoint's directories need.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace flatshard::io {

// Writes `bytes` to a temporary file beside `path`, fsyncs it, renames it over `path`
// and fsyncs the directory. On failure the temporary file is removed, `path` keeps its
// old content, and CheckpointError says why (a full disk, a file-size limit, no
// permission, a missing directory) and what to do.
void write_file_atomically(const std::string& path, const std::vector<char>& bytes);

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
