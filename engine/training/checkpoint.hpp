// Checkpoints on disk (docs/checkpoints.md): what exact resume needs, in files other tools can
// read, committed by a manifest written last. CAF-free: the checkpoint writer actor and the
// `troupe ckpt` command call it.
//
// A checkpoint of step s is the directory ROOT/step-0000000s holding
//   model.safetensors       fp32 master weights, Hugging Face GPT-2 names and layout
//   exp_avg.safetensors     AdamW first moments, the same names and layout
//   exp_avg_sq.safetensors  AdamW second moments
//   lm_head.safetensors     when the head's chunk holds its own copy of the tied wte (a
//                           pipeline): that copy ("lm_head.weight") and its moments, which may
//                           differ from wte's in their last bits (summed in another order)
//   trainer_state.json      step, tokens, data position, update guard, schedule, mesh, recipe
//   manifest.json           magic, format version, step, every file's size and xxh64, and the
//                           xxh64 of its own content ("manifest_version" 2, "checksum")
// The tensors are whole-model tensors whatever the mesh that saved them, so a checkpoint loads
// at any pipeline, data, tensor or ZeRO layout.
//
// With checkpoint.format "parts" (by default, a job of several processes) format 2 instead,
// where each stage writes what it holds itself, in parallel, and nothing crosses to one
// process (as torch's distributed checkpoint):
//   part-RRR-LLL.safetensors  stage (rank R, lane L)'s pieces: tensor "ROLE/NAME/SHARD/OFFSET"
//                             (ROLE model, exp_avg or exp_avg_sq; Troupe's names and layout),
//                             F32, its values [OFFSET, OFFSET + n) of tensor shard SHARD's slice
//   trainer_state.json, manifest.json (version 2: every part's size and xxh64)
// Loading assembles whole tensors from the parts (checkpoint_assembler), so format 2 loads at
// any mesh too, and `troupe ckpt export` writes it as Hugging Face weights.
//
// Invariants:
//  - The manifest is the commit marker: written after every other file is on disk (each file
//    and the manifest: tmp, fsync, rename; then fsync of the directory). A directory without a
//    manifest is torn and is never loaded; the next write of its step removes it.
//  - The manifest is the whole truth: a checkpoint verifies only when the manifest's checksum
//    of itself holds, every file it lists is there with its size and xxh64, nothing else is in
//    the directory, and the manifest, the directory name and the trainer state agree on the
//    step. Loading opens only files the manifest lists.
//  - Rotation counts only checkpoints that verify: an older one is removed only after a newer
//    one is committed, the newest `keep` that verify stay (the one just committed and the
//    newest that verifies always), and a directory that does not verify is never removed by
//    it nor counted: it stays and is reported.
//  - Loading verifies the manifest and every file's size and xxh64 before any tensor is read;
//    a problem is one line naming the file (and the expected and actual checksum).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "engine/model/gpt_model.hpp"
#include "engine/training/recipe.hpp"
#include "engine/training/update_guard.hpp"

