// The gateway, its proxies and the mesh they share. See gateway.hpp.
#include "actors/gateway.hpp"

#include <deque>
#include <functional>
#include <future>
#include <map>
#include <mutex>

#include "actors/error_text.hpp"
#include "transport/ucx_transport.hpp"

namespace troupe::actors {

using namespace messages;
using clock_type = std::chrono::steady_clock;

struct mesh_state {
  gateway_config cfg;
  std::unique_ptr<transport::ucx_transport> transport;
  // Fixed before the gateway starts.
  std::map<std::uint32_t, caf::actor> local, proxies;
  std::map<std::uint32_t, std::function<void(wire::body&&)>> sinks;
  std::map<std::uint32_t, std::string> names;
  std::map<std::uint32_t, int> proxy_rank;
  caf::actor client;
  // Shared with every thread that posts.
  std::mutex mu;
  std::deque<std::pair<int, wire::envelope>> outbox;
  bool stop_requested = false;
  bool started = false, stopped = false;
  std::promise<void> finished;

  void post(int rank, wire::envelope e) {
    {
      std::lock_guard<std::mutex> lock(mu);
      outbox.emplace_back(rank, std::move(e));
    }
    transport->wake();
  }
  std::string host(int r) const {
    const auto i = static_cast<std::size_t>(r);
    return i < cfg.hosts.size() ? cfg.hosts[i] : "?";
  }
};

namespace {

// Answers one request that arrived from another process, then stops.
caf::behavior responder(caf::event_based_actor* self, std::shared_ptr<mesh_state> s,
                        caf::actor target, int origin, std::uint32_t id, std::uint64_t corr,
                        snapshot_request request) {
  self->request(target, caf::infinite, request)
      .then(
          [=](stage_snapshot& snap) {
            s->post(origin, wire::envelope{id, s->cfg.rank, corr, true, std::move(snap)});
            self->quit();
          },
          [=](caf::error& err) {
            s->post(origin, wire::envelope{0, s->cfg.rank, 0, false,
                                           error_report{s->cfg.rank, "snapshot of " + s->names[id] +
                                                                         ": " + error_text(err)}});
            self->quit();
          });
  return {};
}

struct proxy_state {
  std::map<std::uint64_t, caf::response_promise> pending;
  std::uint64_t next = 0;
};

template <class... Ts>
caf::behavior proxy_behavior(caf::stateful_actor<proxy_state>* self, std::shared_ptr<mesh_state> s,
                             std::uint32_t id, int rank) {
  return {
      [s, id, rank](Ts& m) {
        s->post(rank, wire::envelope{id, s->cfg.rank, 0, false, std::move(m)});
      }...,
      [=](snapshot_request& r) {
        auto rp = self->make_response_promise();
        const auto corr = ++self->state.next;
        self->state.pending.emplace(corr, rp);
        s->post(rank, wire::envelope{id, s->cfg.rank, corr, false, r});
        return rp;
      },
      [=](remote_reply& r) {
        auto it = self->state.pending.find(r.correlation);
        if (it == self->state.pending.end()) return;
        it->second.deliver(std::move(r.snapshot));
        self->state.pending.erase(it);
      },
      [=](remote_down& d) { self->quit(caf::make_error(caf::sec::runtime_error, d.reason)); },
  };
}

caf::behavior proxy(caf::stateful_actor<proxy_state>* self, std::shared_ptr<mesh_state> s,
                    std::uint32_t id, int rank) {
  return proxy_behavior<link_message, link_credit, batch_message, batch_credit, step_plan,
                        begin_step, begin_eval, grads_ready, apply_update, update_done, eval_done,
                        tied_grad, trace_batch, step_report, ring_chunk, checkpoint_chunk>(
      self, std::move(s), id, rank);
}

class gateway_impl : public caf::blocking_actor {
 public:
  gateway_impl(caf::actor_config& c, std::shared_ptr<mesh_state> s)
      : caf::blocking_actor(c), s_(std::move(s)) {}

  void act() override {
    try {
      run();
    } catch (...) {
      detach();
      throw;
    }
    detach();
  }

