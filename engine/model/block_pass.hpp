// A pass over one micro-batch (forward, backward, or either half of a split backward) that
// stops before each piece that reads parameters, naming the parameter blocks the piece reads
// (indices into chunk_grad_blocks). Whoever drives the pass decides when to go on: the serial
// engine at once; a ZeRO-3 stage once those blocks are gathered (actors/stage.cpp).
//
// Invariants:
//  - Nothing runs before the first next(): creating a pass computes nothing.
//  - At a stop, the pieces before it are done and read no parameter again: the blocks of the
//    previous stop may be released. The pass reads only the blocks of its latest stop.
//  - An exception thrown by the pass comes out of next() (or run()); the pass is then done.
//  - Arguments are held by value in the pass (C++20 coroutine frame); pointers and references
//    the caller passes (the stage, the activations, input and output buffers) must stay valid
//    until the pass is done.
#pragma once

#include <coroutine>
#include <exception>
#include <utility>
#include <vector>

namespace troupe::engine {

class [[nodiscard]] block_pass {
 public:
  struct promise_type {
    std::vector<int> wanted;
    std::exception_ptr error;
    block_pass get_return_object() {
      return block_pass(std::coroutine_handle<promise_type>::from_promise(*this));
    }
    std::suspend_always initial_suspend() noexcept { return {}; }
    std::suspend_always final_suspend() noexcept { return {}; }
    std::suspend_always yield_value(std::vector<int> blocks) noexcept {
      wanted = std::move(blocks);
      return {};
    }
    void return_void() noexcept {}
    void unhandled_exception() noexcept { error = std::current_exception(); }
  };

  block_pass() = default;
  block_pass(block_pass&& o) noexcept : h_(std::exchange(o.h_, {})) {}
  block_pass& operator=(block_pass&& o) noexcept {
    if (this != &o) {
      destroy();
      h_ = std::exchange(o.h_, {});
    }
    return *this;
  }
  block_pass(const block_pass&) = delete;
  block_pass& operator=(const block_pass&) = delete;
  ~block_pass() { destroy(); }

  // Runs to the next stop and returns the blocks the next piece reads, or nullptr when the pass
  // has finished. Rethrows what the pass threw.
  const std::vector<int>* next() {
    if (!h_ || h_.done()) return nullptr;
    h_.resume();
    if (h_.promise().error) std::rethrow_exception(std::exchange(h_.promise().error, {}));
    return h_.done() ? nullptr : &h_.promise().wanted;
  }
  // Runs to the end, not stopping (every parameter is in place).
  void run() {
    while (next()) {
    }
  }
  bool done() const { return !h_ || h_.done(); }

 private:
  explicit block_pass(std::coroutine_handle<promise_type> h) : h_(h) {}
  void destroy() {
    if (h_) h_.destroy();
    h_ = {};
  }
  std::coroutine_handle<promise_type> h_;
};

}  // namespace troupe::engine
