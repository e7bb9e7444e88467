#include "src/logging.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace flatshard::log {
namespace {

Level level_from_env() {
  const char* v = std::getenv("FLATSHARD_LOG_LEVEL");
  if (v == nullptr) return Level::Warn;
  if (std::strcmp(v, "error") == 0) return Level::Error;
  if (std::strcmp(v, "info") == 0) return Level::Info;
  if (std::strcmp(v, "debug") == 0) return Level::Debug;
  return Level::Warn;
}

const Level kLevel = level_from_env();
std::atomic<int> g_rank{-1};
std::atomic<int> g_world{0};
std::mutex g_write_mutex;

const char* name(Level level) {
  switch (level) {
    case Level::Error: return "E";
    case Level::Warn: return "W";
    case Level::Info: return "I";
    case Level::Debug: return "D";
  }
  return "?";
}

}  // namespace

bool enabled(Level level) { return static_cast<int>(level) <= static_cast<int>(kLevel); }

void set_rank(int rank, int world_size) {
  g_rank = rank;
  g_world = world_size;
}

void write(Level level, const std::string& line) {
  std::string out = g_rank >= 0 ? fmt::format("[flatshard {} rank {}/{}] {}\n", name(level), g_rank.load(),
                                              g_world.load(), line)
                                : fmt::format("[flatshard {}] {}\n", name(level), line);
  std::lock_guard<std::mutex> lock(g_write_mutex);
  std::fputs(out.c_str(), stderr);
}

}  // namespace flatshard::log
