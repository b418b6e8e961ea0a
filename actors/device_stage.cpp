// The device pipeline stage actor. See device_stage.hpp and docs/gpu.md for the protocol.
//
// Invariants (as the CPU stage's S1-S4, plus):
//  D1. A payload goes into its link right before its header message leaves, on the same
//      thread, so each link carries payloads in the order its receiver gets the headers; the
//      receiver posts the matching receive when the header arrives, in that order.
//  D2. A micro-batch occupies a slot of its chunk from its forward (or its activation's
//      arrival) to the end of its backward (of its forward, evaluating), and as long as a
//      payload read from the slot waits for its credit. A gradient leaves from input(slot):
//      the chunk writes the input's gradient there, as nothing reads the input afterwards.
//  D3. Every link call is ordered on the chunk's stream both ways: the link starts after the
//      chunk's work so far (record_event) and the chunk's later work waits for the link's.
//  D4. Data parallelism: in a step's last backward of a chunk, each gradient bucket goes to the
//      rank's reducer with an event recorded right after its last block was enqueued; the
//      reducer enqueues the mean over the replicas after every replica's event, and the chunk's
//      work after grad_bucket_reduced waits for the mean's event. The tied wte copies are summed,
//      and grads_ready sent, only after every bucket is reduced.
//  D5. The tied wte: a rank with one copy sends it through its tied link to the partner rank
//      right before the tied_grad header (no data) leaves; the partner receives it into its
//      chunk's gradient scratch when the header arrives and adds it to its own copy once its own
//      copy has left. The scratch is free again by then: the next step's copy comes after this
//      step's update.
#include "actors/device_stage.hpp"

#include <algorithm>
#include <functional>
#include <stdexcept>

#include "actors/error_text.hpp"
#include "actors/stage_links.hpp"
#include "engine/gpt_weights.hpp"
#include "topology/grad_buckets.hpp"

namespace troupe::actors {
namespace {

using namespace messages;
using engine::trace::event_kind;
using topology::link_key;

struct micro_key {
  bool eval = false;
  int step = 0, round = 0, micro_batch = 0;
  friend auto operator<=>(const micro_key&, const micro_key&) = default;
};

micro_key micro_of(const link_header& h) { return {h.eval, h.step, h.round, h.micro_batch}; }

// The slots of one chunk (D2): a slot is free when nothing holds it. When none is free the
// chunk adds one (`grow`), so a chunk holds what the schedule and its early arrivals need.
class slot_table {
 public:
  explicit slot_table(int slots) : holds_(static_cast<std::size_t>(slots), 0) {}
  int take(const micro_key& k, const std::string& who, const std::function<int()>& grow) {
    auto it = std::find(holds_.begin(), holds_.end(), 0);
    if (it == holds_.end()) {
      const int now = grow();
      if (now != static_cast<int>(holds_.size()) + 1)
        throw std::logic_error(who + ": a chunk grew to " + std::to_string(now) + " slots from " +
                               std::to_string(holds_.size()));
      holds_.push_back(0);
      it = holds_.end() - 1;
    }
    *it = 1;
    const int s = static_cast<int>(it - holds_.begin());
    if (!of_.emplace(k, s).second) throw std::logic_error(who + ": a micro-batch started twice");
    return s;
  }
  int find(const micro_key& k, const std::string& who) const {
    const auto it = of_.find(k);
    if (it == of_.end()) throw std::logic_error(who + ": a micro-batch without a slot");
    return it->second;
  }
  void hold(int s) { ++holds_.at(static_cast<std::size_t>(s)); }
  void drop(int s) {
    if (--holds_.at(static_cast<std::size_t>(s)) > 0) return;
    std::erase_if(of_, [s](const auto& e) { return e.second == s; });
  }

 private:
  std::vector<int> holds_;
  std::map<micro_key, int> of_;
};

class device_stage_impl : public stage_actor::base {
 public:
  device_stage_impl(caf::actor_config& cfg, device_stage_config config)
      : stage_actor::base(cfg), cfg_(std::move(config)), sc_(cfg_.stage) {}

