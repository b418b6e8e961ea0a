// The pipeline stage actor, on any device. See stage.hpp and docs/pipeline.md for the protocol.
//
// Invariants (tests cite them):
//  S1. Actions run strictly in plan order; a message that arrives early waits in the stash.
//  S2. A link message leaves only with its credit (topology/link_credits.hpp).
//  S3. At most one action per handler call: the stage yields to its mailbox between actions
//      (and, ZeRO-3, while an action waits for parameters), so credits and data that arrive
//      meanwhile are handled before the next action.
//  S4. grads_ready is sent once per step, after the last action, every data-parallel bucket's
//      reduction and the tied-wte exchange.
//  S5. ZeRO: a bucket holding a tied wte copy goes to the shard only after the tied exchange
//      (the shard reduces gradients the stage will never see whole again); the squared norm
//      is the sum of the shard's per-bucket reports, in bucket order.
//  S7. A checkpoint's capture (snapshot_request::capture) takes the state between steps, and
//      the next update waits until the copy no longer reads the chunks' state: the capture
//      unit's invariant (topology/stage_capture.hpp), with W5 (a stage writes its part).
//  S8. ZeRO through the devices' zero_group: buckets go to the group in the order they became
//      final, except a bucket holding a tied wte copy, which goes once the exchange is done and
//      every other bucket of the rank has gone (a place the same on every replica, after the
//      rank's last ZeRO-3 gather of the step), so every replica, in every process, enqueues the
//      same collectives in the same order (NCCL's rule) while the other buckets overlap
//      backward; ZeRO-1/2 all-gather the parameters after the update and the next step waits
//      for them; ZeRO-3 gathers (S6) go to the same group.
//  S6. ZeRO-3: an action's pass stops before each piece that reads parameters; it goes on only
//      once the piece's buckets are gathered. Gathers and releases follow the plan's sequence of
//      uses (engine::param_residency, kept by topology::param_gathers), never timing, so every
//      replica issues the same gathers in the same order; a held bucket is never gathered
//      again, so no gather writes parameters a piece is reading.
// Device chunks (payloads in the chunks' buffers, moved by links) add:
//  D1. A payload goes into its link right before its header message leaves, on the same
//      thread, so each link carries payloads in the order its receiver gets the headers; the
//      receiver posts the matching receive when the header arrives, in that order.
//  D2. A micro-batch occupies a slot of its chunk from its forward (or its activation's
//      arrival) to its release, and as long as a payload read from the slot waits for its
//      credit (hold / drop). A gradient leaves from the slot's input, where backward wrote it.
//  D3. Every link call is ordered on the chunk's stream both ways: the link starts after the
//      chunk's work so far (record_event) and the chunk's later work waits for the link's.
//  D4. A gradient bucket goes to the reducer with an event recorded right after its last block
//      was enqueued; the chunk's work after grad_bucket_reduced waits for the mean's event.
//  D5. The tied wte (topology/tied_wte.hpp): a rank with one copy sends it through its tied link
//      right before the tied_grad header (no data) leaves, and its own copy changes only after
//      the send read it; the partner receives it into its chunk's gradient scratch when the
//      header arrives and adds it once its own copy has left.
//  D6. ZeRO-3: the shard gathers a bucket into the chunks' host copy of the parameters; the
//      stage copies it into the chunk (rank_chunks::parameters_from_host) when zero_gathered
//      arrives, before resuming the pass stopped for it, so the copy precedes on the chunk's
//      stream every piece that reads it. The final weights are copied whole. Through the
//      devices' group the gather writes the chunk's own buffers: when bucket_gathered arrives
//      the chunk waits for its event and its compute copy follows, before the pass resumes.
#include "actors/stage.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>

#include "actors/error_text.hpp"
#include "actors/stage_links.hpp"
#include "engine/chunks/rank_chunks.hpp"
#include "engine/model/gpt_weights.hpp"
#include "engine/training/checkpoint.hpp"
#include "kernels/cpu_threads.hpp"
#include "topology/device_zero.hpp"
#include "topology/grad_buckets.hpp"
#include "topology/link_credits.hpp"
#include "topology/param_gathers.hpp"
#include "topology/payload_links.hpp"
#include "topology/stage_capture.hpp"
#include "topology/stage_state.hpp"
#include "topology/tied_wte.hpp"

namespace troupe::actors {
namespace {

using namespace messages;
using engine::trace::event_kind;
using topology::link_key;

// What a stage's action in progress keeps: its pass (engine/model/block_pass.hpp) and the buffers
// the pass reads and writes until it is done.
struct running_action {
  engine::pipeline_action a;
  int round = 0, chunk = 0;
  engine::micro_batch_id id;
  engine::block_pass pass;
  bool stopped = false;  // at a stop whose parameters are not gathered yet (ZeRO-3)
  int use = -1;          // the parameter use being computed (ZeRO-3)
  float_buffer dout, din;
  int B = 0, T = 0;
  std::uint64_t flow = 0;  // the consumed link message's flow id (0 if none)
  double t0 = 0;           // start of the compute span in progress
  bool computed = false;   // a piece ran since t0
  bool counted = true;     // its loss counts (not an evaluation filler, every target ignored)
};

class stage_impl : public stage_actor::base {
 public:
  stage_impl(caf::actor_config& cfg, stage_config config)
      : stage_actor::base(cfg), cfg_(std::move(config)) {}

  // Handles to peers form cycles (a stage may even be its own tied partner): drop them on
  // exit so that every actor can be destroyed.
  void on_exit() override {
    // A shard that stops (failed, or the run is torn down) must not leave its peers waiting in
    // a collective: they throw, naming this stage, and stop too.
    if (cfg_.tp_member) cfg_.tp_member->abort(who() + " stopped");
    if (capture_) capture_->stop(who() + " stopped");
    wiring_ = {};
    held_.clear();
    stash_links_.clear();
    stash_batches_.clear();
  }

  behavior_type make_behavior() override {
    set_exception_handler(
        [this](std::exception_ptr& e) -> caf::error { return exit_reason(who(), e); });
    if (!device()) kernels::set_compute_threads(cfg_.compute_threads);
    if (cfg_.watchdog) watch_ = cfg_.watchdog->enroll(who());
    init_chunks();
    capture_ = std::make_unique<topology::stage_capture>(capture_hooks());
    return {
        [this](stage_wiring& w) {
          wiring_ = std::move(w);
          if (zero() && !zero_on_device()) send_zero_layout();
        },
        [this](step_plan& p) { start_plan(std::move(p)); },
        [this](link_message& m) { on_link(std::move(m)); },
        [this](link_credit& c) { on_credit(c); },
        [this](batch_message& b) { on_batch(std::move(b)); },
        [this](grad_bucket_reduced& r) { on_reduced(r); },
        [this](tied_grad& t) { on_tied(t); },
        [this](apply_update& u) { on_update(u); },
        [this](zero_update_done& d) { on_zero_updated(d); },
        [this](zero_gathered& g) { on_gathered(g); },
        [this](stage_continue) { advance(); },
        [this](snapshot_request& r) -> caf::result<stage_snapshot> {
          if (r.capture) return on_capture();
          return r.state ? on_state(std::move(r.part_dir)) : on_snapshot();
        },
        [this](snapshot_copied) { capture_->copied(); },
        [this](part_written& w) { capture_->part_written(w.token, std::move(w.file), w.error); },
        [this](bucket_gathered& g) { on_bucket_gathered(g); },
    };
  }

