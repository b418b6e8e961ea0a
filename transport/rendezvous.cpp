// Rendezvous over TCP with Cap'n Proto frames (messages/rendezvous.capnp). Rank 0 runs one poll
// loop over its listener and every connection, so a peer that stalls or sends garbage costs only
// its own connection: each connection must deliver a complete hello before its own deadline
// (hello_deadline), a frame larger than the limit is dropped as soon as its segment table says
// so, and a malformed frame closes the connection without a reply. Replies (refusal, welcome)
// are written without blocking; afterwards rank 0 shuts down its side and lingers until the
// peer closes, so the reply is never lost to a reset.
#include "transport/rendezvous.hpp"

#include <capnp/message.h>
#include <capnp/serialize.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "messages/rendezvous.capnp.h"
#include "transport/launch_env.hpp"

namespace troupe::transport {
namespace {

namespace wire = messages::rendezvous_wire;
using steady = std::chrono::steady_clock;

// A read or write failed on one connection (the joiner connects again; rank 0 drops it).
struct connection_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// A frame that cannot be one of ours: over the size limit (no retry helps).
struct frame_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string text(capnp::Text::Reader t) { return std::string(t.begin(), t.size()); }
// A peer's reason, fit for a one-line message: at most 1024 bytes, no control characters.
std::string printable(capnp::Text::Reader t) {
  std::string s(t.begin(), std::min<std::size_t>(t.size(), 1024));
  for (char& c : s)
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = '?';
  return s;
}
using std::chrono::milliseconds;

// A connection has this long (at most the whole timeout) to deliver its hello.
constexpr milliseconds hello_deadline{10000};
// How long rank 0 waits for a peer to close after its reply.
constexpr milliseconds linger_deadline{2000};
// Connections waiting for their hello beyond this many are closed at once.
constexpr std::size_t max_pending_connections = 1024;

// Frame limits. A hello: token, host, worker address and device plus struct overhead. A welcome:
// per peer a list element (4 words), its host, worker address and device (each rounded up to
// words, with a pointer), room for far pointers where a large message crosses segments, and the
// NCCL ids (a pointer and 128 bytes each).
constexpr std::size_t frame_overhead_bytes = 512;
constexpr std::size_t max_hello_bytes = frame_overhead_bytes + max_job_token_bytes +
                                        max_host_bytes + 8 + max_worker_address_bytes + 8 +
                                        max_device_bytes + 8 + max_resume_bytes;
constexpr std::size_t max_peer_bytes =
    32 + max_host_bytes + 8 + max_worker_address_bytes + 8 + max_device_bytes + 32;
std::size_t max_welcome_bytes(int world) {
  return frame_overhead_bytes + static_cast<std::size_t>(world) * max_peer_bytes +
         max_nccl_ids * (8 + nccl_id_bytes);
}

capnp::ReaderOptions reader_options(std::size_t limit_bytes) {
  capnp::ReaderOptions o;
  o.traversalLimitInWords = 2 * (limit_bytes / sizeof(capnp::word)) + 64;
  o.nestingLimit = 8;
  return o;
}

std::string where(const rendezvous_options& o) {
  const bool v6 = o.addr.find(':') != std::string::npos;
  return (v6 ? "[" + o.addr + "]" : o.addr) + ":" + std::to_string(o.port);
}

std::string errno_text() { return std::strerror(errno); }

struct fd_guard {
  int fd = -1;
  explicit fd_guard(int f = -1) : fd(f) {}
  fd_guard(const fd_guard&) = delete;
  fd_guard& operator=(const fd_guard&) = delete;
  ~fd_guard() { reset(); }
  void reset(int f = -1) {
    if (fd >= 0) ::close(fd);
    fd = f;
  }
};

int ms_until(steady::time_point t) {
  const auto left = std::chrono::ceil<milliseconds>(t - steady::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, 1 << 30));
}

bool tokens_equal(std::string_view a, std::string_view b) {
  if (a.size() != b.size()) return false;  // the length is not secret; the content is
  volatile unsigned char diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    diff = static_cast<unsigned char>(diff | (a[i] ^ b[i]));
  return diff == 0;
}

// --- frames -------------------------------------------------------------------------------------

kj::Array<capnp::word> encode_hello(const messages::hello& h) {
  capnp::MallocMessageBuilder m;
  auto f = m.initRoot<wire::Frame>();
  f.setMagic(wire::RENDEZVOUS_MAGIC);
  auto w = f.initHello();
  w.setSchemaVersion(wire::RENDEZVOUS_SCHEMA_VERSION);
  w.setProtocolVersion(h.version);
  w.setToken(h.job_token);
  w.setRank(h.coords.rank);
  w.setWorld(h.coords.world);
  w.setReplica(h.coords.replica);
  w.setPipelineRank(h.coords.pipeline_rank);
  w.setHost(h.host);
  w.setWorkerAddress(kj::arrayPtr(h.worker_address.data(), h.worker_address.size()));
  w.setDevice(h.device);
  w.setResume(h.resume);
  return capnp::messageToFlatArray(m);
}

kj::Array<capnp::word> encode_refusal(const std::string& reason) {
  capnp::MallocMessageBuilder m;
  auto f = m.initRoot<wire::Frame>();
  f.setMagic(wire::RENDEZVOUS_MAGIC);
  f.initRefusal().setReason(reason);
  return capnp::messageToFlatArray(m);
}

kj::Array<capnp::word> encode_welcome(const messages::welcome& w) {
  capnp::MallocMessageBuilder m;
  auto f = m.initRoot<wire::Frame>();
  f.setMagic(wire::RENDEZVOUS_MAGIC);
  auto welcome = f.initWelcome();
  auto peers = welcome.initPeers(static_cast<unsigned>(w.peers.size()));
  for (unsigned i = 0; i < peers.size(); ++i) {
    const auto& p = w.peers[i];
    peers[i].setRank(p.rank);
    peers[i].setHost(p.host);
    peers[i].setWorkerAddress(kj::arrayPtr(p.worker_address.data(), p.worker_address.size()));
    peers[i].setDevice(p.device);
  }
  auto ids = welcome.initNcclIds(static_cast<unsigned>(w.nccl_ids.size()));
  for (unsigned i = 0; i < ids.size(); ++i)
    ids.set(i, kj::arrayPtr(w.nccl_ids[i].data(), w.nccl_ids[i].size()));
  return capnp::messageToFlatArray(m);
}

// Accumulates one frame from a non-blocking socket, never reading past its end and refusing a
// frame whose segment table announces more than `limit` bytes.
class frame_reader {
 public:
  enum class state { more, complete, closed };
  explicit frame_reader(std::size_t limit) : limit_(limit), buf_(1) {}

