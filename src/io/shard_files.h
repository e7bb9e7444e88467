// Sharded checkpoints, the part that knows no modes: what a rank holds (segments of flat
// spaces laid out by spans), the shard files and metadata.json that save() writes, and the
// reader that load() fills a holding from. The modes' adapters (sharded_checkpoint.cpp)
// make the holdings. See docs/checkpoints.md for the format.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "flatshard/checkpoint.h"
#include "flatshard/communicator.h"

namespace flatshard::checkpoint::shards {

// 2: metadata.crc32 is part of the checkpoint (a load refuses a version-2 checkpoint
// without it); 1: written before it was, read as it was.
constexpr int kFormatVersion = 2;
constexpr const char* kFormat = "flatshard-sharded-checkpoint";

// --- what a rank holds -----------------------------------------------------------

// A tensor's place in a flat space: elements [offset, offset + numel).
struct Span {
  std::string key;  // "<parameter>", "<parameter>.<state>"
  std::vector<std::int64_t> shape;
  std::int64_t offset = 0;
  std::int64_t numel = 0;
};

// A 1-D tensor holding elements [begin, begin + values.numel()) of a flat space that
// spans lay out. On save this rank writes [write_begin, write_end) of it; on load it
// reads all of it.
struct Segment {
  at::Tensor values;
  std::int64_t begin = 0;
  std::int64_t write_begin = 0, write_end = 0;
  std::vector<Span> spans;
  std::string kind;  // "param", "state"
};

struct Holding {
  std::string mode;
  std::vector<Segment> segments;
  std::vector<std::pair<std::string, at::Tensor>> buffers;  // written whole by rank 0
  std::map<std::string, std::int64_t> steps;                // optimizer steps per parameter
  std::vector<std::string> state_names;                     // the optimizer's
  bool has_optimizer = false;
  std::vector<std::string> bucket_order;  // DDP's rebuilt bucket order, by name
  std::string training;                   // JSON: the optimizer's groups, scheduler, scaler
};

// --- what a checkpoint holds (metadata.json) ---------------------------------------------

struct Entry {
  std::string kind;
  std::vector<std::int64_t> shape;
  at::ScalarType dtype = at::kFloat;
  struct Part {
    std::string file;
    std::int64_t byte_offset, begin, numel;
    std::uint32_t crc;
    // Note [Checksums per chunk]: each kCrcChunkBytes of the piece's bytes, in order (none
    // for a piece of one chunk, and in checkpoints written before them).
    std::vector<std::uint32_t> chunk_crcs;
  };
  std::vector<Part> parts;  // by begin
};

struct Checkpoint {
  std::string dir;
  int world_size = 0;
  std::string mode;
  std::int64_t step = 0;
  bool has_optimizer = false;
  std::set<std::string> state_names;
  std::map<std::string, std::int64_t> steps;
  std::vector<std::string> bucket_order;
  std::string training;  // JSON ("" when the checkpoint holds none)
  std::map<std::string, Entry> tensors;
};

// --- shared by saving and loading (shard_save.cpp) -----------------------------------------

// metadata.json's CRC-32 in decimal, beside it (written first; absent in older checkpoints).
inline constexpr const char* kMetadataChecksum = "metadata.crc32";

[[noreturn]] void fail(const std::string& path, const std::string& what);
std::string dtype_name(at::ScalarType t);
std::optional<at::ScalarType> dtype_of(const std::string& name);
std::uint32_t crc32_of(const void* data, std::size_t n);

// Note [Checksums per chunk]
// A load at another world size needs parts of the pieces another world wrote: a rank of
// 1,024 loading what 8 ranks saved needs 1/128 of each piece it touches. With one CRC per
// piece it would read each piece whole to check it (12 GB per rank, 12 TB across the job,
// for an 8B model's fp32 state). So each piece also lists the CRC-32 of every
// kCrcChunkBytes of its bytes (the last chunk shorter), and a load reads only the chunks
// that hold its elements, checking each: at most two chunks more than it needs per range.
// A piece of one chunk has no list (its crc32 is its chunk's), and checkpoints written
// before the lists load as before, a piece at a time.
inline constexpr std::int64_t kCrcChunkBytes = std::int64_t{1} << 20;
// Bytes this process has read from shard files (tests: Note [Checksums per chunk]).
std::uint64_t shard_bytes_read();

// Note [One save at a time under a root]
// A save prunes what a killed save left under its root (.step-*.tmp) and may prune older
// checkpoints; a save that ran beside another under the same root (an AsyncSaver's still
// writing when save_sharded starts) would delete the other's files, and a load beside a
// save could read the checkpoint the save is publishing on some ranks and the one before
// on others. Each save registers its root (made absolute and canonical) for its whole run,
// in this process, from the moment it is asked for (an AsyncSaver registers on the
// training thread, before save() returns); a save or load that finds its root registered
// on any rank fails on every rank alike, before anything is written or read, saying to wait
// for the save in flight.
class SaveUnderway {
 public:
  explicit SaveUnderway(const std::string& root);  // registers it, unless already there
  ~SaveUnderway();
  SaveUnderway(const SaveUnderway&) = delete;
  SaveUnderway& operator=(const SaveUnderway&) = delete;
  bool clashes() const { return clashes_; }  // another save under the root was in flight
  // Whether a save under `root` is in flight in this process.
  static bool under(const std::string& root);

