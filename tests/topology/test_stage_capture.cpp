// A stage's checkpoints (topology/stage_capture.hpp) without actors. S7: a capture's copies
// are taken on a thread; the update waits for them (views of the chunks' buffers: until the
// snapshot is made; copies: only until they are taken); state requests wait for the capture and
// get the state as it was at the capture; ZeRO's owned floats join it, now or later (an older
// capture's are dropped); a new capture abandons the requests still waiting; without a capture
// the state is taken now. W5: with a part directory the state is written as the stage's part on
// a thread and answered by its name, size and xxh64; a part that cannot be written fails its
// request. Every wait is bounded.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <future>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tests/data/temp_dir.hpp"
#include "topology/stage_capture.hpp"

using namespace troupe;
using messages::stage_snapshot;
using topology::stage_capture;
using namespace std::chrono_literals;

namespace {

// Waits (bounded) until `flag` is set.
bool eventually(const std::atomic<bool>& flag) {
  for (int i = 0; i < 2000 && !flag; ++i) std::this_thread::sleep_for(5ms);
  return flag;
}

// A stage of one chunk whose state is `weights` (and moments 10x and 100x them).
struct fake_stage {
  std::vector<float> weights = {1, 2, 3, 4};
  std::vector<float> m = {10, 20, 30, 40}, v = {100, 200, 300, 400};
  std::atomic<bool> copied{false};   // post_copied was called
  std::promise<void> snapshot_gate;  // snapshot_of waits for it where `gated`
  bool gated = false;
  std::optional<std::tuple<int, engine::checkpoint_file, std::string>> part;
  std::atomic<bool> part_posted{false};

  stage_capture::hooks hooks() {
    stage_capture::hooks h;
    auto gate = std::make_shared<std::shared_future<void>>(snapshot_gate.get_future().share());
    h.snapshot_of = [this, gate](const std::vector<engine::rank_chunks::host_state>& states,
                                 bool moments) {
      if (gated) gate->wait();
      stage_snapshot s;
      const auto& h0 = states.at(0);
      s.parameters.emplace_back("w", std::vector<float>(h0.params, h0.params + 4));
      if (moments) s.pieces.push_back({messages::tensor_role::exp_avg, "w", 0, {h0.m, h0.m + 4}});
      return s;
    };
    h.with_zero = [](stage_snapshot s, const messages::zero_state& z) {
      s.pieces.push_back({messages::tensor_role::exp_avg, "w", 0, z.m});
      return s;
    };
    h.post_copied = [this] { copied = true; };
    h.post_part = [this](int token, engine::checkpoint_file file, std::string error) {
      part.emplace(token, std::move(file), std::move(error));
      part_posted = true;
    };
    h.part_name = "part-000-000.safetensors";
    return h;
  }
  // The chunk's capture call: views of its buffers (CPU chunks), or copies (device chunks).
  stage_capture::chunk_copies copies(bool detached) {
    return {[this, detached] {
      engine::rank_chunks::host_state h;
      if (detached) {
        h.owned_params = weights;
        h.owned_m = m;
        h.params = h.owned_params.data();
        h.m = h.owned_m.data();
        h.detached = true;
      } else {
        h.params = weights.data();
        h.m = m.data();
      }
      return h;
    }};
  }
};

struct answers {
  std::vector<stage_snapshot> states;
  std::vector<std::string> failures;
  stage_capture::request request(std::string part_dir = "") {
    return {[this](stage_snapshot s) { states.push_back(std::move(s)); },
            [this](const std::string& why) { failures.push_back(why); }, std::move(part_dir)};
  }
};

const auto no_take_now = [](std::function<void(stage_snapshot)>) {
  FAIL("the state was taken now although a capture is in");
};

}  // namespace

TEST_CASE("S7: a capture of views holds the update until its snapshot is made", "[unit][capture]") {
  fake_stage stage;
  stage.gated = true;
  stage_capture c(stage.hooks());
  answers a;
  c.begin([&] { return stage.copies(false); }, true, {}, stage_capture::zero_part::none);
  c.state(a.request(), no_take_now);
  CHECK(a.states.empty());  // the copy is not in yet
  auto update = std::async(std::launch::async, [&] { c.wait_for_copies(); });
  CHECK(update.wait_for(100ms) == std::future_status::timeout);  // the snapshot reads in place
  stage.snapshot_gate.set_value();
  REQUIRE(update.wait_for(10s) == std::future_status::ready);
  update.get();
  stage.weights[0] = -1;  // the update, after the snapshot
  REQUIRE(eventually(stage.copied));
  c.copied();
  REQUIRE(a.states.size() == 1);
  CHECK(a.states[0].parameters.at(0).second == std::vector<float>{1, 2, 3, 4});
  CHECK(a.states[0].pieces.at(0).values == std::vector<float>{10, 20, 30, 40});
}