  // Throws frame_error on a frame over the limit, connection_error on a read error.
  state read_some(int fd) {
    for (;;) {
      const std::size_t target = expected_words_ * 8;
      if (bytes_ == target) {
        expected_words_ = capnp::expectedSizeInWordsFromPrefix(words());
        if (expected_words_ * 8 == bytes_) return state::complete;
        if (expected_words_ * 8 > limit_)
          throw frame_error("frame of " + std::to_string(expected_words_ * 8) +
                            " bytes exceeds the limit of " + std::to_string(limit_));
        buf_.resize(expected_words_);
        continue;
      }
      const ssize_t n =
          ::recv(fd, reinterpret_cast<char*>(buf_.data()) + bytes_, target - bytes_, 0);
      if (n == 0) return state::closed;
      if (n < 0) {
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return state::more;
        throw connection_error("read failed: " + errno_text());
      }
      bytes_ += static_cast<std::size_t>(n);
    }
  }
  kj::ArrayPtr<const capnp::word> words() const {
    return kj::arrayPtr(reinterpret_cast<const capnp::word*>(buf_.data()), bytes_ / 8);
  }
  std::size_t limit() const { return limit_; }

 private:
  std::size_t limit_;
  std::vector<std::uint64_t> buf_;
  std::size_t bytes_ = 0, expected_words_ = 1;
};

// Writes what the socket takes now; returns true once all of `out` is sent.
bool write_some(int fd, kj::ArrayPtr<const kj::byte> out, std::size_t& sent) {
  while (sent < out.size()) {
    const ssize_t n = ::send(fd, out.begin() + sent, out.size() - sent, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) return false;
      throw connection_error("write failed: " + errno_text());
    }
    sent += static_cast<std::size_t>(n);
  }
  return true;
}

