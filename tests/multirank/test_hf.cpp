// Hugging Face models in and out: the safetensors format against the Python package,
// the Llama model against transformers' LlamaForCausalLM in every strategy, loading into
// shards, exporting, and whole state dicts. The reference files come from
// hf_reference.py (CTest fixture hf.reference); hf_check.py checks what FlatShard wrote.
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "models/llama.h"
#include "tests/support/cases.h"
#include "tests/support/multirank.h"

using flatshard::Strategy;
using flatshard::models::LlamaConfig;
using flatshard::models::LlamaForCausalLM;
using namespace flatshard::testing;
namespace fs = std::filesystem;
namespace st = flatshard::safetensors;

namespace {

std::string reference(const std::string& name) {
  return std::string(FLATSHARD_HF_REFERENCE_DIR) + "/" + name;
}

void require_reference() {
  ASSERT_TRUE(fs::exists(reference("tokens.safetensors")))
      << "no reference files in " << FLATSHARD_HF_REFERENCE_DIR << ": run ctest -R hf.reference, or "
      << FLATSHARD_PYTHON << " tests/multirank/hf_reference.py " << FLATSHARD_HF_REFERENCE_DIR;
}

at::Tensor tokens() { return st::load(reference("tokens.safetensors")).at("tokens"); }

RunResult python(const std::vector<std::string>& args) {
  std::vector<std::string> argv{FLATSHARD_PYTHON};
  argv.insert(argv.end(), args.begin(), args.end());
  return run_command(argv);  // deadline: 120 s
}

fs::path temp_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("flatshard_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kFloat) - b.to(at::kFloat)).abs().max().item<double>();
}

// A Llama of `cfg` under `options`, built into shards when `into_shards` (the sharded
// strategies), with another seed than the reference's.
struct Wrapped {
  LlamaForCausalLM model{nullptr};
  std::unique_ptr<flatshard::FullyShard<LlamaForCausalLM>> fsdp;
};
Wrapped wrap(const LlamaConfig& cfg, const flatshard::World& world,
             const flatshard::FullyShardOptions& options, bool into_shards) {
  Wrapped w;
  torch::manual_seed(1234);
  if (into_shards) {
    flatshard::BuildIntoShards build(world, options);
    w.model = LlamaForCausalLM(cfg);
  } else {
    w.model = LlamaForCausalLM(cfg);
  }
  w.fsdp = std::make_unique<flatshard::FullyShard<LlamaForCausalLM>>(w.model, world, options);
  return w;
}

at::Tensor logits(Wrapped& w, const at::Tensor& input) {
  torch::NoGradGuard no_grad;
  return w.fsdp->forward(input);
}

bool sharded(Strategy s) { return s != Strategy::NoShard && s != Strategy::ShardOptimizerState; }

at::Tensor next_token_loss(const at::Tensor& logits, const at::Tensor& input) {
  const auto t = input.size(1);
  return torch::nn::functional::cross_entropy(logits.narrow(1, 0, t - 1).reshape({-1, logits.size(2)}),
                                              input.narrow(1, 1, t - 1).reshape({-1}));
}

}  // namespace

// --- the format, against the Python package ------------------------------------------------

TEST(Safetensors, ReadsEveryDtypeThePythonPackageWrites) {
  require_reference();
  st::File file(reference("dtypes.safetensors"));
  EXPECT_EQ(file.metadata().at("made_by"), "hf_reference.py");
  const auto values = at::arange(30, at::kLong).remainder(7) - 3;
  const std::map<std::string, at::ScalarType> dtypes = {
      {"f64", at::kDouble},    {"f32", at::kFloat}, {"f16", at::kHalf},
      {"bf16", at::kBFloat16}, {"i64", at::kLong},  {"i32", at::kInt},
      {"i16", at::kShort},     {"i8", at::kChar},   {"u8", at::kByte}};
  for (const auto& [name, dtype] : dtypes) {
    const at::Tensor want = (name == "u8" ? values + 3 : values).to(dtype).view({5, 6});
    const at::Tensor got = file.read(name);
    EXPECT_EQ(got.scalar_type(), dtype) << name;
    EXPECT_TRUE(at::equal(got, want)) << name;
    // A slice, converted to fp32 on the way.
    auto slice = at::empty({11}, at::kFloat);
    file.read_into(name, 7, slice);
    EXPECT_TRUE(at::equal(slice, want.view({-1}).narrow(0, 7, 11).to(at::kFloat))) << name;
  }
  EXPECT_TRUE(at::equal(file.read("bool"), at::arange(30).remainder(2).to(at::kBool).view({2, 15})));
  EXPECT_EQ(file.read("empty").sizes().vec(), (std::vector<std::int64_t>{0, 4}));
  EXPECT_EQ(file.read("scalar").dim(), 0);
  EXPECT_EQ(file.read("scalar").item<float>(), 2.5f);
  EXPECT_THROW(file.read_into("f32", 25, at::empty({6}, at::kFloat)), flatshard::InvalidArgument);
  EXPECT_THROW(file.read("nothing"), flatshard::checkpoint::CheckpointError);
}