  // Handles to peers form cycles: drop them on exit so that every actor can be destroyed.
  void on_exit() override {
    // A tensor shard that stops must not leave its peers waiting in a collective.
    if (cfg_.tp_member) cfg_.tp_member->abort(who() + " stopped");
    wiring_ = {};
    held_.clear();
    stash_links_.clear();
    stash_batches_.clear();
  }

  behavior_type make_behavior() override {
    set_exception_handler(
        [this](std::exception_ptr& e) -> caf::error { return exit_reason(who(), e); });
    init_chunks();
    auto unused = [this](const char* what) {
      throw std::logic_error(std::string("a device stage got ") + what + " (not built on devices)");
    };
    return {
        [this](stage_wiring& w) { wiring_ = std::move(w); },
        [this](step_plan& p) { start_plan(std::move(p)); },
        [this](link_message& m) { on_link(m); },
        [this](link_credit& c) { on_credit(c); },
        [this](batch_message& b) { on_batch(std::move(b)); },
        [this](grad_bucket_reduced& r) { on_reduced(r); },
        [this](tied_grad& t) { on_tied(t); },
        [this](apply_update& u) { on_update(u); },
        [unused](zero_update_done&) { unused("a ZeRO update"); },
        [unused](zero_gathered&) { unused("a ZeRO gather"); },
        [this](stage_continue) { advance(); },
        [this](snapshot_request) -> stage_snapshot { return snapshot(); },
    };
  }

 private:
  std::string who() const {
    return "device stage rank " + std::to_string(sc_.rank) + " replica " +
           std::to_string(sc_.replica) + (sc_.tp > 1 ? " tp " + std::to_string(sc_.tp_rank) : "");
  }
  // This shard's place among all stage actors of a rank, as the coordinator counts them.
  int lane() const { return sc_.replica * sc_.tp + sc_.tp_rank; }
  int last_stage() const { return sc_.layout.stage_count() - 1; }

  void init_chunks() {
    std::vector<std::vector<engine::grad_block>> blocks;
    for (const auto& range : sc_.layout.rank_chunks(sc_.rank)) {
      engine::gpt_stage host(sc_.model, range, {sc_.tp_rank, sc_.tp});
      if (sc_.init.empty()) {
        host.init_gpt2(sc_.seed);
      } else {
        engine::load_hf_weights(host, sc_.init);
      }
      const int c = static_cast<int>(chunks_.size());
      chunks_.push_back(cfg_.chunks->make_chunk(host, cfg_.B, cfg_.T, cfg_.slots, sc_.rank, lane(),
                                                cfg_.tp_member));
      slots_.emplace_back(cfg_.slots);
      blocks.push_back(engine::stage_grad_blocks(host));
      if (range.embedding) embedding_chunk_ = c;
      if (range.head) head_chunk_ = c;
    }
    std::vector<float*> grads;
    for (auto& ch : chunks_) grads.push_back(ch->device_gradients());
    buckets_.build(blocks, grads, sc_.bucket_layers);
    // The tied wte copies this rank syncs: none (one chunk holds both ends, or no end), one
    // (exchanged with the partner rank) or two (summed here), as the CPU stage does.
    if (embedding_chunk_ == head_chunk_) return;
    for (int c : {embedding_chunk_, head_chunk_}) {
      if (c < 0) continue;
      for (const auto& p : chunk(c).layout()) {
        if (p.name != "transformer.wte.weight") continue;
        tied_.push_back({c, p.offset});
        tied_numel_ = p.numel;
      }
    }
  }

  engine::device_chunk& chunk(int c) { return *chunks_.at(static_cast<std::size_t>(c)); }
  engine::chunk_link& link(std::map<int, std::shared_ptr<engine::chunk_link>>& links, int peer,
                           const char* what) {
    const auto it = links.find(peer);
    if (it == links.end() || !it->second)
      throw std::logic_error(who() + ": no " + what + " link with rank " + std::to_string(peer));
    return *it->second;
  }