// Checks a hello against this job; returns the refusal reason, or "" to accept.
std::string check_hello(wire::Hello::Reader h, const messages::hello& own) {
  if (h.getSchemaVersion() != wire::RENDEZVOUS_SCHEMA_VERSION)
    return "rendezvous schema version " + std::to_string(h.getSchemaVersion()) +
           ", this job speaks " + std::to_string(wire::RENDEZVOUS_SCHEMA_VERSION);
  if (h.getProtocolVersion() != own.version)
    return "protocol version " + std::to_string(h.getProtocolVersion()) + ", this job speaks " +
           std::to_string(own.version);
  const auto token = h.getToken();
  if (!tokens_equal(std::string_view(token.begin(), token.size()), own.job_token))
    return "job token does not match";
  if (h.getWorld() != own.coords.world)
    return "world size " + std::to_string(h.getWorld()) + ", this job has " +
           std::to_string(own.coords.world);
  if (h.getRank() < 0 || h.getRank() >= own.coords.world)
    return "rank " + std::to_string(h.getRank()) + " is outside 0-" +
           std::to_string(own.coords.world - 1);
  if (h.getHost().size() > max_host_bytes)
    return "host name longer than " + std::to_string(max_host_bytes) + " bytes";
  if (h.getWorkerAddress().size() > max_worker_address_bytes)
    return "worker address longer than " + std::to_string(max_worker_address_bytes) + " bytes";
  if (h.getDevice().size() > max_device_bytes)
    return "device name longer than " + std::to_string(max_device_bytes) + " bytes";
  if (h.getResume().size() > max_resume_bytes)
    return "checkpoint name longer than " + std::to_string(max_resume_bytes) + " bytes";
  return "";
}

// A hello that resumes another checkpoint than rank 0 (or starts fresh where rank 0 resumes, or
// the other way round): "" if the same.
std::string resume_mismatch(wire::Hello::Reader h, const messages::hello& own) {
  const auto theirs = h.getResume();
  const std::string_view joiner(theirs.begin(), theirs.size());
  if (joiner == own.resume) return "";
  auto name = [](std::string_view s) {
    return s.empty() ? std::string("starts fresh") : "resumes " + std::string(s);
  };
  return "rank " + std::to_string(h.getRank()) + " " + name(joiner) + ", but rank 0 " +
         name(own.resume) + ": every process must resume the same checkpoint";
}

void check_own(const messages::hello& own, const char* who) {
  if (own.coords.world < 1 || own.coords.world > max_world)
    throw rendezvous_error(std::string(who) + ": world size " + std::to_string(own.coords.world) +
                           " is outside 1-" + std::to_string(max_world));
  if (own.job_token.size() > max_job_token_bytes || own.host.size() > max_host_bytes ||
      own.worker_address.size() > max_worker_address_bytes ||
      own.device.size() > max_device_bytes || own.resume.size() > max_resume_bytes)
    throw rendezvous_error(std::string(who) + ": job token, host name, worker address, device " +
                           "name or checkpoint name too long");
  if (own.nccl_ids.size() > max_nccl_ids)
    throw rendezvous_error(std::string(who) + ": " + std::to_string(own.nccl_ids.size()) +
                           " NCCL ids, at most " + std::to_string(max_nccl_ids));
  for (const auto& id : own.nccl_ids)
    if (id.size() != nccl_id_bytes)
      throw rendezvous_error(std::string(who) + ": an NCCL id of " + std::to_string(id.size()) +
                             " bytes, not " + std::to_string(nccl_id_bytes));
  if (own.coords.rank < 0 || own.coords.rank >= own.coords.world)
    throw rendezvous_error(std::string(who) + ": rank " + std::to_string(own.coords.rank) +
                           " is outside 0-" + std::to_string(own.coords.world - 1));
}

