// The wire codec (wire_codec.hpp): envelope <-> one Cap'n Proto frame. This file: the kind names
// and encode. Payloads are referenced on send, never copied, and each starts at a multiple of 64
// bytes into the frame. Two layouts:
// - One segment (every message whose builder needs one segment, so every activation): the
//   payload pieces follow segment 0's words inside the same segment, and their Data pointers are
//   written by hand as near list pointers to them (Cap'n Proto's encoding spec: A = 1, B = offset
//   in words from the pointer's end, C = 2 for bytes, D = byte count). The receiver's reader then
//   needs no segment map: decoding a 64 KiB activation took 0.30-0.41 us instead of 0.45-0.49 in
//   a loop, 0.59 instead of 0.82-1.0 with the cache disturbed between decodes.
// - Otherwise, one segment per piece (Orphanage::referenceExternalData), the segment before a
//   payload padded with zero words.
// Decoding: wire_decode.cpp.
#include "messages/wire_codec.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include <capnp/message.h>
#include <capnp/orphan.h>
#include <kj/exception.h>

#include "engine/parallel/schedule_sim.hpp"
#include "messages/wire.capnp.h"

namespace troupe::messages::wire {

namespace s = schema;
static_assert(std::endian::native == std::endian::little, "the wire and its payloads are LE");

namespace {

constexpr std::array<std::string_view, 23> kind_names = {
    "link_message", "link_credit",      "batch_message",    "batch_credit",   "step_plan",
    "begin_step",   "begin_eval",       "grads_ready",      "apply_update",   "update_done",
    "eval_done",    "tied_grad",        "snapshot_request", "stage_snapshot", "trace_batch",
    "step_report",  "heartbeat",        "actor_down",       "error_report",   "job_shutdown",
    "ring_chunk",   "checkpoint_chunk", "tensor_exchange"};
static_assert(kind_names.size() == std::variant_size_v<body>);
// The union's discriminants are the variant's indices.
static_assert(static_cast<int>(s::Envelope::Body::LINK_MESSAGE) == 0 &&
              static_cast<int>(s::Envelope::Body::STEP_PLAN) == 4 &&
              static_cast<int>(s::Envelope::Body::STAGE_SNAPSHOT) == 13 &&
              static_cast<int>(s::Envelope::Body::CHECKPOINT_CHUNK) == 21);

capnp::Text::Reader text(const std::string& str) { return {str.c_str(), str.size()}; }

// ---- encode ------------------------------------------------------------------------------------

// A payload piece of a one-segment frame: its Data pointer is word `pointer_word` of segment 0
// (left null by the builder), its bytes are at `data`.
struct flat_piece {
  std::size_t pointer_word = 0;
  const std::byte* data = nullptr;
  std::size_t bytes = 0;
  bool first = false;  // the first piece of its tensor (which starts 64-byte aligned)
};

// What a frame's iov points into: the builder, the referenced payloads' owners, the table.
// Keepers are recycled (keeper_pool): the builder's first segment is the keeper's own scratch,
// zeroed once, over which Cap'n Proto's destructor writes zeros again where it was used
// (capnp/message.h), and the lists keep their storage, so a warm encode allocates only the
// frame's iov and the control block of its `keep`. A fresh keeper per frame cost a 2 KiB calloc
// for the first segment, the keeper and three lists (callgrind, 64 KiB activation: ~4,100 of
// encode's ~5,800 instructions, most of them in the allocator).
struct frame_keeper {
  static constexpr std::size_t first_segment_words = 256;
  void start(bool one_segment) {
    flat = one_segment;
    flat_failed = false;
    message.emplace(
        kj::arrayPtr(reinterpret_cast<capnp::word*>(first_segment.data()), first_segment.size()));
  }
  // Back to idle: releases the payloads, zeroes the scratch the builder used.
  void clear() {
    message.reset();
    owners.clear();
    pieces.clear();
    external.clear();
    table.clear();
  }
  // Lists grown by an unusually large message are not kept.
  bool oversized() const {
    constexpr std::size_t keep_up_to = 64;
    return owners.capacity() > keep_up_to || pieces.capacity() > keep_up_to ||
           external.bucket_count() > keep_up_to || table.capacity() > keep_up_to;
  }
  capnp::MallocMessageBuilder& builder() { return *message; }

