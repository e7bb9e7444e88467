#include "src/io/atomic_file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include <fmt/format.h>

#include "flatshard/checkpoint.h"

namespace flatshard::io {
namespace {

std::string advice(int err) {
  switch (err) {
    case ENOSPC:
    case EDQUOT: return "the disk (or quota) is full: free space or save elsewhere";
    case EFBIG: return "the file exceeds the process's file-size limit (ulimit -f) or the file system's";
    case EACCES:
    case EPERM:
    case EROFS: return "no permission to write there: choose a writable directory";
    case ENOENT:
    case ENOTDIR: return "the directory does not exist: create it first";
    default: return "check the file system";
  }
}

[[noreturn]] void fail(const std::string& path, const std::string& step, int err) {
  throw checkpoint::CheckpointError(
      path,
      fmt::format("flatshard::checkpoint: {} '{}' failed: {} ({}). The previous file, if any, is intact.",
                  step, path, std::strerror(err), advice(err)));
}

std::string parent_of(const std::string& path) {
  const auto slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  return slash == 0 ? "/" : path.substr(0, slash);
}

}  // namespace

void write_file_atomically(const std::string& path, const std::vector<char>& bytes) {
  // A write past RLIMIT_FSIZE raises SIGXFSZ, which would kill the process before the
  // write could report EFBIG.
  ::signal(SIGXFSZ, SIG_IGN);
  const std::string temp = fmt::format("{}.tmp.{}", path, ::getpid());
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(path, "creating a temporary file beside", errno);
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = n < 0 ? errno : ENOSPC;
      ::close(fd);
      ::unlink(temp.c_str());
      fail(path, "writing", err);
    }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    ::unlink(temp.c_str());
    fail(path, "flushing", err);
  }
  ::close(fd);
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(temp.c_str());
    fail(path, "renaming the temporary file over", err);
  }
  const int dir = ::open(parent_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, "opening", errno != 0 ? errno : ENOENT);
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace flatshard::io
