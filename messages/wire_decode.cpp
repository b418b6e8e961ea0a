// The wire codec's receive side (wire_codec.hpp): one Cap'n Proto frame -> envelope, its payloads
// viewed in place in the receive buffer. The segment table and every size the peer sends are
// checked against the caller's limits before they are used, and every Cap'n Proto exception
// becomes a wire_error naming kind and field. Encoding: wire_codec.cpp.
#include <algorithm>
#include <array>
#include <cstring>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <capnp/message.h>
#include <kj/exception.h>

#include "engine/parallel/schedule_sim.hpp"
#include "messages/wire.capnp.h"
#include "messages/wire_codec.hpp"

namespace troupe::messages::wire {

namespace s = schema;

namespace {

class reader {
 public:
  reader(std::shared_ptr<void> owner, const limits& lim) : owner_(std::move(owner)), lim_(lim) {}

  // Static names (literals, the kind table): naming them costs nothing until a read fails.
  std::string_view kind = "frame";
  std::string_view field;  // the field being read, for error messages

  [[noreturn]] void fail(std::string what) const {
    std::replace(what.begin(), what.end(), '\n', ' ');  // one line, whatever Cap'n Proto says
    std::string where = "wire: ";
    where += kind;
    if (!field.empty()) (where += '.') += field;
    throw wire_error(where + ": " + what);
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

  // Fills h (the caller's, so that an activation's header is built where it stays).
  void header(link_header& h, bool has, s::LinkHeader::Reader r) {
    if (!has) fail("missing");
    h.kind = static_cast<link_kind>(checked(r.getKind(), 2));
    h.step = r.getStep();
    h.round = r.getRound();
    h.micro_batch = r.getMicroBatch();
    h.virtual_stage = r.getVirtualStage();
    h.replica = r.getReplica();
    h.eval = r.getEval();
    field = "header.shape";
    const auto shape = r.getShape();
    list(shape.size());
    h.shape.reserve(shape.size());
    for (const std::int64_t d : shape) h.shape.push_back(d);
  }

  // The product of `dims` must be the payload's element count (each dim >= 0, no overflow).
  // The elements a shape holds, within the limit on a tensor's.
  std::uint64_t shape_elements(const std::vector<std::int64_t>& dims) {
    std::uint64_t product = 1;
    for (const std::int64_t d : dims) {
      if (d < 0 || (d != 0 && product > lim_.max_tensor_elements / static_cast<std::uint64_t>(d)))
        fail("shape dimension " + std::to_string(d) + " is negative or too large");
      product *= static_cast<std::uint64_t>(d);
    }
    return product;
  }
  void shape_matches(const std::vector<std::int64_t>& dims, std::size_t elements) {
    const std::uint64_t product = shape_elements(dims);
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
        out.push_back({static_cast<engine::action_kind>(checked(a.getKind(), 3)),
                       a.getVirtualStage(), a.getMicroBatch()});
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
    e.virtual_stage = r.getVirtualStage();
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
    case B::LINK_MESSAGE: {  // every activation and gradient: built in the returned body
      const auto r = b.getLinkMessage();
      body out(std::in_place_type<link_message>);
      auto& m = std::get<link_message>(out);
      at("header").header(m.header, r.hasHeader(), r.getHeader());
      if (r.hasData()) {  // else header-only: the payload comes by a device link, [B, T, C]
        m.data = at("data").tensor<float>(true, r.getData());
        at("header.shape").shape_matches(m.header.shape, m.data->size());
      } else {
        at("header.shape").shape_elements(m.header.shape);
        if (m.header.shape.size() != 3 ||
            m.header.shape[0] > std::numeric_limits<std::int32_t>::max() ||
            m.header.shape[1] > std::numeric_limits<std::int32_t>::max())
          at("header.shape").fail("a header-only message needs [B, T, C] within int range");
      }
      m.flow_id = r.getFlowId();
      return out;
    }
    case B::LINK_CREDIT: {
      const auto r = b.getLinkCredit();
      body out(std::in_place_type<link_credit>);
      at("header").header(std::get<link_credit>(out).header, r.hasHeader(), r.getHeader());
      return out;
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
      // Without data, the header alone: the copy comes by a device link (the stage checks that
      // it has one).
      return tied_grad{r.getStep(), r.getReplica(),
                       r.hasData() ? at("data").tensor<float>(true, r.getData()) : nullptr};
    }
    case B::SNAPSHOT_REQUEST: {
      const auto r = b.getSnapshotRequest();
      return snapshot_request{r.getStep(), r.getState(), r.getCapture(),
                              at("partDir").str(r.hasPartDir(), r.getPartDir())};
    }
    case B::STAGE_SNAPSHOT: {
      const auto r = b.getStageSnapshot();
      stage_snapshot m;
      m.rank = r.getRank();
      m.replica = r.getReplica();
      m.part = {at("part").str(r.hasPart(), r.getPart()), r.getPartBytes(), r.getPartXxh64()};
      field = "parameters";
      const auto params = r.getParameters();
      list(params.size());
      for (const auto p : params) {
        auto name = at("parameters.name").str(p.hasName(), p.getName());
        const auto view = at("parameters.data").tensor<float>(p.hasData(), p.getData());
        m.parameters.emplace_back(std::move(name), std::vector<float>(view->begin(), view->end()));
      }
      field = "pieces";
      const auto pieces = r.getPieces();
      list(pieces.size());
      for (const auto p : pieces) {
        tensor_piece piece;
        const int role = p.getRole();
        field = "pieces.role";
        if (role < 0 || role > static_cast<int>(tensor_role::exp_avg_sq))
          fail("unknown tensor role " + std::to_string(role));
        piece.role = static_cast<tensor_role>(role);
        piece.name = at("pieces.name").str(p.hasName(), p.getName());
        piece.offset = p.getOffset();
        field = "pieces.offset";
        if (piece.offset < 0) fail("negative offset " + std::to_string(piece.offset));
        const auto view = at("pieces.data").tensor<float>(p.hasData(), p.getData());
        piece.values.assign(view->begin(), view->end());
        m.pieces.push_back(std::move(piece));
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
    case B::TENSOR_EXCHANGE: {
      const auto r = b.getTensorExchange();
      tensor_exchange m;
      m.seq = r.getSeq();
      m.from = r.getFrom();
      const int op = r.getOp();
      field = "op";
      if (op < 0 || op > static_cast<int>(tensor_exchange::op::abort))
        fail("unknown collective " + std::to_string(op));
      m.kind = static_cast<tensor_exchange::op>(op);
      m.data = at("data").tensor<float>(r.hasData(), r.getData());
      field = "data";
      if (m.kind == tensor_exchange::op::sum_f64 && m.data->size() % 2 != 0)
        fail("a double sum of " + std::to_string(m.data->size()) + " floats (an odd count)");
      m.reason = at("reason").str(r.hasReason(), r.getReason());
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
    if (const auto name = detail::kind_name_at(which); !name.empty()) rd.kind = name;
    if (root.getVersion() != protocol_version)
      rd.fail("protocol version " + std::to_string(root.getVersion()) +
              ", this process speaks version " + std::to_string(protocol_version));
    // Built in place: the message is constructed in the returned envelope, never moved.
    return envelope{root.getTarget(), root.getSourceRank(), root.getCorrelation(), root.getReply(),
                    rd.message(body)};
  } catch (const kj::Exception& x) {
    rd.fail(std::string("malformed frame: ") + x.getDescription().cStr());
  }
}

}  // namespace troupe::messages::wire
