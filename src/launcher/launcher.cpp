#include "src/launcher/launcher.h"

#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "src/launcher/rendezvous.h"
#include "src/tcp/socket.h"

namespace flatshard::launcher {
namespace {

using Clock = std::chrono::steady_clock;

int g_signal_pipe[2] = {-1, -1};

void on_signal(int sig) {
  const unsigned char byte = static_cast<unsigned char>(sig);
  [[maybe_unused]] ssize_t n = ::write(g_signal_pipe[1], &byte, 1);
}

int parse_int(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || *end != '\0')
    throw std::invalid_argument(fmt::format("{} needs an integer, got '{}'", flag, text));
  return static_cast<int>(v);
}

double parse_double(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0')
    throw std::invalid_argument(fmt::format("{} needs a number, got '{}'", flag, text));
  return v;
}

// `bytes` bytes from the operating system's random source, in hex; "" when it fails.
std::string random_hex(std::size_t bytes) {
  std::vector<unsigned char> raw(bytes);
  const int fd = ::open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return "";
  std::size_t got = 0;
  while (got < bytes) {
    const ssize_t n = ::read(fd, raw.data() + got, bytes - got);
    if (n <= 0 && errno != EINTR) break;
    if (n > 0) got += static_cast<std::size_t>(n);
  }
  ::close(fd);
  if (got < bytes) return "";
  std::string hex;
  for (unsigned char b : raw) hex += fmt::format("{:02x}", b);
  return hex;
}

// A port free on every interface of both families (Note [Either family]), released for
// rank 0 to bind.
int free_port() {
  try {
    return tcp::Listener(0, "").port();
  } catch (const tcp::IoError& e) {
    throw std::runtime_error(fmt::format("cannot find a free port: {}", e.detail));
  }
}

// A child process and the pipes its output comes through.
struct Rank {
  int index = 0;
  pid_t pid = -1;
  int out_fd = -1;  // its stdout
  int err_fd = -1;  // its stderr
  std::string out_partial, err_partial;
  bool exited = false;
  int code = 0;           // its exit code, or 128 + the signal that killed it
  bool signaled = false;  // killed by a signal (an exit code above 128 is still an exit code)
};

void emit(int rank, std::string& partial, const char* data, std::size_t n, FILE* to) {
  partial.append(data, n);
  std::size_t start = 0;
  for (std::size_t nl; (nl = partial.find('\n', start)) != std::string::npos; start = nl + 1) {
    fmt::print(to, "[rank {}] {}\n", rank, std::string_view(partial).substr(start, nl - start));
  }
  partial.erase(0, start);
  std::fflush(to);
}

void flush_partial(int rank, std::string& partial, FILE* to) {
  if (!partial.empty()) fmt::print(to, "[rank {}] {}\n", rank, partial);
  partial.clear();
  std::fflush(to);
}

pid_t spawn(const LaunchOptions& o, int local, int port, int restart, int out_fd[2], int err_fd[2]) {
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid > 0) ::setpgid(pid, pid);  // the child does too: its group exists before either goes on
  if (pid != 0) return pid;
  // Child: its own process group (the launcher forwards signals), killed if the
  // launcher dies.
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(1);  // the launcher died before the line above
  ::dup2(out_fd[1], STDOUT_FILENO);
  ::dup2(err_fd[1], STDERR_FILENO);
  ::close(out_fd[0]);
  ::close(err_fd[0]);
  const int world = o.nnodes * o.nproc_per_node;
  const int rank = o.node_rank * o.nproc_per_node + local;
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(local).c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", std::to_string(o.nproc_per_node).c_str(), 1);
  ::setenv("GROUP_RANK", std::to_string(o.node_rank).c_str(), 1);
  ::setenv("MASTER_ADDR", o.master_addr.c_str(), 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  ::setenv("OMP_NUM_THREADS", "1", 0);  // ranks share the cores; keep what the user set
  // Note [Restarting a failed job]: which start this is (torchrun's names, and ours).
  ::setenv("TORCHELASTIC_RESTART_COUNT", std::to_string(restart).c_str(), 1);
  ::setenv("TORCHELASTIC_MAX_RESTARTS", std::to_string(o.max_restarts).c_str(), 1);
  ::setenv("FLATSHARD_RESTART_COUNT", std::to_string(restart).c_str(), 1);
  if (o.nccl_host_per_rank) {
    // Note [NCCL between ranks on one GPU]
    ::setenv("NCCL_HOSTID", fmt::format("flatshard-{}-{}-rank{}", o.master_addr, port, rank).c_str(), 1);
    if (o.nnodes == 1) {  // one machine: sockets on loopback, not an RDMA adapter or a net plugin
      ::setenv("NCCL_SOCKET_IFNAME", "lo", 0);
      ::setenv("NCCL_NET", "Socket", 0);
    }
    ::setenv("FLATSHARD_NCCL_HOST_PER_RANK", "1", 1);
  }
  std::vector<char*> argv;
  for (const auto& a : o.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  std::fprintf(stderr, "flatshard-run: cannot start %s: %s\n", argv[0], std::strerror(errno));
  ::_exit(127);
}

// Note [NCCL between ranks on one GPU]
// NCCL refuses two ranks of a communicator on one GPU when it believes they share a host
// ("Duplicate GPU detected"): it compares a host hash, which the NCCL_HOSTID environment
// variable replaces. With --nccl-host-per-rank each rank gets an id of its own (the
// job's address and port, and the rank), so NCCL treats the ranks as separate machines
// and joins them over its network transport (sockets on the loopback interface, unless
// NCCL_NET or NCCL_SOCKET_IFNAME says otherwise: InfiniBand adapters or a net plugin would
// otherwise carry it; across nodes NCCL picks its network as usual): the inter-node path of
// a real cluster, on one machine. It is for testing and measuring NCCL at several ranks where there is one
// GPU; it is slower than NVLink or shared memory between GPUs, and each rank still shares the one GPU's SMs
// and memory. FLATSHARD_NCCL_HOST_PER_RANK=1 tells the ranks it is on.

}  // namespace

std::string usage() {
  return "usage: flatshard-run -n N [--nnodes M|MIN:MAX --node-rank R --master-addr A --master-port P]\n"
         "                     [--grace-s S] [--deadline-s S] [--nccl-host-per-rank] [--max-restarts N]\n"
         "                     [--rdzv-wait-s S] [--rdzv-timeout-s S] PROGRAM [ARGS...]\n"
         "  -n, --nproc-per-node N  ranks to start on this node\n"
         "  --nnodes M              nodes in the job (default 1)\n"
         "  --nnodes MIN:MAX        an elastic job: the nodes meet before every start at node 0\n"
         "                          (--master-addr:--master-port) and each start runs with the\n"
         "                          nodes present, at least MIN; with --max-restarts, a node\n"
         "                          lost for good leaves the job at the world that remains\n"
         "  --node-rank R           this node's index (default 0); elastic: its id, 0 hosts\n"
         "  --rdzv-wait-s S         elastic: how long a start waits for nodes beyond MIN (10)\n"
         "  --rdzv-timeout-s S      elastic: how long a start waits for MIN nodes (600)\n"
         "  --master-addr A         host of global rank 0 (default 127.0.0.1)\n"
         "  --master-port P         its rendezvous port (default: a free port; required if M > 1)\n"
         "  --grace-s S             after a rank fails, seconds the others get to exit (default 5)\n"
         "  --deadline-s S          stop the job and fail after S seconds (default: none)\n"
         "  --nccl-host-per-rank    give each rank its own NCCL_HOSTID, so that NCCL joins ranks\n"
         "                          that share a GPU over its network transport (testing)\n"
         "  --max-restarts N        after a rank fails, stop the others and start every rank\n"
         "                          again, up to N times (default 0); the program resumes from\n"
         "                          its latest checkpoint (TORCHELASTIC_RESTART_COUNT says which\n"
         "                          start it is); on M > 1 fixed nodes the launchers meet\n"
         "                          before each start, as with --nnodes M:M\n";
}

LaunchOptions parse_args(int argc, char** argv) {
  LaunchOptions o;
  int i = 1;
  auto value = [&](const std::string& flag) -> std::string {
    if (i + 1 >= argc) throw std::invalid_argument(fmt::format("{} needs a value", flag));
    return argv[++i];
  };
  for (; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-n" || a == "--nproc-per-node" || a == "--nproc_per_node")
      o.nproc_per_node = parse_int(a, value(a));
    else if (a == "--nnodes") {
      const std::string v = value(a);
      const auto colon = v.find(':');
      if (colon == std::string::npos) {
        o.nnodes = parse_int(a, v);
      } else {
        o.elastic = true;
        o.min_nodes = parse_int(a, v.substr(0, colon));
        o.max_nodes = parse_int(a, v.substr(colon + 1));
        o.nnodes = o.max_nodes;
      }
    } else if (a == "--rdzv-wait-s")
      o.rdzv_wait_s = parse_double(a, value(a));
    else if (a == "--rdzv-timeout-s")
      o.rdzv_timeout_s = parse_double(a, value(a));
    else if (a == "--node-rank" || a == "--node_rank")
      o.node_rank = parse_int(a, value(a));
    else if (a == "--master-addr" || a == "--master_addr")
      o.master_addr = value(a);
    else if (a == "--master-port" || a == "--master_port")
      o.master_port = parse_int(a, value(a));
    else if (a == "--grace-s")
      o.grace_s = parse_double(a, value(a));
    else if (a == "--deadline-s")
      o.deadline_s = parse_double(a, value(a));
    else if (a == "--nccl-host-per-rank")
      o.nccl_host_per_rank = true;
    else if (a == "--max-restarts" || a == "--max_restarts")
      o.max_restarts = parse_int(a, value(a));
    else if (a == "-h" || a == "--help")
      throw std::invalid_argument("help requested");
    else if (a == "--") {
      ++i;
      break;
    } else if (!a.empty() && a[0] == '-')
      throw std::invalid_argument(fmt::format("unknown option {}", a));
    else
      break;
  }
  for (; i < argc; ++i) o.command.emplace_back(argv[i]);
  if (o.command.empty()) throw std::invalid_argument("no PROGRAM given");
  if (o.nproc_per_node < 1) throw std::invalid_argument("-n must be at least 1");
  if (o.nnodes < 1) throw std::invalid_argument("--nnodes must be at least 1");
  if (o.node_rank < 0 || o.node_rank >= o.nnodes)
    throw std::invalid_argument("--node-rank must be in [0, --nnodes)");
  if (o.master_port < 0 || o.master_port > 65535)
    throw std::invalid_argument("--master-port must be in 1..65535");
  if (o.nnodes > 1 && o.master_port == 0)
    throw std::invalid_argument("--master-port is required when --nnodes > 1");
  if (!o.elastic && o.nnodes > 1 && o.max_restarts > 0 && o.master_port == 65535)
    throw std::invalid_argument(
        "--master-port 65535 leaves no port above it, where the launchers of a job with --max-restarts meet");
  if (o.max_restarts < 0) throw std::invalid_argument("--max-restarts must be at least 0");
  if (o.elastic && (o.min_nodes < 1 || o.max_nodes < o.min_nodes))
    throw std::invalid_argument("--nnodes MIN:MAX needs 1 <= MIN <= MAX");
  if (o.elastic && o.master_port == 0)
    throw std::invalid_argument("--nnodes MIN:MAX needs --master-port (where node 0 hosts the rendezvous)");
  if (o.rdzv_wait_s < 0 || o.rdzv_timeout_s <= 0)
    throw std::invalid_argument("--rdzv-wait-s must be >= 0 and --rdzv-timeout-s > 0");
  return o;
}

namespace {

// One start of every rank, and how it ended.
struct Outcome {
  int code = 0;              // the start's exit code, as run() returns it
  bool restartable = false;  // a rank failed by itself: not the launcher's signal, not the deadline
  std::string cause;         // "rank 1 exited with code 3"
  Clock::time_point failed_at;
  std::chrono::system_clock::time_point failed_at_wall;  // the same moment, for the next start's ranks
  bool regrouped = false;  // stopped for a larger world (Note [Growing an elastic job])
};

// An elastic start's ear for a growing job (Note [Growing an elastic job]): `check` asked
// every 100 ms says whether to stop the ranks and meet again; they are stopped `delay`
// after it first says so.
struct Regroup {
  std::function<bool()> check;
  std::chrono::milliseconds delay{0};
  // Node 0 decides: it asks only while every rank of its own runs, and ranks that all
  // finish before its stop leave a finished job. Another node that heard the word always
  // meets again (node 0 tells it there if the job finished).
  bool host = false;
};

// A FileStore (FLATSHARD_INIT_METHOD=file://PATH) outlives a failed start: its file keeps
// that start's keys, the ranks' claims among them, which the next start's ranks would
// find taken. On one machine every rank of the start has stopped when it ends, so the
// launcher removes the file before each restart.
void remove_file_store(const LaunchOptions& o) {
  const char* method = std::getenv("FLATSHARD_INIT_METHOD");
  const std::string scheme = "file://";
  if (o.nnodes != 1 || method == nullptr || std::string(method).rfind(scheme, 0) != 0) return;
  const std::string path = std::string(method).substr(scheme.size());
  if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
    fmt::print(stderr,
               "flatshard-run: cannot remove the last start's store file {}: {}; the restart may find its "
               "ranks claimed\n",
               path, std::strerror(errno));
  }
}

// Of `groups` (the ranks' process groups, each led by its rank, exited or not), those that
// hold a live process other than their leader: what the ranks started and left running.
// One pass over /proc for all of them.
std::vector<pid_t> groups_with_others(const std::vector<pid_t>& groups) {
  std::vector<pid_t> found;
  DIR* proc = ::opendir("/proc");
  if (proc == nullptr) return found;
  while (const dirent* e = ::readdir(proc)) {
    char* end = nullptr;
    const long pid = std::strtol(e->d_name, &end, 10);
    if (*end != '\0' || pid <= 0) continue;
    const std::string path = fmt::format("/proc/{}/stat", pid);
    FILE* f = std::fopen(path.c_str(), "re");
    if (f == nullptr) continue;  // gone meanwhile
    char line[512];
    const bool read = std::fgets(line, sizeof(line), f) != nullptr;
    std::fclose(f);
    // "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
    const char* close = read ? std::strrchr(line, ')') : nullptr;
    char state = 0;
    long ppid = 0, pgrp = 0;
    if (close == nullptr || std::sscanf(close + 1, " %c %ld %ld", &state, &ppid, &pgrp) != 3 ||
        state == 'Z' || pid == pgrp)
      continue;
    const auto g = static_cast<pid_t>(pgrp);
    if (std::find(groups.begin(), groups.end(), g) != groups.end() &&
        std::find(found.begin(), found.end(), g) == found.end())
      found.push_back(g);
  }
  ::closedir(proc);
  return found;
}

// Note [What a rank leaves running]
// A rank's children (a shell's background jobs, a helper process it started) are in its
// process group, which the rank's zombie keeps reserved until the start ends. Once every
// rank of a start that failed (or was stopped, or regroups) has exited, whatever is left
// in their groups is stopped as the ranks would have been: SIGTERM, and SIGKILL after a
// second, each named in the log. Left running, it would meet a restart's ranks (a port,
// a file, device memory) or outlive a failed job. After a start whose ranks all succeeded
// it is left alone: an upload a rank started to finish after training is the program's.
void stop_leftovers(const std::vector<Rank>& ranks) {
  std::vector<pid_t> leaders;
  for (const Rank& r : ranks) {
    if (r.pid > 0) leaders.push_back(r.pid);
  }
  std::vector<pid_t> groups = groups_with_others(leaders);
  if (groups.empty()) return;
  fmt::print(stderr, "flatshard-run: stopping what the ranks left running (process groups {})\n",
             fmt::join(groups, ", "));
  for (pid_t g : groups) ::kill(-g, SIGTERM);
  const auto give_up = Clock::now() + std::chrono::seconds(1);
  while (!(groups = groups_with_others(groups)).empty() && Clock::now() < give_up) ::usleep(20000);
  for (pid_t g : groups) ::kill(-g, SIGKILL);
}

Outcome run_once(const LaunchOptions& o, int restart, Clock::time_point job_start,
                 const Regroup& regroup = {}) {
  const int port = o.master_port != 0 ? o.master_port : free_port();  // a fresh one each start
  std::vector<Rank> ranks(o.nproc_per_node);
  // An exited rank is left a zombie until the start ends: its pid, and so its process
  // group's id, cannot be taken by another process meanwhile, so that signalling the group
  // of an exited rank reaches only what that rank left running.
  struct Reaper {
    std::vector<Rank>& ranks;
    ~Reaper() {
      for (const Rank& r : ranks) {
        if (r.pid > 0 && r.exited) ::waitpid(r.pid, nullptr, 0);
      }
    }
  } reaper{ranks};
  for (int i = 0; i < o.nproc_per_node; ++i) {
    // Out of descriptors, processes or memory: the ranks already started stop, and are
    // reaped, before the launcher reports it (a pid of -1 would signal every process it may
    // signal).
    const auto give_up = [&](const char* what, int err, const char* short_of) {
      for (int k = 0; k < i; ++k) {
        ::kill(-ranks[k].pid, SIGKILL);
        ::waitpid(ranks[k].pid, nullptr, 0);
        ::close(ranks[k].out_fd);
        ::close(ranks[k].err_fd);
      }
      std::fprintf(stderr, "flatshard-run: cannot start local rank %d: %s: %s (out of %s)\n", i, what,
                   std::strerror(err), short_of);
      return Outcome{1};
    };
    int out_fd[2] = {-1, -1}, err_fd[2] = {-1, -1};
    if (::pipe2(out_fd, O_CLOEXEC) != 0 || ::pipe2(err_fd, O_CLOEXEC) != 0) {
      const int err = errno;
      for (int fd : {out_fd[0], out_fd[1], err_fd[0], err_fd[1]}) {
        if (fd >= 0) ::close(fd);
      }
      return give_up("pipe", err, "file descriptors or memory");
    }
    ranks[i].index = o.node_rank * o.nproc_per_node + i;
    ranks[i].pid = spawn(o, i, port, restart, out_fd, err_fd);
    if (ranks[i].pid < 0) {
      const int err = errno;
      for (int k = 0; k < 2; ++k) {
        ::close(out_fd[k]);
        ::close(err_fd[k]);
      }
      return give_up("fork", err, "processes or memory");
    }
    ::close(out_fd[1]);
    ::close(err_fd[1]);
    ranks[i].out_fd = out_fd[0];
    ranks[i].err_fd = err_fd[0];
    ::fcntl(out_fd[0], F_SETFL, O_NONBLOCK);
    ::fcntl(err_fd[0], F_SETFL, O_NONBLOCK);
  }

  int first_failure = -1;       // index into ranks
  Clock::time_point failed_at;  // when the first failure was seen
  int stop_signal = 0;          // what we last sent the survivors
  Clock::time_point stop_sent_at;
  int result_override = -1;  // set by a signal to the launcher or the deadline
  bool regrouping = false;   // the job grows: every rank stops, not as a failure
  Clock::time_point regroup_stop_at;

  // Each rank leads its own process group: signal the group, so that programs the
  // rank started (a shell's children) stop with it, also the group of a rank that has
  // exited and left children behind (its zombie keeps the id; where no child is left, the
  // signal reaches nothing).
  auto signal_all = [&](int sig) {
    for (auto& r : ranks) ::kill(-r.pid, sig);
  };
  Clock::time_point all_exited_at{};

  for (;;) {
    std::vector<pollfd> fds;
    fds.push_back({g_signal_pipe[0], POLLIN, 0});
    for (auto& r : ranks) {
      if (r.out_fd >= 0) fds.push_back({r.out_fd, POLLIN, 0});
      if (r.err_fd >= 0) fds.push_back({r.err_fd, POLLIN, 0});
    }
    ::poll(fds.data(), fds.size(), 100);

    unsigned char sig = 0;
    while (::read(g_signal_pipe[0], &sig, 1) == 1) {
      fmt::print(stderr, "flatshard-run: got signal {}, forwarding it to every rank\n", sig);
      signal_all(sig);
      if (result_override < 0) result_override = 128 + sig;
      if (stop_signal == 0) {
        stop_signal = sig;
        stop_sent_at = Clock::now();
      }
    }
    const bool all_running = std::none_of(ranks.begin(), ranks.end(), [](const Rank& r) { return r.exited; });
    if (regroup.check && !regrouping && result_override < 0 &&
        (!regroup.host || (all_running && first_failure < 0 && stop_signal == 0)) && regroup.check()) {
      regrouping = true;
      regroup_stop_at = Clock::now() + regroup.delay;
      fmt::print(stderr,
                 "flatshard-run: node {}: a node joins the job: every rank stops, and the nodes meet again\n",
                 o.node_rank);
      std::fflush(stderr);
    }
    char buf[65536];
    for (auto& r : ranks) {
      for (int* fd : {&r.out_fd, &r.err_fd}) {
        if (*fd < 0) continue;
        const ssize_t n = ::read(*fd, buf, sizeof(buf));
        FILE* to = fd == &r.out_fd ? stdout : stderr;
        std::string& partial = fd == &r.out_fd ? r.out_partial : r.err_partial;
        if (n > 0) {
          emit(r.index, partial, buf, static_cast<std::size_t>(n), to);
        } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
          flush_partial(r.index, partial, to);
          ::close(*fd);
          *fd = -1;
        }
      }
    }
    for (auto& r : ranks) {
      if (r.exited) continue;
      siginfo_t info{};  // left a zombie (WNOWAIT): the reaper below takes it when the start ends
      if (::waitid(P_PID, static_cast<id_t>(r.pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0 ||
          info.si_pid != r.pid)
        continue;
      r.exited = true;
      r.signaled = info.si_code != CLD_EXITED;
      r.code = r.signaled ? 128 + info.si_status : info.si_status;
      if (r.code != 0 && first_failure < 0 && stop_signal == 0) {
        first_failure = static_cast<int>(&r - ranks.data());
        failed_at = Clock::now();
        fmt::print(stderr, "flatshard-run: rank {} {} {}; the other ranks get {:.1f} s to exit\n", r.index,
                   r.signaled ? "was killed by signal" : "exited with code", info.si_status, o.grace_s);
        std::fflush(stderr);
      }
    }
    bool all_exited = true, all_done = true;
    for (auto& r : ranks) {
      all_exited = all_exited && r.exited;
      all_done = all_done && r.exited && r.out_fd < 0 && r.err_fd < 0;
    }
    if (all_done) break;
    // A rank's leftover children may hold its pipes open: stop reading after a while.
    if (all_exited && all_exited_at == Clock::time_point{}) all_exited_at = Clock::now();
    if (all_exited && Clock::now() - all_exited_at > std::chrono::seconds(2)) {
      for (auto& r : ranks) {
        for (int* fd : {&r.out_fd, &r.err_fd}) {
          if (*fd >= 0) ::close(*fd);
          *fd = -1;
        }
      }
      break;
    }

    const auto now = Clock::now();
    const bool alive = std::any_of(ranks.begin(), ranks.end(), [](const Rank& r) { return !r.exited; });
    if (alive && regrouping && stop_signal == 0 && now >= regroup_stop_at) {
      stop_signal = SIGTERM;
      stop_sent_at = now;
      signal_all(SIGTERM);
    }
    if (alive && o.deadline_s > 0 && stop_signal == 0 &&
        now - job_start > std::chrono::duration<double>(o.deadline_s)) {
      fmt::print(stderr, "flatshard-run: the job passed its deadline of {:.1f} s; stopping every rank\n",
                 o.deadline_s);
      result_override = 124;
      stop_signal = SIGTERM;
      stop_sent_at = now;
      signal_all(SIGTERM);
    }
    if (alive && first_failure >= 0 && stop_signal == 0 &&
        now - failed_at > std::chrono::duration<double>(o.grace_s)) {
      fmt::print(stderr, "flatshard-run: stopping the remaining ranks\n");
      stop_signal = SIGTERM;
      stop_sent_at = now;
      signal_all(SIGTERM);
    }
    if (alive && stop_signal != 0 && stop_signal != SIGKILL && now - stop_sent_at > std::chrono::seconds(5)) {
      stop_signal = SIGKILL;
      signal_all(SIGKILL);
    }
  }
  // Note [What a rank leaves running]: after a start that failed, was stopped or regroups.
  const bool succeeded = !regrouping && result_override < 0 &&
                         std::all_of(ranks.begin(), ranks.end(), [](const Rank& r) { return r.code == 0; });
  if (!succeeded) stop_leftovers(ranks);
  Outcome out;
  // Once the job grows, a rank that failed failed on the stop or on a peer stopped for it.
  // On node 0, ranks that all finished before its stop leave a finished job.
  const bool all_finished =
      std::all_of(ranks.begin(), ranks.end(), [](const Rank& r) { return r.code == 0; });
  if (regrouping && result_override < 0 && !(regroup.host && all_finished)) {
    out.regrouped = true;
    return out;
  }
  if (result_override >= 0) {
    out.code = result_override;  // the launcher was signalled, or the deadline passed: no restart
    return out;
  }
  out.failed_at = failed_at;
  out.failed_at_wall = std::chrono::system_clock::now() - (Clock::now() - failed_at);
  for (auto& r : ranks) {
    const Rank& failed = first_failure >= 0 ? ranks[first_failure] : r;
    if (failed.code == 0) continue;
    out.code = failed.code;
    out.restartable = true;
    out.cause = failed.signaled
                    ? fmt::format("rank {} was killed by signal {}", failed.index, failed.code - 128)
                    : fmt::format("rank {} exited with code {}", failed.index, failed.code);
    break;
  }
  return out;
}

}  // namespace

namespace {

// After a start ended: whether another follows (and then its ranks are told what failed
// and when), or the job ends with the start's code.
bool restart_follows(const LaunchOptions& o, const Outcome& out, int restart) {
  if (out.code == 0 || !out.restartable) return false;
  if (restart >= o.max_restarts) {
    if (o.max_restarts > 0)
      fmt::print(stderr, "flatshard-run: {}; no restart left (--max-restarts {}): the job fails\n", out.cause,
                 o.max_restarts);
    return false;
  }
  // Note [Restarting a failed job]: the next start's ranks learn what failed and when
  // (milliseconds since the Unix epoch), so that a program can report how long the
  // failure cost until its first resumed step.
  ::setenv("FLATSHARD_FAILURE_CAUSE", out.cause.c_str(), 1);
  ::setenv("FLATSHARD_FAILED_AT_UNIX_MS",
           std::to_string(
               std::chrono::duration_cast<std::chrono::milliseconds>(out.failed_at_wall.time_since_epoch())
                   .count())
               .c_str(),
           1);
  fmt::print(stderr,
             "flatshard-run: {}; restart {} of {}, {:.1f} s after the failure: starting every rank again\n",
             out.cause, restart + 1, o.max_restarts,
             std::chrono::duration<double>(Clock::now() - out.failed_at).count());
  std::fflush(stderr);
  return true;
}

// Note [Rounds of an elastic job]: before every start, this node meets the others (node 0
// hosts the rounds), and the start runs as a fixed job of the nodes present.
int run_elastic(const LaunchOptions& o) {
  RendezvousOptions r;
  r.host = o.master_addr;
  r.port = o.master_port;
  r.min_nodes = o.min_nodes;
  r.max_nodes = o.max_nodes;
  r.node_id = o.node_rank;
  r.nproc = o.nproc_per_node;
  r.wait_s = o.rdzv_wait_s;
  r.timeout_s = o.rdzv_timeout_s;
  const char* secret = std::getenv("FLATSHARD_JOB_SECRET");
  r.secret = secret ? secret : "";
  if (r.secret.empty() && tcp::loopback_address_of(o.master_addr).empty()) {
    fmt::print(stderr,
               "flatshard-run: a job across machines needs a secret: give every node the same "
               "FLATSHARD_JOB_SECRET (docs/launching.md)\n");
    return 2;
  }
  const auto job_start = Clock::now();
  // A signal to the launcher, or the job's deadline, while the nodes meet ends the job
  // (Note [Restarting a failed job]): the rounds ask between their waits.
  int stop_signal = 0;
  bool past_deadline = false;
  r.stop = [&] {
    unsigned char sig = 0;
    if (stop_signal == 0 && ::read(g_signal_pipe[0], &sig, 1) == 1) stop_signal = sig;
    if (o.deadline_s > 0 && Clock::now() - job_start > std::chrono::duration<double>(o.deadline_s))
      past_deadline = true;
    return stop_signal != 0 || past_deadline;
  };
  std::unique_ptr<RendezvousHost> host;
  RendezvousNode node(r);
  try {
    if (o.node_rank == 0) host = std::make_unique<RendezvousHost>(r);
  } catch (const std::exception& e) {
    fmt::print(stderr, "flatshard-run: {}\n", e.what());
    return 1;
  }
  std::vector<int> before;  // the node ids of the previous start
  int restart = 0;          // starts after a failure: a regroup is none
  int last_failure = 0;     // this node's last start's code when its ranks failed
  for (;;) {
    Membership m;
    try {
      m = host ? host->next_round(restart) : node.join();
    } catch (const RendezvousStopped&) {
      const int code = stop_signal != 0 ? 128 + stop_signal : 124;
      if (stop_signal != 0) {
        fmt::print(stderr, "flatshard-run: got signal {} while the nodes met: the job ends\n", stop_signal);
      } else {
        fmt::print(stderr,
                   "flatshard-run: node {}: the job passed its deadline of {:.1f} s while the nodes met\n",
                   o.node_rank, o.deadline_s);
      }
      if (host) host->finish(code);
      return code;
    } catch (const std::exception& e) {
      fmt::print(stderr, "flatshard-run: {}\n", e.what());
      return 1;
    }
    if (m.job_over) {
      // A node whose own ranks failed last says so, even where the others finished: a
      // scheduler reading its code must not take its failure for a success.
      const int code = *m.job_over == 0 && last_failure != 0 ? last_failure : *m.job_over;
      fmt::print(stderr,
                 "flatshard-run: node {}: the job ended (code {}) while this node waited to rejoin it{}\n",
                 o.node_rank, *m.job_over,
                 code != *m.job_over ? fmt::format("; this node's ranks failed (code {})", code) : "");
      return code;
    }
    std::vector<int> gone;
    for (int id : before) {
      if (std::find(m.node_ids.begin(), m.node_ids.end(), id) == m.node_ids.end()) gone.push_back(id);
    }
    const int world = m.nnodes * o.nproc_per_node;
    fmt::print(stderr, "flatshard-run: round {}: nodes {} (of {}..{}); this is node {} of world {}{}\n",
               m.round, fmt::join(m.node_ids, ","), o.min_nodes, o.max_nodes, m.node_rank, world,
               gone.empty()
                   ? std::string()
                   : fmt::format("; the job goes on at world {} (was {}): node {} did not return within "
                                 "--rdzv-wait-s {:g}",
                                 world, static_cast<int>(before.size()) * o.nproc_per_node,
                                 fmt::join(gone, ","), o.rdzv_wait_s));
    std::fflush(stderr);
    before = m.node_ids;
    LaunchOptions start = o;
    start.node_rank = m.node_rank;
    start.nnodes = m.nnodes;
    start.master_port = o.ranks_port != 0 ? o.ranks_port : m.port;
    // Note [Growing an elastic job]: the host asks its rendezvous, and stops its own ranks
    // half a second after telling the others; the others listen on their last round's
    // connection.
    Regroup regroup;
    if (host) {
      regroup.check = [&host, &m] {
        if (!host->grows(m.node_ids)) return false;
        host->regroup();
        return true;
      };
      regroup.delay = std::chrono::milliseconds(500);
      regroup.host = true;
    } else {
      regroup.check = [&node] { return node.regroup_requested(); };
    }
    // The job's restart count is the host's: a node that joins a later round is told it too.
    Outcome out = run_once(start, m.restarts, job_start, regroup);
    // Ranks that failed on a peer stopped for the regroup may end this start before the
    // word reaches this node: it is given a moment to come (node 0 sends it to every node at
    // once, before any rank stops for it), which a failure of its own also waits.
    if (!out.regrouped && out.restartable && !host && node.await_regroup(std::chrono::milliseconds(300)))
      out.regrouped = true;
    last_failure = out.regrouped ? 0 : out.code;
    if (out.regrouped) {
      // Not a failure: the next start's ranks are told of none.
      ::unsetenv("FLATSHARD_FAILURE_CAUSE");
      ::unsetenv("FLATSHARD_FAILED_AT_UNIX_MS");
      continue;
    }
    // The host's count decides on every node: a node whose ranks failed before the host's
    // did must not give up while the host restarts the job, nor go on once it has stopped.
    if (!restart_follows(o, out, host ? restart : m.restarts)) {
      if (host) host->finish(out.code);
      return out.code;
    }
    ++restart;
  }
}

}  // namespace

// Note [Restarting a failed job]
// With --max-restarts N, a start that ends with a rank's own failure (an exit code other
// than 0, or a signal the launcher did not send) is followed, once every rank has
// stopped as after any failure, by a new start of every rank: the same command, a fresh
// port when none was given, TORCHELASTIC_RESTART_COUNT (and FLATSHARD_RESTART_COUNT) set
// to the number of starts before it. The program resumes from its latest complete
// checkpoint (train_gpt --resume, which starts at step 0 when there is none yet), and
// sharded checkpoints are complete or absent whatever moment the failure hit
// (Note [Checkpoint directories]). A signal to the launcher (SIGINT, SIGHUP, SIGTERM) or
// the job's deadline (counted from the first start, and also while the nodes meet) ends
// the job without a restart.
//
// Note [Restarting a job of several nodes]
// A job of M fixed nodes with --max-restarts runs as an elastic job of exactly M nodes
// (--nnodes M:M, Note [Rounds of an elastic job]). Each launcher restarting its own ranks
// at the fixed --master-port does not work: a node whose ranks failed first restarts
// within a second, while a peer's old rank 0 still serves that port, and its new ranks
// join the old start (and fail: the ranks are claimed), spending its restarts one after
// another; the nodes' counts drift apart, and one node may give up while the others wait.
// In rounds, every node starts again together (each start's ranks at --master-port, as
// without restarts: every rank of the last start has stopped when the next begins; the
// launchers meet one port above it), and the host's count of restarts is the one every
// node's ranks are told and every node gives up at.
int run(const LaunchOptions& o) {
  if (::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    std::fprintf(stderr, "flatshard-run: pipe: %s\n", std::strerror(errno));
    return 1;
  }
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  // SIGINT and SIGHUP (the terminal or ssh session that ran it went away) unless the
  // launcher was started ignoring them (`nohup`, a shell's background job): then they stay
  // ignored, and the ranks inherit that as before.
  for (const int sig : {SIGINT, SIGHUP}) {
    struct sigaction inherited {};
    if (sigaction(sig, nullptr, &inherited) == 0 && inherited.sa_handler == SIG_IGN) continue;
    sigaction(sig, &sa, nullptr);
  }
  ::signal(SIGPIPE, SIG_IGN);
  // Inherited as ignored, SIGCHLD would have the kernel reap the ranks itself, and waitpid
  // would never see one exit.
  ::signal(SIGCHLD, SIG_DFL);
  // Note [Proving the job's secret]: a job on one machine gets a secret of its own, made
  // here and kept across restarts; the nodes of a job across machines each run a launcher,
  // so the user gives them one (FLATSHARD_JOB_SECRET), which init() requires.
  if (o.nnodes == 1 && std::getenv("FLATSHARD_JOB_SECRET") == nullptr) {
    const std::string secret = random_hex(32);
    if (secret.empty()) {
      std::fprintf(stderr, "flatshard-run: cannot read /dev/urandom for the job's secret: %s\n",
                   std::strerror(errno));
      return 1;
    }
    ::setenv("FLATSHARD_JOB_SECRET", secret.c_str(), 1);
  }
  if (o.elastic) return run_elastic(o);
  if (o.nnodes > 1 && o.max_restarts > 0) {
    // Note [Restarting a job of several nodes]
    LaunchOptions rounds = o;
    rounds.elastic = true;
    rounds.min_nodes = rounds.max_nodes = o.nnodes;
    rounds.ranks_port = o.master_port;
    rounds.master_port = o.master_port + 1;
    return run_elastic(rounds);
  }
  const auto job_start = Clock::now();
  for (int restart = 0;; ++restart) {
    if (restart > 0) remove_file_store(o);
    const Outcome out = run_once(o, restart, job_start);
    if (!restart_follows(o, out, restart)) return out.code;
  }
}

}  // namespace flatshard::launcher
