// A training service: an HTTP server on the loopback interface that embeds a Troupe trainer
// (docs/embedding.md, "An HTTP service") and lets a script or an operator drive it: train N more
// steps, pause, read the status as JSON, commit a checkpoint, swap the pipeline schedule, scrape
// Prometheus metrics, stop.
//
//   trainer_service RECIPE.toml [--port P] [--set key=value ...] [--resume DIR] [--threads N]
//
// It checks the port is free, spawns the trainer (paused before the first step), then binds
// 127.0.0.1 only (port 0, the default: a free one) and prints one line, "listening on
// 127.0.0.1:PORT", to stdout once requests are taken: bad input exits before anything listens.
// POST /stop, SIGINT or SIGTERM end the run between steps (final weights written) and the
// process; a second SIGINT or SIGTERM ends it at once (exit code 130 or 143, no final weights).
// Exit code 0 when the run finished, 1 when it failed (or the trainer did not stop), 2 for bad
// input (a recipe key, the port).
//
// Endpoints (JSON bodies; every error is a 4xx or 5xx with {"error": "one line"}):
//   GET  /status      the trainer's state, steps, last loss and the last step's metrics
//   GET  /metrics     Prometheus text format 0.0.4, metric names troupe_*
//   POST /train       {"steps": N, "wait": false, "timeout_s": 600}: N more steps; 202 at once,
//                     or with "wait": true, 200 once they are done or the run paused before,
//                     202 when timeout_s ran out first
//   POST /pause       200 once the step in flight is done
//   POST /checkpoint  200 {"path", "step"} once a checkpoint is committed (the run is paused)
//   POST /schedule    {"name": "gpipe"}: the pipeline schedule from the next step
//   POST /stop        200 with the final status; then the process exits
// No wait is unbounded: /status and /metrics give the trainer 5 s (503 after), /pause,
// /checkpoint, /schedule and /stop 600 s (504 after), a waiting /train its timeout_s; a trainer
// that stops without answering is a 503 at once.
//
// Threads: cpp-httplib answers each request on a thread of its pool; a handler talks to the
// trainer through a caf::scoped_actor of its own (the request, then its answer, the trainer's
// end or the time limit, whichever comes first). The step events go to one collector actor,
// which keeps the last one and the counters for /metrics. Signals go to one thread; a stop it
// asks for runs on another, so that a second signal is taken while the first stop runs.
#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <initializer_list>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "troupe/trainer.hpp"

namespace trainer_service {

using json = nlohmann::ordered_json;  // fields in the order written
using phase = troupe::trainer_status::phase;

// What the collector keeps of the step events.
struct metrics_snapshot {
  std::optional<troupe::step_event> last;  // the last step's event
  std::optional<double> val_loss;          // the last validation loss seen
  std::int64_t skipped_updates = 0;        // steps whose update the guard skipped
};
struct snapshot_request {};

}  // namespace trainer_service

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(trainer_service::metrics_snapshot)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(trainer_service::snapshot_request)

namespace trainer_service {
namespace {

constexpr int exit_failed = 1, exit_bad_input = 2;

// How long a handler waits for the trainer: a status query (/status, /metrics, the status a
// request answers with), work that waits for a step or a write (/pause, /checkpoint, /schedule,
// /stop), a waiting /train unless it says (timeout_s, at most train_wait_max_s).
constexpr std::chrono::seconds quick{5}, patient{600};
constexpr double train_wait_default_s = 600, train_wait_max_s = 3600;

// The step events' subscriber: keeps what /metrics and /status show of them. (A class: CAF
// 0.17's function-based actors without arguments dereference a null pointer, which UBSan reports.)
class collector : public caf::event_based_actor {
 public:
  using caf::event_based_actor::event_based_actor;

  caf::behavior make_behavior() override {
    return {
        [this](troupe::step_event& e) {
          if (e.val_loss) kept_.val_loss = e.val_loss;
          if (!e.skipped.empty()) ++kept_.skipped_updates;
          kept_.last = std::move(e);
        },
        [this](snapshot_request) { return kept_; },
    };
  }