  // ---- plan (S1) --------------------------------------------------------------------------
  void start_plan(step_plan p) {
    if (p.plan->split_backward)
      throw std::runtime_error("schedule " + p.plan->name +
                               " splits backward (input, then weight gradients): not built for "
                               "device stages yet");
    plan_ = std::move(p);
    actions_ = &plan_.plan->ranks.at(static_cast<std::size_t>(sc_.rank));
    cursor_ = 0;
    active_ = true;
    compute_done_ = grads_sent_ = false;
    loss_sum_ = 0;
    losses_ = 0;
    waiting_since_ = -1;
    if (!plan_.eval) {
      tied_started_ = false;
      tied_done_ = tied_.empty();
      buckets_.start_step();
      buckets_pending_ = sc_.replicas > 1 ? buckets_.size() : 0;
      last_weight_ =
          last_weight_actions(sc_.layout, *actions_, false, static_cast<int>(chunks_.size()));
    }
    std::vector<link_key> order;
    for (int round = 0; round < plan_.rounds; ++round) {
      for (const auto& a : *actions_) {
        if (auto k = incoming_key(sc_.layout, sc_.rank, plan_, a, round)) order.push_back(*k);
      }
    }
    for (const auto& k : incoming_.start(order, sc_.link_credits)) grant(k);
    advance();
  }

  void grant(const link_key& k) {
    caf::anon_send(wiring_.ranks.at(static_cast<std::size_t>(sender_of(sc_.layout, k))),
                   credit_for(k, sc_.replica));
  }

  // ---- the action loop (S1, S3) -----------------------------------------------------------
  void advance() {
    if (!active_) return;
    const int per_round = static_cast<int>(actions_->size());
    if (cursor_ >= per_round * plan_.rounds) {
      active_ = false;
      finish_compute();
      return;
    }
    const int round = cursor_ / per_round;
    const auto& a = (*actions_)[static_cast<std::size_t>(cursor_ % per_round)];
    if (!ready(a, round)) {
      if (waiting_since_ < 0) waiting_since_ = sc_.trace.now_us();
      return;
    }
    const engine::trace::recorder::ids ids{plan_.step, a.micro_batch, a.stage};
    if (waiting_since_ >= 0) {
      sc_.trace.span("wait", "input", waiting_since_, sc_.trace.now_us(), ids);
      waiting_since_ = -1;
    }
    const double t0 = sc_.trace.now_us();
    std::uint64_t flow = 0;
    if (a.kind == engine::action_kind::forward) {
      flow = forward(a, round);
    } else {
      flow = backward(a, round, cursor_ % per_round);
    }
    sc_.trace.span(plan_.eval ? "eval" : "compute",
                   a.kind == engine::action_kind::forward ? "F" : "B", t0, sc_.trace.now_us(), ids);
    if (flow) sc_.trace.flow(event_kind::flow_in, flow, t0, ids);
    ++cursor_;
    send(this, stage_continue{});
  }

  link_key make_key(link_kind kind, int stage, int round, int mb) const {
    return plan_link_key(plan_, kind, stage, round, mb);
  }
  micro_key make_micro(int round, int mb) const { return {plan_.eval, plan_.step, round, mb}; }
  bool ready(const engine::pipeline_action& a, int round) const {
    return action_ready(plan_, last_stage(), a, round, stash_links_, stash_batches_);
  }

  std::uint64_t forward(const engine::pipeline_action& a, int round) {
    const int c = sc_.layout.chunk_of(a.stage);
    auto& ch = chunk(c);
    int slot = -1;
    std::uint64_t flow = 0;
    batch_message inputs, targets;
    if (a.stage == 0) {
      inputs = take_batch(batch_part::inputs, round, a.micro_batch);
      check_shape(inputs);
      slot = take_slot(c, make_micro(round, a.micro_batch));
      flow = inputs.flow_id;
    } else {
      const auto s = take_link(link_kind::activation, a.stage, round, a.micro_batch);
      slot = s.slot;
      flow = s.flow;
    }
    float loss_scale = 1;
    bool counted = true;
    if (a.stage == last_stage()) {
      targets = take_batch(batch_part::targets, round, a.micro_batch);
      check_shape(targets);
      counted = !plan_.eval || std::any_of(targets.tokens->begin(), targets.tokens->end(),
                                           [](int y) { return y != engine::ignore_index; });
      // The mean over the step's micro-batches, times the step's loss scale (as the CPU stage).
      loss_scale = static_cast<float>(plan_.loss_scale) /
                   static_cast<float>(plan_.rounds * plan_.plan->shape.micro_batches);
    }
    const double loss =
        ch.forward(slot, inputs.tokens ? inputs.tokens->data() : nullptr,
                   targets.tokens ? targets.tokens->data() : nullptr, loss_scale, !plan_.eval);
    if (a.stage == last_stage()) {
      if (counted) {
        loss_sum_ += loss;
        ++losses_;
      }
    } else {
      route(link_kind::activation, a.stage + 1, round, a.micro_batch, c, slot, ch.output(slot));
    }
    if (plan_.eval) slots_[static_cast<std::size_t>(c)].drop(slot);
    return flow;
  }

