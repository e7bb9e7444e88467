#!/usr/bin/env python3
"""Where the ranks' communication wait goes, op by op, from the communicator's debug log.

It keys each op on its communicator's name and number; a communicator's ranks are those that
issued on it (under HybridShard each shard group's and each replica set's communicator has a
name of its own: "/shard1of2", "/replica0of2").

With FLATSHARD_LOG_LEVEL=debug every op logs when it was issued and when its stream ran it,
and while waits are timed (FullyShard::communication_wait, bench_modes) every stalled wait
logs its span, all on the host's steady clock, which the ranks of one host share. This
groups the stalls by communicator, op and size, and splits each at the moment the last rank
issued the op, as Note [Waiting for peers] does:

    FLATSHARD_LOG_LEVEL=debug flatshard-run -n 4 build/bench/bench_modes --mode full \\
        --layers 4 --dim 256 --heads 8 --vocab 4096 --context 32 --steps 16 > run.log 2>&1
    bench/wait_trace.py run.log [--skip 0.3]

Each group is split by how the op was issued: "at once" where the rank waited for it within
a millisecond of its own issue (nothing to hide behind), "ahead" otherwise (a prefetch, a
reduction beside backward). For each group: the stalls and their milliseconds (all ranks), the part before the last
rank's issue (for peers), the median time from the last rank's issue to the stall's end
(what the op took once every rank had issued it), and the median time from the waiting
rank's own issue to the start of its wait (the compute the op had to hide behind).
--skip leaves out the first share of the run (warm-up). --check fails (exit 1) unless
there are stalls and none ended before the last rank issued its op, which no collective can
(a wait that did would mean the log's times are not one clock's).
"""

import argparse
import collections
import re
import statistics
import sys

LINE = re.compile(r"^\[rank (\d+)\] .*?\] (\S+): (.*)$")
ISSUED = re.compile(r"^(\w+) #(\d+) issued at (\d+) us$")
RAN = re.compile(r"^(\w+) #(\d+) (\d+) B on stream \w+: [0-9.]+ ms.*, from (\d+) us$")
WAITED = re.compile(r"^waited for #(\d+) ([0-9.]+) ms, from (\d+) to (\d+) us$")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log")
    p.add_argument("--skip", type=float, default=0.3, help="share of the run to leave out at its start")
    p.add_argument("--check", action="store_true", help="fail unless every stall ended after its op's last issue")
    a = p.parse_args()
    if not 0 <= a.skip < 1:
        sys.exit("wait_trace.py: --skip is a share of the run, from 0 up to (not including) 1")
    issued = collections.defaultdict(dict)  # (comm, seq) -> {rank: us}
    op = {}                                 # (comm, seq) -> (name, bytes)
    stalls = []                             # (rank, comm, seq, start_us, end_us)
    for line in open(a.log, errors="replace"):
        m = LINE.match(line.rstrip("\n"))
        if not m:
            continue
        rank, comm, rest = int(m.group(1)), m.group(2), m.group(3)
        if (i := ISSUED.match(rest)):
            issued[(comm, int(i.group(2)))][rank] = int(i.group(3))
            op.setdefault((comm, int(i.group(2))), (i.group(1), 0))
        elif (r := RAN.match(rest)):
            op[(comm, int(r.group(2)))] = (r.group(1), int(r.group(3)))
        elif (w := WAITED.match(rest)):
            stalls.append((rank, comm, int(w.group(1)), int(w.group(3)), int(w.group(4))))
    if not issued or not stalls:
        sys.exit("wait_trace.py: no issued ops or stalled waits in the log (FLATSHARD_LOG_LEVEL=debug, waits timed?)")
    ranks = 1 + max(r for v in issued.values() for r in v)
    members = collections.defaultdict(set)  # comm -> the ranks that issued on it
    for (comm, _), v in issued.items():
        members[comm].update(v)
    first = min(min(v.values()) for v in issued.values())
    last = max(max(v.values()) for v in issued.values())
    cut = first + a.skip * (last - first)
    groups = collections.defaultdict(lambda: {"n": 0, "ms": 0.0, "peer": 0.0, "after": [], "lead": []})
    total = 0.0
    early = []  # stalls that ended before the op's last issue
    for rank, comm, seq, start, end in stalls:
        ranks_issued = issued.get((comm, seq), {})
        if start < cut or len(ranks_issued) < len(members[comm]):
            continue
        last_issue = max(ranks_issued.values())
        if end < last_issue:
            early.append(f"rank {rank}'s wait for {comm} #{seq} ended {(last_issue - end) / 1e3:.3f} ms before the last issue")
        lead = (start - ranks_issued[rank]) / 1e3
        g = groups[(comm,) + op[(comm, seq)] + ("at once" if lead < 1 else "ahead",)]
        g["n"] += 1
        g["ms"] += (end - start) / 1e3
        g["peer"] += min(max(last_issue - start, 0), end - start) / 1e3
        g["after"].append((end - last_issue) / 1e3)
        g["lead"].append(lead)
        total += (end - start) / 1e3
    window = max((last - cut) / 1e3, 1e-3)
    print(f"{ranks} ranks, {window:.0f} ms of issues after the first {100 * a.skip:.0f}%: "
          f"{total:.0f} ms stalled, {100 * total / (ranks * window):.0f}% of the ranks' time")
    print("| communicator | op | bytes | issued | stalls | ms | for peers ms | op after the last issue, median ms "
          "| own issue to the wait, median ms |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    for (comm, name, size, how), g in sorted(groups.items(), key=lambda kv: -kv[1]["ms"]):
        print(f"| {comm} | {name} | {size} | {how} | {g['n']} | {g['ms']:.1f} | {g['peer']:.1f} | "
              f"{statistics.median(g['after']):.2f} | {statistics.median(g['lead']):.2f} |")
    if a.check and (early or not groups):
        sys.exit("wait_trace.py: " + ("; ".join(early[:5]) if early else "no stalls after the skipped share"))


if __name__ == "__main__":
    main()
