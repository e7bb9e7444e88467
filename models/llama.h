// A Llama-family decoder (Llama 2 and 3, and the models that share its shape): RMSNorm,
// rotary position embeddings (with Llama 3's frequency scaling), a SwiGLU MLP and
// grouped-query attention, each decoder layer a FullyShard unit. Its parameter names and
// its math are those of transformers' LlamaForCausalLM, so a Hugging Face model directory
// loads straight into it (flatshard::checkpoint::load_hf) and exports back (save_hf):
//
//   auto cfg = LlamaConfig::from_hf_config("Llama-3.2-1B");       // its config.json
//   LlamaForCausalLM model{nullptr};
//   { flatshard::BuildIntoShards build(world, options); model = LlamaForCausalLM(cfg); }
//   flatshard::FullyShard fsdp(model, world, options);
//   flatshard::checkpoint::load_hf("Llama-3.2-1B", fsdp);
//
// See docs/hugging-face.md.
#pragma once

#include <cmath>
#include <fstream>
#include <sstream>
#include <string>

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include "flatshard/flatshard.h"

namespace flatshard::models {

struct LlamaConfig {
  int vocab = 128;              // vocab_size
  int dim = 32;                 // hidden_size
  int hidden = 64;              // intermediate_size (the MLP's width)
  int layers = 2;               // num_hidden_layers
  int heads = 4;                // num_attention_heads
  int kv_heads = 2;             // num_key_value_heads (grouped-query attention; = heads: none)
  int head_dim = 0;             // 0: dim / heads
  double rms_eps = 1e-6;        // rms_norm_eps
  double rope_theta = 10000;    // rope_parameters.rope_theta (or rope_theta)
  int max_positions = 2048;     // max_position_embeddings
  bool tie_embeddings = false;  // tie_word_embeddings: the output head is the embedding
  double init_std = 0.02;       // initializer_range: weights ~ N(0, init_std), norms 1
  // pad_token_id (-1: none): its embedding row starts at zero and gets no gradient from the
  // lookup, as transformers' nn.Embedding(padding_idx) (the tied head's use of it does).
  int pad_token = -1;
  // Llama 3's rope scaling (rope_type "llama3"); factor 0: none.
  struct RopeScaling {
    double factor = 0;
    double low_freq_factor = 1;
    double high_freq_factor = 4;
    int original_max_positions = 8192;
  } rope_scaling;
  // The embedding and the output head as units of their own (large vocabularies): the
  // root keeps only the final norm. Not with tie_embeddings (a tied weight lives in one unit).
  bool embedding_units = false;
  // The config.json from_hf_config read, whole: hf_config_json keeps the fields this struct
  // does not hold (the token ids, the tokenizer's and generation's settings) as they were.
  std::string hf_source;

  int head_size() const { return head_dim > 0 ? head_dim : dim / heads; }

