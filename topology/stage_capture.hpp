// A stage's checkpoints: the capture of its state between two steps, the state requests that
// follow, and (format 2) the part file it writes. CAF-free: the stage actor (actors/stage.cpp)
// hands it its messages and gives it the calls it needs (hooks); every answer goes out through
// the request's own calls. Invariants (the stage cites them):
//  S7. A capture takes the state between steps. The chunks' copies (rank_chunks::capture_state)
//      begin when the capture arrives and a thread takes them while the next step runs, which
//      only reads parameters and moments; the next update waits (wait_for_copies) until the copy
//      no longer reads the chunks' state: CPU chunks, read in place, until the snapshot is made;
//      device chunks, copied, until their copies are on the host. ZeRO's owned floats come with
//      the capture (zero_now: through the devices' groups) or after it (zero_pending, then
//      zero_arrived: the shard answers before the update the stage sends it later).
//  W5. A state request with a part directory is answered by the part written there, on a
//      thread, while the stage goes on; one part is written at a time.
// A new capture abandons the previous one: its waiting requests fail ("a checkpoint abandoned").
#pragma once

#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "engine/chunks/rank_chunks.hpp"
#include "engine/training/checkpoint.hpp"
#include "messages/pipeline.hpp"

namespace troupe::topology {

class stage_capture {
 public:
  struct hooks {
    // The snapshot of the chunks' taken states (parameters as checkpoint names; with moments,
    // the AdamW moments as pieces), on the copy's thread: it reads only what the stage keeps
    // constant.
    std::function<messages::stage_snapshot(const std::vector<engine::rank_chunks::host_state>&,
                                           bool moments)>
        snapshot_of;
    // ZeRO: the owned floats added to a snapshot as the stage's pieces.
    std::function<messages::stage_snapshot(messages::stage_snapshot, const messages::zero_state&)>
        with_zero;
    // Posts to the stage's mailbox (any thread): the copy is done (copied() is due); a part is
    // written (part_written(token, file, error) is due).
    std::function<void()> post_copied;
    std::function<void(int, engine::checkpoint_file, std::string)> post_part;
    std::string part_name;  // this stage's part file (engine::checkpoint_part_name)
    int rank = 0, replica = 0;
    int shard = 0;     // its tensor shard, in the part's piece keys
    int delay_ms = 0;  // test seam: the copy's thread waits this long before copying
  };
  // A state request: answered once with a state (a part's name, size and xxh64 where part_dir is
  // set), or failed with a reason.
  struct request {
    std::function<void(messages::stage_snapshot)> answer;
    std::function<void(const std::string&)> fail;
    std::string part_dir;  // format 2: where the state is written as this stage's part
  };
  // How ZeRO's owned floats come with a capture.
  enum class zero_part { none, now, pending };

  explicit stage_capture(hooks h) : h_(std::move(h)) {}
  stage_capture(const stage_capture&) = delete;
  stage_capture& operator=(const stage_capture&) = delete;
  ~stage_capture() { stop("the stage stopped"); }

  // S7: a capture begins. copies: the chunks' capture calls (empty: the stage holds nothing of
  // the state to copy, and `empty` stands for it); with zero_part::now, `zero` holds the owned
  // floats. Returns the capture's number, for zero_arrived.
  // copies is called once the previous capture's thread is done with what the chunks gave it
  // (a CUDA chunk reuses its pinned memory).
  using chunk_copies = std::vector<std::function<engine::rank_chunks::host_state()>>;
  int begin(const std::function<chunk_copies()>& copies, bool moments,
            messages::stage_snapshot empty, zero_part zero, messages::zero_state zero_floats = {});
  // ZeRO's owned floats of capture `capture` (a later capture's are dropped).
  void zero_arrived(int capture, messages::zero_state z);
  // The copy's thread said it is done (post_copied).
  void copied();
  // S7: before an update.
  void wait_for_copies();
  // A state request: the capture's state once it is in; without a capture, `take_now` is asked
  // for the state now and answers through the callback it is given.
  void state(request q,
             const std::function<void(std::function<void(messages::stage_snapshot)>)>& take_now);
  // W5: a part was written (post_part's arguments).
  void part_written(int token, engine::checkpoint_file file, const std::string& error);
  // Waits for the threads and fails every request still waiting (the stage stops).
  void stop(const std::string& why);

 private:
  void finish();
  void assemble();
  void answer(request& q, messages::stage_snapshot s);
  void write_part(request& q, messages::stage_snapshot s);

  hooks h_;
  std::future<messages::stage_snapshot> copying_;
  std::future<void> copies_taken_;  // S7: the capture reads the chunks' state no longer
  std::optional<messages::stage_snapshot> copied_, captured_;  // the thread's part; the whole
  std::optional<messages::zero_state> zero_;                   // ZeRO's owned floats
  bool zero_wanted_ = false;   // the capture's snapshot takes ZeRO's owned floats
  bool zero_pending_ = false;  // asked of the shard, not in yet
  int captures_ = 0;           // captures begun
  std::vector<request> waiting_;
  std::future<void> writing_;  // W5: the part being written
  int parts_asked_ = 0;
  std::map<int, request> parts_waiting_;
};

}  // namespace troupe::topology