void check_port(const rendezvous_options& o) {
  if (o.port < 1 || o.port > 65535)
    throw rendezvous_error("rendezvous port " + std::to_string(o.port) + " is outside 1-65535");
}

// "rank 2", "ranks 2-3, 5" (at most 16 runs, then "... (N in all)").
std::string rank_list(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  std::size_t runs = 0;
  for (std::size_t i = 0; i < ranks.size();) {
    std::size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (runs++ == 16) {
      s += ", ... (" + std::to_string(ranks.size()) + " in all)";
      break;
    }
    if (i > 0) s += ", ";
    s += std::to_string(ranks[i]);
    if (j > i) s += "-" + std::to_string(ranks[j]);
    i = j + 1;
  }
  return s;
}

// --- rank 0 -------------------------------------------------------------------------------------

struct connection {
  enum class phase { hello, joined, replying, lingering, done };
  fd_guard fd;
  phase at = phase::hello;
  steady::time_point deadline;
  frame_reader reader{max_hello_bytes};
  int rank = -1;
  kj::Array<capnp::word> own_reply;  // a refusal
  kj::ArrayPtr<const kj::byte> reply;
  std::size_t sent = 0;
  explicit connection(int f, steady::time_point d) : fd(f), deadline(d) {}
};

int listen_on(const rendezvous_options& o) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(o.port);
  if (const int rc = ::getaddrinfo(o.addr.c_str(), port.c_str(), &hints, &found); rc != 0)
    throw rendezvous_error("cannot listen on " + where(o) + ": " + ::gai_strerror(rc));
  std::string error = "no address";
  for (addrinfo* a = found; a; a = a->ai_next) {
    fd_guard fd(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (fd.fd < 0) {
      error = errno_text();
      continue;
    }
    const int one = 1;
    ::setsockopt(fd.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd.fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd.fd, SOMAXCONN) == 0) {
      ::freeaddrinfo(found);
      return std::exchange(fd.fd, -1);
    }
    error = errno_text();
  }
  ::freeaddrinfo(found);
  throw rendezvous_error("cannot listen on " + where(o) + ": " + error);
}

// Starts the reply on `c` (refusal or welcome), then lingering until the peer closes.
void start_reply(connection& c, kj::ArrayPtr<const kj::byte> bytes, steady::time_point deadline) {
  c.at = connection::phase::replying;
  c.reply = bytes;
  c.sent = 0;
  c.deadline = deadline;
}

class server {
 public:
  server(const rendezvous_options& o, const messages::hello& own)
      : o_(o),
        own_(own),
        deadline_(steady::now() + o.timeout),
        holder_(static_cast<std::size_t>(own.coords.world), nullptr) {}

  messages::welcome run();

 private:
  void accept_all();
  void on_readable(connection& c);
  void on_hello(connection& c);
  bool holder_alive(int rank);
  void drop(connection& c) {
    if (c.at == connection::phase::joined) holder_[static_cast<std::size_t>(c.rank)] = nullptr;
    c.at = connection::phase::done;
  }
  void refuse(connection& c, const std::string& reason, int rank);
  std::string missing() const;
  bool replying() const {
    return std::any_of(conns_.begin(), conns_.end(),
                       [](const auto& c) { return c->at == connection::phase::replying; });
  }

  rendezvous_options o_;
  const messages::hello& own_;
  steady::time_point deadline_;
  fd_guard listener_;
  std::vector<std::unique_ptr<connection>> conns_;
  std::vector<connection*> holder_;  // by rank; index 0 is rank 0 itself
  std::vector<messages::peer_address> peers_ = std::vector<messages::peer_address>(holder_.size());
  messages::welcome welcome_;
  std::vector<std::string> refusals_;
  // A process that resumes another checkpoint: the job cannot go on; rank 0 ends once its
  // refusal has gone out.
  std::string fatal_;
};