TEST(Safetensors, WritesWhatThePythonPackageReads) {
  const auto dir = temp_dir("st_write");
  st::File reference_file(reference("dtypes.safetensors"));
  std::map<std::string, at::Tensor> tensors;
  for (const auto& [name, info] : reference_file.tensors()) tensors[name] = reference_file.read(name);
  const std::string path = (dir / "written.safetensors").string();
  st::save(tensors, path, {{"format", "pt"}, {"written_by", "flatshard"}});
  // Every tensor starts aligned to its element size (the header is padded to 8 bytes and
  // larger elements come first), as the package writes.
  st::File again(path);
  for (const auto& [name, info] : again.tensors()) {
    EXPECT_EQ(info.byte_offset % static_cast<std::int64_t>(c10::elementSize(info.dtype)), 0) << name;
    EXPECT_TRUE(at::equal(again.read(name), tensors.at(name))) << name;
  }
  const auto r = python({std::string(FLATSHARD_TESTS_DIR) + "/multirank/hf_check.py", "dtypes", path});
  fs::remove_all(dir);
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

TEST(Safetensors, RefusesCorruptFilesNamingThem) {
  const auto dir = temp_dir("st_corrupt");
  const std::string good = (dir / "good.safetensors").string();
  st::save({{"w", at::arange(64, at::kFloat)}}, good);
  std::ifstream in(good, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto write = [&](const std::string& name, const std::string& content) {
    const std::string path = (dir / name).string();
    std::ofstream(path, std::ios::binary) << content;
    return path;
  };
  auto refused = [&](const std::string& path, const std::string& words) {
    try {
      st::File f(path);
      ADD_FAILURE() << path << " was accepted";
    } catch (const flatshard::checkpoint::CheckpointError& e) {
      EXPECT_EQ(e.path(), path);
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  refused(write("truncated.safetensors", bytes.substr(0, bytes.size() - 4)), "outside the file");
  refused(write("short.safetensors", bytes.substr(0, 5)), "shorter than the 8-byte header length");
  std::string huge = bytes;
  huge[6] = 1;  // a header length beyond the file
  refused(write("length.safetensors", huge), "exceeds the file");
  std::string garbled = bytes;
  garbled[8] = '[';
  refused(write("garbled.safetensors", garbled), "is not JSON");
  std::string dtype = bytes;
  dtype.replace(dtype.find("\"F32\""), 5, "\"X32\"");
  refused(write("dtype.safetensors", dtype), "dtype 'X32'");
  // Headers written by hand: the 8-byte length, the JSON, then `data` zero bytes.
  auto crafted = [&](const std::string& name, const std::string& header, std::size_t data) {
    std::string file(8, '\0');
    const std::uint64_t n = header.size();
    std::memcpy(file.data(), &n, 8);
    return write(name, file + header + std::string(data, '\0'));
  };
  // A shape whose byte count overflows, with data_offsets that match the wrapped product.
  refused(crafted("overflow.safetensors",
                  R"({"w":{"dtype":"F32","shape":[4611686018427387905],"data_offsets":[0,4]}})", 4),
          "impossibly large shape");
  // A name listed twice: a parser keeps one of the two entries, and which one is no promise.
  refused(crafted("twice.safetensors",
                  R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                  16),
          "lists 'w' twice");
  // Bytes no tensor accounts for: before a tensor, and after the last.
  refused(crafted("gap.safetensors", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 16),
          "data bytes [0, 8) belong to no tensor");
  refused(crafted("trailing.safetensors", R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 12),
          "hold 8 of its 12 data bytes");
  // Numbers that are not integers (2.0 would be read as 2 and 2.7 too), and metadata that
  // is not an object of strings.
  refused(crafted("real.safetensors", R"({"w":{"dtype":"F32","shape":[2.7],"data_offsets":[0,8]}})", 8),
          "not an integer");
  refused(crafted("metadata.safetensors",
                  R"({"__metadata__":"x","w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8),
          "__metadata__ is not a JSON object");
  EXPECT_THROW(st::File((dir / "missing.safetensors").string()), flatshard::checkpoint::CheckpointError);
  // A writer that is dropped before commit leaves nothing behind.
  {
    st::Writer w((dir / "dropped.safetensors").string(), {{"w", at::kFloat, {4}}});
    w.write("w", at::ones({4}));
  }
  EXPECT_FALSE(fs::exists(dir / "dropped.safetensors"));
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()),
            12);  // the twelve written above
  fs::remove_all(dir);
}

// --- loading into units left gathered ------------------------------------------------------

namespace {

// A block and a root of two elements: at world 3 the root's flat group pads to three
// slices of four, and ranks 1 and 2 hold padding only.
struct TinyRootImpl : torch::nn::Module {
  TinyRootImpl() {
    block = register_module("block", flatshard::Unit<torch::nn::Linear>(8, 8));
    scale = register_parameter("scale", torch::rand({2}) + 0.5);
  }
  at::Tensor forward(const at::Tensor& x) { return block(x) * scale[0] + scale[1]; }
  flatshard::Unit<torch::nn::Linear> block{nullptr};
  at::Tensor scale;
};
TORCH_MODULE(TinyRoot);

}  // namespace

// Note [Every rank's masters move together]: the root stays gathered after a forward
// without gradients; a load then writes the root's master on rank 0 only (the others hold
// padding), yet every rank must agree to gather it again before the next forward (else rank
// 0 gathers alone and the job hangs), and the forward must see the loaded values.
TEST(HuggingFace, ALoadReachesUnitsLeftGatheredOnEveryRank) {
  FLATSHARD_RUN_RANKS({3});
  auto world = flatshard::init();
  for (Strategy strategy : every_strategy(3)) {
    torch::manual_seed(5);
    TinyRoot source;
    torch::manual_seed(6);
    TinyRoot model;
    flatshard::FullyShard<TinyRoot> fsdp(model, world, options_for(strategy, 3));
    const auto x = at::rand({2, 8});
    torch::NoGradGuard no_grad;
    const auto before = fsdp.forward(x);
    std::map<std::string, at::Tensor> state;
    for (const auto& item : source->named_parameters()) state[item.key()] = item.value().detach();
    flatshard::checkpoint::load_full_state_dict(state, fsdp);
    EXPECT_TRUE(at::allclose(fsdp.forward(x), source->forward(x))) << flatshard::to_string(strategy);
    EXPECT_FALSE(at::allclose(before, source->forward(x)));
  }
}

// --- the model, against transformers -------------------------------------------------------

// Note [Logits against transformers]: hf_reference.py makes two random Llamas with
// transformers and saves them: one in fp32 (grouped-query attention, untied head) and one
// in bf16 over 22 files (tied embeddings, Llama 3 rope scaling, head_dim apart from
// dim / heads), with transformers' fp32 logits on the same tokens. Each loads into every
// strategy at worlds 1-4, built whole and (sharded strategies) built into shards, with the
// embedding and head as units of their own too: FlatShard's fp32 logits equal
// transformers' to 1e-5. The models start from another seed, so a load that misses a
// tensor is off by the weights themselves.
TEST(HuggingFace, LlamaLogitsMatchTransformersInEveryStrategy) {
  FLATSHARD_RUN_RANKS({1, 2, 3, 4}, std::chrono::seconds(240));
  require_reference();
  auto world = flatshard::init();
  const auto input = tokens();
  for (const std::string name : {"llama", "llama3_tied"}) {
    const std::string dir = reference(name);
    const at::Tensor expected = st::load(dir + "/logits.safetensors").at("logits");
    const LlamaConfig base = LlamaConfig::from_hf_config(dir);
    EXPECT_EQ(base.tie_embeddings, name == "llama3_tied");
    for (Strategy strategy : every_strategy(world.world_size())) {
      for (int variant = 0; variant < 3; ++variant) {
        const bool into_shards = variant >= 1, embedding_units = variant == 2;
        if (into_shards && !sharded(strategy)) continue;
        if (embedding_units && base.tie_embeddings) continue;
        LlamaConfig cfg = base;
        cfg.embedding_units = embedding_units;
        auto w = wrap(cfg, world, options_for(strategy, world.world_size()), into_shards);
        const std::string what =
            fmt::format("{} under {}{}{}", name, flatshard::to_string(strategy),
                        into_shards ? ", built into shards" : "", embedding_units ? ", embedding units" : "");
        EXPECT_GT(max_abs_diff(logits(w, input), expected), 1e-3) << what << ": the model starts elsewhere";
        flatshard::checkpoint::load_hf(dir, *w.fsdp);
        const double diff = max_abs_diff(logits(w, input), expected);
        EXPECT_LE(diff, 1e-5) << what;
        if (world.rank() == 0) std::printf("%s: max |logits - transformers'| %.2e\n", what.c_str(), diff);
      }
    }
  }
}

// Loading names what does not fit, on every rank.
TEST(HuggingFace, MismatchedModelsAreRefusedOnEveryRank) {
  FLATSHARD_RUN_RANKS({2});
  require_reference();
  auto world = flatshard::init();
  const std::string dir = reference("llama");
  const LlamaConfig base = LlamaConfig::from_hf_config(dir);
  auto refused = [&](LlamaConfig cfg, const std::string& words,
                     flatshard::checkpoint::LoadModelOptions o = {}) {
    auto w = wrap(cfg, world, options_for(Strategy::FullShard, 2), false);
    try {
      flatshard::checkpoint::load_hf(dir, *w.fsdp, o);
      ADD_FAILURE() << "loaded; expected: " << words;
    } catch (const flatshard::checkpoint::CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  LlamaConfig wider = base;
  wider.hidden = base.hidden + 8;
  refused(wider,
          "parameter 'model.layers.0.mlp.gate_proj.weight' has shape [80, 32] in the model but [72, 32]");
  LlamaConfig deeper = base;
  deeper.layers = base.layers + 1;
  refused(deeper, "the model's parameter 'model.layers.3.");
  LlamaConfig shallower = base;
  shallower.layers = base.layers - 1;
  refused(shallower, "holds 'model.layers.2.");
  // Skipping what the model lacks loads the rest: the first two layers of the reference.
  auto w = wrap(shallower, world, options_for(Strategy::FullShard, 2), false);
  flatshard::checkpoint::LoadModelOptions skip;
  skip.ignore_unexpected = true;
  flatshard::checkpoint::load_hf(dir, *w.fsdp, skip);
  const auto masters = flatshard::checkpoint::full_master_state_dict(*w.fsdp, -1);
  st::File file(dir + "/model.safetensors");
  for (const auto& [name, t] : masters) EXPECT_TRUE(at::equal(t, file.read(name))) << name;
  EXPECT_THROW(flatshard::checkpoint::load_hf(reference("nowhere"), *w.fsdp),
               flatshard::checkpoint::CheckpointError);
}

// Fine-tuned, exported, read back by transformers: its logits are FlatShard's. The export
// splits into several files with an index, and loads back into FlatShard under another
// strategy bit for bit (fp32) or as the masters rounded (bf16 files).
TEST(HuggingFace, ExportedModelLoadsInTransformers) {
  FLATSHARD_RUN_RANKS({2, 3}, std::chrono::seconds(180));
  require_reference();
  auto world = flatshard::init();
  const std::string dir = reference("llama");
  LlamaConfig cfg = LlamaConfig::from_hf_config(dir);
  auto w = wrap(cfg, world, options_for(Strategy::FullShard, world.world_size()), true);
  flatshard::checkpoint::load_hf(dir, *w.fsdp);
  flatshard::optim::SGD opt(*w.fsdp, flatshard::optim::SGDOptions{0.5});
  const auto input = tokens();
  next_token_loss(w.fsdp->forward(input), input).backward();
  opt.step();
  const at::Tensor tuned = logits(w, input);
  const at::Tensor original = st::load(dir + "/logits.safetensors").at("logits");
  ASSERT_GT(max_abs_diff(tuned, original), 1e-3) << "the step moved the model";
  const auto masters = flatshard::checkpoint::full_master_state_dict(*w.fsdp, -1);

  const fs::path out = fs::temp_directory_path() / ("flatshard_export_" + std::to_string(world.world_size()));
  if (world.rank() == 0) fs::remove_all(out);
  flatshard::checkpoint::SaveModelOptions split;
  split.config_json = cfg.hf_config_json();
  split.max_file_bytes = 40 << 10;  // the model is 148 KiB in fp32
  flatshard::checkpoint::save_hf(out.string(), *w.fsdp, split);
  if (world.rank() == 0) {
    EXPECT_TRUE(fs::exists(out / "model.safetensors.index.json"));
    EXPECT_FALSE(fs::exists(out / "model.safetensors"));
    st::save({{"logits", tuned}}, (out / "logits.safetensors").string());
    const auto r = python({std::string(FLATSHARD_TESTS_DIR) + "/multirank/hf_check.py", "model", out.string(),
                           (out / "logits.safetensors").string(), reference("tokens.safetensors"), dir});
    EXPECT_EQ(r.exit_code, 0) << r.output;
    std::printf("transformers on FlatShard's export: %s", r.output.c_str());
  }
  w.fsdp->comm().barrier().wait();
  // Back into FlatShard, replicated this time.
  auto back = wrap(cfg, world, options_for(Strategy::ShardOptimizerState, world.world_size()), false);
  flatshard::checkpoint::load_hf(out.string(), *back.fsdp);
  for (const auto& [name, t] : flatshard::checkpoint::full_master_state_dict(*back.fsdp, -1))
    EXPECT_TRUE(at::equal(t, masters.at(name))) << name;
  // bf16 files, one of them (the cut is larger than the model).
  flatshard::checkpoint::SaveModelOptions bf16;
  bf16.dtype = at::kBFloat16;
  flatshard::checkpoint::save_hf(out.string(), *w.fsdp, bf16);
  if (world.rank() == 0) {
    EXPECT_TRUE(fs::exists(out / "model.safetensors"));
    EXPECT_FALSE(fs::exists(out / "model.safetensors.index.json")) << "the split export's index went";
    EXPECT_FALSE(fs::exists(out / "model-00001-of-00002.safetensors"));
    EXPECT_EQ(st::File((out / "model.safetensors").string()).info("lm_head.weight").dtype, at::kBFloat16);
  }
  w.fsdp->comm().barrier().wait();
  flatshard::checkpoint::load_hf(out.string(), *back.fsdp);
  for (const auto& [name, t] : flatshard::checkpoint::full_master_state_dict(*back.fsdp, -1))
    EXPECT_TRUE(at::equal(t, masters.at(name).to(at::kBFloat16).to(at::kFloat))) << name;
  w.fsdp->comm().barrier().wait();
  if (world.rank() == 0) fs::remove_all(out);
  if (world.world_size() != 2) return;
  // The tied model with Llama 3's rope scaling, exported as it loaded: transformers reads its
  // config (rope_scaling, the tie) and computes the reference's logits on it.
  const std::string tied_dir = reference("llama3_tied");
  const LlamaConfig tied_cfg = LlamaConfig::from_hf_config(tied_dir);
  auto tied = wrap(tied_cfg, world, options_for(Strategy::FullShard, 2), true);
  flatshard::checkpoint::load_hf(tied_dir, *tied.fsdp);
  flatshard::checkpoint::SaveModelOptions whole;
  whole.config_json = tied_cfg.hf_config_json();
  flatshard::checkpoint::save_hf(out.string(), *tied.fsdp, whole);
  if (world.rank() == 0) {
    EXPECT_FALSE(st::File((out / "model.safetensors").string()).contains("lm_head.weight"))
        << "a tied head is saved once";
    const auto r = python({std::string(FLATSHARD_TESTS_DIR) + "/multirank/hf_check.py", "model", out.string(),
                           tied_dir + "/logits.safetensors", reference("tokens.safetensors"), tied_dir});
    EXPECT_EQ(r.exit_code, 0) << r.output;
    std::printf("transformers on FlatShard's tied llama3 export: %s", r.output.c_str());
    fs::remove_all(out);
  }
  tied.fsdp->comm().barrier().wait();
}

// Configurations of other models that share Llama's tensor names are refused; the token
// ids and every field FlatShard does not hold go through to the exported config.json; a
// head_dim that is not hidden_size / heads is kept.
TEST(HuggingFace, ConfigsKeepWhatTheyDoNotHoldAndRefuseOtherModels) {
  require_reference();
  const fs::path d = temp_dir("configs");
  nlohmann::json source;
  std::ifstream(reference("llama/config.json")) >> source;
  auto with = [&](const std::function<void(nlohmann::json&)>& change) {
    nlohmann::json j = source;
    change(j);
    std::ofstream(d / "config.json") << j.dump();
    return (d / "config.json").string();
  };
  for (const char* other : {"mistral", "qwen2"}) {
    try {
      LlamaConfig::from_hf_config(with([&](nlohmann::json& j) { j["model_type"] = other; }));
      ADD_FAILURE() << other << " was read as a Llama";
    } catch (const flatshard::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("type '") + other + "'"), std::string::npos)
          << e.what();
    }
  }
  const auto odd = LlamaConfig::from_hf_config(with([](nlohmann::json& j) {
    j["hidden_size"] = 1000;
    j["num_attention_heads"] = 16;
    j["head_dim"] = 62;
  }));
  EXPECT_EQ(odd.head_size(), 62);
  // What FlatShard's Llama does not compute is refused by name: other rotary scalings,
  // biases, other activations, quantized weights, impossible head counts, keys of the wrong
  // type or missing from a llama3 scaling.
  const std::vector<std::pair<std::function<void(nlohmann::json&)>, std::string>> refusals{
      {[](nlohmann::json& j) {
         j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 2.0}};
       },
       "rope type 'linear'"},
      {[](nlohmann::json& j) {
         j["rope_scaling"] = {{"type", "dynamic"}, {"factor", 2.0}};
       },
       "rope type 'dynamic'"},
      {[](nlohmann::json& j) {
         j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
       },
       "rope type 'yarn'"},
      {[](nlohmann::json& j) { j["attention_bias"] = true; }, "sets attention_bias"},
      {[](nlohmann::json& j) { j["mlp_bias"] = true; }, "sets mlp_bias"},
      {[](nlohmann::json& j) { j["hidden_act"] = "gelu"; }, "only hidden_act \"silu\""},
      {[](nlohmann::json& j) {
         j["quantization_config"] = {{"quant_method", "fbgemm_fp8"}};
       },
       "quantized checkpoint"},
      {[](nlohmann::json& j) { j["num_key_value_heads"] = 0; }, "num_key_value_heads to 0"},
      {[](nlohmann::json& j) { j["num_attention_heads"] = "four"; }, "has a key FlatShard cannot read"},
      {[](nlohmann::json& j) {
         j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
       },
       "has a key FlatShard cannot read"},
  };
  for (const auto& [change, words] : refusals) {
    try {
      LlamaConfig::from_hf_config(with(change));
      ADD_FAILURE() << "read; expected: " << words;
    } catch (const flatshard::InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  }
  EXPECT_NO_THROW(LlamaConfig::from_hf_config(with([](nlohmann::json& j) { j["hidden_act"] = "swish"; })));
  // The pad token's embedding row gets no gradient from the lookup (transformers'
  // nn.Embedding(padding_idx)): an untied model, a batch holding the pad token.
  {
    const LlamaConfig padded = LlamaConfig::from_hf_config(reference("llama"));
    ASSERT_EQ(padded.pad_token, 93);
    ASSERT_FALSE(padded.tie_embeddings);
    LlamaForCausalLM m(padded);
    const auto tokens = at::tensor({5, 93, 7, 93, 11}, at::kLong).view({1, 5});
    m->forward(tokens).pow(2).sum().backward();
    const at::Tensor grad = m->model->embedding_weight().grad();
    EXPECT_EQ(grad[93].abs().sum().item<float>(), 0.0f);
    EXPECT_GT(grad[5].abs().sum().item<float>(), 0.0f);
    EXPECT_EQ(m->model->embedding_weight()[93].abs().sum().item<float>(), 0.0f)
        << "the pad row starts at zero";
  }
  const auto exported =
      nlohmann::json::parse(LlamaConfig::from_hf_config(reference("llama")).hf_config_json());
  EXPECT_EQ(exported.at("bos_token_id"), 90);
  EXPECT_EQ(exported.at("eos_token_id"), nlohmann::json({91, 92}));
  EXPECT_EQ(exported.at("pad_token_id"), 93);
  EXPECT_EQ(exported.at("model_type"), "llama");
  EXPECT_FALSE(exported.contains("rope_scaling")) << "the reference has no rope scaling";
  fs::remove_all(d);
}

// A published config.json as transformers 4.x writes it (Llama 3.2 1B's, verbatim: rope_theta
// at the top, rope_scaling of type llama3, an explicit head_dim, tied embeddings) reads as
// that model, and its rotary frequencies are transformers' own for it, every band of the
// llama3 scaling among them (kept, smoothed, divided by the factor).
TEST(HuggingFace, APublishedLlama3ConfigReadsAsTransformersReadsIt) {
  const fs::path d = temp_dir("llama32");
  std::ofstream(d / "config.json") << R"({"architectures": ["LlamaForCausalLM"], "attention_bias": false,
    "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
    "max_position_embeddings": 131072, "mlp_bias": false, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192, "rope_type": "llama3"}, "rope_theta": 500000.0,
    "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.45.0.dev0",
    "use_cache": true, "vocab_size": 128256})";
  const LlamaConfig c = LlamaConfig::from_hf_config(d.string());
  EXPECT_EQ(c.vocab, 128256);
  EXPECT_EQ(c.dim, 2048);
  EXPECT_EQ(c.hidden, 8192);
  EXPECT_EQ(c.layers, 16);
  EXPECT_EQ(c.heads, 32);
  EXPECT_EQ(c.kv_heads, 8);
  EXPECT_EQ(c.head_size(), 64);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.factor, 32.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.low_freq_factor, 1.0);
  EXPECT_DOUBLE_EQ(c.rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c.rope_scaling.original_max_positions, 8192);
  EXPECT_TRUE(c.tie_embeddings);
  EXPECT_FLOAT_EQ(static_cast<float>(c.rms_eps), 1e-5f);
  EXPECT_EQ(c.max_positions, 131072);
  const std::string out = (d / "inv_freq.safetensors").string();
  const auto r =
      python({std::string(FLATSHARD_TESTS_DIR) + "/multirank/hf_check.py", "rope", d.string(), out});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const at::Tensor want = st::File(out).read("inv_freq");
  const at::Tensor got = rope_inverse_frequencies(c, at::kCPU);
  ASSERT_EQ(got.sizes(), want.sizes());
  EXPECT_TRUE(at::allclose(got, want, 1e-6, 0)) << (got - want).abs().max().item<float>();
  // The bands: the first frequencies kept as they are, the last divided by 32.
  const at::Tensor plain = 1.0 / at::pow(500000.0, at::arange(0, 64, 2, at::kLong).to(at::kFloat) / 64);
  EXPECT_TRUE(at::allclose(got.narrow(0, 0, 4), plain.narrow(0, 0, 4), 1e-6, 0));
  EXPECT_TRUE(at::allclose(got.narrow(0, 28, 4), plain.narrow(0, 28, 4) / 32, 1e-6, 0));
  fs::remove_all(d);
}

