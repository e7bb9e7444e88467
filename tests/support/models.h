// The models the correctness tests and benchmarks train: an MLP (a plain
// torch::nn::Sequential split by SequentialUnits), a small GPT-style transformer with
// its blocks declared as flatshard::Unit<Block>, and the MNIST CNN of PyTorch's DDP
// example with its two stages as units.
#pragma once

#include <cmath>

#include <torch/torch.h>

#include "flatshard/flatshard.h"
#include "models/gpt.h"
#include "models/mnist_net.h"

namespace flatshard::testing {

// --- MLP -----------------------------------------------------------------------------
inline torch::nn::Sequential make_mlp(int in, int hidden, int out, int layers) {
  torch::nn::Sequential seq;
  int width = in;
  for (int i = 0; i < layers; ++i) {
    seq->push_back(torch::nn::Linear(width, hidden));
    seq->push_back(torch::nn::Tanh());
    width = hidden;
  }
  seq->push_back(torch::nn::Linear(width, out));
  return seq;
}

using models::Block;
using models::CausalSelfAttention;
using models::GPT;
using models::GPTConfig;
using models::GPTImpl;
using models::MnistNet;

}  // namespace flatshard::testing
