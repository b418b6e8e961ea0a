// The wire codec (wire_codec.hpp): envelope <-> one Cap'n Proto frame. Payloads are referenced
// on send (Orphanage::referenceExternalData, one segment per piece) and viewed on receive; the
// segment table and every size the peer sends are checked against the caller's limits before
// they are used, and every Cap'n Proto exception becomes a wire_error naming kind and field.
#include "messages/wire_codec.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <limits>
#include <string>
#include <unordered_map>

#include <capnp/message.h>
#include <capnp/orphan.h>
#include <capnp/serialize.h>
#include <kj/exception.h>

#include "engine/schedule_sim.hpp"
#include "messages/wire.capnp.h"

namespace troupe::messages::wire {

namespace s = schema;
static_assert(std::endian::native == std::endian::little, "the wire and its payloads are LE");

namespace {

constexpr std::array<std::string_view, 22> kind_names = {
    "link_message", "link_credit",     "batch_message",    "batch_credit",   "step_plan",
    "begin_step",   "begin_eval",      "grads_ready",      "apply_update",   "update_done",
    "eval_done",    "tied_grad",       "snapshot_request", "stage_snapshot", "trace_batch",
    "step_report",  "heartbeat",       "actor_down",       "error_report",   "job_shutdown",
    "ring_chunk",   "checkpoint_chunk"};
static_assert(kind_names.size() == std::variant_size_v<body>);
// The union's discriminants are the variant's indices.
static_assert(static_cast<int>(s::Envelope::Body::LINK_MESSAGE) == 0 &&
              static_cast<int>(s::Envelope::Body::STEP_PLAN) == 4 &&
              static_cast<int>(s::Envelope::Body::STAGE_SNAPSHOT) == 13 &&
              static_cast<int>(s::Envelope::Body::CHECKPOINT_CHUNK) == 21);

capnp::Text::Reader text(const std::string& str) { return {str.c_str(), str.size()}; }

// ---- encode ------------------------------------------------------------------------------------

// What a frame's iov points into: the builder, the referenced payloads' owners, the table.
struct frame_keeper {
  capnp::MallocMessageBuilder builder{256};
  std::vector<std::shared_ptr<const void>> owners;
  std::unordered_map<const void*, std::size_t> pieces;  // external segment start -> exact bytes
  std::vector<std::uint32_t> table;
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
    const std::size_t n = (bytes + piece_ - 1) / piece_;
    auto list = t.initPieces(static_cast<unsigned>(n));
    auto orphanage = k_.builder.getOrphanage();
    std::vector<capnp::Orphan<capnp::Data>> orphans;
    for (std::size_t off = 0; off < bytes; off += piece_) {
      const std::size_t len = std::min(piece_, bytes - off);
      const auto* at = reinterpret_cast<const kj::byte*>(base + off);
      orphans.push_back(orphanage.referenceExternalData(capnp::Data::Reader(at, len)));
      k_.pieces[at] = len;
    }
    for (unsigned i = 0; i < n; ++i) list.adopt(i, kj::mv(orphans[i]));
  }

