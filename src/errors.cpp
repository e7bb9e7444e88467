#include "flatshard/errors.h"

namespace flatshard {

const char* to_string(CommError::Kind kind) {
  switch (kind) {
    case CommError::Kind::PeerLost: return "peer lost";
    case CommError::Kind::Timeout: return "timeout";
    case CommError::Kind::Mismatch: return "mismatch";
    case CommError::Kind::Aborted: return "aborted";
  }
  return "unknown";
}

}  // namespace flatshard