 private:
  metrics_snapshot kept_;
};

const char* phase_name(phase p) {
  switch (p) {
    case phase::paused:
      return "paused";
    case phase::running:
      return "running";
    case phase::finished:
      return "finished";
    case phase::failed:
      return "failed";
  }
  return "unknown";
}

json number_or_null(double x) { return std::isfinite(x) ? json(x) : json(nullptr); }

json event_json(const troupe::step_event& e) {
  json j{{"step", e.step},
         {"loss", number_or_null(e.loss)},
         {"lr", e.lr},
         {"grad_norm", number_or_null(e.grad_norm)},
         {"tokens_per_second", e.tokens_per_s},
         {"step_ms", e.step_ms},
         {"tokens", e.tokens},
         {"memory", json::array()}};
  if (e.val_loss) j["val_loss"] = number_or_null(*e.val_loss);
  if (!e.skipped.empty()) j["skipped"] = e.skipped;
  for (const auto& m : e.memory)
    j["memory"].push_back({{"replica", m.replica},
                           {"rank", m.rank},
                           {"parameters", m.parameters},
                           {"gradients", m.gradients},
                           {"optimizer", m.optimizer},
                           {"buffers", m.buffers},
                           {"pooled", m.pooled},
                           {"activations", m.activations}});
  return j;
}

json status_json(const troupe::trainer_status& s, const metrics_snapshot& m) {
  json j{{"state", phase_name(s.state)},
         {"step", s.step},
         {"total_steps", s.total_steps},
         {"last_loss", number_or_null(s.last_loss)},
         {"skipped_updates", m.skipped_updates},
         {"last_step", m.last ? event_json(*m.last) : json(nullptr)}};
  if (!s.error.empty()) j["failure"] = s.error;
  return j;
}

std::string dump(const json& j) {  // never throws on bytes that are not UTF-8
  return j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
}

// The Prometheus text exposition format, version 0.0.4.
class exposition {
 public:
  void family(const char* name, const char* type, const char* help) {
    out_ += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  }
  void sample(const char* name, double value, const std::string& labels = "") {
    out_ += name;
    if (!labels.empty()) out_ += "{" + labels + "}";
    out_ += " " + format(value) + "\n";
  }
  void gauge(const char* name, const char* help, double value) {
    family(name, "gauge", help);
    sample(name, value);
  }
  const std::string& text() const { return out_; }