namespace troupe::engine {

constexpr int checkpoint_format_version = 1;
constexpr int checkpoint_parts_version = 2;  // format 2: a part file per stage
inline constexpr const char* checkpoint_magic = "troupe-checkpoint";
// The name of a head chunk's own copy of the tied wte in checkpoint tensors.
inline constexpr const char* checkpoint_head_copy = "lm_head.weight";

// The mesh that saved a checkpoint (resume at another one reshards).
struct checkpoint_mesh {
  int pp = 1, dp = 1, tp = 1, zero = 0, virtual_stages = 1, micro_batches = 1, grad_accum = 1;
  int micro_batch = 1;  // rows per micro-batch
};

// trainer_state.json.
struct checkpoint_state {
  int step = 0;                    // optimizer steps done (the next step is step + 1)
  std::int64_t tokens = 0;         // tokens trained on
  std::int64_t micro_batches = 0;  // training micro-batches consumed, all replicas together
  update_guard::state guard;       // loss scale, skip counters, outlier windows
  std::string schedule;            // the schedule in effect
  checkpoint_mesh mesh;
  std::optional<gpt_config> model;  // the model saved (checkpoints written before it: unset)
  std::string recipe_text;          // the recipe's TOML and its overrides
  std::vector<std::string> overrides;
  // Every trajectory key changed with --allow-change at a resume of this run, oldest first
  // (checkpoints written before it: none).
  std::vector<recipe_change> recipe_changes;
};

// Whole-model tensors by parameter name in Troupe's layout (gpt_chunk with chunk_range::whole:
// [out, in] linear weights, padded vocabulary rows), as the stages' snapshots give them; and
// optionally checkpoint_head_copy, shaped as wte.
using named_tensors = std::map<std::string, std::vector<float>>;
struct checkpoint_tensors {
  named_tensors params, exp_avg, exp_avg_sq;
};

// Whole-model tensors from the pieces the stages of a mesh send (tensor shards' slices, ZeRO
// shards' owned ranges; a range may come twice, as the tied wte's two copies do).
class checkpoint_assembler {
 public:
  enum role : int { parameter = 0, exp_avg = 1, exp_avg_sq = 2 };
  checkpoint_assembler(const gpt_config& model, int tp);
  // Values [offset, offset + n) of tensor shard `shard`'s slice of `name` (the whole tensor
  // without tensor parallelism). Throws std::runtime_error for an unknown name or a range
  // outside the slice.
  void add(role r, const std::string& name, int shard, std::int64_t offset, const float* values,
           std::int64_t n);
  // The same, taking the values: a piece that is its whole slice, the first to arrive for it,
  // is kept as it is (moved, not copied).
  void add(role r, const std::string& name, int shard, std::int64_t offset,
           std::vector<float>&& values);
  // A range [offset, offset + n) as add() takes it, counted as covered but not kept (checking
  // a checkpoint's parts from their headers alone).
  void cover(role r, const std::string& name, int shard, std::int64_t offset, std::int64_t n);
  // Throws std::runtime_error naming the first tensor some part of which nobody sent (or
  // covered). only >= 0: that role's tensors alone; names (if any): those tensors alone.
  void check_covered(int only = -1, const std::set<std::string>& names = {}) const;
  // check_covered, then the tensors. Takes the slices' values (a tensor without tensor shards
  // is moved, not copied): call it once. The roles and tensors left out are left empty.
  checkpoint_tensors finish(int only = -1, const std::set<std::string>& names = {});