TEST_CASE("S7: a capture of copies lets the update run while its snapshot is made",
          "[unit][capture]") {
  fake_stage stage;
  stage.gated = true;
  stage_capture c(stage.hooks());
  answers a;
  c.begin([&] { return stage.copies(true); }, true, {}, stage_capture::zero_part::none);
  auto update = std::async(std::launch::async, [&] { c.wait_for_copies(); });
  REQUIRE(update.wait_for(10s) == std::future_status::ready);  // the snapshot still waits
  update.get();
  stage.weights[0] = -1;
  c.state(a.request(), no_take_now);
  CHECK(a.states.empty());
  stage.snapshot_gate.set_value();
  REQUIRE(eventually(stage.copied));
  c.copied();
  REQUIRE(a.states.size() == 1);
  CHECK(a.states[0].parameters.at(0).second == std::vector<float>{1, 2, 3, 4});
}

TEST_CASE("ZeRO's owned floats join the capture; an older capture's are dropped",
          "[unit][capture]") {
  fake_stage stage;
  stage_capture c(stage.hooks());
  answers a;
  stage_snapshot empty;
  empty.rank = 3;
  const int first = c.begin([] { return stage_capture::chunk_copies{}; }, false, empty,
                            stage_capture::zero_part::pending);
  c.state(a.request(), no_take_now);
  const int second = c.begin([] { return stage_capture::chunk_copies{}; }, false, empty,
                             stage_capture::zero_part::pending);
  REQUIRE(a.failures == std::vector<std::string>{"a checkpoint abandoned"});
  c.state(a.request(), no_take_now);
  c.zero_arrived(first, {{7, 7}, {}, {}});  // the abandoned capture's: dropped
  CHECK(a.states.empty());
  c.zero_arrived(second, {{5, 6}, {}, {}});
  REQUIRE(a.states.size() == 1);
  CHECK(a.states[0].rank == 3);
  CHECK(a.states[0].pieces.at(0).values == std::vector<float>{5, 6});
  // Through the devices' groups the floats come with the capture.
  c.begin([&] { return stage.copies(false); }, false, {}, stage_capture::zero_part::now,
          {{8, 9}, {}, {}});
  REQUIRE(eventually(stage.copied));
  c.copied();
  c.state(a.request(), no_take_now);
  REQUIRE(a.states.size() == 2);
  CHECK(a.states[1].parameters.at(0).second == std::vector<float>{1, 2, 3, 4});
  CHECK(a.states[1].pieces.at(0).values == std::vector<float>{8, 9});
}

TEST_CASE("without a capture the state is taken now", "[unit][capture]") {
  fake_stage stage;
  stage_capture c(stage.hooks());
  answers a;
  stage_snapshot now;
  now.parameters.emplace_back("w", std::vector<float>{42});
  c.state(a.request(), [&](std::function<void(stage_snapshot)> done) { done(now); });
  REQUIRE(a.states.size() == 1);
  CHECK(a.states[0].parameters.at(0).second == std::vector<float>{42});
}

TEST_CASE("W5: a state with a part directory is written as the stage's part", "[unit][capture]") {
  fake_stage stage;
  stage_capture c(stage.hooks());
  answers a;
  const engine::data::test::temp_dir scratch;
  const std::filesystem::path& dir = scratch.path();
  c.begin([&] { return stage.copies(false); }, true, {}, stage_capture::zero_part::none);
  REQUIRE(eventually(stage.copied));
  c.copied();
  c.state(a.request(dir.string()), no_take_now);
  REQUIRE(eventually(stage.part_posted));
  CHECK(a.states.empty());  // answered once the stage hears of the part
  auto [token, file, error] = *stage.part;
  CHECK(error.empty());
  c.part_written(token, file, error);
  REQUIRE(a.states.size() == 1);
  CHECK(a.states[0].part.name == "part-000-000.safetensors");
  CHECK(a.states[0].part.bytes == std::filesystem::file_size(dir / "part-000-000.safetensors"));
  // A part that cannot be written fails its request, naming the file.
  stage.part_posted = false;
  c.state(a.request((dir / "missing").string()),
          [](std::function<void(stage_snapshot)> done) { done(stage_snapshot{}); });
  REQUIRE(eventually(stage.part_posted));
  auto [token2, file2, error2] = *stage.part;
  CHECK_THAT(error2, Catch::Contains("missing"));
  c.part_written(token2, file2, error2);
  REQUIRE(a.failures.size() == 1);
  CHECK(a.failures[0] == error2);
  c.part_written(token2, file2, error2);  // a stale note: nothing more
  CHECK(a.failures.size() == 1);
}

TEST_CASE("a stopping stage fails the requests still waiting", "[unit][capture]") {
  fake_stage stage;
  stage.gated = true;
  stage_capture c(stage.hooks());
  answers a;
  c.begin([&] { return stage.copies(false); }, true, {}, stage_capture::zero_part::none);
  c.state(a.request(), no_take_now);
  stage.snapshot_gate.set_value();
  c.stop("stage rank 0 replica 0 stopped");
  CHECK(a.failures == std::vector<std::string>{"stage rank 0 replica 0 stopped"});
}
