// See nccl_group.hpp.
#include "kernels/cuda/nccl_group.hpp"

#include <nccl.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <thread>
#include <utility>

namespace troupe::kernels::cuda {
namespace {

void check_cuda(cudaError_t e, const std::string& what) {
  if (e != cudaSuccess) throw cuda_error(what + ": " + cudaGetErrorString(e));
}

ncclComm_t as_comm(void* c) { return static_cast<ncclComm_t>(c); }

}  // namespace

nccl_id nccl_new_id() {
  ncclUniqueId id;
  const ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) throw nccl_error(std::string("ncclGetUniqueId: ") + ncclGetErrorString(r));
  static_assert(sizeof(id.internal) == std::tuple_size_v<nccl_id>);
  nccl_id out;
  std::memcpy(out.data(), id.internal, out.size());
  return out;
}

nccl_id nccl_id_from(const std::string& name, const std::vector<std::uint8_t>& bytes) {
  nccl_id id{};
  if (bytes.size() != id.size())
    throw std::invalid_argument("NCCL communicator " + name + ": an id of " +
                                std::to_string(bytes.size()) + " bytes, not " +
                                std::to_string(id.size()));
  std::memcpy(id.data(), bytes.data(), id.size());
  return id;
}

std::string nccl_version() {
  int v = 0;
  ncclGetVersion(&v);
  return std::to_string(v / 10000) + "." + std::to_string(v / 100 % 100) + "." +
         std::to_string(v % 100);
}

std::optional<std::string> nccl_host_id() {
  const char* id = std::getenv("NCCL_HOSTID");
  if (!id) return std::nullopt;
  return std::string(id);
}

nccl_group::nccl_group(std::string name, const nccl_id& id, int ranks, int rank, int device,
                       std::chrono::milliseconds join_timeout)
    : name_(std::move(name)), ranks_(ranks), rank_(rank), device_(device) {
  if (ranks < 1 || rank < 0 || rank >= ranks)
    throw std::invalid_argument("nccl group " + name_ + ": rank " + std::to_string(rank) + " of " +
                                std::to_string(ranks));
  check_cuda(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
  check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
             "nccl group " + name_ + ": cudaStreamCreate");
  if (const cudaError_t e = cudaEventCreateWithFlags(&done_, cudaEventDisableTiming);
      e != cudaSuccess) {
    cudaStreamDestroy(std::exchange(stream_, nullptr));
    check_cuda(e, "nccl group " + name_ + ": cudaEventCreate");
  }
  ncclUniqueId uid;
  std::memcpy(uid.internal, id.data(), id.size());
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, ranks, uid, rank, &config);
  comm_ = comm;
  if (r != ncclSuccess && r != ncclInProgress) {
    const std::string why = std::string("ncclCommInitRankConfig: ") + ncclGetErrorString(r);
    if (comm_) ncclCommAbort(comm);
    comm_ = nullptr;
    cudaEventDestroy(std::exchange(done_, nullptr));  // the destructor will not run
    cudaStreamDestroy(std::exchange(stream_, nullptr));
    throw nccl_error("nccl group " + name_ + " (rank " + std::to_string(rank) + " of " +
                     std::to_string(ranks) + "): " + why);
  }
  try {
    settle("join", std::chrono::steady_clock::now() + join_timeout);
  } catch (...) {
    cudaEventDestroy(done_);
    cudaStreamDestroy(stream_);
    throw;
  }
}