 private:
  // The whole model's tensors among `names` (every one if empty), with the head's copy of wte
  // when a piece of it came.
  std::vector<parameter_info> tensors(const std::set<std::string>& names) const;
  // The slice's element count; throws for an unknown shard or name, or a range outside it.
  std::int64_t slice_numel(const std::string& name, int shard, std::int64_t offset,
                           std::int64_t n) const;
  struct slice {
    std::vector<float> values;
    std::vector<std::pair<std::int64_t, std::int64_t>> covered;  // (offset, n)
  };
  gpt_config model_;
  int tp_;
  std::vector<std::map<std::string, parameter_info>> layouts_;  // by shard
  std::map<std::tuple<int, std::string, int>, slice> slices_;   // (role, name, shard)
};

std::filesystem::path checkpoint_dir(const std::filesystem::path& root, int step);

// Called at each point of a write (after each file, before and after the commit): a test
// throws from it to stop the write there, as a killed writer would.
using checkpoint_hook = std::function<void(const std::string& point)>;

// A step directory that rotation left in place because it does not verify (torn, corrupt or
// foreign), with the one-line problem.
struct checkpoint_left_alone {
  std::filesystem::path dir;
  std::string problem;
};

// Writes the checkpoint of state.step under root and commits it, then rotates: the checkpoints
// that verify beyond the newest `keep` go (see the invariants); returns the directories left
// in place because they do not verify. Throws std::runtime_error naming the file at fault;
// what was committed before stays loadable. `say` hears of a directory of the same step that
// is replaced (prepare_checkpoint_dir).
using checkpoint_say = std::function<void(const std::string&)>;
std::vector<checkpoint_left_alone> write_checkpoint(const std::filesystem::path& root,
                                                    const gpt_config& model,
                                                    const checkpoint_tensors& tensors,
                                                    const checkpoint_state& state, int keep,
                                                    const checkpoint_hook& hook = {},
                                                    const checkpoint_say& say = {});

// ---- format 2: a part per stage ----
// One piece of a part: values [offset, offset + n) of tensor shard `shard`'s slice of `name`
// (checkpoint_assembler::add's arguments).
struct checkpoint_piece {
  checkpoint_assembler::role role = checkpoint_assembler::parameter;
  std::string name;
  int shard = 0;
  std::int64_t offset = 0;
  const float* values = nullptr;
  std::int64_t n = 0;
};
struct checkpoint_file {  // a file as the manifest lists it
  std::string name;
  std::uint64_t bytes = 0, xxh64 = 0;
};
// The step directory of `step` under root, made ready for its parts: a torn one (or one that
// no longer verifies) removed and named through `say`, an empty one created. Throws when a
// committed checkpoint of the step that verifies is there.
std::filesystem::path prepare_checkpoint_dir(const std::filesystem::path& root, int step,
                                             const checkpoint_say& say = {});
// The part file of the stage of pipeline rank `rank` and lane `lane`.
std::string checkpoint_part_name(int rank, int lane);
// Writes a part into dir (name.tmp, fsync, rename), straight from the pieces' values.
checkpoint_file write_checkpoint_part(const std::filesystem::path& dir, const std::string& name,
                                      const std::vector<checkpoint_piece>& pieces);
// Commits the checkpoint of state.step whose parts are written into its prepared directory:
// trainer_state.json, then the manifest (format 2) listing the parts; then removes what
// write_checkpoint removes and returns what it leaves. The hook sees the same points from
// "wrote trainer_state.json" on.
std::vector<checkpoint_left_alone> commit_checkpoint_parts(
    const std::filesystem::path& root, const std::vector<checkpoint_file>& parts,
    const checkpoint_state& state, int keep, const checkpoint_hook& hook = {});
// The whole-model tensors of a checkpoint of either format.
checkpoint_tensors read_checkpoint_tensors(const std::filesystem::path& dir,
                                           const gpt_config& model);

struct checkpoint_entry {
  std::filesystem::path dir;
  int step = 0;
  bool committed = false;  // has a manifest (not verified)
};
// The step directories under root, newest first (none when root does not exist).
std::vector<checkpoint_entry> list_checkpoints(const std::filesystem::path& root);

// Verifies dir's manifest (magic, version, its own checksum, step), every file it lists
// (present, size, xxh64), that nothing else is in dir, and that the trainer state's step is the
// manifest's and the directory's. Returns "" or the one-line problem, naming the file.
std::string verify_checkpoint(const std::filesystem::path& dir);
// verify_checkpoint without hashing the tensor files again where this process has verified
// the same directory with the same manifest before: the manifest, the files' presence and
// sizes, nothing unlisted and the trainer state are checked every time.
std::string verify_checkpoint_cached(const std::filesystem::path& dir);

// The checkpoint to resume from: `where` is a step directory (which must verify) or a root
// (its newest committed checkpoint that verifies; each one passed over is reported through
// `say` with its problem and the one fallen back to). Throws std::runtime_error when none.
std::filesystem::path find_checkpoint(const std::filesystem::path& where,
                                      const std::function<void(const std::string&)>& say);

// The trainer state, checked first against the manifest (its size and xxh64 as listed, its
// step the manifest's). Throws std::runtime_error naming the file.
checkpoint_state read_checkpoint_state(const std::filesystem::path& dir);
// A trainer_state.json's text parsed, unchecked (the fuzz target). Throws on malformed text.
checkpoint_state parse_checkpoint_state(const std::string& text);
// The checkpoint's format version (its manifest's): 1, or checkpoint_parts_version.
int checkpoint_format(const std::filesystem::path& dir);
// Throws std::runtime_error naming the file and tensor where the checkpoint's weights are not
// those of `model` (another shape): format 1's model.safetensors, or every part's pieces.
void check_checkpoint_model(const std::filesystem::path& dir, const gpt_config& model);

// One of the checkpoint's tensor files ("model", "exp_avg", "exp_avg_sq") as a stage's flat
// buffer: the stage of `range` and tensor shard `shard` (its slices) of `model`. A head range
// without the embedding takes the head's copy of wte where the manifest lists one (format 1:
// lm_head.safetensors); only files the manifest lists are opened.
std::vector<float> load_checkpoint_tensors(const std::filesystem::path& dir,
                                           const std::string& which, const gpt_config& model,
                                           const chunk_range& range, tensor_shard shard = {});

}  // namespace troupe::engine
