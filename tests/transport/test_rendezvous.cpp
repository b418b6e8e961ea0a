// Rendezvous between threads of this process on fresh loopback ports: everyone gets the same
// welcome; joiners may start before rank 0; wrong hellos are refused with their reason while the
// job completes; a missing rank times out naming it; garbage, stalled and oversized connections
// do not disturb the job. Every call has a deadline of a few seconds, and every future is waited
// for with a bound, so nothing can hang. Catch2 assertions run on the main thread only.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <future>
#include <optional>
#include <thread>
#include <vector>

#include "transport/rendezvous.hpp"

using namespace troupe;
using namespace troupe::transport;
using Catch::Matchers::Contains;
using namespace std::chrono_literals;

namespace {

constexpr auto short_deadline = std::chrono::milliseconds(10000);

// A port nothing listens on now (the kernel's choice of a free one).
int fresh_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

messages::hello hello_of(int rank, int world, const std::string& token = "job-token") {
  messages::hello h;
  h.job_token = token;
  h.coords = {rank, world, rank % 2, rank / 2};
  h.host = "host" + std::to_string(rank);
  h.worker_address.resize(200 + static_cast<std::size_t>(rank));
  for (std::size_t i = 0; i < h.worker_address.size(); ++i)
    h.worker_address[i] = static_cast<std::uint8_t>(i * 7 + static_cast<std::size_t>(rank));
  return h;
}

rendezvous_options options(int port, std::chrono::milliseconds timeout = short_deadline) {
  rendezvous_options o;
  o.port = port;
  o.timeout = timeout;
  return o;
}

struct outcome {
  std::optional<messages::welcome> welcome;
  std::string error;
};

std::future<outcome> start(bool serve, rendezvous_options o, messages::hello h) {
  return std::async(std::launch::async, [serve, o, h] {
    outcome r;
    try {
      r.welcome = serve ? rendezvous_serve(o, h) : rendezvous_join(o, h);
    } catch (const rendezvous_error& e) {
      r.error = e.what();
    }
    return r;
  });
}

// Hand-built frames (the generated header stays private to rendezvous.cpp); the layout is what
// `capnp compile -ocapnp messages/rendezvous.capnp` prints: Frame = 2 data words (magic, union
// tag in bits 64-80) + 1 pointer; Welcome = 2 pointers and Peer = 1 data word + 3 pointers, of
// which the frames below build the first 1 and 2 (a shorter struct reads its missing fields as
// defaults).
constexpr std::uint64_t magic = 0x74726f7570655256;  // rendezvousMagic
std::uint64_t struct_pointer(std::uint64_t data_words, std::uint64_t pointers) {
  return (data_words << 32) | (pointers << 48);  // offset 0: the struct follows the pointer
}
std::vector<std::uint64_t> one_segment(std::vector<std::uint64_t> words) {
  words.insert(words.begin(), static_cast<std::uint64_t>(words.size()) << 32);  // 1 segment
  return words;
}
// A Frame with `tag` and a null pointer.
std::vector<std::uint64_t> frame_with(std::uint64_t frame_magic, std::uint64_t tag) {
  return one_segment({struct_pointer(2, 1), frame_magic, tag, 0});
}
// A welcome listing `peers` zeroed peers.
std::vector<std::uint64_t> welcome_with(std::uint64_t peers) {
  std::vector<std::uint64_t> w = {struct_pointer(2, 1),
                                  magic,
                                  1,
                                  struct_pointer(0, 1),
                                  1 | (7ull << 32) | ((peers * 3) << 35),  // composite list
                                  (peers << 2) | struct_pointer(1, 2)};    // its tag
  w.resize(w.size() + peers * 3, 0);
  return one_segment(w);
}

// Waits (bounded) for a rendezvous call; every call has its own shorter deadline.
outcome get(std::future<outcome>& f) {
  REQUIRE(f.wait_for(60s) == std::future_status::ready);
  return f.get();
}

bool same(const messages::welcome& a, const messages::welcome& b) {
  if (a.peers.size() != b.peers.size()) return false;
  for (std::size_t i = 0; i < a.peers.size(); ++i) {
    const auto &x = a.peers[i], &y = b.peers[i];
    if (x.rank != y.rank || x.host != y.host || x.worker_address != y.worker_address) return false;
  }
  return true;
}

void check_welcome(const outcome& r, int world) {
  INFO(r.error);
  REQUIRE(r.welcome);
  REQUIRE(r.welcome->peers.size() == static_cast<std::size_t>(world));
  for (int rank = 0; rank < world; ++rank) {
    const auto& p = r.welcome->peers[static_cast<std::size_t>(rank)];
    const auto h = hello_of(rank, world);
    CHECK(p.rank == rank);
    CHECK(p.host == h.host);
    CHECK(p.worker_address == h.worker_address);
  }
}

// A raw client socket to 127.0.0.1:port (connected, blocking).
int raw_connect(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  for (int attempt = 0; attempt < 200; ++attempt) {
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return fd;
    std::this_thread::sleep_for(20ms);
  }
  FAIL("cannot connect to the rendezvous port");
  return -1;
}

void send_all(int fd, const void* data, std::size_t size) {
  REQUIRE(::send(fd, data, size, MSG_NOSIGNAL) == static_cast<ssize_t>(size));
}

// True when the peer closed fd within the bound (reads and discards what it sent first).
bool closed_by_peer(int fd, std::chrono::milliseconds bound) {
  const auto until = std::chrono::steady_clock::now() + bound;
  char sink[256];
  while (std::chrono::steady_clock::now() < until) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::recv(fd, sink, sizeof sink, 0);
    if (n <= 0) return true;
  }
  return false;
}

}  // namespace