  // Reads a Hugging Face config.json (a path to it, or to the directory holding it). Its
  // model_type must be "llama" (Mistral, Qwen and others share the tensor names and differ
  // in what they compute); only rope types "default" and "llama3" are known.
  static LlamaConfig from_hf_config(const std::string& path);
  // config.json for LlamaForCausalLM (checkpoint::SaveModelOptions::config_json): the
  // source's (hf_source) with the fields this struct holds written over it.
  std::string hf_config_json(const std::string& dtype = "float32") const;
};

// x / sqrt(mean(x^2) + eps) * weight, the normalisation computed in fp32 whatever x's
// dtype (as transformers' LlamaRMSNorm).
struct RMSNormImpl : torch::nn::Module {
  RMSNormImpl(int dim, double eps) : eps(eps) { weight = register_parameter("weight", torch::ones({dim})); }
  at::Tensor forward(const at::Tensor& x) {
    auto x32 = x.to(at::kFloat);
    x32 = x32 * at::rsqrt(x32.pow(2).mean(-1, /*keepdim=*/true) + eps);
    return weight * x32.to(x.scalar_type());
  }
  double eps;
  at::Tensor weight;
};
TORCH_MODULE(RMSNorm);

inline torch::nn::Linear llama_linear(int in, int out, double std) {
  torch::nn::Linear l(torch::nn::LinearOptions(in, out).bias(false));
  torch::NoGradGuard no_grad;
  l->weight.normal_(0, std);
  return l;
}

// The rotary embedding's inverse frequencies (fp32, as transformers computes them), with
// Llama 3's scaling when configured.
inline at::Tensor rope_inverse_frequencies(const LlamaConfig& c, const at::Device& device) {
  const int d = c.head_size();
  auto options = at::TensorOptions().device(device);
  auto inv = 1.0 / at::pow(c.rope_theta, at::arange(0, d, 2, options.dtype(at::kLong)).to(at::kFloat) / d);
  const auto& s = c.rope_scaling;
  if (s.factor <= 0) return inv;
  const double low_wavelen = s.original_max_positions / s.low_freq_factor;
  const double high_wavelen = s.original_max_positions / s.high_freq_factor;
  auto wavelen = 2 * M_PI / inv;
  auto scaled = at::where(wavelen > low_wavelen, inv / s.factor, inv);
  auto smooth =
      (s.original_max_positions / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
  auto smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
  auto medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
  return at::where(medium, smoothed, scaled);
}

// (x1, x2) -> (-x2, x1) over the two halves of the last dimension.
inline at::Tensor rotate_half(const at::Tensor& x) {
  auto halves = x.chunk(2, -1);
  return at::cat({-halves[1], halves[0]}, -1);
}

struct LlamaAttentionImpl : torch::nn::Module {
  explicit LlamaAttentionImpl(const LlamaConfig& c)
      : heads(c.heads), kv_heads(c.kv_heads), head_dim(c.head_size()) {
    q_proj = register_module("q_proj", llama_linear(c.dim, heads * head_dim, c.init_std));
    k_proj = register_module("k_proj", llama_linear(c.dim, kv_heads * head_dim, c.init_std));
    v_proj = register_module("v_proj", llama_linear(c.dim, kv_heads * head_dim, c.init_std));
    o_proj = register_module("o_proj", llama_linear(heads * head_dim, c.dim, c.init_std));
  }
  // x [B, T, dim]; cos, sin [T, head_dim] in x's dtype.
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    const auto b = x.size(0), t = x.size(1);
    auto split = [&](const at::Tensor& y, int n) { return y.view({b, t, n, head_dim}).transpose(1, 2); };
    auto q = split(at::linear(x, q_proj->weight), heads);
    auto k = split(at::linear(x, k_proj->weight), kv_heads);
    auto v = split(at::linear(x, v_proj->weight), kv_heads);
    q = q * cos + rotate_half(q) * sin;
    k = k * cos + rotate_half(k) * sin;
    if (kv_heads != heads) {  // each key/value head serves heads / kv_heads query heads in turn
      k = k.repeat_interleave(heads / kv_heads, 1);
      v = v.repeat_interleave(heads / kv_heads, 1);
    }
    auto y =
        at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
    return at::linear(y.transpose(1, 2).reshape({b, t, heads * head_dim}), o_proj->weight);
  }
  int heads, kv_heads, head_dim;
  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
};
TORCH_MODULE(LlamaAttention);

struct LlamaMLPImpl : torch::nn::Module {
  explicit LlamaMLPImpl(const LlamaConfig& c) {
    gate_proj = register_module("gate_proj", llama_linear(c.dim, c.hidden, c.init_std));
    up_proj = register_module("up_proj", llama_linear(c.dim, c.hidden, c.init_std));
    down_proj = register_module("down_proj", llama_linear(c.hidden, c.dim, c.init_std));
  }
  at::Tensor forward(const at::Tensor& x) {
    return at::linear(at::silu(at::linear(x, gate_proj->weight)) * at::linear(x, up_proj->weight),
                      down_proj->weight);
  }
  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(LlamaMLP);

struct LlamaDecoderLayerImpl : torch::nn::Module {
  explicit LlamaDecoderLayerImpl(const LlamaConfig& c) {
    self_attn = register_module("self_attn", LlamaAttention(c));
    mlp = register_module("mlp", LlamaMLP(c));
    input_layernorm = register_module("input_layernorm", RMSNorm(c.dim, c.rms_eps));
    post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(c.dim, c.rms_eps));
  }
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
    x = x + self_attn(input_layernorm(x), cos, sin);
    return x + mlp(post_attention_layernorm(x));
  }
  LlamaAttention self_attn{nullptr};
  LlamaMLP mlp{nullptr};
  RMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
};
TORCH_MODULE(LlamaDecoderLayer);

