#include "src/io/files.h"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string_view>
#include <thread>

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
  fsync_dir(parent_of(path));
}

namespace {
constexpr std::size_t kBlock = 4096;                    // O_DIRECT's alignment on every common device
constexpr std::size_t kStaging = std::size_t{8} << 20;  // bytes per write
}  // namespace

SequentialFile::SequentialFile(const std::string& path) : path_(path) {
  ::signal(SIGXFSZ, SIG_IGN);  // a write past ulimit -f then fails with EFBIG
  constexpr int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
  const char* setting = std::getenv("FLATSHARD_CHECKPOINT_DIRECT");
  const bool wanted = !setting || std::string(setting) != "0";
  if (wanted) fd_ = ::open(path.c_str(), flags | O_DIRECT, 0644);
  direct_ = fd_ >= 0;
  if (!wanted || (fd_ < 0 && errno == EINVAL)) fd_ = ::open(path.c_str(), flags, 0644);  // no O_DIRECT
  if (fd_ < 0) fail("creating", errno);
  void* buffer = nullptr;
  if (::posix_memalign(&buffer, kBlock, kStaging) != 0) {
    ::close(fd_);
    fd_ = -1;
    fail("allocating a staging buffer for", ENOMEM);
  }
  staging_ = static_cast<char*>(buffer);
}

SequentialFile::~SequentialFile() {
  if (fd_ >= 0) ::close(fd_);
  std::free(staging_);
}

void SequentialFile::fail(const char* step, int err) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  throw checkpoint::CheckpointError(
      path_, fmt::format("flatshard::checkpoint: {} '{}' failed: {}", step, path_, errno_reason(err)));
}

void SequentialFile::write_out(const char* data, std::size_t bytes) {
  std::size_t done = 0;
  while (done < bytes) {
    const ssize_t w = ::write(fd_, data + done, bytes - done);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno == EINVAL && direct_) {
      // The file system took O_DIRECT at open but not this write (or a short write left
      // the offset unaligned): go on through the page cache.
      direct_ = false;
      if (::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) & ~O_DIRECT) != 0) fail("writing", errno);
      continue;
    }
    if (w <= 0) fail("writing", w < 0 ? errno : ENOSPC);
    done += static_cast<std::size_t>(w);
  }
  written_ += static_cast<std::int64_t>(bytes);
}

void SequentialFile::stage(const char* data, std::size_t n) {
  while (n > 0) {
    const std::size_t take = std::min(n, kStaging - staged_);
    std::memcpy(staging_ + staged_, data, take);
    staged_ += take;
    size_ += static_cast<std::int64_t>(take);
    data += take;
    n -= take;
    if (staged_ == kStaging) {
      write_out(staging_, staged_);
      staged_ = 0;
    }
  }
}

void SequentialFile::append(const void* data, std::size_t n) {
  const auto* p = static_cast<const char*>(data);
  if (!direct_ && n >= kBlock) {  // through the page cache: no copy of ours either
    if (staged_ > 0) {
      write_out(staging_, staged_);
      staged_ = 0;
    }
    write_out(p, n);
    size_ += static_cast<std::int64_t>(n);
    return;
  }
  const std::size_t in_block = static_cast<std::size_t>(size_) % kBlock;
  if (!direct_ || (reinterpret_cast<std::uintptr_t>(p) - in_block) % kBlock != 0 ||
      n < kBlock + kBlock - in_block) {
    stage(p, n);
    return;
  }
  // The source sits in memory as the file's blocks do: complete the block that is staged,
  // write out what is staged, and send the whole blocks that follow straight from `data`.
  const std::size_t head = in_block == 0 ? 0 : kBlock - in_block;
  stage(p, head);
  if (staged_ > 0) {
    write_out(staging_, staged_);
    staged_ = 0;
  }
  const std::size_t blocks = (n - head) / kBlock * kBlock;
  write_out(p + head, blocks);
  size_ += static_cast<std::int64_t>(blocks);
  stage(p + head + blocks, n - head - blocks);
}

std::int64_t SequentialFile::align_with(const void* data) {
  if (!direct_) return 0;
  const std::size_t want = reinterpret_cast<std::uintptr_t>(data) % kBlock;
  const std::size_t pad = (want + kBlock - static_cast<std::size_t>(size_) % kBlock) % kBlock;
  static const char zeros[kBlock] = {};
  stage(zeros, pad);
  return static_cast<std::int64_t>(pad);
}