void server::accept_all() {
  for (;;) {
    const int fd = ::accept4(listener_.fd, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;  // EAGAIN, or a transient error: poll tells us when to try again
    std::size_t pending = 0;
    for (const auto& c : conns_) pending += c->at == connection::phase::hello;
    if (pending >= max_pending_connections) {
      ::close(fd);
      continue;
    }
    conns_.push_back(
        std::make_unique<connection>(fd, std::min(deadline_, steady::now() + hello_deadline)));
  }
}

bool server::holder_alive(int rank) {
  connection* c = holder_[static_cast<std::size_t>(rank)];
  if (!c) return false;
  char byte;
  const ssize_t n = ::recv(c->fd.fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
  drop(*c);  // closed, reset, or sent more than its hello: its rank is free again
  return false;
}

void server::refuse(connection& c, const std::string& reason, int rank) {
  refusals_.push_back("rank " + std::to_string(rank) + ": " + reason);
  c.own_reply = encode_refusal(reason);
  start_reply(c, c.own_reply.asBytes(), steady::now() + linger_deadline);
}

void server::on_hello(connection& c) {
  capnp::FlatArrayMessageReader message(c.reader.words(), reader_options(c.reader.limit()));
  auto f = message.getRoot<wire::Frame>();
  if (f.getMagic() != wire::RENDEZVOUS_MAGIC || !f.isHello()) return drop(c);
  const auto h = f.getHello();
  std::string reason = check_hello(h, own_);
  const int rank = h.getRank();
  if (reason.empty() && (rank == 0 || holder_alive(rank)))
    reason = "rank " + std::to_string(rank) + " already joined";
  if (!reason.empty()) return refuse(c, reason, rank);
  if (const std::string mismatch = resume_mismatch(h, own_); !mismatch.empty()) {
    if (fatal_.empty()) fatal_ = mismatch;
    return refuse(c, mismatch, rank);
  }
  c.at = connection::phase::joined;
  c.rank = rank;
  holder_[static_cast<std::size_t>(rank)] = &c;
  auto& p = peers_[static_cast<std::size_t>(rank)];
  p.rank = rank;
  p.host = text(h.getHost());
  const auto address = h.getWorkerAddress();
  p.worker_address.assign(address.begin(), address.end());
  p.device = text(h.getDevice());
}

void server::on_readable(connection& c) {
  if (c.at == connection::phase::hello) {
    try {
      switch (c.reader.read_some(c.fd.fd)) {
        case frame_reader::state::more:
          return;
        case frame_reader::state::closed:
          return drop(c);
        case frame_reader::state::complete:
          return on_hello(c);
      }
    } catch (const frame_error&) {
      return drop(c);
    } catch (const connection_error&) {
      return drop(c);
    } catch (const kj::Exception&) {
      return drop(c);  // not a Cap'n Proto frame of ours
    }
  }
  if (c.at == connection::phase::joined) return drop(c);  // hung up, or sent more than a hello
  // Lingering: discard until the peer closes.
  char sink[512];
  const ssize_t n = ::recv(c.fd.fd, sink, sizeof sink, 0);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) c.at = connection::phase::done;
}

std::string server::missing() const {
  std::vector<int> ranks;
  for (std::size_t r = 1; r < holder_.size(); ++r)
    if (!holder_[r]) ranks.push_back(static_cast<int>(r));
  std::string s = rank_list(ranks) + " of " + std::to_string(holder_.size()) + " never joined";
  if (!refusals_.empty()) {
    s += " (refused meanwhile:";
    const std::size_t first = refusals_.size() > 3 ? refusals_.size() - 3 : 0;
    for (std::size_t i = first; i < refusals_.size(); ++i)
      s += (i > first ? "; " : " ") + refusals_[i];
    s += ")";
  }
  return s;
}

messages::welcome server::run() {
  peers_[0] = {0, own_.host, own_.worker_address, own_.device};
  if (holder_.size() > 1) listener_.reset(listen_on(o_));
  kj::Array<capnp::word> welcome_frame;
  bool welcoming = false;
  std::vector<pollfd> fds;
  for (;;) {
    // Tidy up: finished connections go; expired ones are closed (a joined one is never expired
    // before the welcome; the whole rendezvous has deadline_).
    const auto now = steady::now();
    for (auto& c : conns_) {
      if (c->at == connection::phase::lingering && now >= c->deadline)
        c->at = connection::phase::done;
      if (c->at == connection::phase::hello && now >= c->deadline) drop(*c);
      if (c->at == connection::phase::replying && now >= c->deadline) {
        if (c->rank >= 0 && welcoming)
          throw rendezvous_error("rendezvous at " + where(o_) +
                                 ": timed out sending the welcome to rank " +
                                 std::to_string(c->rank));
        c->at = connection::phase::done;
      }
    }
    std::erase_if(conns_, [](const auto& c) { return c->at == connection::phase::done; });
    const bool all_joined =
        std::all_of(holder_.begin() + 1, holder_.end(), [](connection* c) { return c != nullptr; });
    if (all_joined && !welcoming) {
      welcoming = true;
      welcome_ = messages::welcome{peers_, {}};
      if (nccl_obstacle(peers_).empty()) welcome_.nccl_ids = own_.nccl_ids;
      welcome_frame = encode_welcome(welcome_);
      listener_.reset();  // none joins any more
      for (auto& c : conns_) {
        if (c->at == connection::phase::hello) c->at = connection::phase::done;
        if (c->at == connection::phase::joined) start_reply(*c, welcome_frame.asBytes(), deadline_);
      }
      std::erase_if(conns_, [](const auto& c) { return c->at == connection::phase::done; });
      for (auto& h : holder_) h = nullptr;
    }
    if (welcoming && conns_.empty()) return welcome_;
    if (!fatal_.empty() && !replying())
      throw rendezvous_error("rendezvous at " + where(o_) + ": " + fatal_);
    if (!welcoming && now >= deadline_)
      throw rendezvous_error("rendezvous at " + where(o_) + " timed out after " +
                             std::to_string(o_.timeout.count()) + " ms: " + missing());

    fds.clear();
    steady::time_point wake = welcoming ? steady::time_point::max() : deadline_;
    if (listener_.fd >= 0) fds.push_back({listener_.fd, POLLIN, 0});
    for (auto& c : conns_) {
      const short events = c->at == connection::phase::replying ? POLLOUT : POLLIN;
      fds.push_back({c->fd.fd, events, 0});
      if (c->at != connection::phase::joined) wake = std::min(wake, c->deadline);
    }
    if (::poll(fds.data(), fds.size(), ms_until(wake)) < 0 && errno != EINTR)
      throw rendezvous_error("rendezvous at " + where(o_) + ": poll failed: " + errno_text());
    std::size_t i = 0;
    if (listener_.fd >= 0 && (fds[i++].revents & POLLIN)) accept_all();
    for (std::size_t k = 0; k < conns_.size() && i < fds.size(); ++k, ++i) {
      connection& c = *conns_[k];
      if (fds[i].revents == 0 || c.at == connection::phase::done) continue;
      if (c.at != connection::phase::replying) {
        on_readable(c);
        continue;
      }
      try {
        if (!write_some(c.fd.fd, c.reply, c.sent)) continue;
      } catch (const connection_error& e) {
        if (welcoming)
          throw rendezvous_error("rendezvous at " + where(o_) + ": rank " + std::to_string(c.rank) +
                                 " left before its welcome (" + e.what() + ")");
        c.at = connection::phase::done;
        continue;
      }
      ::shutdown(c.fd.fd, SHUT_WR);
      c.at = connection::phase::lingering;
      c.deadline = std::min(welcoming ? deadline_ : steady::time_point::max(),
                            steady::now() + linger_deadline);
    }
  }
}

// --- other ranks --------------------------------------------------------------------------------

// A connected socket to o.addr:o.port, or -1 if none could be made before `until`.
int try_connect(const rendezvous_options& o, steady::time_point until, std::string& last_error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(o.port);
  if (const int rc = ::getaddrinfo(o.addr.c_str(), port.c_str(), &hints, &found); rc != 0) {
    if (rc != EAI_AGAIN)
      throw rendezvous_error("rendezvous at " + where(o) + ": cannot resolve " + o.addr + ": " +
                             ::gai_strerror(rc));
    last_error = ::gai_strerror(rc);
    return -1;
  }
  std::unique_ptr<addrinfo, void (*)(addrinfo*)> list(found, ::freeaddrinfo);
  for (addrinfo* a = found; a; a = a->ai_next) {
    fd_guard fd(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (fd.fd < 0) {
      last_error = errno_text();
      continue;
    }
    if (::connect(fd.fd, a->ai_addr, a->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        last_error = errno_text();
        continue;
      }
      pollfd p{fd.fd, POLLOUT, 0};
      if (::poll(&p, 1, ms_until(until)) <= 0) {
        last_error = "connection attempt timed out";
        continue;
      }
      int error = 0;
      socklen_t len = sizeof error;
      ::getsockopt(fd.fd, SOL_SOCKET, SO_ERROR, &error, &len);
      if (error != 0) {
        last_error = std::strerror(error);
        continue;
      }
    }
    return std::exchange(fd.fd, -1);
  }
  return -1;
}

// Waits until fd is ready for `events` or `until` passes; false on timeout.
bool wait_for(int fd, short events, steady::time_point until) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int rc = ::poll(&p, 1, ms_until(until));
    if (rc > 0) return true;
    if (rc == 0) return false;
    if (errno != EINTR) throw rendezvous_error("poll failed: " + errno_text());
  }
}