 private:
  std::string who() const {
    return std::string(device() ? "device " : "") + "stage rank " + std::to_string(cfg_.rank) +
           " replica " + std::to_string(cfg_.replica) +
           (cfg_.tp > 1 ? " tp " + std::to_string(cfg_.tp_rank) : "");
  }
  bool device() const { return cfg_.device != nullptr; }
  // ZeRO through the devices' zero_group (topology/device_zero.hpp), not a shard actor.
  bool zero_on_device() const { return device() && cfg_.device->zero_group != nullptr; }
  bool staged_buckets() const { return device() && cfg_.device->stage_buckets; }
  // This shard's place among all stage actors of a rank, as the coordinator counts them.
  int lane() const { return cfg_.replica * cfg_.tp + cfg_.tp_rank; }
  int last_virtual_stage() const { return cfg_.layout.virtual_stage_count() - 1; }
  bool zero() const { return cfg_.zero != engine::zero_stage::none; }
  bool release_grads() const { return cfg_.zero >= engine::zero_stage::gradients; }
  bool sharded_params() const { return cfg_.zero >= engine::zero_stage::parameters; }
  // ZeRO-3 before the final weights are gathered: parameters are gathered for each use.
  bool gathering() const { return sharded_params() && !consolidated_; }

  // What this replica owns of each bucket, for its shard actor (same process: raw pointers).
  // ZeRO-3: with a copy of the owned parameters; the stage's parameter buffers are released
  // and hold only gathered buckets from now on.
  void send_zero_layout() {
    zero_layout l{buckets_.shards(cfg_.replica, cfg_.replicas, {cfg_.tp_rank, cfg_.tp}),
                  buckets_.views(),
                  {},
                  {},
                  {}};
    zero_shards_ = l.buckets;
    if (!cfg_.resume.empty()) std::tie(l.m, l.v) = owned_checkpoint_moments(l.buckets);
    if (sharded_params()) {
      for (const auto& b : l.buckets) {
        for (const auto& seg : b.segments) {
          const float* p = l.views.param(seg);
          l.params.resize(static_cast<std::size_t>(seg.at + seg.numel));
          std::copy(p, p + seg.numel, l.params.begin() + seg.at);
        }
      }
      std::int64_t bytes = 0;
      for (int c = 0; c < chunks_->chunk_count(); ++c) {
        engine::release_zeroed(chunks_->host_parameters(c), chunks_->parameter_count(c));
        bytes += chunks_->parameter_count(c) * static_cast<std::int64_t>(sizeof(float));
      }
      gathers_ = std::make_unique<topology::param_gathers>(buckets_, bytes);
    }
    caf::anon_send(wiring_.reducer, std::move(l));
  }
  int my_rank() const { return cfg_.rank; }

  // The owned floats' AdamW moments from the resumed checkpoint, in shard storage order.
  std::pair<std::vector<float>, std::vector<float>> owned_checkpoint_moments(
      const std::vector<engine::bucket_shard>& shards) const {
    std::vector<float> om, ov;
    for (int c = 0; c < chunks_->chunk_count(); ++c) {
      const auto m = checkpoint_tensors(c, "exp_avg"), v = checkpoint_tensors(c, "exp_avg_sq");
      for (const auto& b : shards) {
        for (const auto& seg : b.segments) {
          if (seg.chunk != c) continue;
          const auto end = static_cast<std::size_t>(seg.at + seg.numel);
          if (om.size() < end) om.resize(end), ov.resize(end);
          std::copy_n(m.begin() + seg.offset, seg.numel, om.begin() + seg.at);
          std::copy_n(v.begin() + seg.offset, seg.numel, ov.begin() + seg.at);
        }
      }
    }
    return {std::move(om), std::move(ov)};
  }

  // One of the resumed checkpoint's tensor files as chunk c's flat buffer.
  std::vector<float> checkpoint_tensors(int c, const std::string& which) const {
    return engine::load_checkpoint_tensors(cfg_.resume, which, cfg_.model, chunks_->range(c),
                                           {cfg_.tp_rank, cfg_.tp});
  }

  void init_chunks() {
    const auto ranges = cfg_.layout.rank_chunks(cfg_.rank);
    const engine::chunk_init init = [this](engine::gpt_chunk& st) {
      if (!cfg_.resume.empty()) {  // with the head's own copy of the tied wte, where saved
        const auto values = engine::load_checkpoint_tensors(cfg_.resume, "model", cfg_.model,
                                                            st.range(), st.shard());
        std::copy(values.begin(), values.end(), st.params());
      } else if (cfg_.init.empty()) {
        st.init_gpt2(cfg_.seed);
      } else {
        engine::load_hf_weights(st, cfg_.init);
      }
    };
    const engine::tensor_shard shard{cfg_.tp_rank, cfg_.tp};
    if (device()) {
      // ZeRO: the shard actor holds the moments and updates in host memory (the chunks' host
      // copies); ZeRO-3 gathers there too, each bucket then copied into the chunk (D6).
      const auto& d = *cfg_.device;
      chunks_ = engine::make_device_rank_chunks(*d.factory, cfg_.model, ranges, shard, init, d.B,
                                                d.T, d.slots, cfg_.rank, lane(), cfg_.tp_member,
                                                /*optimizer_state=*/!zero());
    } else {
      auto group = std::dynamic_pointer_cast<engine::tensor_group>(cfg_.tp_member);
      if (cfg_.tp_member && !group)
        throw std::logic_error(who() + ": a tensor group member of another kind");
      chunks_ = engine::make_cpu_rank_chunks(cfg_.model, ranges, init, /*optimizer_state=*/!zero(),
                                             cfg_.recompute, shard, std::move(group));
    }
    for (int c = 0; c < chunks_->chunk_count(); ++c) {
      const auto& r = chunks_->range(c);
      if (r.embedding) embedding_chunk_ = c;
      if (r.head) head_chunk_ = c;
    }
    using side = topology::grad_buckets::zero_side;
    buckets_.build(*chunks_, cfg_.bucket_layers,
                   !zero()            ? side::none
                   : zero_on_device() ? side::device
                                      : side::host);  // the buffers ZeRO works on
    if (zero_on_device()) {  // ZeRO-3: the owned master weights from the chunks' (resumed) ones
      device_zero_ =
          topology::device_zero(*chunks_, buckets_, cfg_.device->zero_group, cfg_.replica,
                                cfg_.replicas, {cfg_.tp_rank, cfg_.tp}, sharded_params());
      zero_shards_ = device_zero_.shards();
      if (!cfg_.resume.empty()) {
        const auto [m, v] = owned_checkpoint_moments(zero_shards_);
        device_zero_.load_moments(m, v);
      }
      if (sharded_params()) {  // the chunks' master weights hold gathered buckets only from now
        for (int b = 0; b < buckets_.size(); ++b) device_zero_.release(b);
        gathers_ = std::make_unique<topology::param_gathers>(
            buckets_,
            topology::param_gathers::bucket_memory{[this](int b) { device_zero_.release(b); },
                                                   [this](int b) { device_zero_.acquire(b); },
                                                   [this] { device_zero_.parameter_round(); }});
      }
    }
    if (!cfg_.resume.empty() && !zero()) {  // the chunks' moments from the checkpoint
      for (int c = 0; c < chunks_->chunk_count(); ++c)
        chunks_->load_moments(c, checkpoint_tensors(c, "exp_avg").data(),
                              checkpoint_tensors(c, "exp_avg_sq").data());
    }
    links_ = device() ? topology::payload_links(*chunks_, cfg_.device->send_links,
                                                cfg_.device->receive_links, who())
                      : topology::payload_links(*chunks_, {}, {}, who());
    tied_ = topology::tied_wte(*chunks_, buckets_, embedding_chunk_, head_chunk_,
                               device() ? cfg_.device->tied_send : nullptr,
                               device() ? cfg_.device->tied_receive : nullptr, who());
    if (release_grads()) {
      std::int64_t bytes = 0;
      for (int c = 0; c < chunks_->chunk_count(); ++c)
        bytes += chunks_->parameter_count(c) * static_cast<std::int64_t>(sizeof(float));
      grad_pool_ = std::make_unique<engine::page_pool>(bytes);
    }
  }

