// The in-process tensor-parallel group. See tensor_group.hpp.
//
// A collective is three barriers: every member publishes its buffer; member r reduces its
// share [n*r/t, n*(r+1)/t) of every member's buffer, in member order, into a shared result;
// every member copies the result into its own buffer; the last barrier keeps the next
// collective from overwriting the result while a member still copies it.
#include "engine/chunks/tensor_group.hpp"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>

namespace troupe::engine {
namespace {

struct group_state {
  std::mutex m;
  std::condition_variable cv;
  int size = 1;
  std::string name;
  std::chrono::milliseconds deadline{};
  std::vector<const void*> inputs;
  std::vector<std::size_t> lengths;
  std::vector<bool> present;  // who reached the current barrier
  int arrived = 0;
  std::uint64_t generation = 0;
  std::vector<std::byte> result;
  std::string aborted;  // non-empty: every collective throws this
};

class local_member final : public tensor_group {
 public:
  local_member(std::shared_ptr<group_state> s, int rank) : s_(std::move(s)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return s_->size; }
  void all_reduce_sum(std::span<float> d) override {
    reduce(d, [](float a, float b) { return a + b; });
  }
  void all_reduce_sum(std::span<double> d) override {
    reduce(d, [](double a, double b) { return a + b; });
  }
  void all_reduce_max(std::span<float> d) override {
    reduce(d, [](float a, float b) { return std::max(a, b); });
  }
  void abort(const std::string& why) override {
    std::lock_guard lk(s_->m);
    if (s_->aborted.empty()) s_->aborted = s_->name + ": " + why;
    s_->cv.notify_all();
  }

 private:
  void check(const std::unique_lock<std::mutex>&) const {
    if (!s_->aborted.empty()) throw tensor_group_error(s_->aborted);
  }

  void barrier(std::unique_lock<std::mutex>& lk, const char* phase) {
    auto& s = *s_;
    check(lk);
    const auto gen = s.generation;
    s.present[static_cast<std::size_t>(rank_)] = true;
    if (++s.arrived == s.size) {
      s.arrived = 0;
      std::fill(s.present.begin(), s.present.end(), false);
      ++s.generation;
      s.cv.notify_all();
      return;
    }
    const bool passed =
        s.cv.wait_for(lk, s.deadline, [&] { return s.generation != gen || !s.aborted.empty(); });
    check(lk);
    if (!passed) {
      int missing = 0;
      while (missing < s.size && s.present[static_cast<std::size_t>(missing)]) ++missing;
      s.aborted = s.name + ": member " + std::to_string(rank_) + " waited " +
                  std::to_string(s.deadline.count()) + " ms for member " + std::to_string(missing) +
                  " at a collective (" + phase + ")";
      s.cv.notify_all();
      throw tensor_group_error(s.aborted);
    }
  }

  template <class T, class Op>
  void reduce(std::span<T> data, Op op) {
    auto& s = *s_;
    if (s.size == 1) return;
    std::unique_lock lk(s.m);
    s.inputs[static_cast<std::size_t>(rank_)] = data.data();
    s.lengths[static_cast<std::size_t>(rank_)] = data.size();
    barrier(lk, "publish");
    const std::size_t n = data.size();
    for (std::size_t len : s.lengths) {
      if (len != n) {
        s.aborted = s.name + ": members reduce buffers of different lengths (" + std::to_string(n) +
                    " and " + std::to_string(len) + ")";
        s.cv.notify_all();
        throw tensor_group_error(s.aborted);
      }
    }
    if (rank_ == 0) s.result.resize(n * sizeof(T));
    barrier(lk, "size");
    T* out = reinterpret_cast<T*>(s.result.data());
    const std::size_t lo = n * static_cast<std::size_t>(rank_) / static_cast<std::size_t>(s.size);
    const std::size_t hi =
        n * static_cast<std::size_t>(rank_ + 1) / static_cast<std::size_t>(s.size);
    std::vector<const T*> in(static_cast<std::size_t>(s.size));
    for (int m = 0; m < s.size; ++m)
      in[static_cast<std::size_t>(m)] =
          static_cast<const T*>(s.inputs[static_cast<std::size_t>(m)]);
    lk.unlock();
    for (std::size_t i = lo; i < hi; ++i) {
      T acc = in[0][i];
      for (std::size_t m = 1; m < in.size(); ++m) acc = op(acc, in[m][i]);
      out[i] = acc;
    }
    lk.lock();
    barrier(lk, "reduce");
    lk.unlock();
    if (n > 0) std::memcpy(data.data(), out, n * sizeof(T));
    lk.lock();
    barrier(lk, "copy");
  }

  std::shared_ptr<group_state> s_;
  int rank_;
};

}  // namespace

std::vector<std::shared_ptr<tensor_group>> make_local_tensor_group(
    int size, std::string name, std::chrono::milliseconds deadline) {
  if (size < 1) throw std::invalid_argument("a tensor-parallel group needs at least one member");
  auto s = std::make_shared<group_state>();
  s->size = size;
  s->name = std::move(name);
  s->deadline = deadline;
  s->inputs.resize(static_cast<std::size_t>(size));
  s->lengths.resize(static_cast<std::size_t>(size));
  s->present.resize(static_cast<std::size_t>(size));
  std::vector<std::shared_ptr<tensor_group>> members;
  for (int r = 0; r < size; ++r) members.push_back(std::make_shared<local_member>(s, r));
  return members;
}

}  // namespace troupe::engine