TEST_CASE("four ranks get identical welcomes with everyone's address", "[unit][rendezvous]") {
  const auto o = options(fresh_port());
  auto server = start(true, o, hello_of(0, 4));
  std::vector<std::future<outcome>> joiners;
  for (int rank = 1; rank < 4; ++rank) joiners.push_back(start(false, o, hello_of(rank, 4)));
  const outcome s = get(server);
  check_welcome(s, 4);
  for (auto& j : joiners) {
    const outcome r = get(j);
    check_welcome(r, 4);
    CHECK(same(*r.welcome, *s.welcome));
  }
}

// NCCL ids travel from rank 0 to every process, but only where NCCL can link them all: each
// process on a device of its own (hosts differ, or devices on one host differ).
TEST_CASE("the welcome carries rank 0's NCCL ids only where every process has its own device",
          "[unit][rendezvous]") {
  struct layout {
    const char* what;
    std::vector<std::pair<std::string, std::string>> where;  // (host, device) by rank
    std::string obstacle;                                    // "" : the ids go out
  };
  const std::vector<layout> layouts = {
      {"two hosts, one device each",
       {{"a", "0000:18:00.0"}, {"b", "0000:18:00.0"}, {"b", "x"}},
       ""},
      {"one host, distinct devices",
       {{"a", "0000:18:00.0"}, {"a", "0000:2a:00.0"}, {"a", "x"}},
       ""},
      {"two processes on one device",
       {{"a", "0000:18:00.0"}, {"b", "d"}, {"a", "0000:18:00.0"}},
       "ranks 0 and 2 share device 0000:18:00.0 on host a"},
      {"a process without a device",
       {{"a", "0"}, {"b", ""}, {"c", "0"}},
       "rank 1 has no CUDA device"},
      {"one device, each process an NCCL host of its own (NCCL_HOSTID)",
       {{"a", "0000:18:00.0 on NCCL host h0"},
        {"a", "0000:18:00.0 on NCCL host h1"},
        {"a", "0000:18:00.0 on NCCL host h2"}},
       ""},
  };
  for (const auto& l : layouts) {
    INFO(l.what);
    const auto o = options(fresh_port());
    std::vector<messages::hello> hellos;
    for (int rank = 0; rank < 3; ++rank) {
      auto h = hello_of(rank, 3);
      h.host = l.where[static_cast<std::size_t>(rank)].first;
      h.device = l.where[static_cast<std::size_t>(rank)].second;
      hellos.push_back(h);
    }
    for (int i = 0; i < 2; ++i)
      hellos[0].nccl_ids.emplace_back(nccl_id_bytes, static_cast<std::uint8_t>(i + 1));
    auto server = start(true, o, hellos[0]);
    std::vector<std::future<outcome>> joiners;
    for (int rank = 1; rank < 3; ++rank) joiners.push_back(start(false, o, hellos[rank]));
    std::vector<outcome> all = {get(server)};
    for (auto& j : joiners) all.push_back(get(j));
    for (const auto& r : all) {
      INFO(r.error);
      REQUIRE(r.welcome);
      CHECK(nccl_obstacle(r.welcome->peers) == l.obstacle);
      for (int rank = 0; rank < 3; ++rank)
        CHECK(r.welcome->peers[static_cast<std::size_t>(rank)].device ==
              hellos[static_cast<std::size_t>(rank)].device);
      if (l.obstacle.empty())
        CHECK(r.welcome->nccl_ids == hellos[0].nccl_ids);
      else
        CHECK(r.welcome->nccl_ids.empty());
    }
  }
  // An id of the wrong size is rank 0's own mistake, refused before it listens.
  auto h = hello_of(0, 1);
  h.device = "0";
  h.nccl_ids.emplace_back(16, 0);
  REQUIRE_THROWS_WITH(rendezvous_serve(options(fresh_port(), 100ms), h),
                      Catch::Contains("an NCCL id of 16 bytes, not 128"));
}

