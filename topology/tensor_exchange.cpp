// A tensor-parallel group across processes. See tensor_exchange.hpp.
#include "topology/tensor_exchange.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace troupe::topology {

using messages::tensor_exchange;

namespace {

const char* kind_text(tensor_exchange::op k) {
  switch (k) {
    case tensor_exchange::op::sum_f32:
      return "a float sum";
    case tensor_exchange::op::sum_f64:
      return "a double sum";
    case tensor_exchange::op::max_f32:
      return "a float maximum";
    case tensor_exchange::op::abort:
      return "an abort";
  }
  return "?";
}

}  // namespace

exchange_member::exchange_member(std::string name, int size, int rank, post_fn post,
                                 std::chrono::milliseconds deadline)
    : name_(std::move(name)),
      size_(size),
      rank_(rank),
      post_(std::move(post)),
      deadline_(deadline) {
  if (size < 1 || rank < 0 || rank >= size)
    throw std::invalid_argument(name_ + ": member " + std::to_string(rank) + " of " +
                                std::to_string(size));
}

void exchange_member::all_reduce_sum(std::span<float> data) {
  reduce(data, tensor_exchange::op::sum_f32, [](float a, float b) { return a + b; });
}
void exchange_member::all_reduce_sum(std::span<double> data) {
  reduce(data, tensor_exchange::op::sum_f64, [](double a, double b) { return a + b; });
}
void exchange_member::all_reduce_max(std::span<float> data) {
  reduce(data, tensor_exchange::op::max_f32, [](float a, float b) { return std::max(a, b); });
}

void exchange_member::broken(std::unique_lock<std::mutex>&, std::string why) {
  if (aborted_.empty()) aborted_ = std::move(why);
  cv_.notify_all();
}

void exchange_member::abort(const std::string& why) {
  std::string reason;
  post_fn post;
  {
    std::unique_lock lk(m_);
    const bool first = aborted_.empty();
    broken(lk, name_ + ": " + why);
    if (!first || !post_) return;  // told the others already, or was told, or closed
    reason = aborted_;
    post = post_;
  }
  for (int to = 0; to < size_; ++to) {
    if (to == rank_) continue;
    tensor_exchange m;
    m.from = rank_;
    m.kind = tensor_exchange::op::abort;
    m.data = std::make_shared<messages::payload<float>>(0);
    m.reason = reason;
    post(to, std::move(m));
  }
}

void exchange_member::close(const std::string& why) {
  std::unique_lock lk(m_);
  broken(lk, name_ + ": " + why);
  post_ = nullptr;
}

void exchange_member::deliver(tensor_exchange m) {
  std::unique_lock lk(m_);
  if (m.kind == tensor_exchange::op::abort) {
    broken(lk,
           m.reason.empty() ? name_ + ": member " + std::to_string(m.from) + " stopped" : m.reason);
    return;
  }
  if (m.from < 0 || m.from >= size_ || m.from == rank_ || m.seq < seq_) {
    broken(lk, name_ + ": member " + std::to_string(rank_) + " got collective " +
                   std::to_string(m.seq) + " from member " + std::to_string(m.from) +
                   ", which it does not expect");
    return;
  }
  const auto key = std::pair{m.seq, m.from};
  if (inbox_.count(key)) {
    broken(lk, name_ + ": member " + std::to_string(m.from) + " sent collective " +
                   std::to_string(m.seq) + " twice");
    return;
  }
  inbox_.emplace(key, std::move(m));
  cv_.notify_all();
}

