// A stage's checkpoints. See stage_capture.hpp.
#include "topology/stage_capture.hpp"

#include <algorithm>
#include <chrono>
#include <memory>
#include <thread>
#include <utility>

namespace troupe::topology {

using messages::stage_snapshot;

int stage_capture::begin(const std::function<chunk_copies()>& copies, bool moments,
                         stage_snapshot empty, zero_part zero, messages::zero_state zero_floats) {
  if (copying_.valid()) copying_.get();  // an abandoned checkpoint's (a failed job's)
  copies_taken_ = {};
  for (auto& q : waiting_) q.fail("a checkpoint abandoned");  // and its state requests
  waiting_.clear();
  captured_.reset();
  copied_.reset();
  zero_.reset();
  zero_pending_ = false;
  zero_wanted_ = zero != zero_part::none;
  const int capture = ++captures_;
  auto chunk_copies = copies();
  if (!chunk_copies.empty()) {
    auto taken = std::make_shared<std::promise<void>>();
    copies_taken_ = taken->get_future();
    copying_ = std::async(std::launch::async, [this, c = std::move(chunk_copies), moments, taken] {
      bool told = false;  // the update told it may run
      try {
        if (h_.delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(h_.delay_ms));
        std::vector<engine::rank_chunks::host_state> states;
        for (const auto& copy : c) states.push_back(copy());
        // Copies (device chunks'): the update need not wait for the snapshot's tensors.
        if (std::all_of(states.begin(), states.end(), [](const auto& s) { return s.detached; })) {
          taken->set_value();
          told = true;
        }
        auto s = h_.snapshot_of(states, moments);
        if (!told) taken->set_value();
        told = true;
        h_.post_copied();
        return s;
      } catch (...) {
        if (!told) taken->set_exception(std::current_exception());
        throw;
      }
    });
  } else {  // ZeRO-3 (or a replica past 0): the stage holds nothing of the state to copy
    copied_ = std::move(empty);
  }
  if (zero == zero_part::now) {
    zero_ = std::move(zero_floats);
    assemble();  // where nothing is left to copy
  } else if (zero == zero_part::pending) {
    zero_pending_ = true;
  }
  return capture;
}

void stage_capture::zero_arrived(int capture, messages::zero_state z) {
  if (capture != captures_) return;  // an abandoned checkpoint's
  zero_ = std::move(z);
  zero_pending_ = false;
  assemble();
}

void stage_capture::copied() { finish(); }

void stage_capture::wait_for_copies() {
  if (copies_taken_.valid()) copies_taken_.get();
}

// The copy, once done, with ZeRO's part once in, to the state requests waiting for it.
void stage_capture::finish() {
  if (copying_.valid()) copied_ = copying_.get();
  assemble();
}

void stage_capture::assemble() {
  if (!copied_ || zero_pending_) return;
  captured_ = zero_wanted_ ? h_.with_zero(std::move(*copied_), *zero_) : std::move(*copied_);
  copied_.reset();
  zero_.reset();
  if (waiting_.empty()) return;
  for (std::size_t i = 0; i + 1 < waiting_.size(); ++i) answer(waiting_[i], *captured_);
  answer(waiting_.back(), std::move(*captured_));
  waiting_.clear();
  captured_.reset();
}

void stage_capture::state(
    request q, const std::function<void(std::function<void(stage_snapshot)>)>& take_now) {
  if (copying_.valid() && copying_.wait_for(std::chrono::seconds(0)) == std::future_status::ready) {
    copied_ = copying_.get();
    assemble();
  }
  if (captured_) {
    stage_snapshot s = std::move(*captured_);
    captured_.reset();
    answer(q, std::move(s));
  } else if (copying_.valid() || copied_ || zero_pending_) {  // once the capture is in
    waiting_.push_back(std::move(q));
  } else {
    take_now([this, q](stage_snapshot s) mutable { answer(q, std::move(s)); });
  }
}

void stage_capture::answer(request& q, stage_snapshot s) {
  if (q.part_dir.empty())
    q.answer(std::move(s));
  else
    write_part(q, std::move(s));
}

// W5: the state written as this stage's part on a thread (post_part when done), while the stage
// goes on; the answer is the part's name, size and xxh64.
void stage_capture::write_part(request& q, stage_snapshot s) {
  if (writing_.valid()) writing_.get();  // the previous checkpoint's (one at a time)
  const int token = ++parts_asked_;
  const std::filesystem::path dir = q.part_dir;
  parts_waiting_.emplace(token, q);
  writing_ = std::async(std::launch::async, [post = h_.post_part, token, dir, name = h_.part_name,
                                             shard = h_.shard, s = std::move(s)] {
    engine::checkpoint_file file;
    std::string error;
    try {
      using role = engine::checkpoint_assembler::role;
      std::vector<engine::checkpoint_piece> pieces;
      for (const auto& [n, v] : s.parameters)
        pieces.push_back(
            {role::parameter, n, shard, 0, v.data(), static_cast<std::int64_t>(v.size())});
      for (const auto& p : s.pieces)
        pieces.push_back({static_cast<role>(p.role), p.name, shard, p.offset, p.values.data(),
                          static_cast<std::int64_t>(p.values.size())});
      file = engine::write_checkpoint_part(dir, name, pieces);
    } catch (const std::exception& e) {
      error = e.what();
    }
    post(token, std::move(file), std::move(error));
  });
}

void stage_capture::part_written(int token, engine::checkpoint_file file,
                                 const std::string& error) {
  const auto it = parts_waiting_.find(token);
  if (it == parts_waiting_.end()) return;
  request q = std::move(it->second);
  parts_waiting_.erase(it);
  if (!error.empty()) {
    q.fail(error);
    return;
  }
  stage_snapshot s;
  s.rank = h_.rank;
  s.replica = h_.replica;
  s.part = std::move(file);
  q.answer(std::move(s));
}

void stage_capture::stop(const std::string& why) {
  if (copying_.valid()) copying_.wait();  // it reads the chunks
  if (writing_.valid()) writing_.wait();  // not left to a destructor on its own thread
  for (auto& [token, q] : parts_waiting_) q.fail(why);
  parts_waiting_.clear();
  for (auto& q : waiting_) q.fail(why);
  waiting_.clear();
}

}  // namespace troupe::topology