// A quantized checkpoint's weights (integers or 8-bit floats, whatever its config says) are
// refused by name rather than converted as values; a Git LFS pointer in place of the file
// says how to get the tensors; a directory holding model.safetensors and an index is read
// as transformers reads it, from model.safetensors.
TEST(HuggingFace, QuantizedWeightsAndLfsPointersAreRefused) {
  FLATSHARD_RUN_RANKS({2});
  require_reference();
  auto world = flatshard::init();
  const std::string dir = reference("llama");
  const LlamaConfig base = LlamaConfig::from_hf_config(dir);
  const fs::path d = temp_dir(fmt::format("quantized{}", world.rank()));
  auto tensors = st::File(dir + "/model.safetensors");
  std::map<std::string, at::Tensor> state;
  for (const auto& [name, info] : tensors.tensors()) state[name] = tensors.read(name);
  auto w = wrap(base, world, options_for(Strategy::FullShard, 2), false);
  for (const at::ScalarType codes : {at::kChar, at::kFloat8_e4m3fn}) {
    auto q = state;
    const std::string name = "model.layers.0.self_attn.q_proj.weight";
    q[name] = q[name].to(codes);
    const std::string path = (d / "model.safetensors").string();
    st::save(q, path);
    try {
      flatshard::checkpoint::load_hf(d.string(), *w.fsdp);
      ADD_FAILURE() << "a quantized weight loaded";
    } catch (const flatshard::checkpoint::CheckpointError& e) {
      EXPECT_NE(std::string(e.what()).find("'" + name + "' is stored as"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("quantized model"), std::string::npos) << e.what();
    }
  }
  std::ofstream(d / "model.safetensors")
      << "version https://git-lfs.github.com/spec/v1\noid sha256:0\nsize 1\n";
  try {
    flatshard::checkpoint::load_hf(d.string(), *w.fsdp);
    ADD_FAILURE() << "a Git LFS pointer loaded";
  } catch (const flatshard::checkpoint::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("git lfs pull"), std::string::npos) << e.what();
  }
  // Both: model.safetensors is read (the index's file holds other values).
  st::save(state, (d / "model.safetensors").string());
  auto other = state;
  for (auto& [name, t] : other) t = t + 1;
  st::save(other, (d / "other.safetensors").string());
  nlohmann::json index;
  for (const auto& [name, t] : other) index["weight_map"][name] = "other.safetensors";
  std::ofstream(d / "model.safetensors.index.json") << index.dump();
  flatshard::checkpoint::load_hf(d.string(), *w.fsdp);
  for (const auto& [name, t] : flatshard::checkpoint::full_master_state_dict(*w.fsdp, -1))
    EXPECT_TRUE(at::equal(t, state.at(name))) << name;
  w.fsdp->comm().barrier().wait();
  fs::remove_all(d);
}