  // ---- plan ---------------------------------------------------------------------------
  void start_plan(step_plan p) {
    plan_ = std::move(p);
    actions_ = &plan_.plan->ranks.at(static_cast<std::size_t>(my_rank()));
    cursor_ = 0;
    active_ = true;
    compute_done_ = grads_sent_ = false;
    loss_sum_ = 0;
    losses_ = 0;
    waiting_since_ = -1;
    if (!plan_.eval) {
      if (release_grads() && grad_pool_->pooled_bytes() > 0) take_back_grads();
      buckets_.start_step();
      buckets_pending_ = cfg_.replicas > 1 || zero() ? buckets_.size() : 0;
      shard_square_sums_.assign(static_cast<std::size_t>(buckets_.size()), 0.0);
      tied_waiting_.clear();
      tied_.start();
      untied_left_ = 0;
      for (int b = 0; b < buckets_.size(); ++b) untied_left_ += tied_.holds(b) ? 0 : 1;
      find_last_weight_actions();
    }
    if (gathering()) start_gathers();
    grant_initial_credits();
    advance();
  }

  // ZeRO-2/3: the gradient buffer was released bucket by bucket into the pool; its pages come
  // back (moved, not faulted in) and are zeroed before backward accumulates into them. Only when
  // the step accumulates several micro-batches: then every block's gradient is resident from the
  // first backward to the last anyway, so taking the pages back early raises no peak. With one
  // micro-batch per step a bucket is released while backward goes on to earlier layers, and its
  // pages are handed back to the kernel instead, so the rank never holds all gradients at once.
  bool pool_grads() const { return plan_.rounds * plan_.plan->shape.micro_batches > 1; }

  void take_back_grads() {
    for (int c = 0; c < chunks_->chunk_count(); ++c) {
      float* g = chunks_->host_gradients(c);
      const auto n = chunks_->parameter_count(c);
      grad_pool_->acquire(g, n);
      std::fill(g, g + n, 0.0f);
    }
  }

  // ---- ZeRO-3: parameters gathered before each use (S6) ---------------------------------
  // The plan's parameter uses in execution order: the stops of every pass it runs, as buckets.
  void start_gathers() {
    std::vector<std::vector<int>> uses;
    for (int round = 0; round < plan_.rounds; ++round) {
      for (const auto& a : *actions_) {
        const int c = cfg_.layout.chunk_of(a.virtual_stage);
        for (const auto& stop : chunks_->stops(c, pass_of(a.kind)))
          uses.push_back(gathers_->buckets_of(c, stop));
      }
    }
    const auto collective = plan_collective();
    gathers_->start(std::move(uses), cfg_.zero_prefetch, [this, collective](int seq, int bucket) {
      gather(plan_.step, collective, seq, bucket);
    });
  }

  // Gather `seq` of (step, collective), of `bucket`'s parameters: by the shard actor
  // (zero_gathered), or through the devices' group (bucket_gathered, to itself).
  void gather(int step, zero_collective collective, int seq, int bucket) {
    if (!zero_on_device()) {
      caf::anon_send(wiring_.reducer, zero_gather{step, collective, seq, bucket});
      return;
    }
    device_zero_.gather(step, bucket, [me = address(), step, collective, seq, bucket](void* done) {
      if (auto self = caf::actor_cast<caf::actor>(me))
        caf::anon_send(self, bucket_gathered{step, bucket, done, collective, seq});
    });
  }

  static engine::pass_kind pass_of(engine::action_kind kind) {
    switch (kind) {
      case engine::action_kind::forward:
        return engine::pass_kind::forward;
      case engine::action_kind::backward:
        return engine::pass_kind::backward;
      case engine::action_kind::weight:
        break;
    }
    return engine::pass_kind::weight;
  }

  zero_collective plan_collective() const {
    return plan_.eval ? zero_collective::eval : zero_collective::train;
  }

  void on_gathered(const zero_gathered& g) {
    if (g.collective == zero_collective::final) {
      final_gathered();
      return;
    }
    if (!active_ || g.step != plan_.step || g.collective != plan_collective())
      throw std::logic_error("ZeRO-3: a parameter gather finished outside its plan");
    const int bucket = gathers_->gathered(g.seq);
    if (device() && !zero_on_device()) load_bucket(bucket);
    advance_if_waiting();
  }

  // Device chunks (D6): a gathered bucket's parameters from the host copy into the chunk, on its
  // stream before the pieces that read them.
  void load_bucket(int b) {
    const auto& info = buckets_.bucket(b);
    const float* base = chunks_->gradients(info.chunk);  // the ranges' offsets, as send_bucket's
    for (const auto& [ptr, n] : info.ranges)
      chunks_->parameters_from_host(info.chunk, ptr - base, n);
  }

  // The final weights: every bucket gathered once more, then kept (no release) for snapshots.
  caf::result<stage_snapshot> on_snapshot() {
    if (!sharded_params() || consolidated_) return snapshot();
    auto rp = make_response_promise<stage_snapshot>();
    if (snapshots_waiting_.empty()) {
      final_pending_ = buckets_.size();
      gathers_->gather_all(
          [this](int seq, int bucket) { gather(0, zero_collective::final, seq, bucket); });
    }
    snapshots_waiting_.push_back(rp);
    return rp;
  }

  // A checkpoint's first phase (S7, topology/stage_capture.hpp): the state taken aside,
  // answered with an empty snapshot at once, so that the next step may begin. The chunks'
  // copies of what the stage holds (parameters, and without ZeRO the moments; under ZeRO-1/2
  // replica 0's lanes alone send parameters) begin now. ZeRO's owned floats come from the
  // shard, asked now: it answers before the update this stage sends it later; or, through the
  // devices' group, from the devices now.
  caf::result<stage_snapshot> on_capture() {
    stage_snapshot empty;
    empty.rank = my_rank();
    empty.replica = cfg_.replica;
    const bool params = !zero() || (!sharded_params() && cfg_.replica == 0);
    const bool moments = !zero();
    auto copies = [this, params, moments] {
      topology::stage_capture::chunk_copies c;
      if (params)
        for (int k = 0; k < chunks_->chunk_count(); ++k)
          c.push_back(chunks_->capture_state(k, moments));
      return c;
    };
    using zero_part = topology::stage_capture::zero_part;
    if (zero_on_device()) {
      capture_->begin(copies, moments, empty, zero_part::now, device_zero_state());
    } else if (zero()) {
      const int capture = capture_->begin(copies, moments, empty, zero_part::pending);
      request(wiring_.reducer, caf::infinite, zero_state_request{})
          .then([this, capture](zero_state& z) { capture_->zero_arrived(capture, std::move(z)); });
    } else {
      capture_->begin(copies, moments, empty, zero_part::none);
    }
    return empty;
  }