TEST_CASE("joiners started before rank 0 still join", "[unit][rendezvous]") {
  const auto o = options(fresh_port());
  std::vector<std::future<outcome>> joiners;
  for (int rank = 1; rank < 3; ++rank) joiners.push_back(start(false, o, hello_of(rank, 3)));
  std::this_thread::sleep_for(300ms);  // let them find nobody listening and retry
  auto server = start(true, o, hello_of(0, 3));
  check_welcome(get(server), 3);
  for (auto& j : joiners) check_welcome(get(j), 3);
}

TEST_CASE("a world of one needs nobody", "[unit][rendezvous]") {
  const messages::welcome w = rendezvous_serve(options(fresh_port(), 100ms), hello_of(0, 1));
  REQUIRE(w.peers.size() == 1);
  CHECK(w.peers[0].host == "host0");
}

TEST_CASE("wrong hellos are refused with their reason; the job completes", "[unit][rendezvous]") {
  const auto o = options(fresh_port());
  auto server = start(true, o, hello_of(0, 4));

  auto token_future = start(false, o, hello_of(1, 4, "another-job"));
  CHECK(get(token_future).error == "rendezvous at 127.0.0.1:" + std::to_string(o.port) +
                                       " refused this process: job token does not match");
  auto old = hello_of(2, 4);
  old.version = messages::protocol_version + 1;
  auto version_future = start(false, o, old);
  CHECK_THAT(get(version_future).error,
             Contains("refused this process: protocol version " +
                      std::to_string(messages::protocol_version + 1) + ", this job speaks " +
                      std::to_string(messages::protocol_version)));
  auto world_future = start(false, o, hello_of(3, 8));
  CHECK_THAT(get(world_future).error,
             Contains("refused this process: world size 8, this job has 4"));
  auto rank0_future = start(false, o, hello_of(0, 4));
  CHECK_THAT(get(rank0_future).error, Contains("refused this process: rank 0 already joined"));

  // Two processes claim rank 3: whichever comes second is refused, the first stays.
  auto a = hello_of(3, 4), b = hello_of(3, 4);
  b.host = "impostor";
  auto fa = start(false, o, a), fb = start(false, o, b);
  std::future<outcome>* refused = nullptr;
  for (int i = 0; i < 600 && !refused; ++i) {
    if (fa.wait_for(50ms) == std::future_status::ready)
      refused = &fa;
    else if (fb.wait_for(0ms) == std::future_status::ready)
      refused = &fb;
  }
  REQUIRE(refused);
  const bool a_refused = refused == &fa;
  CHECK_THAT(get(*refused).error, Contains("refused this process: rank 3 already joined"));

  auto f1 = start(false, o, hello_of(1, 4)), f2 = start(false, o, hello_of(2, 4));
  const outcome s = get(server);
  REQUIRE(s.welcome);
  CHECK(s.welcome->peers[3].host == (a_refused ? "impostor" : "host3"));
  const outcome winner = get(a_refused ? fb : fa);
  REQUIRE(winner.welcome);
  CHECK(same(*winner.welcome, *s.welcome));
  for (auto* f : {&f1, &f2}) {
    const outcome r = get(*f);
    REQUIRE(r.welcome);
    CHECK(same(*r.welcome, *s.welcome));
  }
}

