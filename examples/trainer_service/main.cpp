// A training service: an HTTP server on the loopback interface that embeds a Troupe trainer
// (docs/embedding.md, "An HTTP service") and lets a script or an operator drive it: train N more
// steps, pause, read the status as JSON, commit a checkpoint, swap the pipeline schedule, scrape
// Prometheus metrics, stop.
//
//   trainer_service RECIPE.toml [--port P] [--set key=value ...] [--resume DIR] [--threads N]
//
// It binds 127.0.0.1 only (port 0, the default: a free one), spawns the trainer (paused before
// the first step) and prints one line, "listening on 127.0.0.1:PORT", to stdout once requests are
// taken. POST /stop, SIGINT or SIGTERM end the run between steps (final weights written) and the
// process. Exit code 0 when the run finished, 1 when it failed, 2 for bad input (a recipe key,
// the port).
//
// Endpoints (JSON bodies; every error is a 4xx or 5xx with {"error": "one line"} and leaves the
// run as it was):
//   GET  /status      the trainer's state, steps, last loss and the last step's metrics
//   GET  /metrics     Prometheus text format 0.0.4, metric names troupe_*
//   POST /train       {"steps": N, "wait": false}: N more steps; 202 at once, or with
//                     "wait": true, 200 once they are done
//   POST /pause       200 once the step in flight is done
//   POST /checkpoint  200 {"path", "step"} once a checkpoint is committed (the run is paused)
//   POST /schedule    {"name": "gpipe"}: the pipeline schedule from the next step
//   POST /stop        200 with the final status; then the process exits
//
// Threads: cpp-httplib answers each request on a thread of its pool; a handler talks to the
// trainer through a caf::scoped_actor of its own (a blocking request and its answer). The step
// events go to one collector actor, which keeps the last one and the counters for /metrics.
#include <httplib.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
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

class service {
 public:
  service(caf::actor_system& system, troupe::trainer_actor trainer, caf::actor collector,
          httplib::Server& server)
      : system_(system),
        trainer_(std::move(trainer)),
        collector_(std::move(collector)),
        server_(server) {}

  void add_routes();

  // Ends the run (between steps: final weights written) and the server; the final status.
  // Idempotent: a second call waits for the first and answers the same.
  troupe::trainer_status stop() {
    std::lock_guard<std::mutex> lock(stop_mutex_);
    if (final_) return *final_;
    stopping_ = true;
    std::string error;
    auto s = ask<troupe::trainer_status>(troupe::stop_training{}, error);
    if (!s) {
      s.emplace();
      s->state = phase::failed;
      s->error = "the trainer is gone: " + error;
    }
    final_ = *s;
    // The server's loop may not have begun yet (a signal at the start).
    while (!listen_done_ && !server_.is_running())
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (server_.is_running()) server_.stop();
    return *final_;
  }
  void listen_done() { listen_done_ = true; }

 private:
  // A request to the trainer from this thread, answered; nothing (and `error`) if it is gone.
  template <class Answer, class Request>
  std::optional<Answer> ask(Request request, std::string& error) {
    caf::scoped_actor self{system_};
    std::optional<Answer> answer;
    self->request(trainer_, caf::infinite, std::move(request))
        .receive([&](Answer& a) { answer = std::move(a); },
                 [&](caf::error& e) { error = to_string(e); });
    return answer;
  }

  metrics_snapshot snapshot() {
    caf::scoped_actor self{system_};
    metrics_snapshot m;
    self->request(collector_, caf::infinite, snapshot_request{})
        .receive([&](metrics_snapshot& s) { m = std::move(s); }, [](caf::error&) {});
    return m;
  }

