// Crash-safe file replacement.
#pragma once

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

}  // namespace flatshard::io