  // The transport outlives this actor (it completes leftover sends in its destructor): from
  // here on its callbacks must not reach this object.
  void detach() {
    *alive_ = false;
    s_->transport->on_receive([](int, std::shared_ptr<aligned_buffer>, std::size_t) {});
    s_->transport->on_peer_error([](int, const std::string&) {});
    s_->finished.set_value();
  }

 private:
  void run() {
    auto& t = *s_->transport;
    const int world = s_->cfg.world;
    last_heard_.assign(static_cast<std::size_t>(world), clock_type::now());
    arrived_.assign(static_cast<std::size_t>(world), 0);
    lost_.assign(static_cast<std::size_t>(world), false);
    in_flight_.assign(static_cast<std::size_t>(world), 0);
    for (const auto& [id, a] : s_->local) monitor(a);
    t.on_receive([this](int peer, std::shared_ptr<aligned_buffer> buf, std::size_t bytes) {
      on_frame(peer, std::move(buf), bytes);
    });
    t.on_peer_error([this](int peer, const std::string& why) { lost(peer, "UCX error: " + why); });
    auto next_beat = clock_type::now();
    clock_type::time_point stop_deadline{};
    for (;;) {
      drain_mailbox();
      bool stopping = false;
      std::deque<std::pair<int, wire::envelope>> out;
      {
        std::lock_guard<std::mutex> lock(s_->mu);
        out.swap(s_->outbox);
        stopping = s_->stop_requested;
      }
      for (auto& [rank, e] : out) send(rank, std::move(e));
      // Bounded: a peer that stopped draining (SIGSTOP) must not keep this loop from its
      // heartbeats and liveness checks.
      for (int i = 0; i < 1024 && t.progress() > 0; ++i) {
      }
      const auto now = clock_type::now();
      if (now >= next_beat) {
        beat();
        next_beat = now + s_->cfg.heartbeat_interval;
      }
      check_liveness(now);
      if (stopping) {
        if (stop_deadline == clock_type::time_point{})
          stop_deadline = now + std::chrono::seconds(5);
        bool empty = false;
        {
          std::lock_guard<std::mutex> lock(s_->mu);
          empty = s_->outbox.empty();
        }
        if ((empty && flushed()) || now >= stop_deadline) break;
        t.wait(std::chrono::microseconds(1000));
      } else if (out.empty()) {
        t.wait(std::chrono::microseconds(50000));
      }
    }
  }

  void drain_mailbox() {
    for (int i = 0; i < 64; ++i) {
      bool idle = false;
      receive([this](caf::down_msg& d) { on_local_down(d); },
              caf::after(std::chrono::seconds(0)) >> [&] { idle = true; });
      if (idle) return;
    }
  }

  void send(int rank, wire::envelope e) {
    if (lost_[static_cast<std::size_t>(rank)]) return;
    wire::frame f;
    try {
      f = wire::encode(e);
    } catch (const std::exception& x) {
      fail_job("cannot encode " + std::string(wire::kind_name(e.message)) + " for rank " +
               std::to_string(rank) + ": " + x.what());
      return;
    }
    ++in_flight_[static_cast<std::size_t>(rank)];
    s_->transport->send(
        rank, f.iov, [this, alive = alive_, keep = f.keep, rank](bool ok, const std::string& why) {
          if (!*alive) return;
          --in_flight_[static_cast<std::size_t>(rank)];
          if (!ok) lost(rank, "send failed: " + why);
        });
  }

  void beat() {
    const int me = s_->cfg.rank;
    for (int r = 0; r < s_->cfg.world; ++r)
      if (r != me && (me == 0 || r == 0))
        send(r, wire::envelope{0, me, 0, false, heartbeat{me, ++beats_}});
  }