  std::uint64_t backward(const engine::pipeline_action& a, int round, int index) {
    const int c = sc_.layout.chunk_of(a.stage);
    auto& ch = chunk(c);
    auto& table = slots_[static_cast<std::size_t>(c)];
    std::uint64_t flow = 0;
    int slot = -1;
    if (a.stage != last_stage()) {
      const auto s = take_link(link_kind::gradient, a.stage, round, a.micro_batch);
      slot = s.slot;
      flow = s.flow;
    } else {
      slot = table.find(make_micro(round, a.micro_batch), who());
    }
    void* dinput = a.stage > 0 ? ch.input(slot) : nullptr;  // D2
    engine::grad_block_fn on_block;                         // D4
    if (sc_.replicas > 1 && !plan_.eval && round == plan_.rounds - 1 &&
        index == last_weight_[static_cast<std::size_t>(c)])
      on_block = [this, c](int block) { on_block_final(c, block); };
    ch.backward(slot, dinput, on_block);
    if (dinput) route(link_kind::gradient, a.stage - 1, round, a.micro_batch, c, slot, dinput);
    table.drop(slot);
    return flow;
  }

  int take_slot(int c, const micro_key& k) {
    return slots_[static_cast<std::size_t>(c)].take(k, who(), [this, c] {
      const double t0 = sc_.trace.now_us();
      const int n = chunk(c).add_slot();
      sc_.trace.span("alloc", "slot " + std::to_string(n) + " of chunk " + std::to_string(c), t0,
                     sc_.trace.now_us(), {plan_.step});
      return n;
    });
  }

  void check_shape(const batch_message& b) const {
    if (b.B != cfg_.B || b.T != cfg_.T)
      throw std::runtime_error("a micro-batch of " + std::to_string(b.B) + " x " +
                               std::to_string(b.T) + " tokens; the device chunks hold " +
                               std::to_string(cfg_.B) + " x " + std::to_string(cfg_.T));
  }

  batch_message take_batch(batch_part part, int round, int mb) {
    auto it = stash_batches_.find(plan_batch_key(plan_, part, round, mb));
    batch_message b = std::move(it->second);
    stash_batches_.erase(it);
    if (!b.eval) caf::anon_send(wiring_.loader, batch_credit{part, sc_.replica});
    return b;
  }

  struct stashed {  // an arrived payload: in slot `slot` of its chunk
    int slot = -1;
    std::uint64_t flow = 0;
  };

  stashed take_link(link_kind kind, int stage, int round, int mb) {
    const auto key = make_key(kind, stage, round, mb);
    auto it = stash_links_.find(key);
    const stashed s = it->second;
    stash_links_.erase(it);
    if (auto next = incoming_.consumed(key)) grant(*next);
    return s;
  }

  // ---- links (S2, D1, D3) ---------------------------------------------------------------
  struct outgoing {
    link_header header;
    int chunk = 0, slot = 0;
    const void* data = nullptr;
    std::uint64_t flow = 0;
  };

  void route(link_kind kind, int stage, int round, int mb, int c, int slot, const void* data) {
    outgoing o;
    o.header = {kind,  plan_.step,  round,      mb,
                stage, sc_.replica, plan_.eval, {cfg_.B, cfg_.T, sc_.model.width}};
    o.chunk = c;
    o.slot = slot;
    o.data = data;
    const int to = sc_.layout.rank_of(stage);
    if (to == sc_.rank) {  // the next chunk is on this rank: through the rank's own link
      put(o, to);
      arrive(o.header, 0, to);
      return;
    }
    o.flow = engine::trace::flow_id(static_cast<int>(kind), plan_.step, round, mb, stage,
                                    sc_.replica, plan_.eval);
    const auto key = key_of(o.header);
    if (outgoing_.produced(key)) {
      transmit(o);
    } else {
      slots_[static_cast<std::size_t>(c)].hold(slot);  // D2: until the credit comes
      held_.emplace(key, o);
    }
  }

