// flatshard-plan, the command-line planner: its table is the library's prediction for
// the options it was given, and every bad argument is refused by name with exit code 2.
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "flatshard/plan.h"
#include "tests/support/subprocess.h"

namespace {

using flatshard::testing::run_command;
using flatshard::testing::RunResult;

RunResult plan_cli(std::vector<std::string> args) {
  args.insert(args.begin(), FLATSHARD_PLAN_PATH);
  return run_command(args);
}

struct Row {
  std::string mode;
  int world = 0;
  std::vector<double> mib;  // the numeric columns after the world, in order
  std::string fits;         // "yes" / "no" with --budget-mib
};

// The table's rows (after the description line and the header).
std::vector<Row> rows(const std::string& output) {
  std::vector<Row> out;
  std::istringstream lines(output);
  std::string line;
  std::getline(lines, line);  // description
  std::getline(lines, line);  // header
  while (std::getline(lines, line)) {
    std::istringstream fields(line);
    Row r;
    fields >> r.mode >> r.world;
    std::string field;
    while (fields >> field) {
      if (field == "yes" || field == "no") {
        r.fits = field;
      } else {
        r.mib.push_back(std::stod(field));
      }
    }
    out.push_back(r);
  }
  return out;
}

double mib(std::int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

TEST(PlanCli, EachRowIsTheLibrarysPredictionForTheGivenOptions) {
  const auto r = plan_cli({"--params", "1.3e9", "--units", "24", "--world", "1,2,4", "--dtype", "bf16",
                           "--optimizer", "sgd-momentum", "--prefetch", "2", "--budget-mib", "8000"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("1300000000 parameters in 24 units, bf16 compute with fp32 masters, 4 bytes"),
            std::string::npos)
      << r.output;
  const auto table = rows(r.output);
  ASSERT_EQ(table.size(), 12u) << r.output;  // 4 modes x 3 worlds
  const std::vector<std::string> modes{"ddp", "zero1", "zero2", "full"};
  const flatshard::plan::ModelShape shape = flatshard::plan::uniform_shape(1300000000, 24);
  for (std::size_t i = 0; i < table.size(); ++i) {
    const Row& row = table[i];
    SCOPED_TRACE(row.mode + " world " + std::to_string(row.world));
    EXPECT_EQ(row.mode, modes[i / 3]);
    const int worlds[] = {1, 2, 4};
    EXPECT_EQ(row.world, worlds[i % 3]);
    flatshard::Strategy strategy;
    ASSERT_TRUE(flatshard::parse_strategy(row.mode, strategy));
    flatshard::plan::PlanOptions o;
    o.strategy = strategy;
    o.world_size = row.world;
    o.param_bytes = 2;
    o.optimizer_state_bytes = 4;
    o.prefetch = 2;
    const auto want = flatshard::plan::predict(shape, o);
    ASSERT_EQ(row.mib.size(), 6u);
    EXPECT_NEAR(row.mib[0], mib(want.peak), 0.06);
    EXPECT_NEAR(row.mib[2], mib(want.optimizer_state), 0.06);
    EXPECT_NEAR(row.mib[5], mib(want.zero_formula), 0.06);
    EXPECT_EQ(row.fits, row.mib[0] <= 8000 ? "yes" : "no");
  }
  // The ZeRO paper's arithmetic, independently: 4 + 4 + K bytes per parameter (fp32
  // parameters and gradients, K = 4 of momentum), divided by N for full shard, not for DDP.
  EXPECT_NEAR(table[0].mib[5], 1.3e9 * 12 / (1 << 20), 0.06);
  EXPECT_NEAR(table[11].mib[5], 1.3e9 * 12 / 4 / (1 << 20), 0.06);
}

TEST(PlanCli, OneModeHostColumnsAndTheLargestModelThatFits) {
  const auto offload =
      plan_cli({"--params", "2e8", "--units", "8", "--world", "2", "--mode", "full", "--offload", "1"});
  ASSERT_EQ(offload.exit_code, 0) << offload.output;
  const auto table = rows(offload.output);
  ASSERT_EQ(table.size(), 1u) << offload.output;
  EXPECT_EQ(table[0].mode, "full");
  ASSERT_EQ(table[0].mib.size(), 9u) << "three host columns under --offload";
  flatshard::plan::PlanOptions o;
  o.strategy = flatshard::Strategy::FullShard;
  o.world_size = 2;
  o.cpu_offload = true;
  const auto want = flatshard::plan::predict(flatshard::plan::uniform_shape(200000000, 8), o);
  EXPECT_NEAR(table[0].mib[0], mib(want.peak), 0.06);
  EXPECT_NEAR(table[0].mib[6], mib(want.host), 0.06);

  const auto fit = plan_cli({"--fit-mib", "16000", "--units", "16", "--world", "1,4", "--mode", "full"});
  ASSERT_EQ(fit.exit_code, 0) << fit.output;
  const auto fits = rows(fit.output);
  ASSERT_EQ(fits.size(), 2u) << fit.output;
  o = {};
  o.strategy = flatshard::Strategy::FullShard;
  for (const Row& row : fits) {
    o.world_size = row.world;
    EXPECT_NEAR(row.mib[0],
                static_cast<double>(flatshard::plan::largest_model(o, 16, std::int64_t{16000} << 20, 0)),
                5e-4 * row.mib[0]);  // printed to 4 significant digits
  }
  EXPECT_GT(fits[1].mib[0], 3 * fits[0].mib[0]) << "four ranks of full shard fit about four times the model";
}

TEST(PlanCli, BadArgumentsAreRefusedByName) {
  struct Case {
    std::vector<std::string> args;
    std::string says;
  };
  const std::vector<Case> cases{
      {{}, "--params is required"},
      {{"--params"}, "missing value for --params"},
      {{"--params", "lots"}, "option --params takes a number, got 'lots'"},
      {{"--params", "1e9", "--units", "abc"}, "option --units takes a whole number, got 'abc'"},
      {{"--params", "nan"}, "option --params takes a number, got 'nan'"},
      {{"--params", "1e9", "--units", "1e10"}, "option --units takes a whole number, got '1e10'"},
      {{"--params", "1e9", "--units", "0"}, "--units is from 1 to 1,000,000"},
      {{"--params", "1e9", "--units", "2000000000"}, "--units is from 1 to 1,000,000"},
      {{"--params", "1e9", "--prefetch", "2000000000"}, "--prefetch is from 0 to 1,024"},
      {{"--params", "1e30"}, "--params and --root are at most 1e15"},
      {{"--params", "1e9", "--root", "2e9"}, "--params and --root are counts, --root at most --params"},
      {{"--params", "1e9", "--world", "1,2,"}, "--world takes sizes such as 1,2,4, got '1,2,'"},
      {{"--params", "1e9", "--world", "2,x"}, "--world takes sizes such as 1,2,4, got '2,x'"},
      {{"--params", "1e9", "--world", "0"}, "--world sizes must be at least 1"},
      {{"--params", "1e9", "--dtype", "fp8"}, "--dtype is fp32 or bf16"},
      {{"--params", "1e9", "--optimizer", "lion"}, "--optimizer is adamw, adam, sgd or sgd-momentum"},
      {{"--params", "1e9", "--mode", "hybrid"}, "--mode is ddp, zero1, zero2 or full"},
      {{"--params", "1e9", "--offload", "yes"}, "option --offload takes 0 or 1, got 'yes'"},
      {{"--params", "1e9", "--frozen", "2"}, "--frozen is a fraction in [0, 1]"},
      {{"--params", "1e9", "--bogus", "1"}, "unknown option --bogus"},
      {{"--params", "1e9", "--world", "2,8", "--shard-group-size", "3"},
       "--shard-group-size 3 does not divide the world size 8 (FullyShard refuses it)"},
  };
  for (const Case& c : cases) {
    std::string joined;
    for (const auto& a : c.args) joined += a + " ";
    SCOPED_TRACE(joined);
    const auto r = plan_cli(c.args);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("flatshard-plan: " + c.says), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("usage: flatshard-plan"), std::string::npos) << r.output;
  }
  const auto help = plan_cli({"--help"});
  EXPECT_EQ(help.exit_code, 0);
  EXPECT_NE(help.output.find("usage: flatshard-plan"), std::string::npos) << help.output;
}

}  // namespace