  // A checkpoint's state (snapshot_request::state): what the capture took, or, without one, the
  // state now; with a part directory, written there as this stage's part (format 2).
  caf::result<stage_snapshot> on_state(std::string part_dir) {
    auto rp = make_response_promise<stage_snapshot>();
    topology::stage_capture::request q{[rp](stage_snapshot s) mutable { rp.deliver(std::move(s)); },
                                       [rp](const std::string& why) mutable {
                                         rp.deliver(caf::make_error(caf::sec::runtime_error, why));
                                       },
                                       std::move(part_dir)};
    capture_->state(std::move(q), [this](std::function<void(stage_snapshot)> done) {
      take_state(std::move(done));
    });
    return rp;
  }

  // What the capture unit needs of this stage.
  topology::stage_capture::hooks capture_hooks() {
    topology::stage_capture::hooks h;
    h.snapshot_of = [this](const std::vector<engine::rank_chunks::host_state>& states,
                           bool moments) { return snapshot_of(states, true, moments); };
    h.with_zero = [this](stage_snapshot s, const zero_state& z) {
      return zero_snapshot(std::move(s), z);
    };
    h.post_copied = [me = address()] {
      if (auto self = caf::actor_cast<caf::actor>(me)) caf::anon_send(self, snapshot_copied{});
    };
    h.post_part = [me = address()](int token, engine::checkpoint_file file, std::string error) {
      if (auto self = caf::actor_cast<caf::actor>(me))
        caf::anon_send(self, part_written{token, std::move(file), std::move(error)});
    };
    h.part_name = engine::checkpoint_part_name(my_rank(), lane());
    h.rank = my_rank();
    h.replica = cfg_.replica;
    h.shard = cfg_.tp_rank;
    h.delay_ms = cfg_.test_capture_delay_ms;
    return h;
  }

  // The parameters and the AdamW moments; where the ZeRO shard holds them, as the pieces it owns.
  // Nothing is gathered or released for it. Under ZeRO-1/2 every replica holds the same whole
  // parameters: replica 0's lanes send them, the others their owned moments only.
  void take_state(std::function<void(stage_snapshot)> done) {
    if (!zero()) {
      done(snapshot(true, true));
      return;
    }
    stage_snapshot base;
    if (!sharded_params() && cfg_.replica == 0) {
      base = snapshot(true);
    } else {
      base.rank = my_rank();
      base.replica = cfg_.replica;
    }
    if (zero_on_device()) {
      done(zero_snapshot(std::move(base), device_zero_state()));
      return;
    }
    request(wiring_.reducer, caf::infinite, zero_state_request{})
        .then([this, base = std::move(base), done = std::move(done)](zero_state& z) mutable {
          done(zero_snapshot(std::move(base), z));
        });
  }

  // What this replica owns, through the devices' group: from the devices, now.
  zero_state device_zero_state() {
    auto [m, v] = device_zero_.moments();
    return {std::move(m), std::move(v),
            sharded_params() ? device_zero_.parameters() : std::vector<float>{}};
  }

  // A ZeRO stage's state: `s` (the parameters, replica 0's lanes under ZeRO-1/2) and the owned
  // pieces.
  stage_snapshot zero_snapshot(stage_snapshot s, const zero_state& z) const {
    return topology::with_owned_pieces(std::move(s), *chunks_, zero_shards_, z, sharded_params());
  }

  void final_gathered() {
    if (--final_pending_ > 0) return;
    consolidated_ = true;
    if (device() && !zero_on_device())  // the whole weights into the chunks, which snapshots read
      for (int c = 0; c < chunks_->chunk_count(); ++c)
        chunks_->parameters_from_host(c, 0, chunks_->parameter_count(c));
    for (auto& rp : snapshots_waiting_) rp.deliver(snapshot());
    snapshots_waiting_.clear();
  }

  void find_last_weight_actions() {
    last_weight_ = last_weight_actions(cfg_.layout, *actions_, plan_.plan->split_backward,
                                       chunks_->chunk_count());
  }

  void grant_initial_credits() {
    std::vector<link_key> order;
    for (int round = 0; round < plan_.rounds; ++round) {
      for (const auto& a : *actions_) {
        if (auto k = incoming_key(cfg_.layout, my_rank(), plan_, a, round)) order.push_back(*k);
      }
    }
    for (const auto& k : incoming_.start(order, cfg_.link_credits)) grant(k);
  }

  void grant(const link_key& k) {
    caf::anon_send(wiring_.ranks.at(static_cast<std::size_t>(sender_of(cfg_.layout, k))),
                   credit_for(k, cfg_.replica));
  }

  // ---- the action loop (S1, S3, S6) ---------------------------------------------------
  void advance() {
    if (!active_) return;
    if (!run_) {
      const int per_round = static_cast<int>(actions_->size());
      if (cursor_ >= per_round * plan_.rounds) {
        active_ = false;
        finish_compute();
        return;
      }
      const int round = cursor_ / per_round;
      const int index = cursor_ % per_round;
      const auto& a = (*actions_)[static_cast<std::size_t>(index)];
      if (!ready(a, round)) {
        wait("input");
        return;
      }
      waited(a);
      begin_action(a, round, index);
    }
    if (watch_) {
      static const char* names[] = {"F", "B", "W"};
      watch_->begin(std::string(names[static_cast<int>(run_->a.kind)]) + " of micro-batch " +
                    std::to_string(run_->a.micro_batch) + " (virtual stage " +
                    std::to_string(run_->a.virtual_stage) + ", step " +
                    std::to_string(plan_.step + 1) + (plan_.eval ? ", evaluation" : "") + ")");
    }
    if (plan_.step == cfg_.test_stall_step && !plan_.eval)
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    const bool finished = drive();
    if (watch_) watch_->end();
    compute_span();
    if (!finished) {
      wait("params");
      return;
    }
    waited(run_->a);
    end_action();
    run_.reset();
    ++cursor_;
    send(this, stage_continue{});
  }

  void wait(const char* what) {
    if (waiting_since_ >= 0) return;
    waiting_since_ = cfg_.trace.now_us();
    waiting_for_ = what;
  }
  void waited(const engine::pipeline_action& a) {
    if (waiting_since_ < 0) return;
    cfg_.trace.span("wait", waiting_for_, waiting_since_, cfg_.trace.now_us(),
                    {plan_.step, a.micro_batch, a.virtual_stage});
    waiting_since_ = -1;
  }

  link_key make_key(link_kind kind, int virtual_stage, int round, int mb) const {
    return plan_link_key(plan_, kind, virtual_stage, round, mb);
  }
  bool ready(const engine::pipeline_action& a, int round) const {
    return action_ready(plan_, last_virtual_stage(), a, round, stash_links_, stash_batches_);
  }

  void begin_action(const engine::pipeline_action& a, int round, int index) {
    running_action& r = run_.emplace();
    r.a = a;
    r.round = round;
    r.chunk = cfg_.layout.chunk_of(a.virtual_stage);
    r.id = {round, a.micro_batch};
    r.t0 = cfg_.trace.now_us();
    const int c = r.chunk;
    const bool final_weights = !plan_.eval && round == plan_.rounds - 1 &&
                               index == last_weight_[static_cast<std::size_t>(c)];
    engine::grad_block_fn on_block;
    if (final_weights) on_block = [this, c](int block) { on_block_final(c, block); };
    switch (a.kind) {
      case engine::action_kind::forward:
        begin_forward(r);
        break;
      case engine::action_kind::backward:
        begin_backward(r, std::move(on_block));
        break;
      case engine::action_kind::weight:  // stops only before blocks it recomputes
        r.pass = chunks_->backward_weight(c, r.id, std::move(on_block));
        break;
    }
  }

