// resolve_world() for every source and every bad case, on fake environments.
#include <gtest/gtest.h>

#include <map>

#include "flatshard/errors.h"
#include "flatshard/world.h"

namespace {

using flatshard::InitError;
using flatshard::InitOptions;
using flatshard::resolve_world;
using flatshard::WorldSource;
using Env = std::map<std::string, std::string>;

flatshard::EnvLookup lookup(const Env& env) {
  return [env](const std::string& name) -> std::optional<std::string> {
    auto it = env.find(name);
    if (it == env.end()) return std::nullopt;
    return it->second;
  };
}

flatshard::WorldSpec resolve(const Env& env, InitOptions options = {}) {
  return resolve_world(options, lookup(env));
}

// Expects an InitError naming `variable`, with `fragment` in its message.
void expect_error(const Env& env, const std::string& variable, const std::string& fragment,
                  InitOptions options = {}) {
  try {
    resolve(env, options);
    ADD_FAILURE() << "no error; expected one naming " << variable;
  } catch (const InitError& e) {
    EXPECT_EQ(e.variable(), variable) << e.what();
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(ResolveWorld, NothingSetIsOneProcess) {
  const auto s = resolve({});
  EXPECT_EQ(s.source, WorldSource::SingleProcess);
  EXPECT_EQ(s.rank, 0);
  EXPECT_EQ(s.world_size, 1);
  EXPECT_EQ(s.local_world_size, 1);
}

TEST(ResolveWorld, TorchrunEnvironment) {
  const auto s = resolve({{"RANK", "5"},
                          {"WORLD_SIZE", "8"},
                          {"LOCAL_RANK", "1"},
                          {"LOCAL_WORLD_SIZE", "4"},
                          {"MASTER_ADDR", "node7"},
                          {"MASTER_PORT", "1234"}});
  EXPECT_EQ(s.source, WorldSource::TorchrunEnv);
  EXPECT_EQ(s.rank, 5);
  EXPECT_EQ(s.world_size, 8);
  EXPECT_EQ(s.local_rank, 1);
  EXPECT_EQ(s.local_world_size, 4);
  EXPECT_EQ(s.store_kind, "tcp");
  EXPECT_EQ(s.master_addr, "node7");
  EXPECT_EQ(s.master_port, 1234);
}

TEST(ResolveWorld, TorchrunBadCases) {
  const Env base{{"MASTER_ADDR", "h"}, {"MASTER_PORT", "29500"}};
  auto with = [&](Env extra) {
    Env e = base;
    for (auto& [k, v] : extra) e[k] = v;
    return e;
  };
  expect_error(with({{"RANK", "0"}}), "WORLD_SIZE", "WORLD_SIZE is not set");
  expect_error(with({{"WORLD_SIZE", "2"}}), "RANK", "RANK is not set");
  expect_error(with({{"RANK", "x"}, {"WORLD_SIZE", "2"}}), "RANK", "not an integer");
  expect_error(with({{"RANK", "2"}, {"WORLD_SIZE", "2"}}), "RANK", "outside [0, 2)");
  expect_error(with({{"RANK", "-1"}, {"WORLD_SIZE", "2"}}), "RANK", "outside [0, 2)");
  expect_error(with({{"RANK", "0"}, {"WORLD_SIZE", "0"}}), "WORLD_SIZE", "at least 1");
  expect_error(with({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "3"}, {"LOCAL_WORLD_SIZE", "2"}}),
               "LOCAL_RANK", "outside [0, 2)");
  expect_error(with({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_WORLD_SIZE", "3"}}), "LOCAL_WORLD_SIZE",
               "must be in [1, WORLD_SIZE=2]");
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}, "MASTER_ADDR",
               "MASTER_ADDR is not set");
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}}, "MASTER_PORT",
               "MASTER_PORT is not set");
  expect_error(with({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}), "MASTER_PORT",
               "not a TCP port");
  expect_error(with({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", ""}}), "MASTER_ADDR", "empty");
}

TEST(ResolveWorld, OneRankNeedsNoMaster) {
  const auto s = resolve({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  EXPECT_EQ(s.world_size, 1);
}

TEST(ResolveWorld, Slurm) {
  const auto s = resolve({{"SLURM_PROCID", "3"},
                          {"SLURM_NTASKS", "8"},
                          {"SLURM_LOCALID", "1"},
                          {"SLURM_NTASKS_PER_NODE", "2"},
                          {"SLURM_JOB_NODELIST", "gpu[07-10,12],login1"}});
  EXPECT_EQ(s.source, WorldSource::Slurm);
  EXPECT_EQ(s.rank, 3);
  EXPECT_EQ(s.world_size, 8);
  EXPECT_EQ(s.local_rank, 1);
  EXPECT_EQ(s.local_world_size, 2);
  EXPECT_EQ(s.master_addr, "gpu07");
  EXPECT_EQ(s.master_port, 29500);
}

TEST(ResolveWorld, SlurmTasksPerNodeListAndPlainNodeList) {
  const auto s = resolve({{"SLURM_PROCID", "6"},
                          {"SLURM_NTASKS", "7"},
                          {"SLURM_LOCALID", "0"},
                          {"SLURM_NODEID", "3"},
                          {"SLURM_TASKS_PER_NODE", "2(x3),1"},
                          {"SLURM_NODELIST", "alpha,beta"},
                          {"MASTER_PORT", "4000"}});
  EXPECT_EQ(s.local_world_size, 1);
  EXPECT_EQ(s.master_addr, "alpha");
  EXPECT_EQ(s.master_port, 4000);
  const auto overridden = resolve({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"MASTER_ADDR", "head"}});
  EXPECT_EQ(overridden.master_addr, "head");
}

TEST(ResolveWorld, SlurmBadCases) {
  expect_error({{"SLURM_PROCID", "0"}}, "SLURM_NTASKS", "SLURM_NTASKS is not set");
  expect_error({{"SLURM_NTASKS", "2"}}, "SLURM_PROCID", "SLURM_PROCID is not set");
  expect_error({{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "4"}, {"SLURM_JOB_NODELIST", "a"}}, "SLURM_PROCID",
               "outside [0, 4)");
  expect_error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}, "MASTER_ADDR", "SLURM_JOB_NODELIST");
  expect_error({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "n[01-02"}},
               "SLURM_JOB_NODELIST", "not a Slurm node list");
  expect_error({{"SLURM_PROCID", "0"},
                {"SLURM_NTASKS", "2"},
                {"SLURM_NODEID", "5"},
                {"SLURM_TASKS_PER_NODE", "2"},
                {"SLURM_JOB_NODELIST", "a"}},
               "SLURM_TASKS_PER_NODE", "no entry for node 5");
}