 private:
  std::string root_;
  bool clashes_ = false;
};
std::string shard_file_name(int rank, int world_size);
// Every rank's string, on every rank (a collective).
std::vector<std::string> exchange_strings(Communicator& comm, const std::string& mine);
// An exception's reason for an agreement: an Error's message, or the first line of any
// other (LibTorch's carry a backtrace), without the "flatshard::checkpoint: " prefix.
std::string reason_of(const std::exception& e);
// Throws on every rank when any rank's `failure` is not empty.
void agree(Communicator& comm, const std::string& path, const std::string& what, const std::string& failure);
// The save's first agreement: the directory made on rank 0, and every rank's shards held
// (a rank that could not read or copy them answers it with its failure, and save() is
// not called there).
inline constexpr const char* kStartingTheSave = "starting the save";

// Writes `h` as step options.step under `root` (shard_save.cpp; Note [Checkpoint directories]).
// `underway`: the root's registration, made by the caller when the save was asked for (an
// AsyncSaver's, on the training thread); registered here when null.
CheckpointInfo save(const std::string& root, Communicator& comm, const Holding& h, const SaveOptions& options,
                    std::shared_ptr<const SaveUnderway> underway = nullptr);

// Opens the checkpoint at `path`, asks `hold` what this rank holds, checks names and
// shapes, reads it and calls `finish`; a failure on any rank fails all (shard_load.cpp).
CheckpointInfo load(const std::string& path, Communicator& comm,
                    const std::function<Holding(const Checkpoint&)>& hold,
                    const std::function<void(const Checkpoint&)>& finish);
// Calls f(span, begin, dst) for every piece of a tensor that h holds: elements [begin,
// begin + dst.numel()) of span's tensor, whose place in h is dst (1-D, contiguous).
void for_each_piece(Holding& h, const std::function<void(const Span&, std::int64_t, const at::Tensor&)>& f);
// The optimizer state names to load (every one the optimizer keeps must be there).
std::vector<std::string> states_to_load(const Checkpoint& c, const std::vector<std::string>& wanted);
std::int64_t steps_of(const Checkpoint& c, const std::string& param);

// --- the wrapper's side ---------------------------------------------------------------------

// What this rank holds of `fsdp`'s parameters (its slice of every flat group, as segments)
// and the model's buffers; with `opt`, the optimizer's state too: when loading, the states
// `load_states` (made where missing), else every state it has (sharded_checkpoint.cpp).
Holding hold_fully_shard(FullyShardBase& fsdp, optim::ShardOptimizer* opt, bool loading,
                         const std::vector<std::string>& load_states);

// What save_sharded writes of this rank: its holding, the communication hook's state and
// the training state (optimizer groups, scheduler, scaler, sampler), as of now.
Holding hold_for_save(FullyShardBase& fsdp, const optim::ShardOptimizer* optimizer,
                      const SaveOptions& options);

// A copy of what `h` has this rank write (its share of each segment, rank 0's buffers) in
// host memory of its own (page-locked for device tensors): later writes to the model or
// the optimizer do not reach it (shard_save.cpp).
// With `reuse`, the copies go into its tensors where sizes and dtypes match (a saver's
// buffers from its previous save: no allocation, no first-touch page faults), and take
// their places in it.
Holding snapshot(const Holding& h, int rank, std::vector<at::Tensor>* reuse = nullptr);

// Note [Every rank's masters move together]: a load writes only the elements a rank holds,
// and a rank whose slice of a group is all padding writes none of them; yet whether a
// gathered unit gathers again (Note [Masters written while gathered]) and whether the
// replicated strategies refresh their parameters are decided from the masters' versions,
// rank by rank, before a collective. Every load therefore moves every master's version on
// every rank.
void masters_written(FullyShardBase& fsdp);

// One flat group's shard-shaped values (one per element of this rank's shard) at full
// size, cut into the group's parameters: put(parameter, values) on the ranks that keep
// them (checkpoint.cpp). A collective over fsdp.comm(); its peak is the group's flat buffer.
void assemble(FullyShardBase& fsdp, const ShardLayout& layout, const at::Tensor& shard, bool keep,
              const std::function<void(const ShardLayout::Param&, const at::Tensor&)>& put);

}  // namespace flatshard::checkpoint::shards