 private:
  static std::string format(double x) {
    if (std::isnan(x)) return "NaN";
    if (std::isinf(x)) return x > 0 ? "+Inf" : "-Inf";
    char buf[64];
    const auto r = std::to_chars(buf, buf + sizeof buf, x);
    return std::string(buf, r.ptr);
  }
  std::string out_;
};

std::string metrics_text(const troupe::trainer_status& s, const metrics_snapshot& m) {
  exposition x;
  x.gauge("troupe_step", "Steps done.", s.step);
  x.gauge("troupe_total_steps", "The recipe's steps.", s.total_steps);
  x.family("troupe_state", "gauge",
           "1 for the run's present state (paused, running, finished, failed), 0 for the others.");
  for (phase p : {phase::paused, phase::running, phase::finished, phase::failed})
    x.sample("troupe_state", s.state == p ? 1 : 0, std::string("state=\"") + phase_name(p) + "\"");
  x.family("troupe_tokens_total", "counter", "Training tokens processed.");
  x.sample("troupe_tokens_total", m.last ? double(m.last->tokens) : 0.0);
  x.family("troupe_skipped_updates_total", "counter",
           "Steps whose update the update guard skipped, since the service started.");
  x.sample("troupe_skipped_updates_total", double(m.skipped_updates));
  if (!m.last) return x.text();  // no step done since the service started
  const auto& e = *m.last;
  x.gauge("troupe_loss", "Training loss of the last step (mean over its micro-batches).", e.loss);
  if (m.val_loss) x.gauge("troupe_validation_loss", "The last validation loss.", *m.val_loss);
  x.gauge("troupe_learning_rate", "Learning rate of the last step.", e.lr);
  x.gauge("troupe_grad_norm", "Gradient norm of the last step, before clipping.", e.grad_norm);
  x.gauge("troupe_tokens_per_second", "Training throughput of the last step.", e.tokens_per_s);
  x.gauge("troupe_step_duration_seconds", "Wall time of the last step.", e.step_ms / 1e3);
  if (e.memory.empty()) return x.text();
  x.family("troupe_memory_bytes", "gauge",
           "Memory a pipeline rank of a replica holds at the end of the last step, by kind.");
  for (const auto& r : e.memory) {
    const std::string at =
        "replica=\"" + std::to_string(r.replica) + "\",rank=\"" + std::to_string(r.rank) + "\"";
    const std::pair<const char*, std::int64_t> kinds[] = {
        {"parameters", r.parameters}, {"gradients", r.gradients}, {"optimizer", r.optimizer},
        {"buffers", r.buffers},       {"pooled", r.pooled},       {"activations", r.activations}};
    for (const auto& [kind, bytes] : kinds)
      x.sample("troupe_memory_bytes", double(bytes), at + ",kind=\"" + kind + "\"");
  }
  return x.text();
}

// An error answer: {"error": "one line"}.
void fail(httplib::Response& res, int status, std::string reason) {
  for (char& c : reason)
    if (static_cast<unsigned char>(c) < 0x20) c = ' ';
  res.status = status;
  res.set_content(dump(json{{"error", reason}}), "application/json");
}

// The body as a JSON object with no keys but `keys`; an empty body is {}. On bad input: a 400
// answer and nothing.
std::optional<json> body_object(const std::string& text, httplib::Response& res,
                                std::initializer_list<std::string_view> keys) {
  json j = json::object();
  if (text.find_first_not_of(" \t\r\n") != std::string::npos) {
    try {
      j = json::parse(text);
    } catch (const json::parse_error& e) {
      std::string what = e.what();  // "[json.exception.parse_error.101] parse error at ..."
      if (const auto at = what.find("] "); at != std::string::npos) what.erase(0, at + 2);
      fail(res, 400, "the body is not JSON: " + what);
      return std::nullopt;
    }
  }
  std::string expected;
  for (auto k : keys) expected += (expected.empty() ? "\"" : ", \"") + std::string(k) + "\"";
  if (!j.is_object()) {
    fail(res, 400,
         "the body must be a JSON object" +
             (expected.empty() ? std::string(" (or empty)") : " with " + expected));
    return std::nullopt;
  }
  for (const auto& item : j.items()) {
    bool known = false;
    for (auto k : keys) known = known || item.key() == k;
    if (!known) {
      fail(res, 400,
           "unknown field \"" + item.key() + "\"" +
               (expected.empty() ? std::string(" (this request takes none)")
                                 : " (expected " + expected + ")"));
      return std::nullopt;
    }
  }
  return j;
}

// What came of a request to the trainer: its answer; or none, because the time ran out
// (timed_out) or the trainer is gone (`error` says why).
template <class Answer>
struct reply_of {
  std::optional<Answer> value;
  bool timed_out = false;
  std::string error;
};

// The step of a checkpoint directory, from its name (step-00000008: 8).
std::optional<int> checkpoint_step(const std::string& dir) {
  const std::string name = std::filesystem::path(dir).filename().string();
  if (name.rfind("step-", 0) != 0 || name.size() == 5) return std::nullopt;
  int step = 0;
  const auto r = std::from_chars(name.data() + 5, name.data() + name.size(), step);
  if (r.ec != std::errc() || r.ptr != name.data() + name.size() || step < 0) return std::nullopt;
  return step;
}

std::string seconds_text(std::chrono::milliseconds d) {
  return d.count() % 1000 == 0 ? std::to_string(d.count() / 1000) + " s"
                               : std::to_string(d.count()) + " ms";
}

class service {
 public:
  service(caf::actor_system& system, troupe::trainer_actor trainer, caf::actor collector,
          httplib::Server& server)
      : system_(system),
        trainer_(std::move(trainer)),
        collector_(std::move(collector)),
        server_(server) {}

  void add_routes();

  // The run's end: the final status, and the HTTP code /stop answers with (200; 504 when the
  // trainer did not stop in time, 503 when it is gone: then the job may still run).
  struct ending {
    troupe::trainer_status status;
    int code = 200;
  };

  // Ends the run (between steps: final weights written) and the server. Idempotent: a second
  // call waits for the first and answers the same.
  ending stop() {
    std::lock_guard<std::mutex> lock(stop_mutex_);
    if (auto e = ended()) return *e;
    stopping_ = true;
    auto r = ask<troupe::trainer_status>(troupe::stop_training{}, patient);
    ending e;
    if (r.value) {
      e.status = *r.value;
    } else {
      e.status.state = phase::failed;
      e.status.error =
          r.timed_out ? "the trainer did not stop within " + seconds_text(patient) : r.error;
      e.code = r.timed_out ? 504 : 503;
    }
    {
      std::lock_guard<std::mutex> lock_end(end_mutex_);
      end_ = e;
    }
    // The server's loop may not have begun yet (a signal at the start).
    while (!listen_done_ && !server_.is_running())
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (server_.is_running()) server_.stop();
    return e;
  }
  void listen_done() { listen_done_ = true; }

 private:
  std::optional<ending> ended() {
    std::lock_guard<std::mutex> lock(end_mutex_);
    return end_;
  }

