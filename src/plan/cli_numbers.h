// Strict numbers for flatshard-plan's options (src/plan/flatshard_plan.cpp, cluster_cli.cpp).
#pragma once

#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace flatshard::plan {

// The whole text, finite and in range, or nothing (atoi would read "abc" as 0 and "4k" as 4;
// strtod alone would take "nan", "inf" and " 4").
inline bool parse_double(const std::string& text, double& out) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text.front()))) return false;
  char* end = nullptr;
  errno = 0;
  out = std::strtod(text.c_str(), &end);
  return end == text.c_str() + text.size() && errno == 0 && std::isfinite(out);
}

inline bool parse_int(const std::string& text, int& out) {
  double d;
  if (!parse_double(text, d) || d < std::numeric_limits<int>::min() || d > std::numeric_limits<int>::max() ||
      d != std::floor(d))
    return false;
  out = static_cast<int>(d);
  return true;
}

// Whole numbers separated by commas ("1,2,4"), each the whole of its field.
inline bool parse_list(const std::string& text, std::vector<int>& out) {
  out.clear();
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    int v;
    if (!parse_int(item, v)) return false;
    out.push_back(v);
  }
  return !out.empty() && text.back() != ',';
}

}  // namespace flatshard::plan
