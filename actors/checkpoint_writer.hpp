// The checkpoint writer (docs/checkpoints.md): on checkpoint_begin from the coordinator it asks
// the stages to capture their state (snapshot_request with `capture`), answers checkpoint_copied
// once every stage has, so the next step may begin, then collects the states (snapshot_request
// with `state`) and writes and commits the checkpoint (engine/training/checkpoint.hpp) on its own
// thread while training goes on. A failed
// write stops it with the error, naming the file; the coordinator, which monitors it, ends the run.
//
// Invariants:
//  W1. One checkpoint at a time: the next is collected only after the previous is committed (one
//      begun meanwhile waits, and so does the coordinator's step after it).
//  W2. Parameters come from replica 0's lanes (the shards of a rank; under ZeRO-1/2 the other
//      replicas send none, ZeRO-3's every replica its owned pieces); moments from replica 0's
//      lanes too, or with ZeRO from every replica (each owns a piece of each bucket).
//  W4. The states collected are those the stages captured between the two steps (stage S7),
//      whatever the steps after the capture do.
//  W3. checkpoint_flush is answered after every checkpoint begun before it is committed; with
//      abandon, a checkpoint still being collected is dropped (never written: the last committed
//      one stays the newest) and the answer is immediate; its stages' late answers are ignored.
//  W5. Format 2 (checkpoint.format, parts): the writer prepares the step's directory, each stage
//      writes its own part file there on a thread of its own (snapshot_request's part_dir) and
//      answers with its name, size and xxh64, and the writer commits them (trainer state, then
//      the manifest listing every part); no tensor crosses to the writer's process.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "engine/trace/trace_recorder.hpp"
#include "engine/training/recipe.hpp"
#include "messages/protocols.hpp"

namespace troupe::actors {

struct checkpoint_writer_config {
  engine::gpt_config model;
  int pp = 1, dp = 1, tp = 1;
  bool zero = false;
  std::filesystem::path root;  // checkpoint.dir
  int keep = 2;
  bool parts = false;  // format 2: every stage writes its part (engine::write_checkpoint_part)
  // What every checkpoint's trainer state holds beyond the coordinator's part.
  engine::checkpoint_mesh mesh;
  std::string schedule, recipe_text;
  std::vector<std::string> overrides;
  std::vector<engine::recipe_change> recipe_changes;  // allowed on resume, oldest first
  std::vector<std::vector<caf::actor>> stages;        // [lane][rank], lane = replica * tp + shard
  engine::trace::recorder trace;
  caf::actor tracer;
};

messages::checkpoint_writer_actor spawn_checkpoint_writer(caf::actor_system& system,
                                                          checkpoint_writer_config config);

}  // namespace troupe::actors