  // Runs the action's pass until it is done (true) or stops before a piece whose parameters
  // are not gathered yet (false; zero_gathered resumes it).
  bool drive() {
    running_action& r = *run_;
    for (;;) {
      if (r.stopped) {
        if (gathering()) {
          if (!gathers_->next_ready()) return false;
          r.use = gathers_->begin_next();
        }
        r.stopped = false;
      }
      const std::vector<int>* stop = r.pass.next();
      // Not only a pass's prologue (W's prologue is the head's weight gradients: work).
      if (r.use >= 0 || !gathering() || !stop || r.a.kind == engine::action_kind::weight)
        r.computed = true;
      if (r.use >= 0) {
        gathers_->finish(r.use);
        r.use = -1;
      }
      if (!stop) return true;
      if (gathering()) gathers_->check_next(gathers_->buckets_of(r.chunk, *stop));
      r.stopped = true;
    }
  }

  // The trace span of what ran since the action started or resumed.
  void compute_span() {
    running_action& r = *run_;
    const double t1 = cfg_.trace.now_us();
    if (r.computed) {
      static const char* names[] = {"F", "B", "W"};
      const engine::trace::recorder::ids ids{plan_.step, r.a.micro_batch, r.a.virtual_stage};
      // Evaluation passes are traced apart, so they do not count as pipeline compute.
      cfg_.trace.span(plan_.eval ? "eval" : "compute", names[static_cast<int>(r.a.kind)], r.t0, t1,
                      ids);
      if (r.flow) cfg_.trace.flow(event_kind::flow_in, r.flow, r.t0, ids);
      r.flow = 0;
      r.computed = false;
    }
    r.t0 = t1;
  }

  void end_action() {
    running_action& r = *run_;
    if (r.a.kind == engine::action_kind::forward) {
      end_forward(r);
    } else if (r.a.kind == engine::action_kind::backward) {
      // The input's gradient leaves before the micro-batch is released: a device chunk's is in
      // its slot (D2).
      if (r.a.virtual_stage > 0)
        route(link_kind::gradient, r.a.virtual_stage - 1, r.round, r.a.micro_batch, r.B, r.T,
              r.chunk, std::move(r.din));
      if (!plan_.plan->split_backward) chunks_->release(r.chunk, r.id);
    } else {
      chunks_->release(r.chunk, r.id);
    }
  }

  void begin_forward(running_action& r) {
    const auto& a = r.a;
    engine::rank_chunks::forward_args args;
    args.train = !plan_.eval;
    if (a.virtual_stage == 0) {
      auto b = take_batch(batch_part::inputs, r.round, a.micro_batch);
      args.B = b.B;
      args.T = b.T;
      args.tokens = b.tokens->data();
      args.hold.push_back(b.tokens);
      r.flow = b.flow_id;
    } else {
      auto m = take_link(link_kind::activation, a.virtual_stage, r.round, a.micro_batch);
      args.B = static_cast<int>(m.header.shape.at(0));
      args.T = static_cast<int>(m.header.shape.at(1));
      if (m.data) {  // CPU chunks read the payload in place
        args.input = m.data->data();
        args.hold.push_back(m.data);
      }
      r.flow = m.flow_id;
    }
    if (a.virtual_stage == last_virtual_stage()) {
      auto t = take_batch(batch_part::targets, r.round, a.micro_batch);
      args.targets = t.tokens->data();
      r.counted = !plan_.eval || std::any_of(t.tokens->begin(), t.tokens->end(),
                                             [](int y) { return y != engine::ignore_index; });
      args.hold.push_back(t.tokens);
      // The mean over the step's micro-batches, times the step's loss scale (1 without dynamic
      // loss scaling; a power of two with it, so the seed is exact).
      args.loss_scale = static_cast<float>(plan_.loss_scale) /
                        static_cast<float>(plan_.rounds * plan_.plan->shape.micro_batches);
    }
    r.B = args.B;
    r.T = args.T;
    r.pass =
        traced_growth(r.chunk, [&] { return chunks_->forward(r.chunk, r.id, std::move(args)); });
  }

  // Runs f, and traces an `alloc` span if chunk c added a slot meanwhile (device chunks).
  template <class F>
  std::invoke_result_t<F> traced_growth(int c, F&& f) {
    const int before = chunks_->slot_count(c);
    const double t0 = cfg_.trace.now_us();
    auto result = f();
    const int after = chunks_->slot_count(c);
    if (after > before)
      cfg_.trace.span("alloc", "slot " + std::to_string(after) + " of chunk " + std::to_string(c),
                      t0, cfg_.trace.now_us(), {plan_.step});
    return result;
  }

  void end_forward(running_action& r) {
    const auto& a = r.a;
    if (a.virtual_stage == last_virtual_stage()) {
      if (r.counted) {
        loss_sum_ += chunks_->loss(r.chunk, r.id);
        ++losses_;
      }
    } else {
      float_buffer out;
      if (chunks_->host_payloads()) {  // one copy into the message's payload, no zero-fill
        const std::size_t n = std::size_t(r.B) * std::size_t(r.T) * std::size_t(cfg_.model.width);
        const float* output = chunks_->output(r.chunk, r.id);
        out = std::make_shared<payload<float>>(output, output + n);
      }
      route(link_kind::activation, a.virtual_stage + 1, r.round, a.micro_batch, r.B, r.T, r.chunk,
            std::move(out));
    }
    if (plan_.eval) chunks_->release(r.chunk, r.id);
  }

  void begin_backward(running_action& r, engine::grad_block_fn on_block) {
    const auto& a = r.a;
    std::tie(r.B, r.T) = chunks_->shape(r.chunk, r.id);
    if (a.virtual_stage != last_virtual_stage()) {
      auto m = take_link(link_kind::gradient, a.virtual_stage, r.round, a.micro_batch);
      r.dout = m.data;  // null for device chunks: the gradient is in their slot
      r.flow = m.flow_id;
    }
    if (a.virtual_stage > 0 && chunks_->host_payloads())
      r.din = std::make_shared<payload<float>>(std::size_t(r.B) * std::size_t(r.T) *
                                               std::size_t(cfg_.model.width));
    const float* dptr = r.dout ? r.dout->data() : nullptr;
    float* iptr = r.din ? r.din->data() : nullptr;
    r.pass = plan_.plan->split_backward
                 ? chunks_->backward_input(r.chunk, r.id, dptr, iptr)
                 : chunks_->backward(r.chunk, r.id, dptr, iptr, std::move(on_block));
  }

  batch_message take_batch(batch_part part, int round, int mb) {
    auto it = stash_batches_.find(plan_batch_key(plan_, part, round, mb));
    batch_message b = std::move(it->second);
    stash_batches_.erase(it);
    if (!b.eval) caf::anon_send(wiring_.loader, batch_credit{part, cfg_.replica});
    return b;
  }

