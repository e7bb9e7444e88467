// Precompiled for the library's translation units: the LibTorch headers they share.
#pragma once
#include <ATen/ATen.h>
#include <fmt/format.h>