// Tensors a published file holds that the model computes or ties (Note [Tensors with nothing
// to learn]) load without ignore_unexpected; any other tensor the model lacks is still named,
// and so is a head that is not the embedding in a model that ties them.
TEST(HuggingFace, ComputedAndTiedTensorsInAFileLoadWithoutIgnoring) {
  FLATSHARD_RUN_RANKS({2});
  require_reference();
  auto world = flatshard::init();
  const std::string dir = reference("llama3_tied");
  const LlamaConfig cfg = LlamaConfig::from_hf_config(dir);
  auto w = wrap(cfg, world, options_for(Strategy::FullShard, 2), true);
  flatshard::checkpoint::load_hf(dir, *w.fsdp);
  auto state = flatshard::checkpoint::full_master_state_dict(*w.fsdp, -1);
  const auto want = state;
  state["lm_head.weight"] = state.at("model.embed_tokens.weight").clone();  // as state_dict() lists it
  for (int layer = 0; layer < cfg.layers; ++layer)
    state[fmt::format("model.layers.{}.self_attn.rotary_emb.inv_freq", layer)] =
        at::ones({cfg.head_size() / 2});
  const fs::path d = temp_dir("extras_" + std::to_string(world.rank()));  // each rank its own copy
  st::save(state, (d / "with_extras.safetensors").string());
  state["model.layers.0.mlp.extra_proj.weight"] = at::zeros({4, 4});
  st::save(state, (d / "with_unknown.safetensors").string());
  state.erase("model.layers.0.mlp.extra_proj.weight");
  state["lm_head.weight"] = state.at("model.embed_tokens.weight") + 1;  // an untied model's head
  st::save(state, (d / "untied_head.safetensors").string());
  auto fresh = wrap(cfg, world, options_for(Strategy::FullShard, 2), true);
  flatshard::checkpoint::load_hf((d / "with_extras.safetensors").string(), *fresh.fsdp);
  for (const auto& [name, t] : flatshard::checkpoint::full_master_state_dict(*fresh.fsdp, -1))
    EXPECT_TRUE(at::equal(t, want.at(name))) << name;
  try {
    flatshard::checkpoint::load_hf((d / "with_unknown.safetensors").string(), *fresh.fsdp);
    ADD_FAILURE() << "a tensor the model lacks was skipped";
  } catch (const flatshard::checkpoint::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers.0.mlp.extra_proj.weight"), std::string::npos)
        << e.what();
  }
  try {
    flatshard::checkpoint::load_hf((d / "untied_head.safetensors").string(), *fresh.fsdp);
    ADD_FAILURE() << "a head of its own was dropped for the tied embedding";
  } catch (const flatshard::checkpoint::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("differs from its 'model.embed_tokens.weight'"), std::string::npos)
        << e.what();
  }
  fs::remove_all(d);
}