// Every process must resume the same checkpoint (messages::hello::resume): one that names
// another, or starts fresh where rank 0 resumes, is refused naming both, and rank 0 ends the
// job with the same line instead of waiting for it.
TEST_CASE("a process resuming another checkpoint than rank 0 ends the rendezvous, naming both",
          "[unit][rendezvous]") {
  const std::string newest = "step-00000004 (manifest xxh64 00000000000000aa)";
  const std::string older = "step-00000002 (manifest xxh64 00000000000000bb)";
  for (const std::string& theirs : {older, std::string()}) {
    INFO("rank 2 " << (theirs.empty() ? "starts fresh" : "resumes " + theirs));
    const auto o = options(fresh_port());
    auto own = hello_of(0, 3), same_one = hello_of(1, 3), other = hello_of(2, 3);
    own.resume = same_one.resume = newest;
    other.resume = theirs;
    auto server = start(true, o, own);
    auto f1 = start(false, options(o.port, 3000ms), same_one);
    auto f2 = start(false, o, other);
    const std::string line =
        "rank 2 " + (theirs.empty() ? std::string("starts fresh") : "resumes " + theirs) +
        ", but rank 0 resumes " + newest + ": every process must resume the same checkpoint";
    CHECK_THAT(get(f2).error, Contains("refused this process: " + line));
    const outcome s = get(server);
    CHECK_FALSE(s.welcome);
    CHECK(s.error == "rendezvous at 127.0.0.1:" + std::to_string(o.port) + ": " + line);
    CHECK_FALSE(get(f1).welcome);  // its rank 0 is gone
  }
  // The same checkpoint everywhere: the job joins.
  const auto o = options(fresh_port());
  auto own = hello_of(0, 2), joiner = hello_of(1, 2);
  own.resume = joiner.resume = newest;
  auto server = start(true, o, own);
  auto f1 = start(false, o, joiner);
  check_welcome(get(server), 2);
  check_welcome(get(f1), 2);
}

TEST_CASE("rank 0 names the ranks still missing at its deadline", "[unit][rendezvous]") {
  const auto o = options(fresh_port(), 3000ms);
  auto server = start(true, o, hello_of(0, 5));
  auto joiner = start(false, options(o.port, 4500ms), hello_of(2, 5));
  auto intruder = start(false, o, hello_of(4, 5, "wrong"));
  const outcome s = get(server);
  CHECK_FALSE(s.welcome);
  CHECK_THAT(s.error, Contains("rendezvous at 127.0.0.1:" + std::to_string(o.port) +
                               " timed out after 3000 ms: ranks 1, 3-4 of 5 never joined"));
  CHECK_THAT(s.error, Contains("refused meanwhile: rank 4: job token does not match"));
  // The joiner lost its rank 0 and then times out itself, naming the address.
  const outcome j = get(joiner);
  CHECK_FALSE(j.welcome);
  CHECK_THAT(j.error, Contains("rendezvous at 127.0.0.1:" + std::to_string(o.port) +
                               " timed out after 4500 ms"));
  CHECK_THAT(get(intruder).error, Contains("job token does not match"));
}