  // The payload into the link to `to`, ordered after the chunk's work (D3).
  void put(const outgoing& o, int to) {
    auto& ch = chunk(o.chunk);
    void* sent =
        link(cfg_.send_links, to, "send").send(o.data, ch.activation_bytes(), ch.record_event());
    ch.wait_event(sent);
  }

  void transmit(const outgoing& o) {
    const double t0 = sc_.trace.now_us();
    const int to = sc_.layout.rank_of(o.header.stage);
    put(o, to);  // D1: the payload, then its header
    const auto bytes = static_cast<std::int64_t>(chunk(o.chunk).activation_bytes());
    caf::anon_send(wiring_.ranks.at(static_cast<std::size_t>(to)),
                   link_message{o.header, nullptr, o.flow});
    const engine::trace::recorder::ids ids{o.header.step, o.header.micro_batch, o.header.stage,
                                           bytes};
    sc_.trace.span("send", o.header.kind == link_kind::activation ? "activation" : "gradient", t0,
                   sc_.trace.now_us(), ids);
    sc_.trace.flow(event_kind::flow_out, o.flow, t0, ids);
  }

  void on_credit(const link_credit& c) {
    const auto key = key_of(c.header);
    if (!outgoing_.granted(key)) return;
    auto it = held_.find(key);
    const outgoing o = it->second;
    held_.erase(it);
    transmit(o);
    slots_[static_cast<std::size_t>(o.chunk)].drop(o.slot);
  }

  void on_link(const link_message& m) {
    if (m.data)
      throw std::logic_error(who() +
                             ": a link message with host data (device stages move "
                             "payloads through links)");
    arrive(m.header, m.flow_id, sender_of(sc_.layout, key_of(m.header)));
    advance_if_waiting();
  }

  // A header arrived (or a payload went to the next chunk of this rank): receive its payload
  // into its slot, in arrival order (D1), ordered against the chunk's work (D3).
  void arrive(const link_header& h, std::uint64_t flow, int from) {
    const double t0 = sc_.trace.now_us();
    const int c = sc_.layout.chunk_of(h.stage);
    auto& ch = chunk(c);
    auto& table = slots_[static_cast<std::size_t>(c)];
    const bool activation = h.kind == link_kind::activation;
    const int slot = activation ? take_slot(c, micro_of(h)) : table.find(micro_of(h), who());
    void* into = activation ? ch.input(slot) : ch.output_gradient(slot);
    void* received = link(cfg_.receive_links, from, "receive")
                         .receive(into, ch.activation_bytes(), ch.record_event());
    ch.wait_event(received);
    if (!stash_links_.emplace(key_of(h), stashed{slot, flow}).second)
      throw std::runtime_error(std::string("duplicate ") +
                               (activation ? "activation" : "gradient") + " message");
    if (from != sc_.rank)
      sc_.trace.span(
          "recv", activation ? "activation" : "gradient", t0, sc_.trace.now_us(),
          {h.step, h.micro_batch, h.stage, static_cast<std::int64_t>(ch.activation_bytes())});
  }

  void on_batch(batch_message b) {
    stash_batches_.emplace(key_of(b), std::move(b));
    advance_if_waiting();
  }

  void advance_if_waiting() {
    if (active_ && waiting_since_ >= 0) advance();
  }

  // ---- gradients: data-parallel buckets, the tied wte, grads_ready (S4, D4) -----------------
  // A bucket's last block is enqueued: its mean over the replicas can start once the event
  // recorded now has passed, while backward continues on earlier blocks.
  void on_block_final(int c, int block) {
    const auto b = buckets_.block_done(c, block);
    if (!b) return;
    const double t = sc_.trace.now_us();
    const auto& info = buckets_.bucket(*b);
    caf::anon_send(wiring_.reducer, grad_bucket{plan_.step, sc_.rank, sc_.replica, *b, info.ranges,
                                                chunk(info.chunk).record_event()});
    sc_.trace.span("send", "bucket " + info.name, t, sc_.trace.now_us(), {plan_.step});
  }