  // The trainer's status, or the final one once it has stopped; nothing (a 503) otherwise.
  std::optional<troupe::trainer_status> status(httplib::Response& res) {
    std::string error;
    if (auto s = ask<troupe::trainer_status>(troupe::query_status{}, error)) return s;
    {
      std::lock_guard<std::mutex> lock(stop_mutex_);
      if (final_) return final_;
    }
    fail(res, 503, "the trainer is gone: " + error);
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

  void get_status(const httplib::Request&, httplib::Response& res) {
    auto s = status(res);
    if (s) reply(res, 200, status_json(*s, snapshot()));
  }

  void get_metrics(const httplib::Request&, httplib::Response& res) {
    auto s = status(res);
    if (!s) return;
    res.status = 200;
    res.set_content(metrics_text(*s, snapshot()), "text/plain; version=0.0.4; charset=utf-8");
  }

  void post_train(const std::string& text, httplib::Response& res) {
    auto body = body_object(text, res, {"steps", "wait"});
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
    if (!live_status(res)) return;
    const troupe::train_steps request{static_cast<int>(steps->get<std::int64_t>())};
    std::string error;
    if (wait) {
      auto s = ask<troupe::trainer_status>(request, error);
      if (!s) return fail(res, 503, "the trainer is gone: " + error);
      return reply(res, 200, status_json(*s, snapshot()));
    }
    // Asynchronous: the request, then a status query from the same actor, which the trainer
    // handles after it (one sender's messages keep their order): the state is "running".
    caf::scoped_actor self{system_};
    self->send(trainer_, request);
    std::optional<troupe::trainer_status> s;
    self->request(trainer_, caf::infinite, troupe::query_status{})
        .receive([&](troupe::trainer_status& a) { s = std::move(a); },
                 [&](caf::error& e) { error = to_string(e); });
    if (!s) return fail(res, 503, "the trainer is gone: " + error);
    reply(res, 202, status_json(*s, snapshot()));
  }

  void post_pause(const std::string& text, httplib::Response& res) {
    if (!body_object(text, res, {})) return;
    if (!live_status(res)) return;
    std::string error;
    auto s = ask<troupe::trainer_status>(troupe::pause_training{}, error);
    if (!s) return fail(res, 503, "the trainer is gone: " + error);
    reply(res, 200, status_json(*s, snapshot()));
  }

  void post_checkpoint(const std::string& text, httplib::Response& res) {
    if (!body_object(text, res, {})) return;
    if (!live_status(res)) return;
    std::string error;
    auto c = ask<troupe::checkpoint_result>(troupe::take_checkpoint{}, error);
    if (!c) return fail(res, 503, "the trainer is gone: " + error);
    if (!c->ok) return fail(res, 500, "the checkpoint failed: " + c->error);
    auto s = status(res);
    if (!s) return;
    reply(res, 200, {{"path", c->path}, {"step", s->step}});
  }

  void post_schedule(const std::string& text, httplib::Response& res) {
    auto body = body_object(text, res, {"name"});
    if (!body) return;
    const auto name = body->find("name");
    if (name == body->end()) return fail(res, 400, "\"name\" is missing");
    if (!name->is_string() || name->get<std::string>().empty())
      return fail(res, 400, "\"name\" must be a schedule's name, not " + name->dump());
    if (!live_status(res)) return;
    std::string error;
    auto r = ask<troupe::schedule_result>(troupe::use_schedule{name->get<std::string>()}, error);
    if (!r) return fail(res, 503, "the trainer is gone: " + error);
    if (!r->ok) return fail(res, 400, r->message);
    reply(res, 200, {{"schedule", name->get<std::string>()}, {"message", r->message}});
  }

  void post_stop(const std::string& text, httplib::Response& res) {
    if (!body_object(text, res, {})) return;
    const auto s = stop();
    res.set_header("Connection", "close");
    reply(res, 200, status_json(s, snapshot()));
  }

  caf::actor_system& system_;
  troupe::trainer_actor trainer_;
  caf::actor collector_;
  httplib::Server& server_;
  std::mutex stop_mutex_;
  std::optional<troupe::trainer_status> final_;
  std::atomic<bool> stopping_{false}, listen_done_{false};
};

// A handler of a request with a body, given the body. cpp-httplib would read a body without
// Content-Length (`curl -X POST URL` sends none) until the client closes, which it never does;
// such a request has no body here.
template <class F>
httplib::Server::HandlerWithContentReader with_body(F f) {
  return [f](const httplib::Request& req, httplib::Response& res,
             const httplib::ContentReader& reader) {
    std::string body;
    if (req.has_header("Content-Length") ||
        req.get_header_value("Transfer-Encoding") == "chunked") {
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

  // SIGINT and SIGTERM go to one thread (below): every thread started from here inherits the
  // mask.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  httplib::Server server;
  server.set_socket_options([](socket_t sock) {  // no SO_REUSEPORT: a port in use is an error
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  server.set_payload_max_length(std::size_t{1} << 16);
  const bool bound = port == 0 ? (port = server.bind_to_any_port("127.0.0.1")) > 0
                               : server.bind_to_port("127.0.0.1", port);
  if (!bound) {
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
  auto events = system.spawn<collector>();
  {
    caf::scoped_actor self{system};
    self->request(*trainer, caf::infinite, troupe::subscribe_steps{events})
        .receive([](troupe::trainer_status&) {}, [](caf::error&) {});
  }
  service svc{system, *trainer, events, server};
  svc.add_routes();

  std::atomic<bool> done{false};
  std::thread on_signal([&] {
    const timespec tick{0, 200'000'000};
    while (!done) {
      if (const int sig = sigtimedwait(&signals, nullptr, &tick); sig > 0) {
        std::fprintf(stderr, "trainer_service: %s: stopping after the step in flight\n",
                     sig == SIGINT ? "SIGINT" : "SIGTERM");
        svc.stop();
        return;
      }
    }
  });

  std::printf("listening on 127.0.0.1:%d\n", port);
  std::fflush(stdout);
  server.listen_after_bind();
  svc.listen_done();
  const auto final_status = svc.stop();  // the answer /stop or the signal already had
  done = true;
  on_signal.join();
  caf::anon_send_exit(events, caf::exit_reason::user_shutdown);
  if (final_status.state != phase::finished) {
    std::fprintf(stderr, "trainer_service: the run failed: %s\n", final_status.error.c_str());
    return exit_failed;
  }
  std::fprintf(stderr, "trainer_service: stopped after %d steps, last loss %.4f\n",
               final_status.step, final_status.last_loss);
  return 0;
}