  // A peer is heard from when any of its messages arrives (so every frame delivered by the
  // progress() before this check counts too), not only when a frame of it is delivered: its
  // frames can wait behind this process's own receive backlog (per-peer order,
  // rendezvous receives under their bounds, e.g. behind fetches from a peer that just died),
  // and a live peer must not be named lost for that.
  void check_liveness(clock_type::time_point now) {
    const int me = s_->cfg.rank;
    for (int r = 0; r < s_->cfg.world; ++r) {
      if (r == me || (me != 0 && r != 0) || lost_[static_cast<std::size_t>(r)]) continue;
      const std::uint32_t arrived = s_->transport->messages_arrived(r);
      if (arrived != arrived_[static_cast<std::size_t>(r)]) {
        arrived_[static_cast<std::size_t>(r)] = arrived;
        last_heard_[static_cast<std::size_t>(r)] = now;
      }
      const auto silent = now - last_heard_[static_cast<std::size_t>(r)];
      if (silent > s_->cfg.peer_timeout) {
        const double secs = std::chrono::duration<double>(silent).count();
        lost(r, "no heartbeat for " + std::to_string(secs).substr(0, 4) + " s");
      }
    }
  }

  // Peer `r` is gone: every proxy of its actors stops naming it; losing rank 0 ends this process.
  void lost(int r, const std::string& why) {
    if (lost_[static_cast<std::size_t>(r)]) return;
    lost_[static_cast<std::size_t>(r)] = true;
    const std::string text = "rank " + std::to_string(r) + " (" + s_->host(r) + ") lost: " + why;
    for (const auto& [id, rank] : s_->proxy_rank)
      if (rank == r) caf::anon_send(s_->proxies[id], remote_down{text});
    if (r == 0 && s_->client) caf::anon_send(s_->client, run_finished{false, text});
  }

  void fail_job(const std::string& text) {
    if (s_->cfg.rank == 0) {
      if (s_->client) caf::anon_send(s_->client, run_finished{false, text});
    } else {
      send(0, wire::envelope{0, s_->cfg.rank, 0, false, error_report{s_->cfg.rank, text}});
    }
  }

  void on_local_down(const caf::down_msg& d) {
    for (const auto& [id, a] : s_->local) {
      if (a.address() != d.source) continue;
      if (!d.reason || d.reason == caf::exit_reason::user_shutdown) return;
      const std::string text =
          s_->names[id] + " on rank " + std::to_string(s_->cfg.rank) + ": " + error_text(d.reason);
      for (int r = 0; r < s_->cfg.world; ++r)
        if (r != s_->cfg.rank)
          send(r, wire::envelope{0, s_->cfg.rank, 0, false, actor_down{id, text}});
      return;
    }
  }

  void on_frame(int peer, std::shared_ptr<aligned_buffer> buf, std::size_t bytes) {
    if (peer < 0 || peer >= s_->cfg.world) return;
    wire::envelope e;
    try {
      e = wire::decode(std::move(buf), bytes, s_->cfg.limits);
    } catch (const std::exception& x) {
      fail_job("rank " + std::to_string(peer) + " sent a frame rank " +
               std::to_string(s_->cfg.rank) + " cannot read: " + x.what());
      return;
    }
    if (e.reply) {
      auto it = s_->proxies.find(e.target);
      auto* snap = std::get_if<stage_snapshot>(&e.message);
      if (it != s_->proxies.end() && snap)
        caf::anon_send(it->second, remote_reply{e.correlation, std::move(*snap)});
      return;
    }
    if (e.target == 0) {
      on_control(peer, std::move(e.message));
      return;
    }
    if (auto sink = s_->sinks.find(e.target); sink != s_->sinks.end() && e.correlation == 0) {
      try {  // a group member that cannot take the message breaks the job, not the gateway
        sink->second(std::move(e.message));
      } catch (const std::exception& x) {
        fail_job("rank " + std::to_string(s_->cfg.rank) + ": " + x.what());
      }
      return;
    }
    auto it = s_->local.find(e.target);
    if (it == s_->local.end()) {
      fail_job("rank " + std::to_string(peer) + " sent " + std::string(wire::kind_name(e.message)) +
               " to actor " + std::to_string(e.target) + ", which is not on rank " +
               std::to_string(s_->cfg.rank));
      return;
    }
    if (e.correlation != 0) {  // a request: only snapshot_request is one
      const auto* request = std::get_if<snapshot_request>(&e.message);
      if (!request) {
        fail_job("rank " + std::to_string(peer) + " sent " +
                 std::string(wire::kind_name(e.message)) + " as a request");
        return;
      }
      home_system().spawn(responder, s_, it->second, peer, e.target, e.correlation, *request);
      return;
    }
    std::visit([&](auto& m) { caf::anon_send(it->second, std::move(m)); }, e.message);
  }