  alignas(64) std::array<std::uint64_t, first_segment_words> first_segment{};  // zero when idle
  std::optional<capnp::MallocMessageBuilder> message;
  std::vector<std::shared_ptr<const void>> owners;
  bool flat = true;                // building a one-segment frame
  bool flat_failed = false;        // a piece list did not land in segment 0: build again
  std::vector<flat_piece> pieces;  // one-segment frames
  std::unordered_map<const void*, std::size_t> external;  // segment start -> exact bytes
  std::vector<std::uint32_t> table;
};

// Idle keepers, shared by every thread that encodes: a frame is often dropped on another thread
// than the one that encoded it (the transport's). The most recently returned is handed out first
// (its memory is the warmest); at most max_idle wait, the rest are freed. Never destroyed, so a
// frame that outlives static destruction can still return its keeper.
class keeper_pool {
 public:
  keeper_pool() { idle_.reserve(max_idle); }  // give_back() never allocates
  static keeper_pool& instance() {
    static auto* pool = new keeper_pool;
    return *pool;
  }
  // A keeper that returns here when its last holder drops it.
  std::shared_ptr<frame_keeper> take() {
    frame_keeper* k = nullptr;
    {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (!idle_.empty()) {
        k = idle_.back();
        idle_.pop_back();
      }
    }
    if (k == nullptr) k = new frame_keeper;
    return {k, [](frame_keeper* p) { instance().give_back(p); }};
  }
  void give_back(frame_keeper* k) {
    k->clear();
    if (!k->oversized()) {
      const std::lock_guard<std::mutex> lock(mutex_);
      if (idle_.size() < max_idle) {
        idle_.push_back(k);
        return;
      }
    }
    delete k;
  }

 private:
  static constexpr std::size_t max_idle = 64;
  std::mutex mutex_;
  std::vector<frame_keeper*> idle_;
};

class writer {
 public:
  writer(frame_keeper& k, std::size_t piece_bytes, std::string_view kind)
      : k_(k), piece_(piece_bytes), kind_(kind) {}

  template <class T>
  void tensor(s::Tensor::Builder t, const std::shared_ptr<payload<T>>& p, const char* field) {
    if (!p) throw wire_error("wire: " + std::string(kind_) + "." + field + ": null payload");
    const std::size_t bytes = p->size() * sizeof(T);
    t.setElements(p->size());
    const auto* base = reinterpret_cast<const std::byte*>(p->data());
    const std::size_t n = (bytes + piece_ - 1) / piece_;
    if (k_.flat) {
      // The piece list's n pointer words are allocated at the end of segment 0 (a list of
      // pointers has no tag word); anything else and the frame is built again with segments.
      const auto before = k_.builder().getSegmentsForOutput();
      const std::size_t used = before.size() == 1 ? before[0].size() : 0;
      t.initPieces(static_cast<unsigned>(n));
      const auto after = k_.builder().getSegmentsForOutput();
      if (before.size() != 1 || after.size() != 1 || after[0].size() != used + n) {
        k_.flat_failed = true;
        return;
      }
      k_.owners.push_back(p);  // any alignment: the frame places the bytes, not Cap'n Proto
      for (std::size_t i = 0; i < n; ++i)
        k_.pieces.push_back(
            {used + i, base + i * piece_, std::min(piece_, bytes - i * piece_), i == 0});
      return;
    }
    if (bytes != 0 && reinterpret_cast<std::uintptr_t>(base) % 8 != 0) {
      // Cap'n Proto references only word-aligned memory: one copy for a misaligned view.
      auto copy = std::make_shared<std::vector<std::uint64_t>>((bytes + 7) / 8);
      std::memcpy(copy->data(), base, bytes);
      base = reinterpret_cast<const std::byte*>(copy->data());
      k_.owners.push_back(std::move(copy));
    } else {
      k_.owners.push_back(p);
    }
    // All orphans first, so that the pieces become consecutive segments.
    auto list = t.initPieces(static_cast<unsigned>(n));
    auto orphanage = k_.builder().getOrphanage();
    std::vector<capnp::Orphan<capnp::Data>> orphans;
    for (std::size_t off = 0; off < bytes; off += piece_) {
      const std::size_t len = std::min(piece_, bytes - off);
      const auto* at = reinterpret_cast<const kj::byte*>(base + off);
      orphans.push_back(orphanage.referenceExternalData(capnp::Data::Reader(at, len)));
      k_.external[at] = len;
    }
    for (unsigned i = 0; i < n; ++i) list.adopt(i, kj::mv(orphans[i]));
  }

