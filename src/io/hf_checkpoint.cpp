// Whole models in and out of a wrapped model: Hugging Face model directories (safetensors)
// and whole state dicts, read straight into each rank's slices and written one flat group
// at a time (Note [Streaming full state dicts] in checkpoint.cpp).
#include <algorithm>
#include <functional>
#include <map>
#include <optional>
#include <set>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "flatshard/checkpoint.h"
#include "flatshard/safetensors.h"
#include "src/io/files.h"
#include "src/io/shard_files.h"

namespace flatshard::checkpoint {

namespace {

using shards::Holding;

// Where whole tensors come from: their shapes, and any range of their elements.
struct Source {
  std::string where;  // for messages
  std::map<std::string, std::vector<std::int64_t>> shapes;
  std::map<std::string, at::ScalarType> dtypes;
  // Elements [begin, begin + dst.numel()) of the flattened tensor into dst, converted.
  std::function<void(const std::string&, std::int64_t, const at::Tensor&)> read;
};

std::string shape_str(const std::vector<std::int64_t>& shape) { return c10::str(c10::IntArrayRef(shape)); }

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Whether the source's tensors `a` and `b` hold the same shape and values (read a chunk at a
// time, in fp32).
bool same_values(const Source& src, const std::string& a, const std::string& b) {
  if (src.shapes.at(a) != src.shapes.at(b)) return false;
  std::int64_t numel = 1;
  for (auto d : src.shapes.at(a)) numel *= d;
  constexpr std::int64_t kChunk = std::int64_t{1} << 22;
  for (std::int64_t begin = 0; begin < numel; begin += kChunk) {
    const std::int64_t n = std::min(kChunk, numel - begin);
    auto x = at::empty({n}, at::kFloat), y = at::empty({n}, at::kFloat);
    src.read(a, begin, x);
    src.read(b, begin, y);
    if (!at::equal(x, y)) return false;
  }
  return true;
}

// Note [Tensors with nothing to learn]
// Published files hold tensors that a model which lacks them loads the same without:
// rotary frequencies that transformers before 4.31 saved as buffers (FlatShard's Llama, like
// transformers since, computes them), and the output head of a model whose head is its
// embedding (tie_word_embeddings), which a tied model's state_dict() lists under both names:
// skipped when it holds the embedding's values, and refused, naming the tie, when it does
// not (the files are of an untied model). These load without
// LoadModelOptions::ignore_unexpected, which would also let a tensor the model really lacks
// go by.
bool nothing_to_learn(const Source& src, const std::string& name, const std::set<std::string>& ours) {
  for (const char* computed : {"rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached"})
    if (ends_with(name, computed)) return true;
  const std::string embedding = "model.embed_tokens.weight";
  if (name != "lm_head.weight" || !ours.count(embedding) || !src.shapes.count(embedding)) return false;
  if (same_values(src, name, embedding)) return true;
  shards::fail(src.where,
               fmt::format("'{}' holds an 'lm_head.weight' that differs from its '{}', but the model "
                           "ties its head to its embedding (tie_word_embeddings): the files are of an "
                           "untied model; build the model with tie_word_embeddings false",
                           src.where, embedding));
}

// Names the first parameter the source lacks or holds at another shape, and the first
// tensor of the source the model lacks (unless ignored, or Note [Tensors with nothing to
// learn]).
void check(const Source& src, const Holding& h, const LoadModelOptions& options) {
  std::set<std::string> ours;
  for (const auto& seg : h.segments) {
    for (const auto& span : seg.spans) {
      ours.insert(span.key);
      auto it = src.shapes.find(span.key);
      if (it == src.shapes.end()) {
        shards::fail(src.where, fmt::format("the model's parameter '{}' is not in '{}' ({} tensors): is it "
                                            "the same model, with the same configuration?",
                                            span.key, src.where, src.shapes.size()));
      }
      if (it->second != span.shape) {
        shards::fail(src.where,
                     fmt::format("parameter '{}' has shape {} in the model but {} in '{}': the "
                                 "model's configuration differs from the file's",
                                 span.key, shape_str(span.shape), shape_str(it->second), src.where));
      }
      // Integers or 8-bit floats are a quantized checkpoint's codes (beside scales the model
      // lacks): converted as values, they would load as wrong weights.
      const at::ScalarType stored = src.dtypes.at(span.key);
      if (!at::isFloatingType(stored) || at::isFloat8Type(stored)) {
        shards::fail(src.where,
                     fmt::format("parameter '{}' is stored as {} in '{}': the file holds a quantized model, "
                                 "which FlatShard does not read; load the model's bf16 or fp32 release",
                                 span.key, c10::toString(stored), src.where));
      }
    }
  }
  for (const auto& [name, t] : h.buffers) {
    ours.insert(name);
    auto it = src.shapes.find(name);
    if (it != src.shapes.end() && it->second != t.sizes().vec()) {
      shards::fail(src.where, fmt::format("buffer '{}' has shape {} in the model but {} in '{}'", name,
                                          shape_str(t.sizes().vec()), shape_str(it->second), src.where));
    }
  }
  if (options.ignore_unexpected) return;
  for (const auto& [name, shape] : src.shapes) {
    if (!ours.count(name) && !nothing_to_learn(src, name, ours)) {
      shards::fail(src.where, fmt::format("'{}' holds '{}', which the model lacks: is it the same model? "
                                          "(LoadModelOptions::ignore_unexpected skips such tensors)",
                                          src.where, name));
    }
  }
}

// Every segment this rank holds, read element range by element range; buffers whole.
void read(const Source& src, Holding& h) {
  at::NoGradGuard no_grad;
  shards::for_each_piece(h, [&](const shards::Span& span, std::int64_t begin, const at::Tensor& dst) {
    src.read(span.key, begin, dst);
  });
  for (auto& [name, t] : h.buffers) {
    if (!src.shapes.count(name)) continue;  // not saved (a non-persistent buffer): the model's own
    auto flat = at::empty({t.numel()}, t.options().device(at::kCPU));
    src.read(name, 0, flat);
    t.detach().copy_(flat.view(t.sizes()));
  }
}

// Reads into every rank's holding; a failure on any rank fails all of them. The masters'
// version counters move with the copies, so every strategy gathers (or refreshes) the new
// values before its next forward.
void load_from(const std::function<Source()>& open, const std::string& path, FullyShardBase& fsdp,
               const LoadModelOptions& options) {
  std::string failure;
  try {
    const Source src = open();
    Holding h = shards::hold_fully_shard(fsdp, nullptr, /*loading=*/true, {});
    check(src, h, options);
    read(src, h);
  } catch (const std::exception& e) {  // an Error, or the host out of memory: every rank must hear
    failure = e.what();
  }
  shards::agree(fsdp.comm(), path, "loading a model", failure);
  shards::masters_written(fsdp);
}

}  // namespace

void load_hf(const std::string& path, FullyShardBase& fsdp, const LoadModelOptions& options) {
  std::shared_ptr<safetensors::File> file;
  std::shared_ptr<safetensors::Directory> dir;
  load_from(
      [&] {
        Source src;
        src.where = path;
        if (ends_with(path, ".safetensors")) {
          file = std::make_shared<safetensors::File>(path);
          for (const auto& [name, info] : file->tensors()) {
            src.shapes[name] = info.shape;
            src.dtypes[name] = info.dtype;
          }
          src.read = [f = file](const std::string& name, std::int64_t begin, const at::Tensor& dst) {
            f->read_into(name, begin, dst);
          };
        } else {
          dir = std::make_shared<safetensors::Directory>(path);
          for (const auto& [name, info] : dir->tensors()) {
            src.shapes[name] = info.shape;
            src.dtypes[name] = info.dtype;
          }
          src.read = [d = dir](const std::string& name, std::int64_t begin, const at::Tensor& dst) {
            d->file_of(name).read_into(name, begin, dst);
          };
        }
        return src;
      },
      path, fsdp, options);
}

void load_full_state_dict(const std::map<std::string, at::Tensor>& state, FullyShardBase& fsdp,
                          const LoadModelOptions& options) {
  load_from(
      [&] {
        Source src;
        src.where = "the state dict";
        for (const auto& [name, t] : state) {
          src.shapes[name] = t.sizes().vec();
          src.dtypes[name] = t.scalar_type();
        }
        src.read = [&state](const std::string& name, std::int64_t begin, const at::Tensor& dst) {
          dst.copy_(state.at(name).detach().reshape({-1}).narrow(0, begin, dst.numel()));
        };
        return src;
      },
      "the state dict", fsdp, options);
}

// --- export ----------------------------------------------------------------------------------

namespace {

struct Planned {
  std::vector<std::vector<safetensors::Writer::Entry>> files;  // entries, in file order
  std::map<std::string, std::size_t> file_of;                  // name -> file
  std::int64_t total_bytes = 0;
};

// Cuts the tensors, in the model's order, into files of at most max_file_bytes (a tensor
// larger than that gets a file of its own).
Planned plan_files(const std::vector<safetensors::Writer::Entry>& entries, std::int64_t max_file_bytes) {
  Planned p;
  std::int64_t in_file = 0;
  for (const auto& e : entries) {
    std::int64_t bytes = static_cast<std::int64_t>(c10::elementSize(e.dtype));
    for (auto d : e.shape) bytes *= d;
    if (p.files.empty() || (in_file > 0 && in_file + bytes > max_file_bytes)) {
      p.files.emplace_back();
      in_file = 0;
    }
    p.files.back().push_back(e);
    p.file_of[e.name] = p.files.size() - 1;
    in_file += bytes;
    p.total_bytes += bytes;
  }
  if (p.files.empty()) p.files.emplace_back();
  return p;
}

std::string file_name(std::size_t k, std::size_t n) {
  if (n == 1) return "model.safetensors";
  return fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, n);
}

// Files of an earlier export that this one does not replace, which a reader could take for
// part of it (a single file beside an index, or another split's parts).
void remove_stale(const std::string& dir, std::size_t files) {
  for (const auto& name : io::list_dir(dir)) {
    const bool ours = name.rfind("model", 0) == 0 && ends_with(name, ".safetensors");
    bool current = false;
    for (std::size_t k = 0; k < files; ++k) current = current || name == file_name(k, files);
    if (ours && !current) io::remove_tree(dir + "/" + name);
  }
  if (files == 1) io::remove_tree(dir + "/model.safetensors.index.json");
}

}  // namespace

