// A GPT-style transformer whose blocks are FullyShard units (flatshard::Unit<Block>).
#pragma once

#include <cmath>
#include <limits>

#include <torch/torch.h>

#include "flatshard/flatshard.h"

namespace flatshard::models {

// --- GPT-style -------------------------------------------------------------------------
struct GPTConfig {
  int vocab = 64;
  int context = 16;
  int dim = 32;
  int heads = 4;
  int layers = 3;
  // Attention through at::scaled_dot_product_attention (fused kernels on GPUs) instead of
  // the explicit masked softmax. Same function; the benchmarks use it on GPUs.
  bool fused_attention = false;
  // Residual dropout (after attention and after the MLP) while training.
  double dropout = 0.0;
  // The token embedding and the output head as units of their own (for large
  // vocabularies): the root unit keeps only the position embedding and the final norm,
  // so building into shards never holds the vocabulary-sized matrices whole.
  bool embedding_units = false;
  // A buffer (not a parameter): per-channel scales of the position embedding, drawn from
  // the RNG after every parameter, so a model built with another seed has other values.
  bool position_scale_buffer = false;
};

// y = x W^T + b through at::linear, which folds the bias into the matrix product for
// inputs of any rank (as Python's nn.Linear does). The C++ frontend's Linear::forward
// adds the bias in a separate broadcast kernel for inputs of three or more dimensions,
// a pass over the activations in forward and another in backward.
inline at::Tensor linear(const torch::nn::Linear& l, const at::Tensor& x) {
  return at::linear(x, l->weight, l->bias);
}

struct CausalSelfAttentionImpl : torch::nn::Module {
  // No bias on qkv: a key bias gets an exactly-zero gradient (softmax ignores a constant
  // added to every key), and Adam-type optimizers blow its rounding noise up to
  // +-lr per step, which no two summation orders reproduce.
  explicit CausalSelfAttentionImpl(const GPTConfig& c) : heads(c.heads), fused(c.fused_attention) {
    qkv = register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(c.dim, 3 * c.dim).bias(false)));
    proj = register_module("proj", torch::nn::Linear(c.dim, c.dim));
  }
  at::Tensor forward(const at::Tensor& x) {
    const auto b = x.size(0), t = x.size(1), d = x.size(2);
    auto parts = linear(qkv, x).split(d, 2);
    auto shape = [&](const at::Tensor& y) { return y.view({b, t, heads, d / heads}).transpose(1, 2); };
    auto q = shape(parts[0]), k = shape(parts[1]), v = shape(parts[2]);
    if (fused) {
      auto y =
          at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
      return linear(proj, y.transpose(1, 2).contiguous().view({b, t, d}));
    }
    auto att = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(d / heads));
    auto mask = at::ones({t, t}, at::TensorOptions().dtype(at::kBool).device(x.device())).triu(1);
    att = att.masked_fill(mask, -std::numeric_limits<float>::infinity()).softmax(-1);
    auto y = at::matmul(att, v).transpose(1, 2).contiguous().view({b, t, d});
    return linear(proj, y);
  }
  int heads;
  bool fused;
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
};
TORCH_MODULE(CausalSelfAttention);

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(const GPTConfig& c) : dropout(c.dropout) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    attn = register_module("attn", CausalSelfAttention(c));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    fc = register_module("fc", torch::nn::Linear(c.dim, 4 * c.dim));
    out = register_module("out", torch::nn::Linear(4 * c.dim, c.dim));
  }
  at::Tensor forward(at::Tensor x) {
    x = x + drop(attn(ln1(x)));
    return x + drop(linear(out, torch::gelu(linear(fc, ln2(x)))));
  }
  at::Tensor drop(const at::Tensor& y) { return dropout > 0 ? torch::dropout(y, dropout, is_training()) : y; }
  double dropout;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::Linear fc{nullptr}, out{nullptr};
};
TORCH_MODULE(Block);

struct GPTImpl : torch::nn::Module {
  explicit GPTImpl(const GPTConfig& c) {
    if (c.embedding_units) {
      wte_unit = register_module("wte", flatshard::Unit<torch::nn::Embedding>(c.vocab, c.dim));
    } else {
      wte = register_module("wte", torch::nn::Embedding(c.vocab, c.dim));
    }
    wpe = register_module("wpe", torch::nn::Embedding(c.context, c.dim));
    for (int i = 0; i < c.layers; ++i) {
      blocks.emplace_back(c);
      register_module("h" + std::to_string(i), blocks.back());
    }
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
    const auto head_options = torch::nn::LinearOptions(c.dim, c.vocab).bias(false);
    if (c.embedding_units) {
      head_unit = register_module("head", flatshard::Unit<torch::nn::Linear>(head_options));
    } else {
      head = register_module("head", torch::nn::Linear(head_options));
    }
    if (c.position_scale_buffer)
      position_scale = register_buffer("position_scale", torch::rand({c.dim}) + 0.5);
  }
  // tokens [B, T] -> logits [B, T, vocab]
  at::Tensor forward(const at::Tensor& tokens) {
    auto pos = at::arange(tokens.size(1), at::TensorOptions().dtype(at::kLong).device(tokens.device()));
    auto positions = wpe(pos);
    if (position_scale.defined()) positions = positions * position_scale;
    auto x = (wte_unit.is_empty() ? wte(tokens) : wte_unit(tokens)) + positions;
    for (std::size_t i = 0; i < blocks.size(); ++i) {
      if (static_cast<int>(i) == skip_block) continue;
      x = blocks[i](x);
    }
    x = ln_f(x);
    return head_unit.is_empty() ? head(x) : head_unit(x);
  }
  torch::nn::Embedding wte{nullptr}, wpe{nullptr};
  flatshard::Unit<torch::nn::Embedding> wte_unit{nullptr};  // wte, when embedding_units
  flatshard::Unit<torch::nn::Linear> head_unit{nullptr};    // head, when embedding_units
  std::vector<flatshard::Unit<Block>> blocks;
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};
  at::Tensor position_scale;  // GPTConfig::position_scale_buffer
  int skip_block = -1;        // tests: a unit that goes unused in a step
};
TORCH_MODULE(GPT);

}  // namespace flatshard::models