  link_message take_link(link_kind kind, int virtual_stage, int round, int mb) {
    const auto key = make_key(kind, virtual_stage, round, mb);
    auto it = stash_links_.find(key);
    link_message m = std::move(it->second);
    stash_links_.erase(it);
    if (auto next = incoming_.consumed(key)) grant(*next);
    return m;
  }

  // ---- links (S2, D1-D3) ------------------------------------------------------------------
  // A link message waiting for its credit: with its payload (CPU chunks), or naming the chunk
  // and micro-batch whose slot holds it (device chunks).
  struct outgoing {
    link_message m;
    int chunk = 0;
    engine::micro_batch_id id;
  };

  static engine::payload_kind payload_of(link_kind kind) {
    return kind == link_kind::activation ? engine::payload_kind::activation
                                         : engine::payload_kind::gradient;
  }

  void route(link_kind kind, int virtual_stage, int round, int mb, int B, int T, int c,
             float_buffer data) {
    outgoing o;
    o.m.header = {kind,          plan_.step,   round,      mb,
                  virtual_stage, cfg_.replica, plan_.eval, {B, T, cfg_.model.width}};
    o.m.data = std::move(data);
    o.chunk = c;
    o.id = {round, mb};
    const auto key = key_of(o.m.header);
    if (cfg_.layout.rank_of(virtual_stage) == my_rank()) {  // next chunk on this rank
      if (device()) {                                       // through the rank's own link
        links_.send(o.chunk, o.id, payload_of(kind), my_rank(), nullptr);
        arrive(o.m.header, 0, my_rank(), nullptr);
      } else {  // no link: the payload is the next chunk's input
        stash_links_.emplace(key, std::move(o.m));
      }
      return;
    }
    o.m.flow_id = engine::trace::flow_id(static_cast<int>(kind), plan_.step, round, mb,
                                         virtual_stage, cfg_.replica, plan_.eval);
    if (outgoing_.produced(key)) {
      transmit(std::move(o));
    } else {
      chunks_->hold(c, o.id);  // D2: until the credit comes
      held_.emplace(key, std::move(o));
    }
  }

  void transmit(outgoing o) {
    const double t0 = cfg_.trace.now_us();
    const int to = cfg_.layout.rank_of(o.m.header.virtual_stage);
    const auto bytes = static_cast<std::int64_t>(device() ? chunks_->payload_bytes(o.chunk, o.id)
                                                          : o.m.data->size() * sizeof(float));
    // D1: the payload (into its link, or into the message), then its header.
    o.m.data = links_.send(o.chunk, o.id, payload_of(o.m.header.kind), to, std::move(o.m.data));
    const engine::trace::recorder::ids ids{o.m.header.step, o.m.header.micro_batch,
                                           o.m.header.virtual_stage, bytes};
    const std::uint64_t flow = o.m.flow_id;
    const char* what = o.m.header.kind == link_kind::activation ? "activation" : "gradient";
    caf::anon_send(wiring_.ranks.at(static_cast<std::size_t>(to)), std::move(o.m));
    const double t1 = cfg_.trace.now_us();
    cfg_.trace.span("send", what, t0, t1, ids);
    cfg_.trace.flow(event_kind::flow_out, flow, t0, ids);
  }

  void on_link(link_message m) {
    if (device()) {
      arrive(m.header, m.flow_id, sender_of(cfg_.layout, key_of(m.header)), m.data);
      advance_if_waiting();
      return;
    }
    if (!m.data)  // header-only: only device stages take payloads beside their messages
      throw std::runtime_error("a link message without its payload from rank " +
                               std::to_string(sender_of(cfg_.layout, key_of(m.header))) +
                               " at a stage of CPU chunks");
    const double t0 = cfg_.trace.now_us();
    const auto key = key_of(m.header);
    const engine::trace::recorder::ids ids{m.header.step, m.header.micro_batch,
                                           m.header.virtual_stage,
                                           static_cast<std::int64_t>(m.data->size() * 4)};
    const char* what = m.header.kind == link_kind::activation ? "activation" : "gradient";
    if (!stash_links_.emplace(key, std::move(m)).second)
      throw std::runtime_error(std::string("duplicate ") + what + " message");
    cfg_.trace.span("recv", what, t0, cfg_.trace.now_us(), ids);
    advance_if_waiting();
  }

  // Device chunks: a header arrived (or a payload went to the next chunk of this rank): its
  // payload into its chunk's buffer (payload_links), in arrival order (D1), then the header
  // waits in the stash for its action.
  void arrive(const link_header& h, std::uint64_t flow, int from, const float_buffer& data) {
    const double t0 = cfg_.trace.now_us();
    const int c = cfg_.layout.chunk_of(h.virtual_stage);
    const engine::micro_batch_id id{h.round, h.micro_batch};
    const bool activation = h.kind == link_kind::activation;
    traced_growth(c, [&] {
      links_.receive(c, id, payload_of(h.kind), static_cast<int>(h.shape.at(0)),
                     static_cast<int>(h.shape.at(1)), from, data);
      return 0;
    });
    link_message stub;
    stub.header = h;
    stub.flow_id = flow;
    if (!stash_links_.emplace(key_of(h), std::move(stub)).second)
      throw std::runtime_error(std::string("duplicate ") +
                               (activation ? "activation" : "gradient") + " message");
    if (from != cfg_.rank)
      cfg_.trace.span("recv", activation ? "activation" : "gradient", t0, cfg_.trace.now_us(),
                      {h.step, h.micro_batch, h.virtual_stage,
                       static_cast<std::int64_t>(chunks_->payload_bytes(c, id))});
  }

  void on_credit(const link_credit& c) {
    const auto key = key_of(c.header);
    if (outgoing_.granted(key)) {
      auto it = held_.find(key);
      outgoing o = std::move(it->second);
      held_.erase(it);
      const int chunk = o.chunk;
      const auto id = o.id;
      transmit(std::move(o));
      chunks_->drop(chunk, id);
    }
  }

  void on_batch(batch_message b) {
    stash_batches_.emplace(key_of(b), std::move(b));
    advance_if_waiting();
  }

  // Only a stage that is blocked re-enters the loop here; a running one has a stage_continue
  // queued already.
  void advance_if_waiting() {
    if (active_ && waiting_since_ >= 0) advance();
  }

  // ---- gradients: buckets, tied wte, grads_ready (S4) -----------------------------------
  void on_block_final(int chunk, int block) {
    const auto b = buckets_.block_done(chunk, block);
    if (!b) return;
    if (zero()) {  // S5, S8
      if (tied_.holds(*b)) {
        tied_waiting_.push_back(*b);
        bucket_final(*b);
      } else {
        send_bucket(*b);
        --untied_left_;
      }
      flush_tied_waiting();
      return;
    }
    if (cfg_.replicas > 1) {
      send_bucket(*b);
    } else {
      bucket_final(*b);
    }
  }