// A whole state dict (full_state_dict's, through a torch.save file, and as one safetensors
// file) loads into every strategy, buffers included, and gives the same weights bit for bit.
TEST(HuggingFace, FullStateDictLoadsIntoEveryStrategy) {
  FLATSHARD_RUN_RANKS({2, 3});
  auto world = flatshard::init();
  GPTConfig cfg = gpt_config();
  cfg.position_scale_buffer = true;
  torch::manual_seed(11);
  GPT source(cfg);
  flatshard::FullyShard<GPT> trained(source, world, options_for(Strategy::FullShard, world.world_size()));
  flatshard::optim::SGD opt(trained, flatshard::optim::SGDOptions{0.5});
  const auto b = gpt_batch(0, 2);
  token_loss(trained.forward(b.input), b.target).backward();
  opt.step();
  const auto state = flatshard::checkpoint::full_state_dict(trained, *source, -1);
  ASSERT_EQ(state.size(), source->named_parameters().size() + 1);
  const std::string file =
      (fs::temp_directory_path() / ("flatshard_sd_" + std::to_string(::getpid()))).string();
  flatshard::checkpoint::save_tensors(state, file);
  const auto read = flatshard::checkpoint::load_tensors(file);
  ::unlink(file.c_str());
  // The same dict as one safetensors file (each rank its own copy).
  const std::string st_file = file + ".safetensors";
  st::save(state, st_file);
  at::Tensor expected;
  {
    torch::NoGradGuard no_grad;
    expected = trained.forward(b.input);
  }
  for (Strategy strategy : every_strategy(world.world_size())) {
    torch::manual_seed(99);
    GPT model(cfg);
    flatshard::FullyShard<GPT> fsdp(model, world, options_for(strategy, world.world_size()));
    flatshard::checkpoint::load_full_state_dict(read, fsdp);
    for (const auto& [name, t] : flatshard::checkpoint::full_state_dict(fsdp, *model, -1))
      EXPECT_TRUE(at::equal(t, state.at(name))) << name << " under " << flatshard::to_string(strategy);
    {
      torch::NoGradGuard no_grad;
      EXPECT_TRUE(at::equal(fsdp.forward(b.input), expected)) << flatshard::to_string(strategy);
    }
    torch::manual_seed(98);
    GPT again(cfg);
    flatshard::FullyShard<GPT> from_file(again, world, options_for(strategy, world.world_size()));
    flatshard::checkpoint::load_hf(st_file, from_file);
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(at::equal(from_file.forward(b.input), expected))
        << flatshard::to_string(strategy) << ", safetensors";
  }
  ::unlink(st_file.c_str());
}
