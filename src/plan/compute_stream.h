// The step-time model's streams (src/plan/step_time.cpp): a link's queue of collectives
// and the compute stream that collectives beside it slow down.
#pragma once

#include <algorithm>
#include <vector>

#include "flatshard/step_time.h"

namespace flatshard::plan::sim {

// What one collective (or copy) takes on its link: the whole, and of it the ring steps'
// latency; `cpu`, where given, the part of the rest that is the CPU's work of moving its
// bytes (a collective beside compute takes longer than that work: Note [Collectives beside
// compute] in step_time.cpp).
struct Cost {
  double seconds = 0, latency = 0;
  double cpu = -1;  // below 0: all of seconds - latency
  double moving() const { return cpu >= 0 ? std::min(cpu, seconds - latency) : seconds - latency; }
};

// A link as a queue: collectives run one after another in the order issued.
struct Lane {
  const Link* link = nullptr;
  double free_at = 0;
  double busy = 0, latency = 0;
  struct Span {
    double start, end;
    double moving_share;  // of its time, the CPU moving bytes (the rest is waiting: the ring steps' latency,
                          // cores)
  };
  std::vector<Span> spans{};  // when it ran, in order
  double run(double issued, const Cost& c) {
    const double start = std::max(issued, free_at);
    free_at = start + c.seconds;
    busy += c.seconds;
    latency += c.latency;
    if (c.seconds > 0) spans.push_back({start, free_at, c.moving() / c.seconds});
    return free_at;
  }
};

// Note [Collectives on the compute's cores]
// A collective running beside compute takes `share` of the device from it: while a link
// moves bytes, compute advances at 1 - share of its rate (at share 1 it waits each
// collective's bytes out, as if the two ran one after another; two links at once take
// share each, together at most the whole device). On a GPU NCCL's kernels take a
// few SMs and the effect is small; on a CPU host whose cores the ranks' compute fills
// (ranks x intra-op threads >= cores) the communicator's memcpys and reductions run on those
// same cores, and every second of them is a second of compute lost. Only a collective's
// bytes take the cores: its ring steps' latency is the communicator waiting in poll() for
// its peer, so a span contends for the part of it that moves bytes. The collectives keep
// the duration their link gives them (measured with the cores free). Every collective that
// can overlap a stretch of compute was issued when the stretch began (gathers ahead of a
// unit, reductions at the end of the one before), so the stretch's end follows from the
// lanes' spans so far. The copies between host and device (offload) are not among the
// lanes: a GPU's copy engines run them beside its SMs.
struct ComputeStream {
  double share = 0;
  std::vector<const Lane*> lanes;
  double contended = 0;  // seconds lost to collectives so far
  // Compute of `seconds` (at the full rate) started at `start`: when it ends.
  double run(double start, double seconds) {
    if (share <= 0 || seconds <= 0) return start + seconds;
    // The rate changes only where a span that ends after `start` begins or ends: between two
    // such times compute runs at 1 - share x (the bytes-moving shares of the spans then running).
    std::vector<Lane::Span> running;  // the spans that end after `start`
    std::vector<double> times{start};
    for (const Lane* lane : lanes) {
      for (const auto& span : lane->spans) {
        if (span.end <= start) continue;
        running.push_back(span);
        times.push_back(span.start);
        times.push_back(span.end);
      }
    }
    std::sort(times.begin(), times.end());
    double t = start, left = seconds;
    for (std::size_t i = 0; i < times.size() && left > 0; ++i) {
      const double to = times[i];
      if (to <= t) continue;
      double moving = 0;
      for (const auto& span : running) {
        if (span.start <= t && span.end >= to) moving += span.moving_share;
      }
      const double rate = 1 - std::min(share * moving, 1.0);
      if (rate > 0 && (to - t) * rate >= left) {
        t += left / rate;
        left = 0;
      } else {
        left -= (to - t) * rate;
        t = to;
      }
    }
    const double end = t + left;
    contended += std::max(0.0, end - start - seconds);
    return end;
  }
};

}  // namespace flatshard::plan::sim
