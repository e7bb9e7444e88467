// Internal invariants. A failed FLATSHARD_ASSERT is a FlatShard bug, not a user error:
// it aborts with the condition and location instead of throwing a typed error.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#define FLATSHARD_ASSERT(cond, msg)                                                                         \
  do {                                                                                                      \
    if (!(cond)) {                                                                                          \
      std::fprintf(stderr, "FlatShard internal error at %s:%d: %s (%s)\n", __FILE__, __LINE__, #cond, msg); \
      std::abort();                                                                                         \
    }                                                                                                       \
  } while (0)

namespace flatshard {

// An exception's message up to its first line break: LibTorch's errors carry a backtrace
// after it, which a FlatShard error passing the reason on leaves out.
inline std::string first_line(const std::string& what) { return what.substr(0, what.find('\n')); }

}  // namespace flatshard
