// Atomic checkpoint files: round trip, a failed write leaves the old file intact (a
// file-size limit stands in for a full disk), and damaged files are refused.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "flatshard/checkpoint.h"

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

}  // namespace