TEST(ResolveWorld, OpenMpi) {
  const auto s = resolve({{"OMPI_COMM_WORLD_RANK", "2"},
                          {"OMPI_COMM_WORLD_SIZE", "4"},
                          {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                          {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}});
  EXPECT_EQ(s.source, WorldSource::OpenMpi);
  EXPECT_EQ(s.rank, 2);
  EXPECT_EQ(s.local_world_size, 4);
  EXPECT_EQ(s.master_addr, "127.0.0.1");  // all ranks on one node
  EXPECT_EQ(s.master_port, 29500);
}

TEST(ResolveWorld, OpenMpiBadCases) {
  expect_error({{"OMPI_COMM_WORLD_RANK", "0"}}, "OMPI_COMM_WORLD_SIZE", "is not set");
  expect_error({{"OMPI_COMM_WORLD_RANK", "0"},
                {"OMPI_COMM_WORLD_SIZE", "4"},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}},
               "MASTER_ADDR", "MASTER_ADDR is not set");
  expect_error({{"OMPI_COMM_WORLD_RANK", "0"},
                {"OMPI_COMM_WORLD_SIZE", "2"},
                {"OMPI_COMM_WORLD_LOCAL_RANK", "2"},
                {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}},
               "OMPI_COMM_WORLD_LOCAL_RANK", "outside [0, 2)");
}

TEST(ResolveWorld, TorchrunVariablesWinOverTheScheduler) {
  // torchrun started by srun: RANK and friends describe this process.
  const auto s = resolve({{"RANK", "1"},
                          {"WORLD_SIZE", "2"},
                          {"MASTER_ADDR", "h"},
                          {"MASTER_PORT", "5"},
                          {"SLURM_PROCID", "0"},
                          {"SLURM_NTASKS", "1"}});
  EXPECT_EQ(s.source, WorldSource::TorchrunEnv);
  EXPECT_EQ(s.rank, 1);
}

TEST(ResolveWorld, InitMethods) {
  InitOptions tcp;
  tcp.init_method = "tcp://10.1.2.3:4567";
  auto s = resolve({{"RANK", "0"}, {"WORLD_SIZE", "2"}}, tcp);
  EXPECT_EQ(s.store_kind, "tcp");
  EXPECT_EQ(s.master_addr, "10.1.2.3");
  EXPECT_EQ(s.master_port, 4567);

  InitOptions v6;
  v6.init_method = "tcp://[::1]:80";
  EXPECT_EQ(resolve({{"RANK", "0"}, {"WORLD_SIZE", "2"}}, v6).master_addr, "::1");

  InitOptions file;
  file.init_method = "file:///shared/job/store";
  s = resolve({{"RANK", "0"}, {"WORLD_SIZE", "2"}}, file);
  EXPECT_EQ(s.store_kind, "file");
  EXPECT_EQ(s.file_path, "/shared/job/store");

  // From the environment, and explicit rank/world size from the options.
  s = resolve({{"FLATSHARD_INIT_METHOD", "tcp://h:1"}}, [] {
    InitOptions o;
    o.rank = 1;
    o.world_size = 3;
    return o;
  }());
  EXPECT_EQ(s.rank, 1);
  EXPECT_EQ(s.world_size, 3);
  EXPECT_EQ(s.master_addr, "h");

  InitOptions env_method;
  env_method.init_method = "env://";
  expect_error({{"RANK", "0"}, {"WORLD_SIZE", "2"}}, "MASTER_ADDR", "MASTER_ADDR is not set", env_method);
}

TEST(ResolveWorld, InitMethodBadCases) {
  const Env two{{"RANK", "0"}, {"WORLD_SIZE", "2"}};
  for (const char* bad :
       {"tcp://hostonly", "tcp://:5", "tcp://h:", "udp://h:1", "file://relative", "file://"}) {
    InitOptions o;
    o.init_method = bad;
    expect_error(two, "init_method", "init_method", o);
  }
  InitOptions port;
  port.init_method = "tcp://h:0";
  expect_error(two, "init_method", "not a TCP port", port);
  InitOptions half;
  half.rank = 0;
  expect_error({}, "world_size", "must be given together", half);
  InitOptions out_of_range;
  out_of_range.rank = 3;
  out_of_range.world_size = 3;
  expect_error({}, "rank", "outside [0, 3)", out_of_range);
}

}  // namespace
