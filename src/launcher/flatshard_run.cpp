#include <cstdio>
#include <exception>
#include <stdexcept>

#include "src/launcher/launcher.h"

int main(int argc, char** argv) {
  flatshard::launcher::LaunchOptions options;
  try {
    options = flatshard::launcher::parse_args(argc, argv);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "flatshard-run: %s\n\n%s", e.what(), flatshard::launcher::usage().c_str());
    return 2;
  }
  return flatshard::launcher::run(options);
}