nccl_group::~nccl_group() {
  if (comm_) {
    if (broken()) {
      ncclCommAbort(as_comm(comm_));
    } else {
      // Finalize flushes outstanding work; a communicator that cannot finish is aborted.
      ncclCommFinalize(as_comm(comm_));
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      ncclResult_t state = ncclInProgress;
      while (state == ncclInProgress && std::chrono::steady_clock::now() < deadline) {
        ncclCommGetAsyncError(as_comm(comm_), &state);
        if (state == ncclInProgress) std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
      if (state == ncclSuccess) {
        ncclCommDestroy(as_comm(comm_));
      } else {
        ncclCommAbort(as_comm(comm_));
      }
    }
  }
  if (done_) cudaEventDestroy(done_);
  if (stream_) cudaStreamDestroy(stream_);
}

// Polls the communicator until the last non-blocking call has completed, or aborts it.
void nccl_group::settle(const char* op, std::chrono::steady_clock::time_point deadline) {
  ncclResult_t state = ncclInProgress;
  while (true) {
    ncclCommGetAsyncError(as_comm(comm_), &state);
    if (state != ncclInProgress) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      abort(std::string(op) + " did not complete before its deadline");
      throw nccl_error("nccl group " + name_ + " (rank " + std::to_string(rank_) + " of " +
                       std::to_string(ranks_) + "): " + broken_reason_ + "; communicator aborted");
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  if (state != ncclSuccess) {
    abort(std::string(op) + ": " + ncclGetErrorString(state));
    throw nccl_error("nccl group " + name_ + " (rank " + std::to_string(rank_) +
                     "): " + broken_reason_ + "; communicator aborted");
  }
}

void nccl_group::usable(const char* op) const {
  if (broken())
    throw nccl_error("nccl group " + name_ + ": " + op + " on a broken communicator (" +
                     broken_reason_ + ")");
}

void nccl_group::order_after(cudaEvent_t after) {
  if (after) check_cuda(cudaStreamWaitEvent(stream_, after, 0), "cudaStreamWaitEvent");
}

namespace {
constexpr auto kEnqueueDeadline = std::chrono::seconds(60);

// A call NCCL refused at once breaks the group too: later calls must not go on with it.
void enqueue_result(ncclResult_t r, const char* op, nccl_group& g) {
  if (r == ncclSuccess || r == ncclInProgress) return;
  const std::string why = std::string(op) + ": " + ncclGetErrorString(r);
  g.abort(why);
  throw nccl_error("nccl group " + g.name() + ": " + why + "; communicator aborted");
}
}  // namespace

void nccl_group::all_reduce_sum(float* data, std::int64_t n, cudaEvent_t after) {
  usable("all_reduce");
  order_after(after);
  enqueue_result(ncclAllReduce(data, data, static_cast<std::size_t>(n), ncclFloat32, ncclSum,
                               as_comm(comm_), stream_),
                 "ncclAllReduce", *this);
  settle("all_reduce", std::chrono::steady_clock::now() + kEnqueueDeadline);
}

void nccl_group::all_reduce(void* data, std::int64_t n, element type, reduction op,
                            cudaEvent_t after) {
  usable("all_reduce");
  order_after(after);
  const ncclDataType_t t = type == element::bf16  ? ncclBfloat16
                           : type == element::f16 ? ncclFloat16
                                                  : ncclFloat32;
  enqueue_result(ncclAllReduce(data, data, static_cast<std::size_t>(n), t,
                               op == reduction::max ? ncclMax : ncclSum, as_comm(comm_), stream_),
                 "ncclAllReduce", *this);
  settle("all_reduce", std::chrono::steady_clock::now() + kEnqueueDeadline);
}

void nccl_group::reduce_scatter_sum(const float* in, float* out, std::int64_t per_rank,
                                    cudaEvent_t after) {
  usable("reduce_scatter");
  order_after(after);
  enqueue_result(ncclReduceScatter(in, out, static_cast<std::size_t>(per_rank), ncclFloat32,
                                   ncclSum, as_comm(comm_), stream_),
                 "ncclReduceScatter", *this);
  settle("reduce_scatter", std::chrono::steady_clock::now() + kEnqueueDeadline);
}

void nccl_group::all_gather(const float* in, float* out, std::int64_t per_rank, cudaEvent_t after) {
  usable("all_gather");
  order_after(after);
  enqueue_result(ncclAllGather(in, out, static_cast<std::size_t>(per_rank), ncclFloat32,
                               as_comm(comm_), stream_),
                 "ncclAllGather", *this);
  settle("all_gather", std::chrono::steady_clock::now() + kEnqueueDeadline);
}

void nccl_group::send(const void* data, std::size_t bytes, int peer, cudaEvent_t after) {
  usable("send");
  order_after(after);
  enqueue_result(ncclSend(data, bytes, ncclUint8, peer, as_comm(comm_), stream_), "ncclSend",
                 *this);
  settle("send", std::chrono::steady_clock::now() + kEnqueueDeadline);
}

void nccl_group::recv(void* data, std::size_t bytes, int peer, cudaEvent_t after) {
  usable("recv");
  order_after(after);
  enqueue_result(ncclRecv(data, bytes, ncclUint8, peer, as_comm(comm_), stream_), "ncclRecv",
                 *this);
  settle("recv", std::chrono::steady_clock::now() + kEnqueueDeadline);
}

void nccl_group::grouped(const std::vector<nccl_group*>& groups,
                         const std::vector<float_ranges>& ranges,
                         const std::vector<cudaEvent_t>& after, const char* what,
                         const std::function<int(nccl_group&, const float_ranges&)>& call) {
  if (ranges.size() != groups.size() || after.size() != groups.size())
    throw std::invalid_argument(std::string("nccl ") + what + ": " + std::to_string(groups.size()) +
                                " groups, " + std::to_string(ranges.size()) + " range lists, " +
                                std::to_string(after.size()) + " events");
  for (std::size_t i = 0; i < groups.size(); ++i) {
    nccl_group& g = *groups[i];
    g.usable(what);
    check_cuda(cudaSetDevice(g.device_), "cudaSetDevice(" + std::to_string(g.device_) + ")");
    g.order_after(after[i]);
  }
  // Every call inside the group only queues; ncclGroupEnd launches them all.
  auto fail_all = [&groups](const std::string& why) {
    for (auto* g : groups) g->abort(why);
    throw nccl_error("nccl groups " + groups.front()->name() + ": " + why +
                     "; communicators aborted");
  };
  if (const ncclResult_t r = ncclGroupStart(); r != ncclSuccess)
    fail_all(std::string("ncclGroupStart: ") + ncclGetErrorString(r));
  ncclResult_t first_error = ncclSuccess;
  for (std::size_t i = 0; i < groups.size(); ++i) {
    const auto r = static_cast<ncclResult_t>(call(*groups[i], ranges[i]));
    if (r != ncclSuccess && r != ncclInProgress && first_error == ncclSuccess) first_error = r;
  }
  const ncclResult_t end = ncclGroupEnd();
  if (first_error != ncclSuccess)
    fail_all(std::string(what) + ": " + ncclGetErrorString(first_error));
  if (end != ncclSuccess && end != ncclInProgress)
    fail_all(std::string("ncclGroupEnd: ") + ncclGetErrorString(end));
  const auto deadline = std::chrono::steady_clock::now() + kEnqueueDeadline;
  for (auto* g : groups) g->settle(what, deadline);
}

void nccl_group::all_reduce_mean(const std::vector<nccl_group*>& groups,
                                 const std::vector<float_ranges>& ranges,
                                 const std::vector<cudaEvent_t>& after) {
  grouped(groups, ranges, after, "all_reduce_mean", [](nccl_group& g, const float_ranges& r) {
    int first = ncclSuccess;
    for (const auto& [p, n] : r) {
      const ncclResult_t e = ncclAllReduce(p, p, static_cast<std::size_t>(n), ncclFloat32, ncclAvg,
                                           as_comm(g.comm_), g.stream_);
      if (e != ncclSuccess && e != ncclInProgress && first == ncclSuccess) first = e;
    }
    return first;
  });
}

void nccl_group::owned_collective(const std::vector<nccl_group*>& groups,
                                  const std::vector<float_ranges>& ranges,
                                  const std::vector<cudaEvent_t>& after, owned_op op) {
  const char* what = op == owned_op::reduce_mean ? "reduce_to_owners" : "broadcast_from_owners";
  grouped(groups, ranges, after, what, [op](nccl_group& g, const float_ranges& r) {
    std::int64_t n = 0;
    for (const auto& range : r) n += range.second;
    const std::int64_t d = g.ranks_;
    int first = ncclSuccess;
    for (std::int64_t c = 0; c < d; ++c) {
      // Ring chunk c ([n c / d, n (c + 1) / d), engine::owned_chunk_bounds) and its owner.
      const std::int64_t begin = n * c / d, end = n * (c + 1) / d;
      const int owner = static_cast<int>((c + d - 1) % d);
      std::int64_t at = 0;
      for (const auto& [p, k] : r) {
        const std::int64_t lo = std::max(begin, at), hi = std::min(end, at + k);
        if (lo < hi) {
          float* piece = p + (lo - at);
          const auto count = static_cast<std::size_t>(hi - lo);
          const ncclResult_t e = op == owned_op::reduce_mean
                                     ? ncclReduce(piece, piece, count, ncclFloat32, ncclAvg, owner,
                                                  as_comm(g.comm_), g.stream_)
                                     : ncclBroadcast(piece, piece, count, ncclFloat32, owner,
                                                     as_comm(g.comm_), g.stream_);
          if (e != ncclSuccess && e != ncclInProgress && first == ncclSuccess) first = e;
        }
        at += k;
        if (at >= end) break;
      }
    }
    return first;
  });
}

std::vector<std::unique_ptr<nccl_group>> nccl_group::join_all(
    const std::string& name, const std::vector<int>& devices,
    std::chrono::milliseconds join_timeout) {
  const nccl_id id = nccl_new_id();
  const int n = static_cast<int>(devices.size());
  std::vector<std::unique_ptr<nccl_group>> groups(devices.size());
  std::vector<std::exception_ptr> failed(devices.size());
  std::vector<std::thread> threads;
  threads.reserve(devices.size());
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      const auto at = static_cast<std::size_t>(i);
      try {
        groups[at] = std::make_unique<nccl_group>(name, id, n, i, devices[at], join_timeout);
      } catch (...) {
        failed[at] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& f : failed)
    if (f) std::rethrow_exception(f);
  return groups;
}

namespace {
// Floats of device memory for transfers that only connect: allocated, zeroed and freed on the
// group's stream, so nothing waits on the device's other streams (other communicators' joins).
class scratch {
 public:
  scratch(int device, cudaStream_t stream, std::size_t floats = 1) : stream_(stream) {
    check_cuda(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
    check_cuda(cudaMallocAsync(&p_, floats * sizeof(float), stream_), "cudaMallocAsync");
    check_cuda(cudaMemsetAsync(p_, 0, floats * sizeof(float), stream_), "cudaMemsetAsync");
  }
  ~scratch() { cudaFreeAsync(p_, stream_); }
  scratch(const scratch&) = delete;
  scratch& operator=(const scratch&) = delete;
  float* get() const { return static_cast<float*>(p_); }

 private:
  cudaStream_t stream_;
  void* p_ = nullptr;
};
}  // namespace

void nccl_group::connect_peer(int peer, bool sending, std::chrono::milliseconds timeout) {
  const scratch s(device_, stream_);  // on the stream the transfer runs on: ordered before it
  if (sending) {
    send(s.get(), 1, peer, nullptr);
  } else {
    recv(s.get(), 1, peer, nullptr);
  }
  wait(timeout, sending ? "connecting to rank " + std::to_string(peer)
                        : "connecting from rank " + std::to_string(peer));
}

void nccl_group::connect_collectives(std::chrono::milliseconds timeout) {
  // An all-reduce, then a reduce to and a broadcast from every rank (ZeRO's owned collectives,
  // whose algorithm NCCL may connect apart from the all-reduce's), one float each.
  const scratch s(device_, stream_, static_cast<std::size_t>(ranks_));
  all_reduce_sum(s.get(), 1, nullptr);
  const float_ranges one_each{{s.get(), ranks_}};
  owned_collective({this}, {one_each}, {nullptr}, owned_op::reduce_mean);
  owned_collective({this}, {one_each}, {nullptr}, owned_op::broadcast);
  wait(timeout, "connecting the collectives");
}

cudaEvent_t nccl_group::done() {
  check_cuda(cudaEventRecord(done_, stream_), "cudaEventRecord");
  return done_;
}

void nccl_group::wait(std::chrono::milliseconds timeout, const std::string& what) {
  usable("wait");
  check_cuda(cudaEventRecord(done_, stream_), "cudaEventRecord");
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    const cudaError_t q = cudaEventQuery(done_);
    if (q == cudaSuccess) return;
    if (q != cudaErrorNotReady) check_cuda(q, "nccl group " + name_ + ": " + what);
    ncclResult_t state = ncclSuccess;
    ncclCommGetAsyncError(as_comm(comm_), &state);
    if (state != ncclSuccess && state != ncclInProgress) {
      abort(what + ": " + ncclGetErrorString(state));
      break;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      abort(what + " did not finish within " + std::to_string(timeout.count()) + " ms");
      break;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
  throw nccl_error("nccl group " + name_ + " (rank " + std::to_string(rank_) + " of " +
                   std::to_string(ranks_) + "): " + broken_reason_ + "; communicator aborted");
}

void nccl_group::abort(const std::string& reason) {
  if (broken()) return;
  broken_reason_ = reason;
  if (comm_) ncclCommAbort(as_comm(comm_));
  comm_ = nullptr;
}

}  // namespace troupe::kernels::cuda
