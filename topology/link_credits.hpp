// Credit-based flow control for pipeline links, as plain bookkeeping (no actors, no I/O).
//
// The receiver knows from its plan the order in which it will consume the messages of each
// link (a link = message kind + receiving virtual stage). It grants credits for exactly the
// next k messages in that order, and one more each time it consumes one. A sender sends a
// message only once it holds that message's credit; otherwise it keeps it until the credit
// comes. So at most k messages per link are ever unacknowledged, and the message a receiver
// needs next always has its credit: credits cannot deadlock a plan that the simulator accepts.
#pragma once

#include <compare>
#include <cstddef>
#include <map>
#include <optional>
#include <set>
#include <vector>

namespace troupe::topology {

struct link_key {
  int kind = 0;  // messages::link_kind
  bool eval = false;
  int step = 0;
  int virtual_stage = 0;  // the receiving one
  int round = 0;
  int micro_batch = 0;
  friend auto operator<=>(const link_key&, const link_key&) = default;
};

class incoming_credits {
 public:
  // consumption: every message this receiver will consume this step, in plan order.
  // Returns the credits to grant now (the first k of each link).
  std::vector<link_key> start(const std::vector<link_key>& consumption, int k);
  // The receiver consumed `key`: returns the next credit to grant on that link, if any.
  std::optional<link_key> consumed(const link_key& key);

 private:
  struct link_state {
    std::vector<link_key> order;
    std::size_t next_grant = 0;
  };
  static std::pair<int, int> link_of(const link_key& k) { return {k.kind, k.virtual_stage}; }
  std::map<std::pair<int, int>, link_state> links_;
};

class outgoing_credits {
 public:
  // The sender has produced `key`: true if it may send now (it held the credit).
  bool produced(const link_key& key);
  // A credit arrived: true if the message was waiting and must be sent now.
  bool granted(const link_key& key);

 private:
  std::set<link_key> credits_;
  std::set<link_key> waiting_;
};

}  // namespace troupe::topology