  // A request to the trainer from this thread and its answer, waited for at most `timeout`, or
  // until the trainer stops without answering. (The request goes as a message, not a CAF
  // request: its answer then comes as an ordinary message, and the wait can also end with the
  // trainer's down message.)
  template <class Answer, class Request>
  reply_of<Answer> ask(Request request, std::chrono::milliseconds timeout) {
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + timeout;
    caf::scoped_actor self{system_};
    self->monitor(trainer_);  // a down message when it stops (at once if it has)
    self->send(trainer_, std::move(request));
    reply_of<Answer> r;
    bool down = false, waiting = true;
    while (waiting) {
      // After the down message, only an answer already here (sent before it) counts.
      const auto left =
          down ? std::chrono::milliseconds(0)
               : std::max(std::chrono::milliseconds(0),
                          std::chrono::ceil<std::chrono::milliseconds>(deadline - clock::now()));
      self->receive(
          [&](Answer& a) {
            r.value = std::move(a);
            waiting = false;
          },
          [&](caf::error& e) {
            r.error = "the trainer answered with an error: " + to_string(e);
            waiting = false;
          },
          [&](caf::down_msg&) { down = true; },
          caf::after(left) >>
              [&] {
                waiting = false;
                if (down)
                  r.error = "the trainer has stopped without answering";
                else
                  r.timed_out = true;
              });
    }
    self->demonitor(trainer_.address());
    return r;
  }

  // What the collector holds; nothing if it does not answer within `quick`.
  std::optional<metrics_snapshot> snapshot() {
    caf::scoped_actor self{system_};
    std::optional<metrics_snapshot> m;
    self->request(collector_, quick, snapshot_request{})
        .receive([&](metrics_snapshot& s) { m = std::move(s); }, [](caf::error&) {});
    return m;
  }

  // An answer the trainer did not give: 504 (`timed_out_code`) when the time ran out, 503 when
  // it is gone.
  template <class Answer>
  void no_answer(httplib::Response& res, const reply_of<Answer>& r, std::chrono::milliseconds t,
                 int timed_out_code) {
    if (r.timed_out)
      return fail(res, timed_out_code, "the trainer did not answer within " + seconds_text(t));
    fail(res, 503, r.error);
  }

  // The trainer's status (within `quick`), or the final one once it has stopped; nothing (a
  // 503) otherwise.
  std::optional<troupe::trainer_status> status(httplib::Response& res) {
    auto r = ask<troupe::trainer_status>(troupe::query_status{}, quick);
    if (r.value) return r.value;
    if (auto e = ended()) return e->status;
    no_answer(res, r, quick, 503);
    return std::nullopt;
  }

  // The status of a run that can still take work; otherwise a 409 (or 503) and nothing.
  std::optional<troupe::trainer_status> live_status(httplib::Response& res) {
    if (stopping_) {
      fail(res, 409, "the service is stopping");
      return std::nullopt;
    }
    auto s = status(res);
    if (!s) return std::nullopt;
    if (s->state == phase::finished) {
      fail(res, 409,
           "the run has finished (" + std::to_string(s->step) + " of " +
               std::to_string(s->total_steps) + " steps); POST /stop ends the service");
      return std::nullopt;
    }
    if (s->state == phase::failed) {
      fail(res, 409, "the run failed: " + s->error);
      return std::nullopt;
    }
    return s;
  }

  void reply(httplib::Response& res, int code, const json& j) {
    res.status = code;
    res.set_content(dump(j), "application/json");
  }

  // `code` with the status and what the collector holds (503 if it does not answer).
  void reply_status(httplib::Response& res, int code, const troupe::trainer_status& s) {
    auto m = snapshot();
    if (!m) return fail(res, 503, "the step collector did not answer");
    reply(res, code, status_json(s, *m));
  }

  void get_status(const httplib::Request&, httplib::Response& res) {
    if (auto s = status(res)) reply_status(res, 200, *s);
  }

  void get_metrics(const httplib::Request&, httplib::Response& res) {
    auto s = status(res);
    if (!s) return;
    auto m = snapshot();
    if (!m) return fail(res, 503, "the step collector did not answer");
    res.status = 200;
    res.set_content(metrics_text(*s, *m), "text/plain; version=0.0.4; charset=utf-8");
  }