// The token embedding and the output head, initialised in their constructors (so that
// either can be a unit built into shards).
struct LlamaEmbeddingImpl : torch::nn::Module {
  explicit LlamaEmbeddingImpl(const LlamaConfig& c) {
    weight = register_parameter("weight", torch::randn({c.vocab, c.dim}) * c.init_std);
    if (c.pad_token >= 0 && c.pad_token < c.vocab) {
      torch::NoGradGuard no_grad;
      weight[c.pad_token].zero_();
      pad_token = c.pad_token;
    }
  }
  at::Tensor forward(const at::Tensor& tokens) { return at::embedding(weight, tokens, pad_token); }
  at::Tensor weight;
  int64_t pad_token = -1;
};
TORCH_MODULE(LlamaEmbedding);

struct LlamaHeadImpl : torch::nn::Module {
  explicit LlamaHeadImpl(const LlamaConfig& c) {
    weight = register_parameter("weight", torch::randn({c.vocab, c.dim}) * c.init_std);
  }
  at::Tensor forward(const at::Tensor& x) { return at::linear(x, weight); }
  at::Tensor weight;
};
TORCH_MODULE(LlamaHead);

// transformers' LlamaModel: model.embed_tokens, model.layers.<i>, model.norm.
struct LlamaModelImpl : torch::nn::Module {
  explicit LlamaModelImpl(const LlamaConfig& c) : config(c) {
    if (c.embedding_units) {
      embed_unit = register_module("embed_tokens", flatshard::Unit<LlamaEmbedding>(c));
    } else {
      embed_tokens = register_module("embed_tokens", LlamaEmbedding(c));
    }
    layers = register_module("layers", torch::nn::ModuleList());
    for (int i = 0; i < c.layers; ++i) {
      blocks.emplace_back(c);
      layers->push_back(blocks.back());
    }
    norm = register_module("norm", RMSNorm(c.dim, c.rms_eps));
  }
  // tokens [B, T] -> final hidden states [B, T, dim]
  at::Tensor forward(const at::Tensor& tokens) {
    at::Tensor x = embed_unit.is_empty() ? embed_tokens(tokens) : embed_unit(tokens);
    auto positions =
        at::arange(tokens.size(1), at::TensorOptions().dtype(at::kFloat).device(tokens.device()));
    auto freqs = at::outer(positions, rope_inverse_frequencies(config, tokens.device()));
    auto angles = at::cat({freqs, freqs}, -1);
    const auto cos = angles.cos().to(x.scalar_type()), sin = angles.sin().to(x.scalar_type());
    for (auto& block : blocks) x = block(x, cos, sin);
    return norm(x);
  }
  const at::Tensor& embedding_weight() {
    return embed_unit.is_empty() ? embed_tokens->weight : embed_unit->weight;
  }

  LlamaConfig config;
  LlamaEmbedding embed_tokens{nullptr};
  flatshard::Unit<LlamaEmbedding> embed_unit{nullptr};  // embed_tokens, when embedding_units
  torch::nn::ModuleList layers{nullptr};
  std::vector<flatshard::Unit<LlamaDecoderLayer>> blocks;  // layers' elements
  RMSNorm norm{nullptr};
};
TORCH_MODULE(LlamaModel);

