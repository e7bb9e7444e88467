#include "flatshard/checkpoint.h"

#include <ATen/ATen.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/serialize.h>

#include <algorithm>
#include <functional>

#include <fmt/format.h>

#include "src/errors.h"
#include "src/io/files.h"
#include "src/io/shard_files.h"

namespace flatshard::checkpoint {
namespace {

at::Tensor host_copy(const at::Tensor& t) { return t.to(at::kCPU, /*non_blocking=*/false, /*copy=*/true); }

// torch.save's zip format, as torch::pickle_save writes it but with untagged
// containers: Python's torch.load, whose default (weights_only) unpickler refuses the
// type-tag helper that tagged containers need, reads it as a plain dict of tensors.
std::vector<char> torch_save_bytes(const torch::IValue& value) {
  std::vector<char> pickled;
  torch::jit::Pickler pickler(
      [&](const char* data, std::size_t n) { pickled.insert(pickled.end(), data, data + n); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  std::vector<char> archive;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, std::size_t n) -> std::size_t {
    const auto* bytes = static_cast<const char*>(data);
    archive.insert(archive.end(), bytes, bytes + n);
    return n;
  });
  torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(), writer);
  writer.writeEndOfFile();
  return archive;
}

}  // namespace

// Note [Streaming full state dicts]: full_state_dict, full_master_state_dict,
// full_optimizer_state_dict and save_hf assemble one flat group at a time from the fp32
// masters: a rank holds its shards plus one group at full size, never the whole model at
// once (summoning every unit would hold all of it on every rank). Only the rank that keeps
// the result holds the whole dict, as host copies.
std::map<std::string, at::Tensor> full_state_dict(FullyShardBase& fsdp, torch::nn::Module& model, int to) {
  const bool keep = to < 0 || fsdp.world().rank() == to;
  const auto layout = fsdp.layout();
  const auto masters = fsdp.shards();
  FLATSHARD_ASSERT(masters.size() == layout.size(), "one master shard per flat group");
  // The parameters as the model computes with them: the masters rounded to the compute
  // dtype, as every gather rounds them.
  const at::ScalarType dtype = fsdp.param_dtype();
  std::map<std::string, at::Tensor> out;
  for (std::size_t i = 0; i < layout.size(); ++i) {
    shards::assemble(fsdp, layout[i], masters[i].detach(), keep,
                     [&](const ShardLayout::Param& p, const at::Tensor& values) {
                       out[p.name] = values.to(at::kCPU, dtype, /*non_blocking=*/false, /*copy=*/true);
                     });
  }
  if (!keep) return {};
  for (const auto& item : model.named_buffers(/*recurse=*/true))
    out[item.key()] = host_copy(item.value().detach());
  return out;
}

namespace shards {

// Every rank takes part: the first shard group's slices, each in its place and
// zeros elsewhere, summed over the world (each element has one owner, so the sum adds only
// zeros: exact). An undefined shard contributes zeros.
void assemble(FullyShardBase& fsdp, const ShardLayout& layout, const at::Tensor& shard, bool keep,
              const std::function<void(const ShardLayout::Param&, const at::Tensor&)>& put) {
  const ShardGroup group = fsdp.shard_group();
  const auto options = at::TensorOptions().dtype(at::kFloat).device(fsdp.comm().device());
  auto full = at::zeros({layout.padded_numel}, options);
  if (group.replica == 0 && shard.defined()) {
    for (const auto& seg : layout.segments) {
      full.narrow(0, seg.offset + group.rank * seg.slice, seg.slice)
          .copy_(shard.narrow(0, seg.shard_offset, seg.slice));
    }
  }
  fsdp.comm().all_reduce(full, ReduceOp::Sum).wait();
  if (!keep) return;
  for (const auto& p : layout.params) put(p, full.narrow(0, p.offset, p.numel).view(p.shape));
}

void masters_written(FullyShardBase& fsdp) {
  for (const auto& master : fsdp.shards()) master.unsafeGetTensorImpl()->bump_version();
}

}  // namespace shards