template <class T, class Op>
void exchange_member::reduce(std::span<T> data, tensor_exchange::op kind, Op op) {
  if (size_ == 1) return;
  const std::uint64_t seq = seq_;
  // As floats: a double travels as its two halves' bits.
  const std::size_t floats = data.size() * sizeof(T) / sizeof(float);
  post_fn post;
  {
    std::unique_lock lk(m_);
    if (!aborted_.empty()) throw engine::tensor_group_error(aborted_);
    post = post_;
  }
  auto mine =
      std::make_shared<messages::payload<float>>(floats, messages::payload<float>::for_overwrite);
  if (floats > 0) std::memcpy(mine->data(), data.data(), floats * sizeof(float));
  for (int to = 0; to < size_; ++to) {
    if (to == rank_) continue;
    tensor_exchange m;
    m.seq = seq;
    m.from = rank_;
    m.kind = kind;
    m.data = mine;  // shared, never written again
    post(to, std::move(m));
  }
  std::vector<messages::float_buffer> in(static_cast<std::size_t>(size_));
  {
    std::unique_lock lk(m_);
    for (int from = 0; from < size_; ++from) {
      if (from == rank_) continue;
      const auto key = std::pair{seq, from};
      const bool arrived =
          cv_.wait_for(lk, deadline_, [&] { return inbox_.count(key) > 0 || !aborted_.empty(); });
      if (!aborted_.empty()) throw engine::tensor_group_error(aborted_);
      if (!arrived) {
        broken(lk, name_ + ": member " + std::to_string(rank_) + " waited " +
                       std::to_string(deadline_.count()) + " ms for member " +
                       std::to_string(from) + " at a collective");
        throw engine::tensor_group_error(aborted_);
      }
      auto node = inbox_.extract(key);
      tensor_exchange& m = node.mapped();
      if (m.kind != kind || m.data->size() != floats) {
        broken(lk, name_ + ": member " + std::to_string(from) + " sent " + kind_text(m.kind) +
                       " of " + std::to_string(m.data->size()) + " floats where member " +
                       std::to_string(rank_) + " reduces " + kind_text(kind) + " of " +
                       std::to_string(floats));
        throw engine::tensor_group_error(aborted_);
      }
      in[static_cast<std::size_t>(from)] = std::move(m.data);
    }
    ++seq_;
  }
  // In member order, as the in-process group: member 0's value, then each next member's.
  std::vector<const T*> src(static_cast<std::size_t>(size_));
  for (int from = 0; from < size_; ++from)
    src[static_cast<std::size_t>(from)] =
        from == rank_ ? reinterpret_cast<const T*>(mine->data())
                      : reinterpret_cast<const T*>(in[static_cast<std::size_t>(from)]->data());
  for (std::size_t i = 0; i < data.size(); ++i) {
    T acc = src[0][i];
    for (std::size_t m = 1; m < src.size(); ++m) acc = op(acc, src[m][i]);
    data[i] = acc;
  }
}

std::vector<std::shared_ptr<exchange_member>> make_exchange_group(
    std::string name, const std::vector<bool>& here, exchange_member::post_fn remote,
    std::chrono::milliseconds deadline) {
  // The members here, weakly: a member's post function must not keep its peers (or itself)
  // alive.
  struct routes {
    std::vector<bool> here;
    std::vector<std::weak_ptr<exchange_member>> local;
    exchange_member::post_fn remote;
  };
  auto r = std::make_shared<routes>();
  r->here = here;
  r->local.resize(here.size());
  r->remote = std::move(remote);
  std::vector<std::shared_ptr<exchange_member>> members(here.size());
  const int size = static_cast<int>(here.size());
  for (int j = 0; j < size; ++j) {
    if (!here[static_cast<std::size_t>(j)]) continue;
    auto post = [r](int to, tensor_exchange m) {
      const auto k = static_cast<std::size_t>(to);
      if (!r->here.at(k)) {
        r->remote(to, std::move(m));
      } else if (auto peer = r->local[k].lock()) {
        peer->deliver(std::move(m));
      }  // else: a member here that is gone has nobody to tell
    };
    members[static_cast<std::size_t>(j)] =
        std::make_shared<exchange_member>(name, size, j, std::move(post), deadline);
    r->local[static_cast<std::size_t>(j)] = members[static_cast<std::size_t>(j)];
  }
  return members;
}

}  // namespace troupe::topology
