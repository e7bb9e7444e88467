// The CNN of PyTorch's MNIST DDP example, its two stages declared as FullyShard units.
#pragma once

#include <cmath>
#include <limits>

#include <torch/torch.h>

#include "flatshard/flatshard.h"

namespace flatshard::models {

// --- the MNIST CNN of PyTorch's DDP example ------------------------------------------
struct ConvStageImpl : torch::nn::Module {
  ConvStageImpl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3)));
  }
  at::Tensor forward(at::Tensor x) {
    x = torch::relu(conv1(x));
    x = torch::relu(conv2(x));
    return torch::max_pool2d(x, 2).flatten(1);
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
};
TORCH_MODULE(ConvStage);

struct DenseStageImpl : torch::nn::Module {
  explicit DenseStageImpl(double dropout) : dropout(dropout) {
    fc1 = register_module("fc1", torch::nn::Linear(9216, 128));
    fc2 = register_module("fc2", torch::nn::Linear(128, 10));
  }
  at::Tensor forward(at::Tensor x) {
    x = torch::relu(fc1(x));
    x = torch::dropout(x, dropout, is_training());
    return torch::log_softmax(fc2(x), 1);
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  double dropout;
};
TORCH_MODULE(DenseStage);

// PyTorch's example uses dropout 0.25 and 0.5; the correctness tests pass 0 so that
// sharded and single-process runs draw no random masks.
struct MnistNetImpl : torch::nn::Module {
  explicit MnistNetImpl(double dropout = 0.5) {
    features = register_module("features", flatshard::Unit<ConvStage>());
    classifier = register_module("classifier", flatshard::Unit<DenseStage>(dropout));
  }
  at::Tensor forward(const at::Tensor& images) { return classifier(features(images)); }
  flatshard::Unit<ConvStage> features{nullptr};
  flatshard::Unit<DenseStage> classifier{nullptr};
};
TORCH_MODULE(MnistNet);

}  // namespace flatshard::models