  void on_control(int peer, wire::body message) {
    if (auto* down = std::get_if<actor_down>(&message)) {
      auto it = s_->proxies.find(down->actor);
      if (it != s_->proxies.end()) caf::anon_send(it->second, remote_down{down->reason});
    } else if (auto* end = std::get_if<job_shutdown>(&message)) {
      if (s_->client) caf::anon_send(s_->client, run_finished{end->ok, end->message});
    } else if (auto* err = std::get_if<error_report>(&message)) {
      if (s_->client)
        caf::anon_send(s_->client, run_finished{false, "rank " + std::to_string(err->rank) + ": " +
                                                           err->message});
    }
    // heartbeat: its arrival was counted (messages_arrived), which check_liveness reads.
  }

  std::shared_ptr<mesh_state> s_;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);
  std::vector<clock_type::time_point> last_heard_;
  std::vector<std::uint32_t> arrived_;  // messages_arrived() at the last liveness check
  std::vector<bool> lost_;
  std::uint64_t beats_ = 0;
  std::vector<int> in_flight_;  // sends not yet completed, by peer

  // Every send to a peer that is still there has completed.
  bool flushed() const {
    for (std::size_t r = 0; r < in_flight_.size(); ++r)
      if (in_flight_[r] > 0 && !lost_[r]) return false;
    return true;
  }
};

}  // namespace

remote_mesh::remote_mesh(std::unique_ptr<transport::ucx_transport> transport, gateway_config config)
    : state_(std::make_shared<mesh_state>()) {
  state_->cfg = std::move(config);
  state_->transport = std::move(transport);
}

// Normal ends call shutdown() first; reaching here unstopped means the driver left early.
remote_mesh::~remote_mesh() {
  shutdown(false, "the process of rank " + std::to_string(state_->cfg.rank) +
                      " stopped before the job ended");
}

int remote_mesh::rank() const { return state_->cfg.rank; }

caf::actor remote_mesh::make_proxy(caf::actor_system& sys, std::uint32_t id, int rank,
                                   std::string name) {
  auto p = sys.spawn(proxy, state_, id, rank);
  state_->proxies[id] = p;
  state_->proxy_rank[id] = rank;
  state_->names[id] = std::move(name);
  return p;
}

void remote_mesh::add_local(std::uint32_t id, caf::actor actor, std::string name) {
  state_->local[id] = std::move(actor);
  state_->names[id] = std::move(name);
}

void remote_mesh::add_sink(std::uint32_t id, std::function<void(messages::wire::body&&)> sink,
                           std::string name) {
  state_->sinks[id] = std::move(sink);
  state_->names[id] = std::move(name);
}

void remote_mesh::start(caf::actor_system& sys, caf::actor client) {
  state_->client = std::move(client);
  state_->started = true;
  sys.spawn<gateway_impl, caf::detached>(state_);
}

void remote_mesh::post(int rank, wire::envelope e) { state_->post(rank, std::move(e)); }

void remote_mesh::shutdown(bool ok, const std::string& message) {
  auto& s = *state_;
  if (s.stopped) return;
  s.stopped = true;
  if (s.started) {
    if (s.cfg.rank == 0)
      for (int r = 1; r < s.cfg.world; ++r)
        s.post(r, wire::envelope{0, 0, 0, false, job_shutdown{ok, message}});
    {
      std::lock_guard<std::mutex> lock(s.mu);
      s.stop_requested = true;
    }
    s.transport->wake();
    // Bounded: a gateway stuck past this is left running rather than waited for forever.
    if (s.finished.get_future().wait_for(std::chrono::seconds(10)) != std::future_status::ready)
      return;
  }
  for (auto& [id, p] : s.proxies) caf::anon_send_exit(p, caf::exit_reason::user_shutdown);
  s.proxies.clear();
  s.local.clear();
  s.sinks.clear();
  s.client = nullptr;
}

}  // namespace troupe::actors
