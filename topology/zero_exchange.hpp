// A zero_group (engine/chunks/device_chunk.hpp) whose replicas live in several processes, over
// messages (messages::ring_chunk through the job's gateways), in host memory: ZeRO through the
// devices' groups for host chunks across processes, the path a GPU job's NCCL group takes, with
// the host shards' numbers.
//
// Invariants:
//  - A replica's k-th call is collective k; its messages carry k (ring_chunk::collective) and
//    name the collective (phase 0 reduce-scatter, 1 all-gather; step; bucket). A replica whose
//    k-th call is another collective than a peer's k-th message throws, naming both: NCCL's
//    rule that every rank enqueue the same collectives in one order, checked across processes.
//  - reduce_scatter: each replica sends every ring chunk it does not own to the chunk's owner;
//    the owner, once it has called and every other replica's piece has arrived, sums the chunk
//    in the ring's order (x_c + x_{c+1} + ... + x_{c+d-1}) and scales it by 1/d into its ranges,
//    bitwise what the host shards' ring leaves, and is done.
//  - all_gather: each replica sends its owned chunk to every other; a replica is done once every
//    other owner's chunk has arrived and is written into its ranges.
//  - done runs on the thread that completed the collective (a caller's, or the gateway's for a
//    message), events are nullptr; pieces are copied into the messages when sent.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/chunks/device_chunk.hpp"
#include "messages/remote.hpp"

namespace troupe::topology {

class exchange_zero_group final : public engine::zero_group {
 public:
  // Delivers a message to replica `to` in another process; must not block.
  using post_fn = std::function<void(int to, messages::ring_chunk)>;
  // The group of pipeline rank `rank` over here.size() replicas, here[r]: replica r lives in
  // this process.
  exchange_zero_group(std::string name, int rank, std::vector<bool> here, post_fn remote);
  void reduce_scatter(int step, int bucket, int replica, const float_ranges& ranges, void* ready,
                      done_fn done) override;
  void all_gather(int step, int bucket, int replica, const float_ranges& ranges, void* ready,
                  done_fn done) override;
  std::string describe() const override;
  // A message for `replica`, one of this process's (any thread).
  void deliver(int replica, messages::ring_chunk m);

 private:
  struct pending {  // one replica's collective k
    bool called = false;
    int phase = 0, step = 0, bucket = 0;
    float_ranges ranges;
    done_fn done;
    std::map<int, messages::ring_chunk> received;  // by sending replica
  };
  void call(int phase, int step, int bucket, int replica, const float_ranges& ranges, done_fn done);
  // Completes (replica, k) if everything is in: its done, to run once the lock is released.
  done_fn complete(int replica, std::uint64_t k);
  void send(int to, messages::ring_chunk m);
  std::string collective(int phase, int step, int bucket) const;

  std::string name_;
  int rank_, replicas_;
  std::vector<bool> here_;
  post_fn remote_;
  std::mutex m_;
  std::map<std::pair<int, std::uint64_t>, pending> pending_;  // (replica, k)
  std::vector<std::uint64_t> calls_;                          // by replica: calls so far
};

}  // namespace troupe::topology