// transformers' LlamaForCausalLM: model.* and lm_head (none when tied: the head is the
// embedding, as the Hugging Face files then hold it once).
struct LlamaForCausalLMImpl : torch::nn::Module {
  explicit LlamaForCausalLMImpl(const LlamaConfig& c) {
    if (c.tie_embeddings && c.embedding_units) {
      throw flatshard::InvalidArgument(
          "LlamaConfig: tie_embeddings with embedding_units would put one weight in two units; keep the "
          "tied embedding in the root (embedding_units = false)");
    }
    if (c.heads < 1 || c.kv_heads < 1 || c.heads % c.kv_heads != 0 ||
        (c.head_dim == 0 && c.dim % c.heads != 0)) {
      throw flatshard::InvalidArgument(
          "LlamaConfig: heads must be a multiple of kv_heads, and dim of heads "
          "unless head_dim is given");
    }
    model = register_module("model", LlamaModel(c));
    if (c.tie_embeddings) return;
    if (c.embedding_units) {
      head_unit = register_module("lm_head", flatshard::Unit<LlamaHead>(c));
    } else {
      lm_head = register_module("lm_head", LlamaHead(c));
    }
  }
  // tokens [B, T] -> logits [B, T, vocab]
  at::Tensor forward(const at::Tensor& tokens) {
    auto x = model(tokens);
    if (!head_unit.is_empty()) return head_unit(x);
    return at::linear(x, lm_head.is_empty() ? model->embedding_weight() : lm_head->weight);
  }
  LlamaModel model{nullptr};
  LlamaHead lm_head{nullptr};
  flatshard::Unit<LlamaHead> head_unit{nullptr};  // lm_head, when embedding_units
};
TORCH_MODULE(LlamaForCausalLM);

// --- config.json ------------------------------------------------------------------------

inline LlamaConfig LlamaConfig::from_hf_config(const std::string& path) {
  std::string file = path;
  if (file.size() < 5 || file.compare(file.size() - 5, 5, ".json") != 0) file += "/config.json";
  std::ifstream in(file);
  if (!in) throw flatshard::InvalidArgument("LlamaConfig: cannot read '" + file + "'");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    throw flatshard::InvalidArgument("LlamaConfig: '" + file + "' is not JSON: " + e.what());
  }
  auto need = [&](const char* key) {
    if (!j.contains(key) || j.at(key).is_null())
      throw flatshard::InvalidArgument(std::string("LlamaConfig: '") + file + "' lacks " + key);
    return j.at(key);
  };
  const std::string type_name = j.contains("model_type") && j.at("model_type").is_string()
                                    ? j.at("model_type").get<std::string>()
                                    : "llama";
  if (type_name != "llama") {
    throw flatshard::InvalidArgument("LlamaConfig: '" + file + "' is a model of type '" + type_name +
                                     "', not \"llama\": its tensors may share Llama's names, but it computes "
                                     "something else (sliding windows, biases, norms of q and k)");
  }
  if (j.contains("quantization_config") && !j.at("quantization_config").is_null()) {
    throw flatshard::InvalidArgument(
        "LlamaConfig: '" + file +
        "' describes a quantized checkpoint (quantization_config): its weights are stored as integers or "
        "8-bit floats beside scales, which FlatShard does not read; load the model's bf16 or fp32 release");
  }
  LlamaConfig c;
  c.hf_source = j.dump();
  // A key of the wrong type (a string where a number goes, a missing key of a rope scaling)
  // is named with the file, as the keys that are missing.
  try {
    c.vocab = need("vocab_size").get<int>();
    c.dim = need("hidden_size").get<int>();
    c.hidden = need("intermediate_size").get<int>();
    c.layers = need("num_hidden_layers").get<int>();
    c.heads = need("num_attention_heads").get<int>();
    const bool grouped = j.contains("num_key_value_heads") && !j.at("num_key_value_heads").is_null();
    c.kv_heads = grouped ? j.at("num_key_value_heads").get<int>() : c.heads;
    if (j.contains("head_dim") && !j.at("head_dim").is_null()) c.head_dim = j.at("head_dim").get<int>();
    if (c.head_dim * c.heads == c.dim) c.head_dim = 0;
    c.rms_eps = j.value("rms_norm_eps", c.rms_eps);
    c.max_positions = j.value("max_position_embeddings", c.max_positions);
    c.tie_embeddings = j.value("tie_word_embeddings", false);
    c.init_std = j.value("initializer_range", c.init_std);
    if (j.contains("pad_token_id") && j.at("pad_token_id").is_number_integer())
      c.pad_token = j.at("pad_token_id").get<int>();
    for (const char* flag : {"attention_bias", "mlp_bias"}) {
      if (j.contains(flag) && !j.at(flag).is_null() && j.at(flag).get<bool>())
        throw flatshard::InvalidArgument(std::string("LlamaConfig: '") + file + "' sets " + flag +
                                         ", which this model does not have");
    }
    // transformers computes "swish" as "silu".
    if (j.contains("hidden_act") && j.at("hidden_act") != "silu" && j.at("hidden_act") != "swish")
      throw flatshard::InvalidArgument("LlamaConfig: '" + file + "': only hidden_act \"silu\" is supported");
    // transformers 5 writes rope_parameters; earlier versions rope_theta and rope_scaling.
    // The scaling's type is the one rope_scaling names ("rope_type", or "type" before
    // transformers 4.45), else rope_parameters'.
    nlohmann::json rope = nlohmann::json::object();
    std::string type = "default";
    for (const char* key : {"rope_parameters", "rope_scaling"}) {
      if (!j.contains(key) || !j.at(key).is_object()) continue;
      const auto& part = j.at(key);
      rope.update(part);
      type = part.value("rope_type", part.value("type", type));
    }
    c.rope_theta = rope.value("rope_theta", j.value("rope_theta", c.rope_theta));
    if (type == "llama3") {
      c.rope_scaling.factor = rope.at("factor").get<double>();
      c.rope_scaling.low_freq_factor = rope.at("low_freq_factor").get<double>();
      c.rope_scaling.high_freq_factor = rope.at("high_freq_factor").get<double>();
      c.rope_scaling.original_max_positions = rope.at("original_max_position_embeddings").get<int>();
    } else if (type != "default") {
      throw flatshard::InvalidArgument("LlamaConfig: '" + file + "' uses rope type '" + type +
                                       "'; FlatShard's Llama knows \"default\" and \"llama3\"");
    }
  } catch (const nlohmann::json::exception& e) {
    throw flatshard::InvalidArgument("LlamaConfig: '" + file +
                                     "' has a key FlatShard cannot read: " + e.what());
  }
  for (const auto& [key, value] :
       {std::pair{"vocab_size", c.vocab}, std::pair{"hidden_size", c.dim},
        std::pair{"intermediate_size", c.hidden}, std::pair{"num_hidden_layers", c.layers},
        std::pair{"num_attention_heads", c.heads}, std::pair{"num_key_value_heads", c.kv_heads}}) {
    if (value < 1)
      throw flatshard::InvalidArgument("LlamaConfig: '" + file + "' sets " + key + " to " +
                                       std::to_string(value) + "; it must be at least 1");
  }
  return c;
}

