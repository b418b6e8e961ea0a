// The tied wte's gradient copies on one pipeline rank and their exchange each step: a rank holds
// none (no end of the model, or both ends in one chunk), one (the embedding's or the head's; the
// other copy is the partner rank's), or two (both ends, in two chunks of this rank). Once the
// buckets holding this rank's copies are final (after their mean over the replicas, if any), two
// copies are summed in place; one is sent to the partner and, once the partner's has arrived,
// becomes own + other, as the partner's does: the same float sums on both ranks. CAF-free: the
// stage actor sends and receives the tied_grad messages (actors/stage.cpp).
//
// How a copy crosses to the partner is the chunks' kind's policy: CPU chunks' inside the message
// (a payload copy); device chunks' through the tied link beside a header-only message (an NCCL
// link when the partner is in another process), or, with no link (the partner in another
// process, NCCL not there), staged through host memory inside the message.
// Device chunks' own copy changes only after the link's send has read it; the partner's is
// received into the chunk's gradient scratch in header order.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/chunks/device_chunk.hpp"
#include "engine/chunks/rank_chunks.hpp"
#include "messages/pipeline.hpp"
#include "topology/grad_buckets.hpp"

namespace troupe::topology {

class tied_wte {
 public:
  tied_wte() = default;
  // The copies in the rank's embedding and head chunks (-1: none), and the buckets holding
  // them. `send` and `receive`: the links with the partner rank (device chunks in one process);
  // without them, copies travel inside the messages. `who` names the rank in errors.
  tied_wte(engine::rank_chunks& chunks, const grad_buckets& buckets, int embedding_chunk,
           int head_chunk, std::shared_ptr<engine::chunk_link> send,
           std::shared_ptr<engine::chunk_link> receive, std::string who);

  int copies() const { return static_cast<int>(copies_.size()); }
  bool holds(int bucket) const;  // the bucket holds one of this rank's copies
  void start();                  // a new step
  bool done() const { return done_; }

  // A bucket is final. When that makes this rank's copies final: two are summed (done); one
  // leaves for the partner, and the payload the tied_grad message carries is returned (null:
  // the copy went through the link). Otherwise nothing is returned.
  std::optional<messages::float_buffer> bucket_final(int bucket);
  // The partner's copy arrived (its tied_grad's payload; null: through the link).
  void received(const messages::float_buffer& data);

 private:
  struct copy {
    int chunk = 0;
    std::int64_t offset = 0;
    int bucket = 0;
  };
  float* grads(int i) const;
  std::size_t bytes() const { return static_cast<std::size_t>(numel_) * sizeof(float); }
  bool device() const { return chunks_->kind() != "cpu"; }
  void finish();

  engine::rank_chunks* chunks_ = nullptr;
  std::shared_ptr<engine::chunk_link> send_, receive_;
  std::string who_;
  std::vector<copy> copies_;
  std::int64_t numel_ = 0;
  int ready_ = 0;          // copies final this step
  bool received_ = false;  // the partner's copy is here (it may come before ours is final)
  bool done_ = true;
  messages::float_buffer partner_;  // CPU chunks: the partner's copy
  void* sent_ = nullptr;            // device chunks: the event after which ours was sent
};

}  // namespace troupe::topology