  // The bucket holds the mean once `done` has passed: the chunk's later work waits for it.
  void on_reduced(const grad_bucket_reduced& r) {
    if (buckets_pending_ <= 0)
      throw std::logic_error(who() + ": a reduced bucket nobody waits for");
    chunk(buckets_.bucket(r.bucket).chunk).wait_event(r.done);
    --buckets_pending_;
    start_tied();
    check_grads_ready();
  }

  void finish_compute() {
    if (plan_.eval) {
      if (head_chunk_ >= 0)
        caf::anon_send(wiring_.coordinator, eval_done{plan_.step, lane(), loss_sum_, losses_});
      flush_trace();
      return;
    }
    compute_done_ = true;
    dp_wait_since_ = sc_.trace.now_us();
    start_tied();
    check_grads_ready();
  }

  // The tied wte copies are summed on the devices once every bucket holds its mean over the
  // replicas (as the CPU stage: the mean first, then own + other; the same float sums on both
  // sides, as addition commutes).
  void start_tied() {
    if (!compute_done_ || buckets_pending_ > 0 || tied_started_) return;
    tied_started_ = true;
    if (tied_.size() == 2) {  // both copies here: a = a + h, then h = a
      auto& a = chunk(tied_[0].chunk);
      auto& h = chunk(tied_[1].chunk);
      a.wait_event(h.record_event());
      a.add_gradients(tied_[0].offset, h.device_gradients() + tied_[1].offset, tied_numel_);
      h.wait_event(a.record_event());
      h.copy_gradients(tied_[1].offset, a.device_gradients() + tied_[0].offset, tied_numel_);
      tied_done_ = true;
    } else if (tied_.size() == 1) {  // D5: the own copy through the tied link, then the header
      auto& ch = chunk(tied_[0].chunk);
      void* sent =
          tied_link(cfg_.tied_send, "send")
              .send(ch.device_gradients() + tied_[0].offset, tied_bytes(), ch.record_event());
      ch.wait_event(sent);  // the own copy changes only after the send has read it
      caf::anon_send(wiring_.tied_partner, tied_grad{plan_.step, sc_.replica, nullptr});
      finish_tied();
    }
  }

  // The other copy's header: receive it into the chunk's scratch, in header order (D5).
  void on_tied(const tied_grad& t) {
    if (t.data || tied_.size() != 1)
      throw std::logic_error(who() + ": a tied wte gradient " +
                             (t.data ? "with host data" : "for a rank without one copy"));
    auto& ch = chunk(tied_[0].chunk);
    void* received =
        tied_link(cfg_.tied_receive, "receive")
            .receive(ch.gradient_scratch(tied_numel_), tied_bytes(), ch.record_event());
    ch.wait_event(received);
    tied_received_ = true;
    finish_tied();
    check_grads_ready();
  }

  void finish_tied() {
    if (tied_done_ || !tied_received_ || !tied_started_) return;
    auto& ch = chunk(tied_[0].chunk);
    ch.add_gradients(tied_[0].offset, ch.gradient_scratch(tied_numel_), tied_numel_);
    tied_received_ = false;
    tied_done_ = true;
  }

  std::size_t tied_bytes() const { return static_cast<std::size_t>(tied_numel_) * sizeof(float); }
  engine::chunk_link& tied_link(const std::shared_ptr<engine::chunk_link>& l, const char* what) {
    if (!l) throw std::logic_error(who() + ": no tied wte " + what + " link");
    return *l;
  }