  void send_bucket(int b) {
    const double t = cfg_.trace.now_us();
    const auto& info = buckets_.bucket(b);
    if (zero_on_device()) {
      const int step = plan_.step;
      device_zero_.reduce_scatter(step, b, [me = address(), step, b](void* done) {
        if (auto self = caf::actor_cast<caf::actor>(me))  // a stage that stopped: nobody
          caf::anon_send(self, grad_bucket_reduced{step, b, 0.0, done});
      });
    } else if (zero()) {  // the shard works on the chunks' host buffers (device chunks: copied
                          // there)
      const float* base = chunks_->gradients(info.chunk);
      for (const auto& [ptr, n] : info.ranges)
        chunks_->gradients_to_host(info.chunk, ptr - base, n);
      caf::anon_send(wiring_.reducer, grad_bucket{plan_.step, my_rank(), cfg_.replica, b,
                                                  buckets_.shard_grad_ranges(b), nullptr});
    } else if (staged_buckets()) {  // host copies of the device ranges, reduced there and copied
                                    // back
      auto& host = staged_[b];
      std::int64_t at = 0;
      for (const auto& range : info.ranges) at += range.second;
      host.resize(static_cast<std::size_t>(at));
      std::vector<std::pair<float*, std::int64_t>> ranges;
      at = 0;
      for (const auto& [ptr, n] : info.ranges) {
        chunks_->copy_to_host(info.chunk, host.data() + at, ptr,
                              static_cast<std::size_t>(n) * sizeof(float));
        ranges.emplace_back(host.data() + at, n);
        at += n;
      }
      caf::anon_send(wiring_.reducer, grad_bucket{plan_.step, my_rank(), cfg_.replica, b,
                                                  std::move(ranges), nullptr});
    } else {
      // D4: device gradients are final on the stream after the event recorded now.
      caf::anon_send(wiring_.reducer, grad_bucket{plan_.step, my_rank(), cfg_.replica, b,
                                                  info.ranges, chunks_->record_event(info.chunk)});
    }
    cfg_.trace.span("send", "bucket " + buckets_.bucket(b).name, t, cfg_.trace.now_us(),
                    {plan_.step});
  }

  void flush_tied_waiting() {
    if (!tied_.done() || (zero_on_device() && untied_left_ > 0)) return;
    // S8 under ZeRO-3: the group's order across replicas needs the tied reduce-scatter after the
    // plan's last gather, which no message's timing may move.
    if (zero_on_device() && gathering() && !tied_waiting_.empty() && !gathers_->all_issued())
      throw std::logic_error(who() +
                             ": the tied bucket's reduce-scatter before the plan's last "
                             "gather (stage invariant S8)");
    for (int b : tied_waiting_) send_bucket(b);
    tied_waiting_.clear();
  }

  void on_reduced(const grad_bucket_reduced& r) {
    if (buckets_pending_ <= 0)
      throw std::logic_error(who() + ": a reduced bucket nobody waits for");
    // D4: the chunk's later work waits for the mean (device chunks); or the mean of the staged
    // copies goes back to the device.
    if (r.done) chunks_->wait_event(buckets_.bucket(r.bucket).chunk, r.done);
    if (staged_buckets() && !zero()) {
      const auto& info = buckets_.bucket(r.bucket);
      const auto& host = staged_.at(r.bucket);
      std::int64_t at = 0;
      for (const auto& [ptr, n] : info.ranges) {
        chunks_->copy_from_host(info.chunk, ptr, host.data() + at,
                                static_cast<std::size_t>(n) * sizeof(float));
        at += n;
      }
    }
    --buckets_pending_;
    if (zero()) {
      shard_square_sums_.at(static_cast<std::size_t>(r.bucket)) = r.square_sum;
      // ZeRO-2: the shard copied its chunk; the whole bucket's host pages go to the pool.
      if (release_grads() && !zero_on_device()) {
        for (const auto& [ptr, n] : buckets_.shard_grad_ranges(r.bucket)) {
          if (pool_grads())
            grad_pool_->release(ptr, n);
          else
            engine::release_zeroed(ptr, n);
        }
      }
    } else {
      bucket_final(r.bucket);
    }
    check_grads_ready();
  }

  // A bucket is final (reduced over the replicas, if any): the tied wte's exchange may start.
  void bucket_final(int b) {
    if (auto copy = tied_.bucket_final(b))
      caf::anon_send(wiring_.tied_partner, tied_grad{plan_.step, cfg_.replica, std::move(*copy)});
  }

  void on_tied(const tied_grad& t) {
    tied_.received(t.data);
    if (zero()) flush_tied_waiting();
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
    dp_wait_since_ = cfg_.trace.now_us();
    check_grads_ready();
  }

  void check_grads_ready() {
    if (!compute_done_ || grads_sent_ || buckets_pending_ > 0 || !tied_.done()) return;
    grads_sent_ = true;
    const double now = cfg_.trace.now_us();
    if (cfg_.replicas > 1 || tied_.copies() == 1)
      cfg_.trace.span("wait", cfg_.replicas > 1 ? "dp" : "tied", dp_wait_since_, now, {plan_.step});
    double sq = 0;
    if (zero_on_device()) {
      sq = device_zero_.square_sum();
    } else if (zero()) {
      for (double s : shard_square_sums_) sq += s;
    } else {
      for (int c = 0; c < chunks_->chunk_count(); ++c) {
        const auto& r = chunks_->range(c);
        sq += chunks_->grad_square_sum(c, !(r.head && !r.embedding));
      }
    }
    caf::anon_send(wiring_.coordinator,
                   grads_ready{plan_.step, my_rank(), lane(), sq, loss_sum_, losses_});
  }

  // A skipped update (the coordinator's guard) drops the step's gradients and leaves the
  // parameters and moments as they are.
  void on_update(const apply_update& u) {
    capture_->wait_for_copies();  // S7
    if (zero_on_device()) {
      update_on_devices(u);
      return;
    }
    if (zero()) {
      caf::anon_send(wiring_.reducer, zero_update{u.step, u.grad_norm, u.skip, u.unscale});
      return;
    }
    const double t0 = cfg_.trace.now_us();
    double lr = engine::learning_rate(cfg_.optimizer, u.step, cfg_.total_steps);
    if (!u.skip)
      for (int c = 0; c < chunks_->chunk_count(); ++c)
        lr = chunks_->update(c, cfg_.optimizer, u.step, cfg_.total_steps, u.grad_norm, u.unscale);
    chunks_->zero_grad();
    if (!u.skip) cfg_.trace.span("optimizer", "AdamW", t0, cfg_.trace.now_us(), {u.step});
    caf::anon_send(wiring_.coordinator, update_done{u.step, my_rank(), lane(), lr, memory()});
    flush_trace();
  }

  // ZeRO through the devices: AdamW on the owned floats, then (ZeRO-1/2) every bucket's
  // all-gather (bucket_gathered each); ZeRO-3 gathers each bucket before its next use. A skipped
  // update changes nothing: every replica's parameters are still the same whole ones.
  void update_on_devices(const apply_update& u) {
    update_lr_ = engine::learning_rate(cfg_.optimizer, u.step, cfg_.total_steps);
    if (u.skip || buckets_.size() == 0) {
      update_gathered(u.step);
      return;
    }
    const double t0 = cfg_.trace.now_us();
    update_lr_ =
        device_zero_.update(cfg_.optimizer, u.step, cfg_.total_steps, u.grad_norm, u.unscale);
    cfg_.trace.span("optimizer", "AdamW shard", t0, cfg_.trace.now_us(), {u.step});
    if (sharded_params()) {
      update_gathered(u.step);
      return;
    }
    gathers_pending_ = buckets_.size();
    gather_t0_ = cfg_.trace.now_us();
    for (int b = 0; b < buckets_.size(); ++b)
      device_zero_.all_gather(u.step, b, [me = address(), step = u.step, b](void* done) {
        if (auto self = caf::actor_cast<caf::actor>(me))
          caf::anon_send(self, bucket_gathered{step, b, done});
      });
  }

