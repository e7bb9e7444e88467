// Atomic checkpoint files: round trip, a failed write leaves the old file intact (a
// file-size limit stands in for a full disk), and damaged files are refused.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "flatshard/checkpoint.h"
#include "src/io/files.h"

namespace {

namespace fs = std::filesystem;
using flatshard::checkpoint::CheckpointError;
using flatshard::checkpoint::load_tensors;
using flatshard::checkpoint::save_tensors;

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("flatshard_ckpt_" + std::to_string(::getpid()));
  TempDir() { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
};

std::map<std::string, at::Tensor> sample(float scale) {
  return {{"a.weight", at::arange(12, at::kFloat).view({3, 4}) * scale},
          {"b", at::ones({5}, at::kDouble) * scale}};
}

TEST(CheckpointFiles, RoundTrip) {
  TempDir dir;
  const auto file = (dir.path / "model.pt").string();
  save_tensors(sample(2), file);
  const auto back = load_tensors(file);
  ASSERT_EQ(back.size(), 2u);
  EXPECT_TRUE(at::equal(back.at("a.weight"), sample(2).at("a.weight")));
  EXPECT_TRUE(at::equal(back.at("b"), sample(2).at("b")));
}

TEST(CheckpointFiles, FailedWriteKeepsThePreviousFile) {
  TempDir dir;
  const auto file = (dir.path / "model.pt").string();
  save_tensors(sample(1), file);
  rlimit old{};
  ::getrlimit(RLIMIT_FSIZE, &old);
  rlimit small = old;
  small.rlim_cur = 256;  // bytes: the new file cannot be written
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  try {
    save_tensors(sample(3), file);
    ::setrlimit(RLIMIT_FSIZE, &old);
    FAIL() << "the write succeeded under a 256-byte file-size limit";
  } catch (const CheckpointError& e) {
    ::setrlimit(RLIMIT_FSIZE, &old);
    EXPECT_EQ(e.path(), file);
    EXPECT_NE(std::string(e.what()).find("file-size limit"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("previous file"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(at::equal(load_tensors(file).at("a.weight"), sample(1).at("a.weight")));
  for (const auto& entry : fs::directory_iterator(dir.path)) {
    EXPECT_EQ(entry.path().filename(), "model.pt") << "a temporary file was left behind";
  }
}

// Shard files are written around the page cache (O_DIRECT where the file system takes
// it) through an aligned staging buffer: lengths that end inside a block, exactly on one,
// on the staging buffer's size and past it, appended in uneven pieces, come back byte for
// byte at their exact length.
TEST(CheckpointFiles, SequentialFileWritesExactBytes) {
  TempDir dir;
  const std::size_t staging = std::size_t{8} << 20;
  for (const char* direct : {"1", "0"})  // 0: FLATSHARD_CHECKPOINT_DIRECT=0, through the page cache
    for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{4095}, std::size_t{4096},
                                std::size_t{4097}, staging, staging + 12345, 2 * staging + 4096}) {
      std::vector<char> bytes(n);
      for (std::size_t i = 0; i < n; ++i) bytes[i] = static_cast<char>((i * 2654435761u) >> 13);
      const auto file = (dir.path / ("f" + std::to_string(n))).string();
      ::setenv("FLATSHARD_CHECKPOINT_DIRECT", direct, 1);
      flatshard::io::SequentialFile out(file);
      ::unsetenv("FLATSHARD_CHECKPOINT_DIRECT");
      if (direct[0] == '0') EXPECT_FALSE(out.direct());
      std::size_t done = 0, piece = 1;
      while (done < n) {  // pieces of 1, 3, 9, ... bytes, up to 3 MiB
        const std::size_t take = std::min(n - done, piece);
        out.append(bytes.data() + done, take);
        done += take;
        piece = std::min<std::size_t>(piece * 3, 3u << 20);
      }
      EXPECT_EQ(out.size(), static_cast<std::int64_t>(n));
      out.finish();
      ASSERT_EQ(fs::file_size(file), n) << file;
      std::ifstream in(file, std::ios::binary);
      const std::vector<char> back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      EXPECT_TRUE(back == bytes) << n << " bytes came back different (direct " << direct << ")";
    }
}

// A large piece is written from where it lies: align_with pads the file (with zeros, less
// than a block) so that the piece's address and its place in the file agree within a
// block, and the piece lands at the offset the file's size gave after the padding.
TEST(CheckpointFiles, SequentialFileWritesALargePieceFromWhereItLies) {
  TempDir dir;
  std::vector<char> source((std::size_t{5} << 20) + 4096 + 200);
  for (std::size_t i = 0; i < source.size(); ++i) source[i] = static_cast<char>((i * 40503u) >> 7);
  const std::string prefix(1000, 'p'), suffix(77, 's');
  const char* piece = source.data() + 123;
  const std::size_t n = (std::size_t{5} << 20) + 77;
  const auto file = (dir.path / "aligned").string();
  flatshard::io::SequentialFile out(file);
  out.append(prefix.data(), prefix.size());
  const std::int64_t pad = out.align_with(piece);
  EXPECT_GE(pad, 0);
  EXPECT_LT(pad, 4096);
  const std::int64_t offset = out.size();
  EXPECT_EQ(offset, 1000 + pad);
  if (out.direct()) {
    EXPECT_EQ((reinterpret_cast<std::uintptr_t>(piece) - static_cast<std::uintptr_t>(offset)) % 4096, 0u)
        << "the piece's address and its place in the file do not agree within a block";
  } else {
    std::printf("this file system refused O_DIRECT: the piece went through the page cache\n");
  }
  out.append(piece, n);
  out.append(suffix.data(), suffix.size());
  out.finish();
  std::ifstream in(file, std::ios::binary);
  const std::string back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSERT_EQ(back.size(), 1000 + static_cast<std::size_t>(pad) + n + 77);
  EXPECT_EQ(back.substr(0, 1000), prefix);
  EXPECT_EQ(back.substr(1000, static_cast<std::size_t>(pad)),
            std::string(static_cast<std::size_t>(pad), '\0'));
  EXPECT_TRUE(back.compare(static_cast<std::size_t>(offset), n, piece, n) == 0)
      << "the piece came back different";
  EXPECT_EQ(back.substr(static_cast<std::size_t>(offset) + n), suffix);
}

// Past the file-size limit (a full disk's stand-in) a direct write fails as a buffered one
// does: a CheckpointError naming the file and saying what to do.
TEST(CheckpointFiles, SequentialFileReportsAFullDisk) {
  TempDir dir;
  const auto file = (dir.path / "big").string();
  rlimit old{};
  ::getrlimit(RLIMIT_FSIZE, &old);
  rlimit small = old;
  small.rlim_cur = 1 << 20;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  try {
    flatshard::io::SequentialFile out(file);
    const std::vector<char> bytes(std::size_t{20} << 20, 'x');
    out.append(bytes.data(), bytes.size());
    out.finish();
    ::setrlimit(RLIMIT_FSIZE, &old);
    FAIL() << "20 MiB were written under a 1 MiB file-size limit";
  } catch (const CheckpointError& e) {
    ::setrlimit(RLIMIT_FSIZE, &old);
    EXPECT_EQ(e.path(), file);
    EXPECT_NE(std::string(e.what()).find("ulimit -f"), std::string::npos) << e.what();
  }
}

TEST(CheckpointFiles, MissingDirectoryIsATypedError) {
  try {
    save_tensors(sample(1), "/nonexistent-dir-flatshard/model.pt");
    FAIL() << "saved into a directory that does not exist";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("does not exist"), std::string::npos) << e.what();
  }
}

TEST(CheckpointFiles, DamagedFilesAreRefused) {
  TempDir dir;
  const auto file = (dir.path / "model.pt").string();
  save_tensors(sample(1), file);
  const auto size = fs::file_size(file);
  fs::resize_file(file, size / 2);  // truncated
  EXPECT_THROW(load_tensors(file), CheckpointError);
  std::ofstream(file, std::ios::binary) << "not a checkpoint";
  EXPECT_THROW(load_tensors(file), CheckpointError);
  EXPECT_THROW(load_tensors((dir.path / "absent.pt").string()), CheckpointError);
}

// Note [Checking a full state dict's records]: one flipped bit inside a tensor's record is
// refused, naming the record (LibTorch's reader alone loads the changed value); the file
// as saved loads.
TEST(CheckpointFiles, AFlippedBitInATensorIsRefused) {
  TempDir dir;
  const auto file = (dir.path / "model.pt").string();
  save_tensors({{"w", at::arange(4096, at::kFloat)}}, file);
  EXPECT_TRUE(at::equal(load_tensors(file).at("w"), at::arange(4096, at::kFloat)));
  std::vector<char> bytes;
  {
    std::ifstream in(file, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const float marker = 2048.0f;
  const char* m = reinterpret_cast<const char*>(&marker);
  const auto where = std::search(bytes.begin(), bytes.end(), m, m + sizeof(marker));
  ASSERT_NE(where, bytes.end()) << "the value 2048 is not in the file";
  where[2] = static_cast<char>(where[2] ^ 0x01);  // 2048 becomes another float
  std::ofstream(file, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  try {
    load_tensors(file);
    ADD_FAILURE() << "a changed value loaded";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("does not match its CRC-32"), std::string::npos) << e.what();
  }
}

}  // namespace