  void header(s::LinkHeader::Builder b, const link_header& h) {
    b.setKind(static_cast<s::LinkKind>(h.kind));
    b.setStep(h.step);
    b.setRound(h.round);
    b.setMicroBatch(h.micro_batch);
    b.setVirtualStage(h.virtual_stage);
    b.setReplica(h.replica);
    b.setEval(h.eval);
    auto shape = b.initShape(static_cast<unsigned>(h.shape.size()));
    for (unsigned i = 0; i < shape.size(); ++i) shape.set(i, h.shape[i]);
  }

  void plan(s::PipelinePlan::Builder b, const engine::pipeline_plan& p) {
    b.setName(text(p.name));
    b.setRanks(p.shape.ranks);
    b.setMicroBatches(p.shape.micro_batches);
    b.setVirtualStages(p.shape.virtual_stages);
    b.setSplitBackward(p.split_backward);
    auto ranks = b.initActions(static_cast<unsigned>(p.ranks.size()));
    for (unsigned r = 0; r < ranks.size(); ++r) {
      const auto& src = p.ranks[r];
      auto list = ranks.init(r, static_cast<unsigned>(src.size()));
      for (unsigned i = 0; i < list.size(); ++i) {
        list[i].setKind(static_cast<s::ActionKind>(src[i].kind));
        list[i].setVirtualStage(src[i].virtual_stage);
        list[i].setMicroBatch(src[i].micro_batch);
      }
    }
  }

  void event(s::TraceEvent::Builder b, const engine::trace::event& e) {
    b.setKind(static_cast<s::TraceEventKind>(e.kind));
    b.setTrack(e.track);
    b.setCategory(text(e.category));
    b.setName(text(e.name));
    b.setTsUs(e.ts_us);
    b.setDurUs(e.dur_us);
    b.setFlowId(e.flow_id);
    b.setStep(e.step);
    b.setMicroBatch(e.micro_batch);
    b.setVirtualStage(e.virtual_stage);
    b.setBytes(e.bytes);
  }

  void metrics(s::StepReport::Builder b, const engine::step_metrics& m) {
    b.setStep(m.step);
    b.setTotalSteps(m.total_steps);
    b.setLoss(m.loss);
    b.setHasValLoss(m.val_loss.has_value());
    b.setValLoss(m.val_loss.value_or(0.0));
    b.setLr(m.lr);
    b.setGradNorm(m.grad_norm);
    b.setTokensPerS(m.tokens_per_s);
    b.setStepMs(m.step_ms);
    b.setElapsedS(m.elapsed_s);
    b.setTokens(m.tokens);
    b.setFlopsPerS(m.flops_per_s);
    auto mem = b.initMemory(static_cast<unsigned>(m.memory.size()));
    for (unsigned i = 0; i < m.memory.size(); ++i) memory(mem[i], m.memory[i]);
    b.setSkipped(m.skipped);
    b.setHasLossScale(m.loss_scale.has_value());
    b.setLossScale(m.loss_scale.value_or(0.0));
  }

  static void memory(s::MemoryReport::Builder b, const engine::memory_report& m) {
    b.setReplica(m.replica);
    b.setRank(m.rank);
    b.setParameters(m.parameters);
    b.setGradients(m.gradients);
    b.setOptimizer(m.optimizer);
    b.setBuffers(m.buffers);
    b.setPooled(m.pooled);
    b.setActivations(m.activations);
  }

  void body(s::Envelope::Body::Builder b, const wire::body& msg);

