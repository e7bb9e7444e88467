// resolve_world(): rank, world size and rendezvous from options and environment.
// Pure logic (no sockets), so every source and every bad case is unit-tested.
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "flatshard/errors.h"
#include "flatshard/world.h"

namespace flatshard {
namespace {

constexpr int kDefaultPort = 29500;

[[noreturn]] void fail(const std::string& variable, const std::string& message) {
  throw InitError(variable, fmt::format("flatshard::init: {}", message));
}

int parse_int(const std::string& variable, const std::string& text, const char* what) {
  errno = 0;
  char* end = nullptr;
  const long value = std::strtol(text.c_str(), &end, 10);
  if (text.empty() || end != text.c_str() + text.size() || errno == ERANGE || value < INT_MIN ||
      value > INT_MAX) {
    fail(variable, fmt::format("{}='{}' is not an integer; set it to {}", variable, text, what));
  }
  return static_cast<int>(value);
}

std::optional<int> get_int(const EnvLookup& env, const std::string& variable, const char* what) {
  auto text = env(variable);
  if (!text) return std::nullopt;
  return parse_int(variable, *text, what);
}

int require_int(const EnvLookup& env, const std::string& variable, const std::string& because,
                const char* what) {
  auto value = get_int(env, variable, what);
  if (!value) fail(variable, fmt::format("{} is not set ({}); set it to {}", variable, because, what));
  return *value;
}

// First host of a Slurm node list: "node[07-09,12],gpu1" -> "node07".
std::string first_slurm_host(const std::string& variable, const std::string& list) {
  std::string host;
  std::size_t i = 0;
  while (i < list.size() && list[i] != ',' && list[i] != '[') host += list[i++];
  if (i < list.size() && list[i] == '[') {
    ++i;
    std::string first;
    while (i < list.size() && list[i] != '-' && list[i] != ',' && list[i] != ']') first += list[i++];
    while (i < list.size() && list[i] != ']') ++i;
    if (i == list.size() || first.empty()) {
      fail(variable,
           fmt::format("{}='{}' is not a Slurm node list; set MASTER_ADDR instead", variable, list));
    }
    host += first;
    ++i;
    while (i < list.size() && list[i] != ',') host += list[i++];
  }
  if (host.empty()) {
    fail(variable, fmt::format("{}='{}' is not a Slurm node list; set MASTER_ADDR instead", variable, list));
  }
  return host;
}

// Slurm's tasks-per-node list: "2(x3),1" means nodes 0-2 run 2 tasks, node 3 runs 1.
int slurm_tasks_on_node(const std::string& variable, const std::string& list, int node) {
  std::vector<int> per_node;
  std::size_t i = 0;
  while (i < list.size()) {
    std::size_t j = list.find(',', i);
    if (j == std::string::npos) j = list.size();
    std::string item = list.substr(i, j - i);
    int repeat = 1;
    const auto paren = item.find("(x");
    if (paren != std::string::npos && item.back() == ')') {
      repeat = parse_int(variable, item.substr(paren + 2, item.size() - paren - 3),
                         "a Slurm tasks-per-node list such as 2(x3),1");
      item = item.substr(0, paren);
    }
    const int tasks = parse_int(variable, item, "a Slurm tasks-per-node list such as 2(x3),1");
    for (int k = 0; k < repeat; ++k) per_node.push_back(tasks);
    i = j + 1;
  }
  if (node < 0 || node >= static_cast<int>(per_node.size())) {
    fail(variable, fmt::format("{}='{}' has no entry for node {} (SLURM_NODEID)", variable, list, node));
  }
  return per_node[node];
}

// Reads rank and sizes; leaves rendezvous fields at their defaults.
WorldSpec resolve_ranks(const InitOptions& options, const EnvLookup& env) {
  WorldSpec spec;
  if (options.rank.has_value() != options.world_size.has_value()) {
    fail(options.rank ? "world_size" : "rank",
         "InitOptions::rank and InitOptions::world_size must be given together");
  }
  if (options.rank) {
    spec.rank = *options.rank;
    spec.world_size = *options.world_size;
    spec.source = WorldSource::TorchrunEnv;
    spec.local_rank = get_int(env, "LOCAL_RANK", "this rank's index on its node").value_or(spec.rank);
    spec.local_world_size =
        get_int(env, "LOCAL_WORLD_SIZE", "the number of ranks on this node").value_or(spec.world_size);
    return spec;
  }
  if (env("RANK") || env("WORLD_SIZE")) {
    spec.source = WorldSource::TorchrunEnv;
    spec.rank = require_int(env, "RANK", "WORLD_SIZE is set", "this process's global rank");
    spec.world_size = require_int(env, "WORLD_SIZE", "RANK is set", "the total number of ranks");
    spec.local_rank = get_int(env, "LOCAL_RANK", "this rank's index on its node").value_or(spec.rank);
    spec.local_world_size =
        get_int(env, "LOCAL_WORLD_SIZE", "the number of ranks on this node").value_or(spec.world_size);
    return spec;
  }
  if (env("OMPI_COMM_WORLD_RANK") || env("OMPI_COMM_WORLD_SIZE")) {
    spec.source = WorldSource::OpenMpi;
    spec.rank = require_int(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE is set",
                            "the MPI rank (launch with mpirun)");
    spec.world_size = require_int(env, "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK is set",
                                  "the MPI world size (launch with mpirun)");
    spec.local_rank =
        get_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", "the node-local MPI rank").value_or(spec.rank);
    spec.local_world_size =
        get_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", "the node-local MPI size").value_or(spec.world_size);
    return spec;
  }
  if (env("SLURM_PROCID") || env("SLURM_NTASKS")) {
    spec.source = WorldSource::Slurm;
    spec.rank = require_int(env, "SLURM_PROCID", "SLURM_NTASKS is set", "the task rank (launch with srun)");
    spec.world_size =
        require_int(env, "SLURM_NTASKS", "SLURM_PROCID is set", "the number of tasks (sbatch --ntasks)");
    spec.local_rank = get_int(env, "SLURM_LOCALID", "the node-local task id").value_or(spec.rank);
    if (auto n = get_int(env, "SLURM_NTASKS_PER_NODE", "the tasks per node")) {
      spec.local_world_size = *n;
    } else if (auto list = env("SLURM_TASKS_PER_NODE")) {
      const int node = get_int(env, "SLURM_NODEID", "this node's index in the job").value_or(0);
      spec.local_world_size = slurm_tasks_on_node("SLURM_TASKS_PER_NODE", *list, node);
    } else {
      spec.local_world_size = spec.world_size;
    }
    return spec;
  }
  return spec;  // nothing set: a single-process world
}

// The variables that named this rank, for messages.
struct Names {
  const char* rank;
  const char* world_size;
  const char* local_rank;
  const char* local_world_size;
};

Names names_of(WorldSource source, bool from_options) {
  if (from_options) return {"rank", "world_size", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
  switch (source) {
    case WorldSource::OpenMpi:
      return {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
              "OMPI_COMM_WORLD_LOCAL_SIZE"};
    case WorldSource::Slurm:
      return {"SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"};
    default: return {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
  }
}

void check_consistent(const WorldSpec& spec, const Names& n) {
  if (spec.world_size <= 0) {
    fail(n.world_size, fmt::format("{}={} must be at least 1", n.world_size, spec.world_size));
  }
  if (spec.rank < 0 || spec.rank >= spec.world_size) {
    fail(n.rank, fmt::format("{}={} is outside [0, {}) given {}={}", n.rank, spec.rank, spec.world_size,
                             n.world_size, spec.world_size));
  }
  if (spec.local_world_size <= 0 || spec.local_world_size > spec.world_size) {
    fail(n.local_world_size, fmt::format("{}={} must be in [1, {}={}]", n.local_world_size,
                                         spec.local_world_size, n.world_size, spec.world_size));
  }
  if (spec.local_rank < 0 || spec.local_rank >= spec.local_world_size) {
    fail(n.local_rank, fmt::format("{}={} is outside [0, {}) given {}={}", n.local_rank, spec.local_rank,
                                   spec.local_world_size, n.local_world_size, spec.local_world_size));
  }
}

int parse_port(const std::string& variable, const std::string& text) {
  const int port = parse_int(variable, text, "a TCP port in 1..65535");
  if (port < 1 || port > 65535) {
    fail(variable, fmt::format("{}={} is not a TCP port; set it to a port in 1..65535", variable, port));
  }
  return port;
}

void resolve_rendezvous(WorldSpec& spec, const std::string& method, const EnvLookup& env) {
  const std::string tcp = "tcp://";
  const std::string file = "file://";
  if (method.rfind(tcp, 0) == 0) {
    const std::string rest = method.substr(tcp.size());
    const auto colon = rest.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == rest.size()) {
      fail("init_method", fmt::format("init_method '{}' must be tcp://HOST:PORT", method));
    }
    spec.store_kind = "tcp";
    spec.master_addr = rest.substr(0, colon);
    if (spec.master_addr.size() > 2 && spec.master_addr.front() == '[') {  // [::1]
      spec.master_addr = spec.master_addr.substr(1, spec.master_addr.size() - 2);
    }
    spec.master_port = parse_port("init_method", rest.substr(colon + 1));
    return;
  }
  if (method.rfind(file, 0) == 0) {
    spec.store_kind = "file";
    spec.file_path = method.substr(file.size());
    if (spec.file_path.empty() || spec.file_path.front() != '/') {
      fail("init_method", fmt::format("init_method '{}' must be file:///ABSOLUTE/PATH", method));
    }
    return;
  }
  if (!method.empty() && method != "env://") {
    fail("init_method", fmt::format("init_method '{}' is not one of env://, tcp://HOST:PORT, "
                                    "file:///PATH",
                                    method));
  }
  // env:// (or nothing): MASTER_ADDR and MASTER_PORT.
  spec.store_kind = "tcp";
  const auto addr = env("MASTER_ADDR");
  const auto port = env("MASTER_PORT");
  if (spec.world_size == 1 && !addr && !port) return;  // nobody to meet
  if (addr) {
    if (addr->empty()) fail("MASTER_ADDR", "MASTER_ADDR is empty; set it to rank 0's host name or address");
    spec.master_addr = *addr;
  } else if (spec.source == WorldSource::Slurm) {
    auto list = env("SLURM_JOB_NODELIST");
    const char* list_var = "SLURM_JOB_NODELIST";
    if (!list) {
      list = env("SLURM_NODELIST");
      list_var = "SLURM_NODELIST";
    }
    if (!list)
      fail("MASTER_ADDR",
           "neither MASTER_ADDR nor SLURM_JOB_NODELIST is set; set MASTER_ADDR "
           "to the first node of the job");
    spec.master_addr = first_slurm_host(list_var, *list);
  } else if (spec.source == WorldSource::OpenMpi && spec.local_world_size == spec.world_size) {
    spec.master_addr = "127.0.0.1";  // every rank on this node
  } else {
    fail("MASTER_ADDR",
         "MASTER_ADDR is not set; set it to the host name or address of rank 0 "
         "(flatshard-run and torchrun set it for you)");
  }
  if (port) {
    spec.master_port = parse_port("MASTER_PORT", *port);
  } else if (spec.source == WorldSource::TorchrunEnv) {
    fail("MASTER_PORT", "MASTER_PORT is not set; set it to a free TCP port on rank 0's host");
  } else {
    spec.master_port = kDefaultPort;
  }
}

}  // namespace

const char* to_string(WorldSource source) {
  switch (source) {
    case WorldSource::SingleProcess: return "single process";
    case WorldSource::TorchrunEnv: return "torchrun-style environment";
    case WorldSource::Slurm: return "Slurm";
    case WorldSource::OpenMpi: return "Open MPI";
  }
  return "unknown";
}

EnvLookup process_env() {
  return [](const std::string& name) -> std::optional<std::string> {
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

WorldSpec resolve_world(const InitOptions& options, const EnvLookup& env) {
  WorldSpec spec = resolve_ranks(options, env);
  check_consistent(spec, names_of(spec.source, options.rank.has_value()));
  std::string method = options.init_method;
  if (method.empty()) method = env("FLATSHARD_INIT_METHOD").value_or("");
  resolve_rendezvous(spec, method, env);
  if (options.timeout.count() <= 0) fail("timeout", "InitOptions::timeout must be positive");
  return spec;
}

}  // namespace flatshard
