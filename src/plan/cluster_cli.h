// flatshard-plan --cluster (src/plan/cluster_cli.cpp).
#pragma once

namespace flatshard::plan {

// Runs `flatshard-plan --cluster ...`; returns the exit code (2 for bad arguments).
int cluster_main(int argc, char** argv);

}  // namespace flatshard::plan