messages::welcome decode_welcome(const rendezvous_options& o, wire::Welcome::Reader w,
                                 const messages::hello& own) {
  const auto bad = [&](const std::string& why) {
    return rendezvous_error("rendezvous at " + where(o) + " sent a malformed welcome: " + why);
  };
  const auto peers = w.getPeers();
  if (peers.size() != static_cast<unsigned>(own.coords.world))
    throw bad(std::to_string(peers.size()) + " peers for world size " +
              std::to_string(own.coords.world));
  messages::welcome out;
  out.peers.reserve(peers.size());
  for (unsigned i = 0; i < peers.size(); ++i) {
    const auto p = peers[i];
    if (p.getRank() != static_cast<int>(i))
      throw bad("peer " + std::to_string(i) + " has rank " + std::to_string(p.getRank()));
    if (p.getHost().size() > max_host_bytes ||
        p.getWorkerAddress().size() > max_worker_address_bytes ||
        p.getDevice().size() > max_device_bytes)
      throw bad("peer " + std::to_string(i) + " has an oversized host, address or device");
    const auto address = p.getWorkerAddress();
    out.peers.push_back(
        {p.getRank(), text(p.getHost()), {address.begin(), address.end()}, text(p.getDevice())});
  }
  const auto ids = w.getNcclIds();
  if (ids.size() > max_nccl_ids)
    throw bad(std::to_string(ids.size()) + " NCCL ids, at most " + std::to_string(max_nccl_ids));
  for (unsigned i = 0; i < ids.size(); ++i) {
    if (ids[i].size() != nccl_id_bytes)
      throw bad("NCCL id " + std::to_string(i) + " has " + std::to_string(ids[i].size()) +
                " bytes");
    out.nccl_ids.emplace_back(ids[i].begin(), ids[i].end());
  }
  if (const std::string obstacle = nccl_obstacle(out.peers);
      !out.nccl_ids.empty() && !obstacle.empty())
    throw bad("NCCL ids for processes that cannot use them (" + obstacle + ")");
  const auto& me = out.peers[static_cast<std::size_t>(own.coords.rank)];
  if (me.host != own.host || me.worker_address != own.worker_address || me.device != own.device)
    throw bad("its entry for this process (rank " + std::to_string(own.coords.rank) + ") differs");
  return out;
}

}  // namespace