  void post_train(const std::string& text, httplib::Response& res) {
    auto body = body_object(text, res, {"steps", "wait", "timeout_s"});
    if (!body) return;
    const auto steps = body->find("steps");
    if (steps == body->end()) return fail(res, 400, "\"steps\" is missing");
    // (JSON's 3 parses as unsigned, -3 as signed, 3.0 as a float: only the first is taken.)
    const bool in_range = steps->is_number_unsigned() && steps->get<std::uint64_t>() >= 1 &&
                          steps->get<std::uint64_t>() <= 1'000'000'000u;
    if (!in_range)
      return fail(res, 400,
                  "\"steps\" must be an integer from 1 to 1000000000, not " + steps->dump());
    bool wait = false;
    if (const auto w = body->find("wait"); w != body->end()) {
      if (!w->is_boolean())
        return fail(res, 400, "\"wait\" must be true or false, not " + w->dump());
      wait = w->get<bool>();
    }
    double wait_s = train_wait_default_s;
    if (const auto t = body->find("timeout_s"); t != body->end()) {
      if (!t->is_number() || !(t->get<double>() > 0) || t->get<double>() > train_wait_max_s)
        return fail(
            res, 400,
            "\"timeout_s\" must be a number of seconds above 0 and at most 3600, not " + t->dump());
      if (!wait) return fail(res, 400, "\"timeout_s\" needs \"wait\": true");
      wait_s = t->get<double>();
    }
    if (!live_status(res)) return;
    const troupe::train_steps request{static_cast<int>(steps->get<std::int64_t>())};
    if (wait) {
      const auto limit =
          std::chrono::ceil<std::chrono::milliseconds>(std::chrono::duration<double>(wait_s));
      auto r = ask<troupe::trainer_status>(request, limit);
      if (r.value) return reply_status(res, 200, *r.value);
      if (!r.timed_out) return fail(res, 503, r.error);
      // Still running: the status now, as an asynchronous /train answers.
      if (auto s = status(res)) reply_status(res, 202, *s);
      return;
    }
    // Asynchronous: the request, then a status query from the same actor, which the trainer
    // handles after it (one sender's messages keep their order): the state is "running".
    caf::scoped_actor self{system_};
    self->send(trainer_, request);
    std::optional<troupe::trainer_status> s;
    std::string error;
    self->request(trainer_, quick, troupe::query_status{})
        .receive([&](troupe::trainer_status& a) { s = std::move(a); },
                 [&](caf::error& e) { error = to_string(e); });
    if (!s)
      return fail(
          res, 503,
          "the steps were asked for, but the trainer did not answer the status query: " + error);
    reply_status(res, 202, *s);
  }

  void post_pause(const std::string& text, httplib::Response& res) {
    if (!body_object(text, res, {})) return;
    if (!live_status(res)) return;
    auto r = ask<troupe::trainer_status>(troupe::pause_training{}, patient);
    if (!r.value) return no_answer(res, r, patient, 504);
    reply_status(res, 200, *r.value);
  }

  void post_checkpoint(const std::string& text, httplib::Response& res) {
    if (!body_object(text, res, {})) return;
    if (!live_status(res)) return;
    auto r = ask<troupe::checkpoint_result>(troupe::take_checkpoint{}, patient);
    if (!r.value) return no_answer(res, r, patient, 504);
    if (!r.value->ok) return fail(res, 500, "the checkpoint failed: " + r.value->error);
    // The step is the checkpoint's own (its directory's name): a status asked for now could
    // already count steps a /train began since.
    const auto step = checkpoint_step(r.value->path);
    reply(res, 200, {{"path", r.value->path}, {"step", step ? json(*step) : json(nullptr)}});
  }

  void post_schedule(const std::string& text, httplib::Response& res) {
    auto body = body_object(text, res, {"name"});
    if (!body) return;
    const auto name = body->find("name");
    if (name == body->end()) return fail(res, 400, "\"name\" is missing");
    if (!name->is_string() || name->get<std::string>().empty())
      return fail(res, 400, "\"name\" must be a schedule's name, not " + name->dump());
    if (!live_status(res)) return;
    auto r = ask<troupe::schedule_result>(troupe::use_schedule{name->get<std::string>()}, patient);
    if (!r.value) return no_answer(res, r, patient, 504);
    if (!r.value->ok) return fail(res, 400, r.value->message);
    reply(res, 200, {{"schedule", name->get<std::string>()}, {"message", r.value->message}});
  }

  void post_stop(const std::string& text, httplib::Response& res) {
    if (!body_object(text, res, {})) return;
    const auto e = stop();
    res.set_header("Connection", "close");
    if (e.code != 200) return fail(res, e.code, e.status.error);
    reply(res, 200, status_json(e.status, snapshot().value_or(metrics_snapshot{})));
  }