 private:
  frame_keeper& k_;
  std::size_t piece_;
  std::string_view kind_;
};

void writer::body(s::Envelope::Body::Builder b, const wire::body& msg) {
  struct visitor {
    writer& w;
    s::Envelope::Body::Builder b;
    void operator()(const link_message& m) {
      auto o = b.initLinkMessage();
      w.header(o.initHeader(), m.header);
      // No data: a header-only message, its payload on a device link (topology/payload_links).
      if (m.data) w.tensor(o.initData(), m.data, "data");
      o.setFlowId(m.flow_id);
    }
    void operator()(const link_credit& m) { w.header(b.initLinkCredit().initHeader(), m.header); }
    void operator()(const batch_message& m) {
      auto o = b.initBatchMessage();
      o.setPart(static_cast<s::BatchPart>(m.part));
      o.setStep(m.step);
      o.setRound(m.round);
      o.setMicroBatch(m.micro_batch);
      o.setReplica(m.replica);
      o.setEval(m.eval);
      o.setB(m.B);
      o.setT(m.T);
      w.tensor(o.initTokens(), m.tokens, "tokens");
      o.setFlowId(m.flow_id);
    }
    void operator()(const batch_credit& m) {
      auto o = b.initBatchCredit();
      o.setPart(static_cast<s::BatchPart>(m.part));
      o.setReplica(m.replica);
    }
    void operator()(const step_plan& m) {
      if (!m.plan) throw wire_error("wire: step_plan.plan: null plan");
      auto o = b.initStepPlan();
      o.setStep(m.step);
      o.setRounds(m.rounds);
      o.setEval(m.eval);
      w.plan(o.initPlan(), *m.plan);
      o.setLossScale(m.loss_scale);
    }
    void operator()(const begin_step& m) {
      auto o = b.initBeginStep();
      o.setStep(m.step);
      o.setRounds(m.rounds);
      o.setLossScale(m.loss_scale);
    }
    void operator()(const begin_eval& m) {
      auto o = b.initBeginEval();
      o.setStep(m.step);
      o.setBatches(m.batches);
    }
    void operator()(const grads_ready& m) {
      auto o = b.initGradsReady();
      o.setStep(m.step);
      o.setRank(m.rank);
      o.setReplica(m.replica);
      o.setGradSquareSum(m.grad_square_sum);
      o.setLossSum(m.loss_sum);
      o.setLosses(m.losses);
    }
    void operator()(const apply_update& m) {
      auto o = b.initApplyUpdate();
      o.setStep(m.step);
      o.setGradNorm(m.grad_norm);
      o.setSkip(m.skip);
      o.setUnscale(m.unscale);
    }
    void operator()(const update_done& m) {
      auto o = b.initUpdateDone();
      o.setStep(m.step);
      o.setRank(m.rank);
      o.setReplica(m.replica);
      o.setLr(m.lr);
      w.memory(o.initMemory(), m.memory);
    }
    void operator()(const eval_done& m) {
      auto o = b.initEvalDone();
      o.setStep(m.step);
      o.setReplica(m.replica);
      o.setLossSum(m.loss_sum);
      o.setLosses(m.losses);
    }
    void operator()(const tied_grad& m) {
      auto o = b.initTiedGrad();
      o.setStep(m.step);
      o.setReplica(m.replica);
      // No data: a header-only message, the copy on a device link (topology/tied_wte.hpp).
      if (m.data) w.tensor(o.initData(), m.data, "data");
    }
    void operator()(const snapshot_request& m) {
      auto o = b.initSnapshotRequest();
      o.setStep(m.step);
      o.setState(m.state);
      o.setCapture(m.capture);
      if (!m.part_dir.empty()) o.setPartDir(text(m.part_dir));
    }
    void operator()(const stage_snapshot& m) {
      auto o = b.initStageSnapshot();
      o.setRank(m.rank);
      o.setReplica(m.replica);
      if (!m.part.name.empty()) o.setPart(text(m.part.name));
      o.setPartBytes(m.part.bytes);
      o.setPartXxh64(m.part.xxh64);
      auto list = o.initParameters(static_cast<unsigned>(m.parameters.size()));
      for (unsigned i = 0; i < list.size(); ++i) {
        const auto& [name, values] = m.parameters[i];
        list[i].setName(text(name));
        // std::vector parameters cannot be shared with `keep`: one copy, then referenced.
        w.tensor(list[i].initData(),
                 std::make_shared<payload<float>>(values.data(), values.data() + values.size()),
                 "parameters");
      }
      auto pieces = o.initPieces(static_cast<unsigned>(m.pieces.size()));
      for (unsigned i = 0; i < pieces.size(); ++i) {
        const auto& p = m.pieces[i];
        pieces[i].setRole(static_cast<std::int32_t>(p.role));
        pieces[i].setName(text(p.name));
        pieces[i].setOffset(p.offset);
        w.tensor(
            pieces[i].initData(),
            std::make_shared<payload<float>>(p.values.data(), p.values.data() + p.values.size()),
            "pieces");
      }
    }
    void operator()(const trace_batch& m) {
      auto list = b.initTraceBatch().initEvents(static_cast<unsigned>(m.events.size()));
      for (unsigned i = 0; i < list.size(); ++i) w.event(list[i], m.events[i]);
    }
    void operator()(const step_report& m) { w.metrics(b.initStepReport(), m.metrics); }
    void operator()(const heartbeat& m) {
      auto o = b.initHeartbeat();
      o.setRank(m.rank);
      o.setSequence(m.sequence);
    }
    void operator()(const actor_down& m) {
      auto o = b.initActorDown();
      o.setActor(m.actor);
      o.setReason(text(m.reason));
    }
    void operator()(const error_report& m) {
      auto o = b.initErrorReport();
      o.setRank(m.rank);
      o.setMessage(text(m.message));
    }
    void operator()(const job_shutdown& m) {
      auto o = b.initJobShutdown();
      o.setOk(m.ok);
      o.setMessage(text(m.message));
    }
    void operator()(const ring_chunk& m) {
      auto o = b.initRingChunk();
      o.setStep(m.step);
      o.setRank(m.rank);
      o.setBucket(m.bucket);
      o.setFromReplica(m.from_replica);
      o.setPhase(m.phase);
      o.setChunk(m.chunk);
      o.setCollective(m.collective);
      w.tensor(o.initData(), m.data, "data");
    }
    void operator()(const tensor_exchange& m) {
      auto o = b.initTensorExchange();
      o.setSeq(m.seq);
      o.setFrom(m.from);
      o.setOp(static_cast<std::int32_t>(m.kind));
      w.tensor(o.initData(), m.data, "data");
      o.setReason(text(m.reason));
    }
    void operator()(const checkpoint_chunk& m) {
      auto o = b.initCheckpointChunk();
      o.setStep(m.step);
      o.setFile(text(m.file));
      o.setOffset(m.offset);
      o.setXxhash(m.xxhash);
      w.tensor(o.initData(), m.data, "data");
    }
  };
  std::visit(visitor{*this, b}, msg);
}

}  // namespace

std::string_view kind_name(const body& b) {
  return b.valueless_by_exception() ? "valueless" : kind_names[b.index()];
}

std::string_view detail::kind_name_at(std::size_t index) {
  return index < kind_names.size() ? kind_names[index] : std::string_view();
}

namespace {
constexpr std::size_t payload_alignment = 64;
constexpr std::array<std::uint64_t, payload_alignment / 8> padding{};
}  // namespace

frame encode(const envelope& e) { return detail::encode(e, detail::max_piece_bytes); }

namespace {

// Builds the envelope's message into k (one-segment or segmented, as k says).
void build(frame_keeper& k, const envelope& e, std::size_t piece_bytes) {
  try {
    auto root = k.builder().initRoot<s::Envelope>();
    root.setSchema(s::ENVELOPE_SCHEMA);
    root.setVersion(protocol_version);
    root.setTarget(e.target);
    root.setSourceRank(e.source_rank);
    root.setCorrelation(e.correlation);
    root.setReply(e.reply);
    writer(k, piece_bytes, kind_name(e.message)).body(root.getBody(), e.message);
  } catch (const kj::Exception& x) {
    std::string what = x.getDescription().cStr();
    std::replace(what.begin(), what.end(), '\n', ' ');
    throw wire_error("wire: " + std::string(kind_name(e.message)) + ": cannot encode: " + what);
  }
}

// [table: 1 segment][segment 0's words][zeros to 64 bytes][piece][zeros to 8 bytes][piece]...,
// all one segment; false (k unusable) if the message did not fit that layout.
bool one_segment_frame(frame_keeper& k, frame& f) {
  const auto segments = k.builder().getSegmentsForOutput();
  if (k.flat_failed || segments.size() != 1) return false;
  const auto seg0 = segments[0];
  // The builder's own, writable memory.
  auto* words = reinterpret_cast<std::byte*>(const_cast<capnp::word*>(seg0.begin()));
  k.table.assign(2, 0);
  f.iov.reserve(3 + 2 * k.pieces.size());  // table, segment 0, then padding and bytes per piece
  f.iov.emplace_back(k.table.data(), 8);
  f.iov.emplace_back(seg0.begin(), seg0.size() * 8);
  std::size_t offset = 8 + seg0.size() * 8;                    // of the next byte in the frame
  constexpr std::uint64_t max_words = std::uint64_t{1} << 29;  // B is a signed 30-bit field
  for (const flat_piece& p : k.pieces) {
    if (p.first && offset % payload_alignment != 0) {
      const std::size_t pad = payload_alignment - offset % payload_alignment;
      f.iov.emplace_back(padding.data(), pad);
      offset += pad;
    }
    const std::uint64_t target = (offset - 8) / 8;  // word index in the segment
    const std::uint64_t distance = target - (p.pointer_word + 1);
    if (target <= p.pointer_word || distance >= max_words || p.bytes >= max_words) return false;
    std::uint64_t pointer = 0;
    std::memcpy(&pointer, words + 8 * p.pointer_word, 8);
    if (pointer != 0) return false;  // not the null pointer initPieces left
    // Near list pointer: A = 1 (list), B = distance, C = 2 (bytes), D = byte count.
    pointer = 1 | (distance << 2) | (std::uint64_t{2} << 32) | (std::uint64_t{p.bytes} << 35);
    std::memcpy(words + 8 * p.pointer_word, &pointer, 8);
    f.iov.emplace_back(p.data, p.bytes);
    if (p.bytes % 8 != 0) f.iov.emplace_back(padding.data(), 8 - p.bytes % 8);
    offset += (p.bytes + 7) / 8 * 8;
  }
  if ((offset - 8) / 8 > 0xffffffffu) return false;
  k.table[1] = static_cast<std::uint32_t>((offset - 8) / 8);
  f.bytes = offset;
  return true;
}

}  // namespace

frame detail::encode(const envelope& e, std::size_t piece_bytes) {
  if (piece_bytes == 0 || piece_bytes % 8 != 0 || piece_bytes > max_piece_bytes)
    throw wire_error("wire: piece size " + std::to_string(piece_bytes) +
                     " is not a positive multiple of 8 up to " + std::to_string(max_piece_bytes));
  auto k = keeper_pool::instance().take();
  k->start(true);
  build(*k, e, piece_bytes);
  if (frame f; one_segment_frame(*k, f)) {
    f.keep = std::move(k);
    return f;
  }
  // A message without payloads (a long trace batch) is laid out as it was built; one with
  // payloads is built again with a segment per piece.
  if (k->flat_failed || !k->pieces.empty()) {
    k->clear();
    k->start(false);
    build(*k, e, piece_bytes);
  }
  const auto segments = k->builder().getSegmentsForOutput();
  k->table.assign((segments.size() + 2) / 2 * 2, 0);
  k->table[0] = static_cast<std::uint32_t>(segments.size() - 1);
  frame f;
  f.iov.emplace_back(k->table.data(), k->table.size() * 4);
  std::size_t offset = k->table.size() * 4;  // of the next segment in the frame
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const auto seg = segments[i];
    k->table[i + 1] = static_cast<std::uint32_t>(seg.size());
    const auto piece = k->external.find(seg.begin());
    if (piece == k->external.end()) {
      f.iov.emplace_back(seg.begin(), seg.size() * 8);
      offset += seg.size() * 8;
      // Zero words after the segment before a payload, so that the payload starts at a multiple
      // of 64 bytes in the frame (unread space at a segment's end is legal Cap'n Proto): in a
      // 64-byte aligned receive buffer the tensor a receiver reads in place is then as aligned
      // as the sender's (cache lines, vector loads), at a cost of at most 56 bytes a frame.
      const bool before_payload =
          i + 1 < segments.size() && k->external.count(segments[i + 1].begin()) > 0;
      if (before_payload && offset % payload_alignment != 0) {
        const std::size_t pad = payload_alignment - offset % payload_alignment;
        f.iov.emplace_back(padding.data(), pad);
        k->table[i + 1] += static_cast<std::uint32_t>(pad / 8);
        offset += pad;
      }
      continue;
    }
    // A referenced payload: its own bytes, then zeros up to the segment's word boundary (never
    // the bytes past the payload's end, which Cap'n Proto would send).
    f.iov.emplace_back(seg.begin(), piece->second);
    if (piece->second % 8 != 0) f.iov.emplace_back(padding.data(), 8 - piece->second % 8);
    offset += (piece->second + 7) / 8 * 8;
  }
  for (const auto& [ptr, len] : f.iov) f.bytes += len;
  f.keep = std::move(k);
  return f;
}

}  // namespace troupe::messages::wire