TEST_CASE("a joiner with nobody listening times out naming the address", "[unit][rendezvous]") {
  const auto o = options(fresh_port(), 300ms);
  const outcome r = [&] {
    auto f = start(false, o, hello_of(1, 2));
    return get(f);
  }();
  CHECK(r.error == "rendezvous at 127.0.0.1:" + std::to_string(o.port) +
                       " timed out after 300 ms (Connection refused)");
}

TEST_CASE("rank 0 that cannot listen names the address", "[unit][rendezvous]") {
  const int port = fresh_port();
  const int busy = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(busy, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(busy, 1) == 0);
  CHECK_THROWS_WITH(rendezvous_serve(options(port, 500ms), hello_of(0, 2)),
                    Contains("cannot listen on 127.0.0.1:" + std::to_string(port)));
  ::close(busy);
  CHECK_THROWS_WITH(rendezvous_serve(options(0, 500ms), hello_of(0, 2)),
                    Contains("port 0 is outside 1-65535"));
  CHECK_THROWS_WITH(rendezvous_serve(options(port, 500ms), hello_of(1, 2)),
                    Contains("rendezvous_serve is for rank 0"));
}

TEST_CASE("garbage, stalled and oversized connections do not disturb the job",
          "[unit][rendezvous]") {
  const auto o = options(fresh_port());
  auto server = start(true, o, hello_of(0, 3));

  // Not Cap'n Proto at all: the first word announces an absurd segment count.
  const int http = raw_connect(o.port);
  const std::string request = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  send_all(http, request.data(), request.size());
  // A segment table announcing a 1 GiB segment: dropped before anything is read.
  const int huge = raw_connect(o.port);
  const std::uint32_t table[2] = {0, 1u << 27};
  send_all(huge, table, sizeof table);
  // A well-formed frame with the wrong magic.
  const int stranger = raw_connect(o.port);
  const auto wrong_magic = frame_with(0x1234, 0);
  send_all(stranger, wrong_magic.data(), wrong_magic.size() * 8);
  // Half a hello, then silence.
  const int stalled = raw_connect(o.port);
  send_all(stalled, table, 4);
  const int silent = raw_connect(o.port);

  CHECK(closed_by_peer(http, 5000ms));
  CHECK(closed_by_peer(huge, 5000ms));
  CHECK(closed_by_peer(stranger, 5000ms));

  auto f1 = start(false, o, hello_of(1, 3)), f2 = start(false, o, hello_of(2, 3));
  const outcome s = get(server);
  check_welcome(s, 3);
  check_welcome(get(f1), 3);
  check_welcome(get(f2), 3);
  // Once the job has its welcome, rank 0 lets go of the connections that never said hello.
  CHECK(closed_by_peer(stalled, 5000ms));
  CHECK(closed_by_peer(silent, 5000ms));
  for (int fd : {http, huge, stranger, stalled, silent}) ::close(fd);
}

TEST_CASE("a joiner refuses a malformed welcome", "[unit][rendezvous]") {
  // A fake rank 0 that answers with a welcome listing the wrong number of peers.
  const int port = fresh_port();
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(::listen(listener, 4) == 0);
  auto joiner = start(false, options(port, 5000ms), hello_of(1, 2));
  pollfd p{listener, POLLIN, 0};
  REQUIRE(::poll(&p, 1, 5000) == 1);
  const int fd = ::accept(listener, nullptr, nullptr);
  const auto welcome = welcome_with(3);
  send_all(fd, welcome.data(), welcome.size() * 8);
  CHECK_THAT(get(joiner).error, Contains("sent a malformed welcome: 3 peers for world size 2"));
  ::close(fd);
  ::close(listener);
}