  void header(s::LinkHeader::Builder b, const link_header& h) {
    b.setKind(static_cast<s::LinkKind>(h.kind));
    b.setStep(h.step);
    b.setRound(h.round);
    b.setMicroBatch(h.micro_batch);
    b.setStage(h.stage);
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
        list[i].setStage(src[i].stage);
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
    b.setStage(e.stage);
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
      w.tensor(o.initData(), m.data, "data");
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
      w.tensor(o.initData(), m.data, "data");
    }
    void operator()(const snapshot_request&) { b.initSnapshotRequest(); }
    void operator()(const stage_snapshot& m) {
      auto o = b.initStageSnapshot();
      o.setRank(m.rank);
      o.setReplica(m.replica);
      auto list = o.initParameters(static_cast<unsigned>(m.parameters.size()));
      for (unsigned i = 0; i < list.size(); ++i) {
        const auto& [name, values] = m.parameters[i];
        list[i].setName(text(name));
        // std::vector parameters cannot be shared with `keep`: one copy, then referenced.
        w.tensor(list[i].initData(),
                 std::make_shared<payload<float>>(values.data(), values.data() + values.size()),
                 "parameters");
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

// ---- decode ------------------------------------------------------------------------------------

class reader {
 public:
  reader(std::shared_ptr<void> owner, const limits& lim) : owner_(std::move(owner)), lim_(lim) {}

  std::string kind = "frame";
  std::string field;  // the field being read, for error messages

  [[noreturn]] void fail(std::string what) const {
    std::replace(what.begin(), what.end(), '\n', ' ');  // one line, whatever Cap'n Proto says
    throw wire_error("wire: " + kind + (field.empty() ? "" : "." + field) + ": " + what);
  }
  void list(std::size_t n) const {
    if (n > lim_.max_list_elements)
      fail("list of " + std::to_string(n) + " elements exceeds max_list_elements " +
           std::to_string(lim_.max_list_elements));
  }
  template <class E>
  E checked(E value, unsigned count) const {
    if (static_cast<unsigned>(value) >= count)
      fail("unknown enum value " + std::to_string(static_cast<unsigned>(value)));
    return value;
  }
  // Names the field that the next read belongs to: r.at("data").tensor<float>(...) sets it
  // before the arguments are read (C++17 sequencing).
  reader& at(const char* name) {
    field = name;
    return *this;
  }
  std::string str(bool has, capnp::Text::Reader t) const {
    return has ? std::string(t.cStr(), t.size()) : std::string();
  }

  // A view of the tensor's bytes in the frame: its pieces must be back to back.
  template <class T>
  std::shared_ptr<payload<T>> tensor(bool has, s::Tensor::Reader t) {
    if (!has) fail("missing payload");
    const std::uint64_t elements = t.getElements();
    if (elements > lim_.max_tensor_elements)
      fail(std::to_string(elements) + " elements exceed max_tensor_elements " +
           std::to_string(lim_.max_tensor_elements));
    const auto pieces = t.getPieces();
    list(pieces.size());
    const kj::byte* first = nullptr;
    const kj::byte* end = nullptr;
    for (unsigned i = 0; i < pieces.size(); ++i) {
      const auto piece = pieces[i];
      if (piece.size() == 0) continue;
      if (first == nullptr) {
        first = piece.begin();
      } else if (piece.begin() != end) {
        fail("piece " + std::to_string(i) + " does not follow the one before in the frame");
      }
      end = piece.end();
    }
    const auto bytes = static_cast<std::uint64_t>(end - first);
    if (bytes % sizeof(T) != 0 || bytes / sizeof(T) != elements)
      fail("holds " + std::to_string(bytes) + " bytes for " + std::to_string(elements) +
           " elements of " + std::to_string(sizeof(T)) + " bytes");
    if (reinterpret_cast<std::uintptr_t>(first) % alignof(T) != 0) fail("payload is unaligned");
    // The frame's memory is the caller's writable buffer; Cap'n Proto hands out const views.
    T* data = reinterpret_cast<T*>(const_cast<kj::byte*>(first));
    return std::make_shared<payload<T>>(owner_, data, static_cast<std::size_t>(elements));
  }

  link_header header(bool has, s::LinkHeader::Reader r) {
    if (!has) fail("missing");
    link_header h;
    h.kind = static_cast<link_kind>(checked(r.getKind(), 2));
    h.step = r.getStep();
    h.round = r.getRound();
    h.micro_batch = r.getMicroBatch();
    h.stage = r.getStage();
    h.replica = r.getReplica();
    h.eval = r.getEval();
    field = "header.shape";
    const auto shape = r.getShape();
    list(shape.size());
    h.shape.reserve(shape.size());
    for (const std::int64_t d : shape) h.shape.push_back(d);
    return h;
  }

  // The product of `dims` must be the payload's element count (each dim >= 0, no overflow).
  void shape_matches(const std::vector<std::int64_t>& dims, std::size_t elements) {
    std::uint64_t product = 1;
    for (const std::int64_t d : dims) {
      if (d < 0 || (d != 0 && product > lim_.max_tensor_elements / static_cast<std::uint64_t>(d)))
        fail("shape dimension " + std::to_string(d) + " is negative or too large");
      product *= static_cast<std::uint64_t>(d);
    }
    if (product != elements)
      fail("shape holds " + std::to_string(product) + " elements, the payload " +
           std::to_string(elements));
  }

  std::shared_ptr<const engine::pipeline_plan> plan(bool has, s::PipelinePlan::Reader r,
                                                    bool forward_only) {
    if (!has) fail("missing plan");
    auto p = std::make_shared<engine::pipeline_plan>();
    p->name = at("plan.name").str(r.hasName(), r.getName());
    field = "plan";
    p->shape = {r.getRanks(), r.getMicroBatches(), r.getVirtualStages()};
    p->split_backward = r.getSplitBackward();
    const auto& sh = p->shape;
    const auto size = std::int64_t{sh.ranks} * sh.virtual_stages * sh.micro_batches;
    if (sh.ranks < 1 || sh.micro_batches < 1 || sh.virtual_stages < 1 ||
        size > lim_.max_list_elements || size > std::numeric_limits<int>::max() / 3)
      fail("shape " + std::to_string(sh.ranks) + " ranks x " + std::to_string(sh.virtual_stages) +
           " virtual stages x " + std::to_string(sh.micro_batches) +
           " micro-batches is empty or over max_list_elements");
    field = "plan.actions";
    const auto ranks = r.getActions();
    if (ranks.size() != static_cast<unsigned>(sh.ranks))
      fail(std::to_string(ranks.size()) + " action lists for " + std::to_string(sh.ranks) +
           " ranks");
    for (const auto actions : ranks) {
      list(actions.size());
      auto& out = p->ranks.emplace_back();
      for (const auto a : actions)
        out.push_back({static_cast<engine::action_kind>(checked(a.getKind(), 3)), a.getStage(),
                       a.getMicroBatch()});
    }
    field = "plan";
    try {
      if (forward_only)
        engine::check_forward_plan(*p);  // an evaluation plan
      else
        engine::check_plan(*p);
    } catch (const std::invalid_argument& e) {
      fail(std::string(forward_only ? "" : "does not pass check_plan: ") + e.what());
    }
    return p;
  }

  static engine::memory_report memory(s::MemoryReport::Reader r) {
    engine::memory_report m;
    m.replica = r.getReplica();
    m.rank = r.getRank();
    m.parameters = r.getParameters();
    m.gradients = r.getGradients();
    m.optimizer = r.getOptimizer();
    m.buffers = r.getBuffers();
    m.pooled = r.getPooled();
    m.activations = r.getActivations();
    return m;
  }

  engine::trace::event event(s::TraceEvent::Reader r) {
    engine::trace::event e;
    e.kind = static_cast<engine::trace::event_kind>(at("events").checked(r.getKind(), 4));
    e.track = r.getTrack();
    e.category = at("events.category").str(r.hasCategory(), r.getCategory());
    e.name = at("events.name").str(r.hasName(), r.getName());
    e.ts_us = r.getTsUs();
    e.dur_us = r.getDurUs();
    e.flow_id = r.getFlowId();
    e.step = r.getStep();
    e.micro_batch = r.getMicroBatch();
    e.stage = r.getStage();
    e.bytes = r.getBytes();
    return e;
  }

  body message(s::Envelope::Body::Reader b);

 private:
  std::shared_ptr<void> owner_;
  const limits& lim_;
};

body reader::message(s::Envelope::Body::Reader b) {
  using B = s::Envelope::Body;
  switch (b.which()) {
    case B::LINK_MESSAGE: {
      const auto r = b.getLinkMessage();
      link_message m;
      m.header = at("header").header(r.hasHeader(), r.getHeader());
      m.data = at("data").tensor<float>(r.hasData(), r.getData());
      at("header.shape").shape_matches(m.header.shape, m.data->size());
      m.flow_id = r.getFlowId();
      return m;
    }
    case B::LINK_CREDIT: {
      const auto r = b.getLinkCredit();
      return link_credit{at("header").header(r.hasHeader(), r.getHeader())};
    }
    case B::BATCH_MESSAGE: {
      const auto r = b.getBatchMessage();
      batch_message m;
      m.part = static_cast<batch_part>(at("part").checked(r.getPart(), 2));
      m.step = r.getStep();
      m.round = r.getRound();
      m.micro_batch = r.getMicroBatch();
      m.replica = r.getReplica();
      m.eval = r.getEval();
      m.B = r.getB();
      m.T = r.getT();
      m.tokens = at("tokens").tensor<std::int32_t>(r.hasTokens(), r.getTokens());
      at("B x T").shape_matches({m.B, m.T}, m.tokens->size());
      m.flow_id = r.getFlowId();
      return m;
    }
    case B::BATCH_CREDIT: {
      const auto r = b.getBatchCredit();
      return batch_credit{static_cast<batch_part>(at("part").checked(r.getPart(), 2)),
                          r.getReplica()};
    }
    case B::STEP_PLAN: {
      const auto r = b.getStepPlan();
      return step_plan{r.getStep(), r.getRounds(), r.getEval(),
                       at("plan").plan(r.hasPlan(), r.getPlan(), r.getEval()), r.getLossScale()};
    }
    case B::BEGIN_STEP: {
      const auto r = b.getBeginStep();
      return begin_step{r.getStep(), r.getRounds(), r.getLossScale()};
    }
    case B::BEGIN_EVAL: {
      const auto r = b.getBeginEval();
      return begin_eval{r.getStep(), r.getBatches()};
    }
    case B::GRADS_READY: {
      const auto r = b.getGradsReady();
      return grads_ready{r.getStep(),          r.getRank(),    r.getReplica(),
                         r.getGradSquareSum(), r.getLossSum(), r.getLosses()};
    }
    case B::APPLY_UPDATE: {
      const auto r = b.getApplyUpdate();
      return apply_update{r.getStep(), r.getGradNorm(), r.getSkip(), r.getUnscale()};
    }
    case B::UPDATE_DONE: {
      const auto r = b.getUpdateDone();
      return update_done{r.getStep(), r.getRank(), r.getReplica(), r.getLr(),
                         memory(r.getMemory())};
    }
    case B::EVAL_DONE: {
      const auto r = b.getEvalDone();
      return eval_done{r.getStep(), r.getReplica(), r.getLossSum(), r.getLosses()};
    }
    case B::TIED_GRAD: {
      const auto r = b.getTiedGrad();
      return tied_grad{r.getStep(), r.getReplica(),
                       at("data").tensor<float>(r.hasData(), r.getData())};
    }
    case B::SNAPSHOT_REQUEST:
      return snapshot_request{};
    case B::STAGE_SNAPSHOT: {
      const auto r = b.getStageSnapshot();
      stage_snapshot m;
      m.rank = r.getRank();
      m.replica = r.getReplica();
      field = "parameters";
      const auto params = r.getParameters();
      list(params.size());
      for (const auto p : params) {
        auto name = at("parameters.name").str(p.hasName(), p.getName());
        const auto view = at("parameters.data").tensor<float>(p.hasData(), p.getData());
        m.parameters.emplace_back(std::move(name), std::vector<float>(view->begin(), view->end()));
      }
      return m;
    }
    case B::TRACE_BATCH: {
      field = "events";
      const auto events = b.getTraceBatch().getEvents();
      list(events.size());
      trace_batch m;
      m.events.reserve(events.size());
      for (const auto e : events) m.events.push_back(event(e));
      return m;
    }
    case B::STEP_REPORT: {
      const auto r = b.getStepReport();
      step_report m;
      auto& x = m.metrics;
      x.step = r.getStep();
      x.total_steps = r.getTotalSteps();
      x.loss = r.getLoss();
      if (r.getHasValLoss()) x.val_loss = r.getValLoss();
      x.lr = r.getLr();
      x.grad_norm = r.getGradNorm();
      x.tokens_per_s = r.getTokensPerS();
      x.step_ms = r.getStepMs();
      x.elapsed_s = r.getElapsedS();
      x.tokens = r.getTokens();
      x.flops_per_s = r.getFlopsPerS();
      list(r.getMemory().size());
      for (auto e : r.getMemory()) x.memory.push_back(memory(e));
      x.skipped = at("skipped").str(r.hasSkipped(), r.getSkipped());
      if (r.getHasLossScale()) x.loss_scale = r.getLossScale();
      return m;
    }
    case B::HEARTBEAT: {
      const auto r = b.getHeartbeat();
      return heartbeat{r.getRank(), r.getSequence()};
    }
    case B::ACTOR_DOWN: {
      const auto r = b.getActorDown();
      return actor_down{r.getActor(), at("reason").str(r.hasReason(), r.getReason())};
    }
    case B::ERROR_REPORT: {
      const auto r = b.getErrorReport();
      return error_report{r.getRank(), at("message").str(r.hasMessage(), r.getMessage())};
    }
    case B::JOB_SHUTDOWN: {
      const auto r = b.getJobShutdown();
      return job_shutdown{r.getOk(), at("message").str(r.hasMessage(), r.getMessage())};
    }
    case B::RING_CHUNK: {
      const auto r = b.getRingChunk();
      return ring_chunk{r.getStep(),
                        r.getRank(),
                        r.getBucket(),
                        r.getFromReplica(),
                        r.getPhase(),
                        r.getChunk(),
                        at("data").tensor<float>(r.hasData(), r.getData()),
                        r.getCollective()};
    }
    case B::CHECKPOINT_CHUNK: {
      const auto r = b.getCheckpointChunk();
      checkpoint_chunk m;
      m.step = r.getStep();
      m.file = at("file").str(r.hasFile(), r.getFile());
      m.offset = r.getOffset();
      m.xxhash = r.getXxhash();
      m.data = at("data").tensor<float>(r.hasData(), r.getData());
      return m;
    }
  }
  fail("unknown message kind " + std::to_string(static_cast<unsigned>(b.which())));
}

// A frame's segments, read from its table (which check_segment_table has checked against the
// frame's size). Like capnp::FlatArrayMessageReader, but without its heap array of the segments
// after the first: a frame with a payload always has them, and the receive path decodes every
// frame.
class frame_message final : public capnp::MessageReader {
 public:
  frame_message(const std::byte* data, capnp::ReaderOptions options)
      : capnp::MessageReader(options) {
    std::uint32_t word = 0;
    std::memcpy(&word, data, 4);
    count_ = std::size_t{word} + 1;
    if (count_ > inline_segments) more_.resize(count_ - inline_segments);
    const auto* at = reinterpret_cast<const capnp::word*>(data) + (count_ + 2) / 2;
    for (std::size_t i = 0; i < count_; ++i) {
      std::memcpy(&word, data + 4 * (i + 1), 4);
      slot(i) = kj::arrayPtr(at, word);
      at += word;
    }
  }
  kj::ArrayPtr<const capnp::word> getSegment(uint id) override {
    return id < count_ ? slot(id) : nullptr;
  }

 private:
  static constexpr std::size_t inline_segments = 8;
  kj::ArrayPtr<const capnp::word>& slot(std::size_t i) {
    return i < inline_segments ? inline_[i] : more_[i - inline_segments];
  }
  std::size_t count_ = 0;
  std::array<kj::ArrayPtr<const capnp::word>, inline_segments> inline_{};
  std::vector<kj::ArrayPtr<const capnp::word>> more_;
};

// The segment table against `bytes`, before Cap'n Proto sees the frame.
void check_segment_table(const std::byte* data, std::size_t bytes) {
  const auto truncated = [bytes](std::uint64_t needed, const char* what) {
    throw wire_error("wire: frame: truncated: " + std::string(what) + " needs " +
                     std::to_string(needed) + " bytes, the frame holds " + std::to_string(bytes));
  };
  if (bytes < 8) truncated(8, "the segment table");
  std::uint32_t word = 0;
  std::memcpy(&word, data, 4);
  const std::uint64_t count = std::uint64_t{word} + 1;
  const std::uint64_t table = (count + 2) / 2 * 8;  // count + 1 entries, padded to a word
  if (table > bytes) truncated(table, "the segment table");
  std::uint64_t total = table;
  for (std::uint64_t i = 0; i < count; ++i) {
    std::memcpy(&word, data + 4 * (i + 1), 4);
    total += std::uint64_t{word} * 8;
  }
  if (total > bytes) truncated(total, "the segments");
  if (total < bytes)
    throw wire_error("wire: frame: " + std::to_string(bytes - total) +
                     " bytes after the last segment");
}

}  // namespace

std::string_view kind_name(const body& b) {
  return b.valueless_by_exception() ? "valueless" : kind_names[b.index()];
}

namespace {
constexpr std::size_t payload_alignment = 64;
constexpr std::array<std::uint64_t, payload_alignment / 8> padding{};
}  // namespace

frame encode(const envelope& e) { return detail::encode(e, detail::max_piece_bytes); }

frame detail::encode(const envelope& e, std::size_t piece_bytes) {
  if (piece_bytes == 0 || piece_bytes % 8 != 0 || piece_bytes > max_piece_bytes)
    throw wire_error("wire: piece size " + std::to_string(piece_bytes) +
                     " is not a positive multiple of 8 up to " + std::to_string(max_piece_bytes));
  auto k = std::make_shared<frame_keeper>();
  try {
    auto root = k->builder.initRoot<s::Envelope>();
    root.setSchema(s::ENVELOPE_SCHEMA);
    root.setVersion(protocol_version);
    root.setTarget(e.target);
    root.setSourceRank(e.source_rank);
    root.setCorrelation(e.correlation);
    root.setReply(e.reply);
    writer(*k, piece_bytes, kind_name(e.message)).body(root.getBody(), e.message);
  } catch (const kj::Exception& x) {
    std::string what = x.getDescription().cStr();
    std::replace(what.begin(), what.end(), '\n', ' ');
    throw wire_error("wire: " + std::string(kind_name(e.message)) + ": cannot encode: " + what);
  }
  const auto segments = k->builder.getSegmentsForOutput();
  k->table.assign((segments.size() + 2) / 2 * 2, 0);
  k->table[0] = static_cast<std::uint32_t>(segments.size() - 1);
  frame f;
  f.iov.emplace_back(k->table.data(), k->table.size() * 4);
  std::size_t offset = k->table.size() * 4;  // of the next segment in the frame
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const auto seg = segments[i];
    k->table[i + 1] = static_cast<std::uint32_t>(seg.size());
    const auto piece = k->pieces.find(seg.begin());
    if (piece == k->pieces.end()) {
      f.iov.emplace_back(seg.begin(), seg.size() * 8);
      offset += seg.size() * 8;
      // Zero words after the segment before a payload, so that the payload starts at a multiple
      // of 64 bytes in the frame (unread space at a segment's end is legal Cap'n Proto): in a
      // 64-byte aligned receive buffer the tensor a receiver reads in place is then as aligned
      // as the sender's (cache lines, vector loads), at a cost of at most 56 bytes a frame.
      const bool before_payload =
          i + 1 < segments.size() && k->pieces.count(segments[i + 1].begin()) > 0;
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

envelope decode(std::shared_ptr<aligned_buffer> buf, std::size_t bytes, const limits& lim) {
  if (!buf) throw wire_error("wire: frame: no receive buffer");
  if (bytes > buf->size())
    throw wire_error("wire: frame: " + std::to_string(bytes) + " bytes in a buffer of " +
                     std::to_string(buf->size()));
  std::byte* data = buf->data();
  return detail::decode(std::move(buf), data, bytes, lim);
}

envelope detail::decode(std::shared_ptr<void> owner, std::byte* data, std::size_t bytes,
                        const limits& lim) {
  if (bytes > lim.max_frame_bytes)
    throw wire_error("wire: frame: " + std::to_string(bytes) + " bytes exceed max_frame_bytes " +
                     std::to_string(lim.max_frame_bytes));
  if (reinterpret_cast<std::uintptr_t>(data) % 8 != 0)
    throw wire_error("wire: frame: unaligned buffer (address % 8 = " +
                     std::to_string(reinterpret_cast<std::uintptr_t>(data) % 8) +
                     "; Cap'n Proto needs 8-byte alignment)");
  check_segment_table(data, bytes);
  capnp::ReaderOptions options;
  options.traversalLimitInWords = lim.max_frame_bytes / 8 + 1;
  options.nestingLimit = static_cast<int>(std::min<std::uint32_t>(lim.max_nesting, 1 << 20));
  reader rd(std::move(owner), lim);
  try {
    frame_message message(data, options);
    const auto root = message.getRoot<s::Envelope>();
    if (root.getSchema() != s::ENVELOPE_SCHEMA)
      rd.fail("schema id " + std::to_string(root.getSchema()) + " is not the wire schema " +
              std::to_string(s::ENVELOPE_SCHEMA));
    const auto body = root.getBody();
    const auto which = static_cast<unsigned>(body.which());
    if (which < kind_names.size()) rd.kind = kind_names[which];
    if (root.getVersion() != protocol_version)
      rd.fail("protocol version " + std::to_string(root.getVersion()) +
              ", this process speaks version " + std::to_string(protocol_version));
    envelope e;
    e.target = root.getTarget();
    e.source_rank = root.getSourceRank();
    e.correlation = root.getCorrelation();
    e.reply = root.getReply();
    e.message = rd.message(body);
    return e;
  } catch (const kj::Exception& x) {
    rd.fail(std::string("malformed frame: ") + x.getDescription().cStr());
  }
}

}  // namespace troupe::messages::wire
