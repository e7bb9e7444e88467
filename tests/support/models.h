// The models the correctness tests and benchmarks train: an MLP (a plain
// torch::nn::Sequential split by SequentialUnits), a small GPT-style transformer with
// its blocks declared as flatshard::Unit<Block>, and the MNIST CNN of PyTorch's DDP
// example with its two stages as units.
#pragma once

#include <cmath>

#include <torch/torch.h>

#include "flatshard/flatshard.h"

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

// --- GPT-style -------------------------------------------------------------------------
struct GPTConfig {
  int vocab = 64;
  int context = 16;
  int dim = 32;
  int heads = 4;
  int layers = 3;
};

struct CausalSelfAttentionImpl : torch::nn::Module {
  // No bias on qkv: a key bias gets an exactly-zero gradient (softmax ignores a constant
  // added to every key), and Adam-type optimizers blow its rounding noise up to
  // +-lr per step, which no two summation orders reproduce.
  explicit CausalSelfAttentionImpl(const GPTConfig& c) : heads(c.heads) {
    qkv = register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(c.dim, 3 * c.dim).bias(false)));
    proj = register_module("proj", torch::nn::Linear(c.dim, c.dim));
  }
  at::Tensor forward(const at::Tensor& x) {
    const auto b = x.size(0), t = x.size(1), d = x.size(2);
    auto parts = qkv(x).split(d, 2);
    auto shape = [&](const at::Tensor& y) { return y.view({b, t, heads, d / heads}).transpose(1, 2); };
    auto q = shape(parts[0]), k = shape(parts[1]), v = shape(parts[2]);
    auto att = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(d / heads));
    auto mask = at::ones({t, t}, at::kBool).triu(1);
    att = att.masked_fill(mask, -std::numeric_limits<float>::infinity()).softmax(-1);
    auto y = at::matmul(att, v).transpose(1, 2).contiguous().view({b, t, d});
    return proj(y);
  }
  int heads;
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
};
TORCH_MODULE(CausalSelfAttention);

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const GPTConfig& c) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    attn = register_module("attn", CausalSelfAttention(c));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    fc = register_module("fc", torch::nn::Linear(c.dim, 4 * c.dim));
    out = register_module("out", torch::nn::Linear(4 * c.dim, c.dim));
  }
  at::Tensor forward(at::Tensor x) {
    x = x + attn(ln1(x));
    return x + out(torch::gelu(fc(ln2(x))));
  }
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::Linear fc{nullptr}, out{nullptr};
};
TORCH_MODULE(Block);

struct GPTImpl : torch::nn::Module {
  explicit GPTImpl(const GPTConfig& c) {
    wte = register_module("wte", torch::nn::Embedding(c.vocab, c.dim));
    wpe = register_module("wpe", torch::nn::Embedding(c.context, c.dim));
    for (int i = 0; i < c.layers; ++i) {
      blocks.emplace_back(c);
      register_module("h" + std::to_string(i), blocks.back());
    }
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(c.dim, c.vocab).bias(false)));
  }
  // tokens [B, T] -> logits [B, T, vocab]
  at::Tensor forward(const at::Tensor& tokens) {
    auto pos = at::arange(tokens.size(1), at::kLong);
    auto x = wte(tokens) + wpe(pos);
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      if (static_cast<int>(i) == skip_block) continue;
      x = blocks[i](x);
    }
    return head(ln_f(x));
  }
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  std::vector<flatshard::Unit<Block>> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
  int skip_block = -1;  // tests: a unit that goes unused in a step
};
TORCH_MODULE(GPT);

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

}  // namespace flatshard::testing
