// Internal invariants. A failed FLATSHARD_ASSERT is a FlatShard bug, not a user error:
// it aborts with the condition and location instead of throwing a typed error.
#pragma once

#include <cstdio>
#include <cstdlib>

#define FLATSHARD_ASSERT(cond, msg)                                                                         \
  do {                                                                                                      \
    if (!(cond)) {                                                                                          \
      std::fprintf(stderr, "FlatShard internal error at %s:%d: %s (%s)\n", __FILE__, __LINE__, #cond, msg); \
      std::abort();                                                                                         \
    }                                                                                                       \
  } while (0)