std::string nccl_obstacle(const std::vector<messages::peer_address>& peers) {
  std::map<std::pair<std::string, std::string>, int> seen;  // (host, device) -> rank
  for (const auto& p : peers) {
    if (p.device.empty()) return "rank " + std::to_string(p.rank) + " has no CUDA device";
    const auto [at, fresh] = seen.emplace(std::pair{p.host, p.device}, p.rank);
    if (!fresh)
      return "ranks " + std::to_string(at->second) + " and " + std::to_string(p.rank) +
             " share device " + p.device + " on host " + p.host;
  }
  return "";
}

messages::welcome rendezvous_serve(const rendezvous_options& o, const messages::hello& own) {
  check_own(own, "rendezvous_serve");
  check_port(o);
  if (own.coords.rank != 0)
    throw rendezvous_error("rendezvous_serve is for rank 0; this process is rank " +
                           std::to_string(own.coords.rank));
  server s(o, own);
  return s.run();
}

messages::welcome rendezvous_join(const rendezvous_options& o, const messages::hello& own) {
  check_own(own, "rendezvous_join");
  check_port(o);
  const auto until = steady::now() + o.timeout;
  const auto hello = encode_hello(own);
  std::string last_error = "connection refused";
  milliseconds backoff{20};
  while (steady::now() < until) {
    fd_guard fd(try_connect(o, until, last_error));
    if (fd.fd >= 0) {
      try {
        std::size_t sent = 0;
        while (!write_some(fd.fd, hello.asBytes(), sent))
          if (!wait_for(fd.fd, POLLOUT, until)) break;
        frame_reader reader(max_welcome_bytes(own.coords.world));
        auto st = frame_reader::state::more;
        while (sent == hello.asBytes().size() && st == frame_reader::state::more &&
               wait_for(fd.fd, POLLIN, until))
          st = reader.read_some(fd.fd);
        if (st == frame_reader::state::complete) {
          capnp::FlatArrayMessageReader message(reader.words(), reader_options(reader.limit()));
          auto f = message.getRoot<wire::Frame>();
          if (f.getMagic() != wire::RENDEZVOUS_MAGIC)
            throw rendezvous_error("rendezvous at " + where(o) + " is not a troupe rendezvous");
          if (f.isRefusal())
            throw rendezvous_error("rendezvous at " + where(o) + " refused this process: " +
                                   printable(f.getRefusal().getReason()));
          if (!f.isWelcome())
            throw rendezvous_error("rendezvous at " + where(o) + " answered with a hello");
          return decode_welcome(o, f.getWelcome(), own);
        }
        // Closed before a whole reply (rank 0 went away or dropped us): connect again.
        last_error =
            st == frame_reader::state::closed ? "rank 0 closed the connection" : "no reply in time";
      } catch (const kj::Exception& e) {
        throw rendezvous_error("rendezvous at " + where(o) + " sent a malformed reply: " +
                               std::string(e.getDescription().cStr()));
      } catch (const frame_error& e) {
        throw rendezvous_error("rendezvous at " + where(o) +
                               " sent a malformed reply: " + e.what());
      } catch (const connection_error& e) {
        last_error = e.what();  // a read or write error on this connection: connect again
      }
    }
    std::this_thread::sleep_for(std::min<milliseconds>(backoff, milliseconds(ms_until(until))));
    backoff = std::min(backoff * 2, milliseconds(500));
  }
  throw rendezvous_error("rendezvous at " + where(o) + " timed out after " +
                         std::to_string(o.timeout.count()) + " ms (" + last_error + ")");
}

}  // namespace troupe::transport