std::map<std::string, at::Tensor> full_master_state_dict(FullyShardBase& fsdp, int to) {
  const bool keep = to < 0 || fsdp.world().rank() == to;
  const auto layout = fsdp.layout();
  const auto masters = fsdp.shards();
  FLATSHARD_ASSERT(masters.size() == layout.size(), "one master shard per flat group");
  std::map<std::string, at::Tensor> out;
  for (std::size_t i = 0; i < layout.size(); ++i) {
    shards::assemble(
        fsdp, layout[i], masters[i].detach(), keep,
        [&](const ShardLayout::Param& p, const at::Tensor& values) { out[p.name] = host_copy(values); });
  }
  return out;
}

std::map<std::string, at::Tensor> full_optimizer_state_dict(FullyShardBase& fsdp,
                                                            const optim::ShardOptimizer& optimizer, int to,
                                                            const optim::LRScheduler* scheduler,
                                                            const optim::GradScaler* scaler) {
  const auto layout = fsdp.layout();
  const bool keep = to < 0 || fsdp.world().rank() == to;
  std::map<std::string, at::Tensor> out;
  std::int64_t steps = 0;
  for (std::size_t i = 0; i < layout.size(); ++i) {
    steps = std::max(steps, optimizer.steps(i));
    for (const auto& [name, shard] : optimizer.named_state(i)) {  // a state not made yet: zeros
      shards::assemble(fsdp, layout[i], shard, keep,
                       [&](const ShardLayout::Param& p, const at::Tensor& values) {
                         out[p.name + "." + name] = host_copy(values);
                       });
    }
    if (!keep) continue;
    for (const auto& p : layout[i].params)
      out[p.name + ".step"] = at::full({}, optimizer.steps(i, p.name), at::kLong);
  }
  if (!keep) return out;
  out["step"] = at::full({}, steps, at::kLong);
  for (std::size_t g = 0; g < optimizer.num_groups(); ++g) {
    for (const auto& [name, value] : optimizer.hyperparameters(g))
      out["param_groups." + optimizer.group_name(g) + "." + name] = at::full({}, value, at::kDouble);
  }
  if (scheduler) {
    out["scheduler.steps"] = at::full({}, scheduler->steps(), at::kLong);
    for (std::size_t g = 0; g < scheduler->base_lrs().size(); ++g)
      out["scheduler.base_lr." + optimizer.group_name(g)] =
          at::full({}, scheduler->base_lrs()[g], at::kDouble);
  }
  if (scaler) {
    out["scaler.scale"] = at::full({}, scaler->scale(), at::kDouble);
    out["scaler.growth_tracker"] = at::full({}, scaler->growth_tracker(), at::kLong);
  }
  return out;
}

