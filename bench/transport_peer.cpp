// The peer process of `troupe bench transport` (`troupe bench transport-peer`, hidden): rank 1 of
// one measurement. It swaps worker addresses with the measuring process over the inherited
// socket, then echoes latency frames, or decodes bandwidth frames (checking that each payload is
// a view of the receive buffer) and acknowledges after the warm-up and after the last frame,
// until the measuring process says bye (an empty frame); its status line goes back on the socket.
#include <poll.h>

#include <cstdio>
#include <memory>
#include <string>
#include <variant>
#include <vector>

#include "bench/transport_bench.hpp"
#include "bench/transport_io.hpp"
#include "messages/wire_codec.hpp"
#include "transport/ucx_transport.hpp"

namespace troupe::bench {

using namespace transport_io;
namespace wire = messages::wire;

int run_transport_peer(const transport_peer_options& o) {
  auto status_line = [&](const std::string& text) {
    write_all(o.fd, (text + "\n").data(), text.size() + 1);
  };
  try {
    if (o.fd < 0) fail("--fd is required");
    if (o.mode != "bandwidth" && o.mode != "latency" && o.mode != "latency-wait")
      fail("unknown --mode '" + o.mode + "' (bandwidth, latency or latency-wait)");
    transport::ucx_options uo;
    uo.transports = o.transports;
    auto t = std::make_unique<transport::ucx_transport>(1, uo);
    send_blob(o.fd, t->address());
    t->connect(0, receive_blob(o.fd));
    const bool echo = o.mode != "bandwidth", wait_mode = o.mode == "latency-wait";
    const wire::limits lim = bench_limits();
    std::uint64_t ack = 0;
    const transport::iov_list ack_iov = {{&ack, sizeof ack}};
    bool bye = false, views = true;
    long received = 0;
    std::string error;
    // Echoing: each frame goes back from its own receive buffer, which is kept until every echo
    // in flight completed (only when its send did not complete at once); the iov and the kept
    // list reuse their storage, so an echo allocates nothing (the bench times the transport, not
    // the heap).
    struct echo_state {
      transport::iov_list iov{{nullptr, 0}};
      std::vector<std::shared_ptr<messages::aligned_buffer>> kept;
      long in_flight = 0;
      bool done_at_once = false;  // the send just made completed inside send()
    } echoes;
    t->on_receive([&](int, std::shared_ptr<messages::aligned_buffer> buf, std::size_t bytes) {
      if (bytes == 0) {
        bye = true;
        return;
      }
      ++received;
      if (echo) {
        echoes.iov[0] = {buf->data(), bytes};
        ++echoes.in_flight;
        echoes.done_at_once = false;
        t->send(0, echoes.iov, [&echoes](bool, const std::string&) {
          echoes.done_at_once = true;  // read only right after send(), where it ran inline
          if (--echoes.in_flight == 0) echoes.kept.clear();
        });
        if (!echoes.done_at_once) echoes.kept.push_back(std::move(buf));
        return;
      }
      try {
        const auto e = wire::decode(buf, bytes, lim);
        const auto* m = std::get_if<messages::link_message>(&e.message);
        const auto* data = m ? reinterpret_cast<const std::byte*>(m->data->data()) : nullptr;
        views &= m && m->data->is_view() && data >= buf->data() &&
                 data + m->data->size() * sizeof(float) <= buf->data() + bytes;
      } catch (const std::exception& ex) {
        if (error.empty()) error = ex.what();
      }
      if (received == o.warmup || received == o.warmup + o.frames)
        t->send(0, ack_iov, [](bool, const std::string&) {});
    });
    const auto deadline = clock_type::now() + 2 * measurement_deadline;
    for (unsigned spins = 0; !bye; ++spins) {
      if (t->progress() == 0 && wait_mode) t->wait(std::chrono::milliseconds(100));
      if (spins % 4096 == 4095) {
        pollfd pfd{o.fd, POLLIN, 0};  // readable = the measuring process is gone
        if (clock_type::now() > deadline || ::poll(&pfd, 1, 0) != 0)
          fail("no bye from the measuring process");
      }
    }
    t.reset();
    status_line(error.empty() ? std::string(peer_line_ok) + " views=" + (views && !echo ? "1" : "0")
                              : "error " + error);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe bench transport-peer: %s\n", e.what());
    status_line(std::string("error ") + e.what());
    return 1;
  }
}

}  // namespace troupe::bench