inline std::string LlamaConfig::hf_config_json(const std::string& dtype) const {
  nlohmann::json rope = {{"rope_type", rope_scaling.factor > 0 ? "llama3" : "default"},
                         {"rope_theta", rope_theta}};
  if (rope_scaling.factor > 0) {
    rope["factor"] = rope_scaling.factor;
    rope["low_freq_factor"] = rope_scaling.low_freq_factor;
    rope["high_freq_factor"] = rope_scaling.high_freq_factor;
    rope["original_max_position_embeddings"] = rope_scaling.original_max_positions;
  }
  nlohmann::json j = hf_source.empty() ? nlohmann::json::object() : nlohmann::json::parse(hf_source);
  j.erase("rope_scaling");         // written again below when there is scaling
  j.erase("quantization_config");  // the export is plain fp32 or bf16
  j.erase("auto_map");             // custom modeling code: the export is LlamaForCausalLM
  if (j.contains("torch_dtype")) j["torch_dtype"] = dtype;  // transformers before 4.56 reads this
  j.update(nlohmann::json{
      {"architectures", {"LlamaForCausalLM"}},
      {"model_type", "llama"},
      {"vocab_size", vocab},
      {"hidden_size", dim},
      {"intermediate_size", hidden},
      {"num_hidden_layers", layers},
      {"num_attention_heads", heads},
      {"num_key_value_heads", kv_heads},
      {"head_dim", head_size()},
      {"hidden_act", "silu"},
      {"rms_norm_eps", rms_eps},
      {"max_position_embeddings", max_positions},
      {"tie_word_embeddings", tie_embeddings},
      {"initializer_range", init_std},
      {"attention_bias", false},
      {"mlp_bias", false},
      {"rope_parameters", rope},
      {"rope_theta", rope_theta},
      {"dtype", dtype},
  });
  if (rope_scaling.factor > 0) j["rope_scaling"] = rope;
  return j.dump(2) + "\n";
}

}  // namespace flatshard::models