void SequentialFile::finish() {
  if (staged_ > 0) {
    std::size_t bytes = staged_;
    if (direct_) {  // pad to whole blocks; the truncate below drops the padding
      bytes = (staged_ + kBlock - 1) / kBlock * kBlock;
      std::memset(staging_ + staged_, 0, bytes - staged_);
    }
    write_out(staging_, bytes);
    staged_ = 0;
  }
  if (written_ != size_ && ::ftruncate(fd_, size_) != 0) fail("setting the length of", errno);
  if (fault_injected("fsync")) fail("flushing", EIO);  // Note [Injected checkpoint faults]
  if (fault_injected("slow")) std::this_thread::sleep_for(std::chrono::seconds(5));
  if (::fsync(fd_) != 0) fail("flushing", errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0)
    throw checkpoint::CheckpointError(
        path_, fmt::format("flatshard::checkpoint: closing '{}' failed: {}", path_, errno_reason(errno)));
}

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    // A read's failure gets a reader's advice (the writers' above speaks of saving).
    const int err = errno != 0 ? errno : ENOENT;
    const char* why = err == ENOENT || err == ENOTDIR
                          ? "the file is missing: check the path, or copy the whole "
                            "directory again"
                      : err == EACCES || err == EPERM ? "no permission to read it"
                                                      : "check the file system";
    throw checkpoint::CheckpointError(path, fmt::format("flatshard::checkpoint: reading '{}' failed: {} ({})",
                                                        path, std::strerror(err), why));
  }
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

bool fault_injected(const char* site) {
  const char* faults = std::getenv("FLATSHARD_CHECKPOINT_FAULT");
  if (faults == nullptr) return false;
  const std::string_view all(faults), want(site);
  for (std::size_t at = 0; at <= all.size();) {
    const std::size_t comma = std::min(all.find(',', at), all.size());
    if (all.substr(at, comma - at) == want) return true;
    at = comma + 1;
  }
  return false;
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

// A rename or a new entry is durable once its directory is flushed. A file system that
// cannot flush a directory (EINVAL) keeps its entries by other means; any other failure
// (EIO, a full journal) means the entry may not survive a power loss, and the save fails.
void fsync_dir(const std::string& dir) {
  auto refuse = [&](const char* step, int err) {
    throw checkpoint::CheckpointError(
        dir, fmt::format("flatshard::checkpoint: {} '{}' failed: {}: what was last renamed or made in it may "
                         "not survive a power loss; check the disk",
                         step, dir, std::strerror(err)));
  };
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) refuse("opening the directory", errno);
  if (::fsync(fd) != 0 && errno != EINVAL && errno != EROFS) {
    const int err = errno;
    ::close(fd);
    refuse("flushing the directory", err);
  }
  ::close(fd);
}

void make_dirs(const std::string& dir) {
  std::string sofar;
  std::size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    sofar = dir.substr(0, pos);
    if (sofar.empty() || exists(sofar)) continue;
    if (::mkdir(sofar.c_str(), 0755) != 0) {
      if (errno == EEXIST) continue;
      throw checkpoint::CheckpointError(
          dir,
          fmt::format("flatshard::checkpoint: cannot create directory '{}': {}", sofar, errno_reason(errno)));
    }
    fsync_dir(parent_of(sofar));  // the new directory survives a power loss with what is saved in it
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

Mapping map_file(const std::string& path) {
  auto refuse = [&](const char* what, int err) {
    const char* why = err == ENOENT ? " (the file is missing: download or copy the whole directory again)"
                      : err == EACCES || err == EPERM ? " (no permission to read it)"
                                                      : "";
    throw checkpoint::CheckpointError(
        path, fmt::format("cannot {} '{}': {}{}", what, path, std::strerror(err), why));
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) refuse("open", errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    refuse("read", err);
  }
  Mapping m;
  m.bytes = static_cast<std::size_t>(st.st_size);
  if (m.bytes > 0) {
    void* map = ::mmap(nullptr, m.bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    ::close(fd);
    if (map == MAP_FAILED) refuse("map", err);
    m.data = static_cast<const char*>(map);
  } else {
    ::close(fd);
  }
  return m;
}

void unmap_file(const Mapping& m) {
  if (m.data) ::munmap(const_cast<char*>(m.data), m.bytes);
}

}  // namespace flatshard::io