// Note [Checking a full state dict's records]
// torch::pickle_save writes a zip whose records are stored uncompressed, each with its
// CRC-32 in the zip's central directory, but LibTorch's reader does not check them: a
// flipped bit in a tensor's record loads as a wrong value. So the records are checked here
// first, from the central directory (zip64 fields where a size or offset needs them): each
// stored record's bytes against its CRC-32. A directory that cannot be read is left to the
// reader, which refuses what it cannot parse.
namespace {
std::uint64_t little(const char* p, int n) {
  std::uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

void check_zip_crcs(const std::vector<char>& bytes, const std::string& path) {
  const std::uint64_t size = bytes.size();
  const char* b = bytes.data();
  // Whether [at, at + n) lies in the file, without overflowing on values read from it.
  const auto fits = [size](std::uint64_t at, std::uint64_t n) { return at <= size && size - at >= n; };
  if (size < 22) return;
  std::uint64_t end = size - 22;  // the end-of-directory record, behind a comment of up to 64 KiB
  const std::uint64_t lowest = size > 22 + 65535 ? size - 22 - 65535 : 0;
  while (little(b + end, 4) != 0x06054b50) {
    if (end == lowest) return;
    --end;
  }
  std::uint64_t entries = little(b + end + 10, 2), directory = little(b + end + 16, 4);
  if (end >= 20 && little(b + end - 20, 4) == 0x07064b50) {  // the zip64 locator
    const std::uint64_t at = little(b + end - 20 + 8, 8);
    if (fits(at, 56) && little(b + at, 4) == 0x06064b50) {
      entries = little(b + at + 32, 8);
      directory = little(b + at + 48, 8);
    }
  }
  const auto corrupt = [&](const std::string& what) {
    return CheckpointError(path, fmt::format("flatshard::checkpoint: '{}' is corrupt ({}): load an earlier "
                                             "checkpoint or save it again",
                                             path, what));
  };
  std::uint64_t at = directory;
  for (std::uint64_t i = 0; i < entries; ++i) {
    if (!fits(at, 46) || little(b + at, 4) != 0x02014b50) throw corrupt("its zip directory is damaged");
    const std::uint64_t method = little(b + at + 10, 2), crc = little(b + at + 16, 4);
    std::uint64_t stored = little(b + at + 20, 4), local = little(b + at + 42, 4);
    const std::uint64_t name_len = little(b + at + 28, 2), extra_len = little(b + at + 30, 2),
                        comment_len = little(b + at + 32, 2), uncompressed = little(b + at + 24, 4);
    if (!fits(at + 46, name_len + extra_len + comment_len)) throw corrupt("its zip directory is damaged");
    const std::string name(b + at + 46, name_len);
    // Zip64: the 64-bit values, in this order, of the fields that hold 0xFFFFFFFF.
    const std::uint64_t extra_end = at + 46 + name_len + extra_len;
    for (std::uint64_t e = at + 46 + name_len; e + 4 <= extra_end;) {
      const std::uint64_t id = little(b + e, 2),
                          len = std::min<std::uint64_t>(little(b + e + 2, 2), extra_end - e - 4);
      if (id == 0x0001) {
        std::uint64_t f = e + 4;
        const std::uint64_t field_end = e + 4 + len;
        if (uncompressed == 0xFFFFFFFFu && f + 8 <= field_end) f += 8;
        if (stored == 0xFFFFFFFFu && f + 8 <= field_end) {
          stored = little(b + f, 8);
          f += 8;
        }
        if (local == 0xFFFFFFFFu && f + 8 <= field_end) local = little(b + f, 8);
      }
      e += 4 + len;
    }
    at += 46 + name_len + extra_len + comment_len;
    // Only stored records are checked; a CRC of 0 on a record with bytes is one written
    // without (torch.serialization.set_crc32_options(False)).
    if (method != 0 || (crc == 0 && stored > 0)) continue;
    if (!fits(local, 30) || little(b + local, 4) != 0x04034b50)
      throw corrupt(fmt::format("record '{}' is not where its directory says", name));
    const std::uint64_t header = 30 + little(b + local + 26, 2) + little(b + local + 28, 2);
    if (!fits(local, header) || !fits(local + header, stored))
      throw corrupt(fmt::format("record '{}' is cut short", name));
    if (shards::crc32_of(b + local + header, stored) != crc)
      throw corrupt(fmt::format("record '{}' does not match its CRC-32", name));
  }
}
}  // namespace

void save_tensors(const std::map<std::string, at::Tensor>& tensors, const std::string& path) {
  c10::Dict<std::string, at::Tensor> dict;
  for (const auto& [name, t] : tensors) dict.insert(name, t.contiguous());
  io::write_file_atomically(path, torch_save_bytes(torch::IValue(dict)));
}

std::map<std::string, at::Tensor> load_tensors(const std::string& path) {
  const auto bytes = io::read_file(path);
  check_zip_crcs(bytes, path);
  torch::IValue value;
  try {
    value = torch::pickle_load(bytes);
  } catch (const std::exception& e) {
    throw CheckpointError(path,
                          fmt::format("flatshard::checkpoint: '{}' is not a readable checkpoint (corrupt or "
                                      "truncated): {}",
                                      path, first_line(e.what())));
  }
  if (!value.isGenericDict()) {
    throw CheckpointError(path,
                          fmt::format("flatshard::checkpoint: '{}' does not hold a dict of tensors", path));
  }
  std::map<std::string, at::Tensor> out;
  for (const auto& entry : value.toGenericDict()) {
    if (!entry.key().isString() || !entry.value().isTensor()) {
      throw CheckpointError(path, fmt::format("flatshard::checkpoint: '{}' holds an entry that is not "
                                              "name -> tensor",
                                              path));
    }
    out[entry.key().toStringRef()] = entry.value().toTensor();
  }
  return out;
}

}  // namespace flatshard::checkpoint