  void check_grads_ready() {
    if (!compute_done_ || grads_sent_ || buckets_pending_ > 0 || !tied_done_) return;
    grads_sent_ = true;
    if (sc_.replicas > 1 || tied_.size() == 1)
      sc_.trace.span("wait", sc_.replicas > 1 ? "dp" : "tied", dp_wait_since_, sc_.trace.now_us(),
                     {plan_.step});
    double sq = 0;
    for (int c = 0; c < static_cast<int>(chunks_.size()); ++c) {
      const auto& r = chunk(c).range();
      sq += chunk(c).grad_square_sum(!(r.head && !r.embedding));
    }
    caf::anon_send(wiring_.coordinator,
                   grads_ready{plan_.step, sc_.rank, lane(), sq, loss_sum_, losses_});
  }

  // A skipped update (the coordinator's guard) drops the step's gradients.
  void on_update(const apply_update& u) {
    const double t0 = sc_.trace.now_us();
    double lr = engine::learning_rate(sc_.optimizer, u.step, sc_.total_steps);
    for (auto& ch : chunks_) {
      if (!u.skip) lr = ch->update(sc_.optimizer, u.step, sc_.total_steps, u.grad_norm, u.unscale);
      ch->zero_grad();
    }
    if (!u.skip) sc_.trace.span("optimizer", "AdamW", t0, sc_.trace.now_us(), {u.step});
    caf::anon_send(wiring_.coordinator, update_done{u.step, sc_.rank, lane(), lr, memory()});
    flush_trace();
  }

  // fp32 master weights, gradients and the two AdamW moments; everything else the chunks
  // allocated (16-bit weights, activations, scratch) counts as activations.
  engine::memory_report memory() const {
    engine::memory_report m;
    m.replica = lane();
    m.rank = sc_.rank;
    for (const auto& ch : chunks_) {
      const std::int64_t bytes = ch->parameter_count() * static_cast<std::int64_t>(sizeof(float));
      m.parameters += bytes;
      m.gradients += bytes;
      m.optimizer += 2 * bytes;
      m.activations += std::max<std::int64_t>(0, ch->device_bytes() - 4 * bytes);
    }
    return m;
  }

  void flush_trace() {
    if (sc_.trace.enabled() && !sc_.trace.empty())
      caf::anon_send(wiring_.tracer, trace_batch{sc_.trace.take()});
  }

  stage_snapshot snapshot() {
    stage_snapshot s;
    s.rank = sc_.rank;
    s.replica = sc_.replica;
    for (const auto& ch : chunks_) {
      const auto values = ch->parameters();
      for (const auto& p : ch->layout()) {
        const auto from = values.begin() + p.offset;
        s.parameters.emplace_back(p.name, std::vector<float>(from, from + p.numel));
      }
    }
    return s;
  }

  device_stage_config cfg_;
  stage_config& sc_;
  stage_wiring wiring_;
  std::vector<std::unique_ptr<engine::device_chunk>> chunks_;
  std::vector<slot_table> slots_;  // by chunk
  topology::incoming_credits incoming_;
  topology::outgoing_credits outgoing_;
  std::map<link_key, outgoing> held_;
  std::map<link_key, stashed> stash_links_;
  std::map<batch_key, batch_message> stash_batches_;
  step_plan plan_;
  const std::vector<engine::pipeline_action>* actions_ = nullptr;
  int cursor_ = 0;
  bool active_ = false, compute_done_ = false, grads_sent_ = false;
  double waiting_since_ = -1, dp_wait_since_ = 0;
  double loss_sum_ = 0;
  int losses_ = 0;
  int embedding_chunk_ = -1, head_chunk_ = -1;
  struct tied_copy {
    int chunk = 0;
    std::int64_t offset = 0;
  };
  std::vector<tied_copy> tied_;  // the wte gradient copies on this rank (0, 1 or 2)
  std::int64_t tied_numel_ = 0;
  // tied_received_: the other copy is in the chunk's gradient_scratch (it may come before this
  // rank's own backward is over; it is added after).
  bool tied_started_ = false, tied_received_ = false, tied_done_ = true;
  topology::grad_buckets buckets_;  // D4: data-parallel buckets over the chunks' gradients
  int buckets_pending_ = 0;         // not yet reduced this step
  std::vector<int> last_weight_;    // by chunk: its last backward in the plan's actions
};

}  // namespace

stage_actor spawn_device_stage(caf::actor_system& system, device_stage_config config) {
  return system.spawn<device_stage_impl, caf::detached>(std::move(config));
}

}  // namespace troupe::actors
