// A tensor-parallel group whose members live in several processes (engine/chunks/tensor_group.hpp's
// contract, over messages): in every collective each member sends its buffer to every other
// member (messages::tensor_exchange, through the job's gateways) and, once all the others'
// buffers have arrived, reduces the members' buffers in member order. That is the in-process
// group's order (engine::make_local_tensor_group), so a job gives bitwise the same numbers
// whether a stage's shards share a process or not.
//
// Invariants:
//  - Every member calls the same collectives in the same order: collective k of a member carries
//    seq k. A buffer of a later collective that arrives early waits in the member's inbox.
//  - A buffer of another kind or length than the receiver's at the same seq breaks the group,
//    naming both members.
//  - No wait is unbounded: past the deadline the member throws tensor_group_error naming the
//    member it waited for. abort() (a stage that stopped, a job torn down) makes this member's
//    collectives throw and is sent to every other member, whose collectives then throw with the
//    same reason.
//  - Each member sends (t - 1) copies of its buffer per collective; members in one process hand
//    buffers over without a copy.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/chunks/tensor_group.hpp"
#include "messages/remote.hpp"

namespace troupe::topology {

class exchange_member final : public engine::tensor_group {
 public:
  // Delivers a message to member `to` (in this process or another); called on the collective's
  // thread, it must not block.
  using post_fn = std::function<void(int to, messages::tensor_exchange)>;
  exchange_member(std::string name, int size, int rank, post_fn post,
                  std::chrono::milliseconds deadline);
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void all_reduce_sum(std::span<float> data) override;
  void all_reduce_sum(std::span<double> data) override;
  void all_reduce_max(std::span<float> data) override;
  void abort(const std::string& why) override;
  // A message from another member; any thread.
  void deliver(messages::tensor_exchange m);
  // Breaks this member with `why` and sends nothing from now on (the transport is going away):
  // a later abort() tells no one.
  void close(const std::string& why);

 private:
  template <class T, class Op>
  void reduce(std::span<T> data, messages::tensor_exchange::op kind, Op op);
  void broken(std::unique_lock<std::mutex>& lk, std::string why);

  std::string name_;
  int size_, rank_;
  post_fn post_;
  std::chrono::milliseconds deadline_;
  std::mutex m_;
  std::condition_variable cv_;
  std::map<std::pair<std::uint64_t, int>, messages::tensor_exchange> inbox_;  // (seq, from)
  std::uint64_t seq_ = 0;
  std::string aborted_;  // non-empty: every collective throws this
};

// The members of a group of `here.size()` members that live in this process (here[j]: member j
// does; the others' entries are null). `remote(to, m)` carries a message to a member elsewhere;
// members here hand messages to each other directly. name appears in errors ("tp group of
// stage 1 · dp 0").
std::vector<std::shared_ptr<exchange_member>> make_exchange_group(
    std::string name, const std::vector<bool>& here, exchange_member::post_fn remote,
    std::chrono::milliseconds deadline = std::chrono::seconds(120));

}  // namespace troupe::topology