void save_hf(const std::string& dir, FullyShardBase& fsdp, const SaveModelOptions& options) {
  if (options.to < 0 || options.to >= fsdp.world().world_size()) {
    throw InvalidArgument(fmt::format("save_hf: SaveModelOptions::to = {} is not a rank of the world of {}",
                                      options.to, fsdp.world().world_size()));
  }
  const bool writes = fsdp.world().rank() == options.to;
  const auto layout = fsdp.layout();
  const auto masters = fsdp.shards();
  auto& model = fsdp.root_module();
  auto file_dtype = [&](at::ScalarType t) { return at::isFloatingType(t) ? options.dtype : t; };

  std::vector<safetensors::Writer::Entry> entries;
  for (const auto& l : layout) {
    for (const auto& p : l.params) entries.push_back({p.name, options.dtype, p.shape});
  }
  const auto buffers = model.named_buffers(/*recurse=*/true);
  for (const auto& item : buffers)
    entries.push_back({item.key(), file_dtype(item.value().scalar_type()), item.value().sizes().vec()});
  const Planned plan = plan_files(entries, std::max<std::int64_t>(options.max_file_bytes, 1));

  std::string failure;
  std::vector<std::unique_ptr<safetensors::Writer>> writers;
  auto attempt = [&](const std::function<void()>& f) {
    if (!writes || !failure.empty()) return;
    try {
      f();
    } catch (const std::exception& e) {  // an Error, or the host out of memory: the collectives go on
      failure = e.what();
    }
  };
  attempt([&] {
    io::make_dirs(dir);
    for (std::size_t k = 0; k < plan.files.size(); ++k)
      writers.push_back(
          std::make_unique<safetensors::Writer>(dir + "/" + file_name(k, plan.files.size()), plan.files[k]));
  });
  // Every rank takes part in every group's assembly, whatever happened on the writer.
  for (std::size_t i = 0; i < layout.size(); ++i) {
    shards::assemble(fsdp, layout[i], masters[i].detach(), writes,
                     [&](const ShardLayout::Param& p, const at::Tensor& values) {
                       attempt([&] { writers[plan.file_of.at(p.name)]->write(p.name, values); });
                     });
  }
  attempt([&] {
    for (const auto& item : buffers) writers[plan.file_of.at(item.key())]->write(item.key(), item.value());
    // Every file complete and on disk before any takes its name: a failure leaves the
    // previous export's files as they were.
    for (auto& w : writers) w->sync();
    for (auto& w : writers) w->publish();
    // An earlier single file goes before the index comes: a reader takes model.safetensors
    // over an index (as transformers does), so a save killed between the two would
    // otherwise leave the earlier weights to be read in silence.
    if (plan.files.size() > 1) io::remove_tree(dir + "/model.safetensors");
    if (plan.files.size() > 1) {
      nlohmann::json index;
      index["metadata"] = {{"total_size", plan.total_bytes}};
      for (const auto& [name, k] : plan.file_of) index["weight_map"][name] = file_name(k, plan.files.size());
      const std::string text = index.dump(2) + "\n";
      io::write_file_atomically(dir + "/model.safetensors.index.json", {text.begin(), text.end()});
    }
    remove_stale(dir, plan.files.size());
    if (!options.config_json.empty())
      io::write_file_atomically(dir + "/config.json",
                                {options.config_json.begin(), options.config_json.end()});
  });
  writers.clear();
  shards::agree(fsdp.comm(), dir, "exporting the model", failure);
}

}  // namespace flatshard::checkpoint
