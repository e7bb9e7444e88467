// Logging: one line per message on stderr, prefixed with the rank. The level comes from
// FLATSHARD_LOG_LEVEL (error, warn, info, debug; default warn). Every collective is
// logged at debug level with its sequence number, size and duration.
#pragma once

#include <string>
#include <utility>

#include <fmt/format.h>

namespace flatshard::log {

enum class Level { Error = 0, Warn = 1, Info = 2, Debug = 3 };

bool enabled(Level level);
void set_rank(int rank, int world_size);
void write(Level level, const std::string& line);

template <typename... Args>
void at(Level level, fmt::format_string<Args...> format, Args&&... args) {
  if (enabled(level)) write(level, fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace flatshard::log