  caf::actor_system& system_;
  troupe::trainer_actor trainer_;
  caf::actor collector_;
  httplib::Server& server_;
  std::mutex stop_mutex_;  // held while a stop runs
  std::mutex end_mutex_;   // guards end_
  std::optional<ending> end_;
  std::atomic<bool> stopping_{false}, listen_done_{false};
};

// How a request's body comes (RFC 9112, 6): none, Content-Length bytes, or chunked (the only
// transfer coding cpp-httplib decodes, and only as Transfer-Encoding's sole value); a body with
// other codings cannot be read (nor its end found).
enum class framing { none, length, chunked, unreadable };

std::string lower_trimmed(std::string_view s) {
  const auto first = s.find_first_not_of(" \t");
  if (first == std::string_view::npos) return "";
  s = s.substr(first, s.find_last_not_of(" \t") - first + 1);
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

framing body_framing(const httplib::Request& req, std::string& codings) {
  const auto headers = req.get_header_value_count("Transfer-Encoding");
  if (headers == 0) return req.has_header("Content-Length") ? framing::length : framing::none;
  std::vector<std::string> list;  // every header's comma-separated codings, in order
  for (std::size_t i = 0; i < headers; ++i) {
    const std::string value = req.get_header_value("Transfer-Encoding", i);
    codings += (i ? ", " : "") + value;
    for (std::size_t at = 0; at <= value.size();) {
      auto comma = value.find(',', at);
      if (comma == std::string::npos) comma = value.size();
      if (auto c = lower_trimmed(std::string_view(value).substr(at, comma - at)); !c.empty())
        list.push_back(std::move(c));
      at = comma + 1;
    }
  }
  // cpp-httplib decodes chunked when the first header's whole value is "chunked" (any case).
  const bool decodable =
      headers == 1 && list.size() == 1 && list[0] == "chunked" &&
      strcasecmp(req.get_header_value("Transfer-Encoding").c_str(), "chunked") == 0;
  return decodable ? framing::chunked : framing::unreadable;
}

// A handler of a request with a body, given the body. cpp-httplib would read a body without
// Content-Length (`curl -X POST URL` sends none) until the client closes, which it never does;
// such a request has no body here. A body that cannot be read is refused with "Connection:
// close" (what is left of it must not be taken for the next request).
template <class F>
httplib::Server::HandlerWithContentReader with_body(F f) {
  return [f](const httplib::Request& req, httplib::Response& res,
             const httplib::ContentReader& reader) {
    std::string body, codings;
    const framing how = body_framing(req, codings);
    if (how == framing::unreadable) {
      res.set_header("Connection", "close");
      // A coding this server does not know: 501; chunked missing or not the last: 400.
      std::string last = codings.substr(codings.find_last_of(',') + 1);
      const bool chunked_last = lower_trimmed(last) == "chunked";
      return fail(res, chunked_last ? 501 : 400,
                  "Transfer-Encoding \"" + codings +
                      (chunked_last ? "\": only \"chunked\" alone is supported"
                                    : "\": the body's end cannot be found (chunked must be last)"));
    }
    if (how != framing::none) {
      const bool read = reader([&](const char* data, std::size_t n) {
        body.append(data, n);
        return true;
      });
      if (!read) {  // over the size limit (413), or cut short
        res.set_header("Connection", "close");
        return fail(res, res.status == 413 ? 413 : 400,
                    res.status == 413 ? "the body is over 64 KiB" : "the body was cut short");
      }
    }
    f(req, res, body);
  };
}

void service::add_routes() {
  using get_handler = void (service::*)(const httplib::Request&, httplib::Response&);
  using post_handler = void (service::*)(const std::string&, httplib::Response&);
  auto get = [this](get_handler h) {
    return [this, h](const httplib::Request& req, httplib::Response& res) { (this->*h)(req, res); };
  };
  auto post = [this](post_handler h) {
    return with_body([this, h](const httplib::Request&, httplib::Response& res,
                               const std::string& body) { (this->*h)(body, res); });
  };
  server_.Get("/status", get(&service::get_status));
  server_.Get("/metrics", get(&service::get_metrics));
  server_.Post("/train", post(&service::post_train));
  server_.Post("/pause", post(&service::post_pause));
  server_.Post("/checkpoint", post(&service::post_checkpoint));
  server_.Post("/schedule", post(&service::post_schedule));
  server_.Post("/stop", post(&service::post_stop));
  // Everything else: 405 on a known path (with Allow), 404 otherwise.
  static const std::map<std::string, std::string> allowed = {
      {"/status", "GET, HEAD"}, {"/metrics", "GET, HEAD"}, {"/train", "POST"}, {"/pause", "POST"},
      {"/checkpoint", "POST"},  {"/schedule", "POST"},     {"/stop", "POST"}};
  auto other = [](const httplib::Request& req, httplib::Response& res) {
    const auto at = allowed.find(req.path);
    if (at == allowed.end())
      return fail(res, 404,
                  "no endpoint " + req.path +
                      " (GET /status, GET /metrics; POST /train, /pause, /checkpoint, "
                      "/schedule, /stop)");
    res.set_header("Allow", at->second);
    fail(res, 405, req.method + " " + req.path + ": use " + at->second);
  };
  auto other_with_body = with_body([other](const httplib::Request& req, httplib::Response& res,
                                           const std::string&) { other(req, res); });
  server_.Get(".*", other);
  server_.Options(".*", other);
  // TRACE and CONNECT (no handlers in cpp-httplib, no body): the same answers.
  server_.set_pre_routing_handler([other](const httplib::Request& req, httplib::Response& res) {
    if (req.method != "TRACE" && req.method != "CONNECT")
      return httplib::Server::HandlerResponse::Unhandled;
    other(req, res);
    return httplib::Server::HandlerResponse::Handled;
  });
  server_.Post(".*", other_with_body);
  server_.Put(".*", other_with_body);
  server_.Patch(".*", other_with_body);
  server_.Delete(".*", other_with_body);
  // Answers cpp-httplib makes itself (a malformed request, a body over the limit): the same
  // one-line JSON.
  server_.set_error_handler(
      httplib::Server::HandlerWithResponse([](const httplib::Request&, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        const char* what = res.status == 400   ? "a malformed request"
                           : res.status == 413 ? "the body is over 64 KiB"
                           : res.status == 414 ? "the URI is too long"
                                               : "the request was refused";
        fail(res, res.status, "HTTP " + std::to_string(res.status) + ": " + what);
        return httplib::Server::HandlerResponse::Handled;
      }));
  server_.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown exception";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        fail(res, 500, "internal error: " + what);
      });
  server_.set_logger([](const httplib::Request& req, const httplib::Response& res) {
    std::fprintf(stderr, "trainer_service: %s %s %d\n", req.method.c_str(), req.path.c_str(),
                 res.status);
  });
}

// SIGINT and SIGTERM, taken by one thread (watch_signals): the first asks for a stop, which
// serve() runs on a thread of its own; a second ends the process at once. The same thread
// bounds the teardown once the run's outcome is known (teardown_limit).
struct signal_watch {
  sigset_t signals;
  std::mutex mutex;
  std::condition_variable changed;
  bool stop = false;              // a first signal came
  bool serving_done = false;      // serve() needs no more stops
  std::atomic<bool> done{false};  // the process is ending: the watch ends
  // The exit code, once the run has ended and only the actor system's end is left (-1 before).
  std::atomic<int> tearing_down{-1};
};

// How long the actor system may take to end once the run's outcome is known (the final weights
// written): an actor that never ends (a trainer that quit holding an unanswered request) would
// otherwise keep the process forever.
constexpr std::chrono::seconds teardown_limit{30};

void watch_signals(signal_watch& w) {
  const timespec tick{0, 100'000'000};
  int seen = 0;
  std::optional<std::chrono::steady_clock::time_point> teardown;
  while (!w.done) {
    if (const int code = w.tearing_down; code >= 0) {
      const auto now = std::chrono::steady_clock::now();
      if (!teardown) teardown = now;
      if (now - *teardown > teardown_limit) {
        std::fprintf(stderr, "trainer_service: the actors did not end within %d s: exiting\n",
                     static_cast<int>(teardown_limit.count()));
        std::_Exit(code);
      }
    }
    const int sig = sigtimedwait(&w.signals, nullptr, &tick);
    if (sig <= 0) continue;
    const char* name = sig == SIGINT ? "SIGINT" : "SIGTERM";
    if (seen++ > 0) {  // impatient: no final weights, no checkpoint committed
      std::fprintf(stderr, "trainer_service: %s again while stopping: exiting at once\n", name);
      std::_Exit(128 + sig);
    }
    std::fprintf(stderr, "trainer_service: %s: stopping after the step in flight\n", name);
    {
      std::lock_guard<std::mutex> lock(w.mutex);
      w.stop = true;
    }
    w.changed.notify_all();
  }
}

// Whether 127.0.0.1:port can be bound now: a port in use is bad input, found before the
// trainer is spawned (the socket is closed again: nothing listens yet).
bool port_free(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return true;  // the bind itself will say
  int yes = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  sockaddr_in at{};
  at.sin_family = AF_INET;
  at.sin_port = htons(static_cast<std::uint16_t>(port));
  at.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool free = bind(fd, reinterpret_cast<const sockaddr*>(&at), sizeof at) == 0;
  close(fd);
  return free;
}

// The service: the trainer, then the server, until a stop; the exit code.
int serve(const std::string& recipe, int port, const troupe::trainer_options& options,
          signal_watch& watch) {
  if (port != 0 && !port_free(port)) {
    std::fprintf(stderr, "trainer_service: cannot listen on 127.0.0.1:%d\n", port);
    return exit_bad_input;
  }
  caf::actor_system_config cfg;
  caf::actor_system system{cfg};
  auto trainer = troupe::spawn_trainer(system, recipe, options);
  if (!trainer) {
    std::fprintf(stderr, "trainer_service: %s\n", to_string(trainer.error()).c_str());
    return exit_bad_input;
  }

  httplib::Server server;
  server.set_socket_options([](socket_t sock) {  // no SO_REUSEPORT: a port in use is an error
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  server.set_payload_max_length(std::size_t{1} << 16);
  const bool bound = port == 0 ? (port = server.bind_to_any_port("127.0.0.1")) > 0
                               : server.bind_to_port("127.0.0.1", port);
  if (!bound) {
    // The port was taken since port_free(). The trainer has run no step: nothing of it to keep,
    // and stopping it would write its untrained weights (over a previous run's).
    std::fprintf(stderr, "trainer_service: cannot listen on 127.0.0.1:%d\n", port);
    std::fflush(stderr);
    std::_Exit(exit_bad_input);
  }

  auto events = system.spawn<collector>();
  {
    caf::scoped_actor self{system};
    self->request(*trainer, quick, troupe::subscribe_steps{events})
        .receive([](troupe::trainer_status&) {}, [](caf::error&) {});
  }
  service svc{system, *trainer, events, server};
  svc.add_routes();

  // A stop a signal asks for (before the server's loop begins, too).
  std::thread stopper([&] {
    std::unique_lock<std::mutex> lock(watch.mutex);
    watch.changed.wait(lock, [&] { return watch.stop || watch.serving_done; });
    const bool stop = watch.stop;
    lock.unlock();
    if (stop) svc.stop();
  });

  std::printf("listening on 127.0.0.1:%d\n", port);
  std::fflush(stdout);
  server.listen_after_bind();
  svc.listen_done();
  const auto end = svc.stop();  // the answer /stop or the signal already had
  {
    std::lock_guard<std::mutex> lock(watch.mutex);
    watch.serving_done = true;
  }
  watch.changed.notify_all();
  stopper.join();
  if (end.code != 200) {
    // The trainer did not answer the stop: its job may still run, and the actor system's end
    // would wait for it.
    std::fprintf(stderr, "trainer_service: %s\n", end.status.error.c_str());
    std::fflush(stderr);
    std::_Exit(exit_failed);
  }
  caf::anon_send_exit(events, caf::exit_reason::user_shutdown);
  const int code = end.status.state == phase::finished ? 0 : exit_failed;
  if (code != 0)
    std::fprintf(stderr, "trainer_service: the run failed: %s\n", end.status.error.c_str());
  else
    std::fprintf(stderr, "trainer_service: stopped after %d steps, last loss %.4f\n",
                 end.status.step, end.status.last_loss);
  watch.tearing_down = code;  // (the actor system ends on the return)
  return code;
}

}  // namespace
}  // namespace trainer_service

int main(int argc, char** argv) {
  using namespace trainer_service;
  CLI::App app{
      "trainer_service: an HTTP service on 127.0.0.1 that embeds a Troupe trainer "
      "(docs/embedding.md)"};
  std::string recipe;
  int port = 0;
  troupe::trainer_options options;
  app.add_option("recipe", recipe, "Recipe TOML file")->required();
  app.add_option("--port", port, "TCP port on 127.0.0.1; 0: a free one (printed)")
      ->check(CLI::Range(0, 65535));
  app.add_option("--set", options.overrides, "Override a recipe key: --set optimizer.lr=3e-4")
      ->take_all()
      ->allow_extra_args(false);
  app.add_option("--resume", options.resume,
                 "Continue from a checkpoint: the newest committed one under DIR (a checkpoint "
                 "directory, or one step-N directory of it)");
  app.add_option("--threads", options.threads,
                 "BLAS/OpenMP threads per stage (default: the cores / the stages)")
      ->check(CLI::Range(1, 1024));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::string what = e.what();
    for (char& c : what)
      if (c == '\n') c = ' ';
    std::fprintf(stderr, "trainer_service: %s\n", what.c_str());
    return exit_bad_input;
  }

  // SIGINT and SIGTERM go to one thread: every thread started from here inherits the mask.
  signal_watch watch;
  sigemptyset(&watch.signals);
  sigaddset(&watch.signals, SIGINT);
  sigaddset(&watch.signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &watch.signals, nullptr);
  std::thread on_signal([&] { watch_signals(watch); });
  const int code = serve(recipe, port, options, watch);  // (the actor system ended there)
  watch.done = true;
  on_signal.join();
  return code;
}