  void on_bucket_gathered(const bucket_gathered& g) {
    if (g.collective != zero_collective::buckets) {  // ZeRO-3: a gather for a use
      if (g.done) chunks_->wait_event(buckets_.bucket(g.bucket).chunk, g.done);
      device_zero_.bucket_gathered(g.bucket);
      on_gathered(zero_gathered{g.step, g.collective, g.seq});
      return;
    }
    if (gathers_pending_ <= 0) throw std::logic_error(who() + ": a gather nobody waits for");
    if (g.done) chunks_->wait_event(buckets_.bucket(g.bucket).chunk, g.done);
    if (--gathers_pending_ > 0) return;
    cfg_.trace.span("collective", "all-gather (enqueued)", gather_t0_, cfg_.trace.now_us(),
                    {g.step});
    device_zero_.gathered();
    update_gathered(g.step);
  }

  void update_gathered(int step) {
    chunks_->zero_grad();
    caf::anon_send(wiring_.coordinator, update_done{step, my_rank(), lane(), update_lr_, memory()});
    flush_trace();
  }

  // The shard updated its floats and every replica's parameters are whole again (in the host
  // buffers: device chunks load them).
  void on_zero_updated(const zero_update_done& d) {
    if (device()) {
      if (!sharded_params())  // ZeRO-3: each bucket is loaded when gathered for its next use
        for (int c = 0; c < chunks_->chunk_count(); ++c)
          chunks_->parameters_from_host(c, 0, chunks_->parameter_count(c));
      chunks_->zero_grad();
    } else if (!release_grads()) {
      chunks_->zero_grad();  // ZeRO-2: zeroed when taken back (next step)
    }
    engine::memory_report mem = memory();
    mem.parameters += d.memory.parameters;  // ZeRO-3: the owned parameters
    mem.optimizer += d.memory.optimizer;
    mem.gradients += d.memory.gradients;
    mem.buffers += d.memory.buffers;
    caf::anon_send(wiring_.coordinator, update_done{d.step, my_rank(), lane(), d.lr, mem});
    flush_trace();
  }

  // What the stage itself holds: parameter and gradient buffers and its optimizer state. A
  // ZeRO-2 gradient buffer is released bucket by bucket: its resident pages count as buffers.
  // ZeRO-3 parameter buffers hold gathered buckets only: their peak this step counts as buffers.
  // Released pages kept for reuse (the page pools) count as pooled. Device chunks: everything
  // they allocated beyond fp32 weights, gradients and moments counts as activations; with ZeRO,
  // the host copies the shard works on count as buffers.
  engine::memory_report memory() {
    engine::memory_report m;
    m.replica = lane();
    m.rank = my_rank();
    for (int c = 0; c < chunks_->chunk_count(); ++c) {
      const auto bytes = chunks_->parameter_count(c) * static_cast<std::int64_t>(sizeof(float));
      if (!sharded_params()) m.parameters += bytes;  // ZeRO-3: the shard holds them
      if (release_grads() && !device())
        m.buffers += engine::resident_bytes(chunks_->gradients(c), bytes);
      else
        m.gradients += bytes;
      if (zero() && device() && !zero_on_device())
        m.buffers += engine::resident_bytes(chunks_->host_parameters(c), bytes) +
                     engine::resident_bytes(chunks_->host_gradients(c), bytes);
    }
    if (zero_on_device() && sharded_params())  // the owned master weights, beside their moments
      m.parameters += device_zero_.owned_floats() * static_cast<std::int64_t>(sizeof(float));
    m.optimizer = chunks_->optimizer_bytes();  // with ZeRO: the owned floats', or none (shards)
    m.activations = chunks_->activation_bytes();
    if (gathers_) {
      m.buffers += gathers_->peak_bytes();  // ZeRO-3: the most gathered at once this step
      m.pooled += gathers_->pooled_bytes();
    }
    if (grad_pool_) m.pooled += grad_pool_->pooled_bytes();
    return m;
  }

  void flush_trace() {
    if (cfg_.trace.enabled() && !cfg_.trace.empty())
      caf::anon_send(wiring_.tracer, trace_batch{cfg_.trace.take()});
  }

  // state: a checkpoint's (parameters under their checkpoint names); with moments, the AdamW
  // moments as pieces (topology/stage_state.hpp).
  stage_snapshot snapshot(bool state = false, bool moments = false) {
    std::vector<engine::rank_chunks::host_state> states;
    for (int c = 0; c < chunks_->chunk_count(); ++c)
      states.push_back(chunks_->state_on_host(c, moments));
    return snapshot_of(states, state, moments);
  }
  stage_snapshot snapshot_of(const std::vector<engine::rank_chunks::host_state>& states, bool state,
                             bool moments) const {
    return topology::snapshot_of(*chunks_, states, state, moments, my_rank(), cfg_.replica);
  }

  stage_config cfg_;
  stage_wiring wiring_;
  std::unique_ptr<engine::rank_chunks> chunks_;
  topology::grad_buckets buckets_;
  topology::incoming_credits incoming_;
  topology::outgoing_credits outgoing_;
  std::map<link_key, outgoing> held_;
  topology::payload_links links_;                 // device chunks: how payloads cross to each peer
  std::map<int, std::vector<float>> staged_;      // by bucket: host copies (stage_buckets)
  std::map<link_key, link_message> stash_links_;  // device chunks: headers, payloads in slots
  std::map<batch_key, batch_message> stash_batches_;
  step_plan plan_;
  const std::vector<engine::pipeline_action>* actions_ = nullptr;
  std::vector<int> last_weight_;
  int cursor_ = 0;
  std::optional<running_action> run_;
  const char* waiting_for_ = "input";
  // ZeRO-3
  std::unique_ptr<topology::param_gathers> gathers_;  // which buckets the buffers hold
  std::unique_ptr<engine::page_pool> grad_pool_;      // ZeRO-2/3: released gradient pages
  bool consolidated_ = false;  // the final weights are gathered: nothing is released any more
  int final_pending_ = 0;
  std::vector<caf::typed_response_promise<stage_snapshot>> snapshots_waiting_;
  std::unique_ptr<topology::stage_capture> capture_;  // S7, W5: its checkpoints
  bool active_ = false, compute_done_ = false, grads_sent_ = false;
  double waiting_since_ = -1, dp_wait_since_ = 0;
  double loss_sum_ = 0;
  int losses_ = 0;
  int buckets_pending_ = 0;
  std::vector<double> shard_square_sums_;  // ZeRO: by bucket, this step
  std::vector<int> tied_waiting_;          // ZeRO: complete buckets waiting for the tied exchange
  int untied_left_ = 0;                    // and (S8) the other buckets not sent yet this step
  std::vector<engine::bucket_shard> zero_shards_;  // ZeRO: what this replica owns, by bucket
  topology::device_zero device_zero_;              // ZeRO through the devices' group
  int gathers_pending_ = 0;                        // and its update's all-gathers still running
  double update_lr_ = 0, gather_t0_ = 0;
  std::shared_ptr<engine::action_watchdog::entry> watch_;  // this stage's watchdog record
  int embedding_chunk_ = -1, head_chunk_ = -1;
  topology::tied_wte tied_;  // the tied wte's copies here and their exchange
};

}  // namespace

stage_actor spawn_stage(caf::actor_system& system, stage_config config) {
  return system.spawn<stage_impl, caf::detached>(std::move(config));
}

}  // namespace troupe::actors
