// Device memory mapped by granule. See paged_buffer.hpp.
#include "kernels/cuda/paged_buffer.hpp"

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <string>

#include "kernels/cuda/cuda_ops.hpp"

namespace troupe::kernels::cuda {
namespace {

// The driver's virtual memory calls, resolved once through the runtime.
struct vmm_api {
  decltype(&cuDeviceGet) device = nullptr;
  decltype(&cuDeviceGetAttribute) attribute = nullptr;
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemAddressFree) free = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
};

template <class F>
void resolve(const char* symbol, F& fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status{};
  const cudaError_t e =
      cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &status);
  if (e != cudaSuccess || status != cudaDriverEntryPointSuccess || !p)
    throw cuda_error(std::string("paged_buffer: the driver has no ") + symbol);
  fn = reinterpret_cast<F>(p);
}

const vmm_api& api() {
  static const vmm_api a = [] {
    vmm_api v;
    resolve("cuDeviceGet", v.device);
    resolve("cuDeviceGetAttribute", v.attribute);
    resolve("cuMemGetAllocationGranularity", v.granularity);
    resolve("cuMemAddressReserve", v.reserve);
    resolve("cuMemAddressFree", v.free);
    resolve("cuMemCreate", v.create);
    resolve("cuMemRelease", v.release);
    resolve("cuMemMap", v.map);
    resolve("cuMemUnmap", v.unmap);
    resolve("cuMemSetAccess", v.set_access);
    return v;
  }();
  return a;
}

void check(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS)
    throw cuda_error(std::string("paged_buffer: ") + what + " failed (CUresult " +
                     std::to_string(static_cast<int>(r)) + ")");
}
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw cuda_error(std::string("paged_buffer: ") + what + ": " + cudaGetErrorString(e));
}

CUmemAllocationProp properties(int device) {
  CUmemAllocationProp p{};
  p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  p.location.id = device;
  return p;
}

}  // namespace

bool paged_buffer::supported(int device) {
  try {
    const auto& a = api();
    CUdevice dev = 0;
    int yes = 0;
    return a.device(&dev, device) == CUDA_SUCCESS &&
           a.attribute(&yes, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev) ==
               CUDA_SUCCESS &&
           yes != 0;
  } catch (const cuda_error&) {  // a driver without the calls
    return false;
  }
}

paged_buffer::paged_buffer(int device, std::size_t bytes) : device_(device), bytes_(bytes) {
  if (!supported(device))
    throw cuda_error("paged_buffer: device " + std::to_string(device) +
                     " has no virtual memory management");
  const auto& a = api();
  const auto prop = properties(device);
  check(a.granularity(&granule_, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "cuMemGetAllocationGranularity");
  // Every device that can reach this one directly may read and write it (NCCL's peers in one
  // process): peer access does not extend to these mappings by itself.
  int devices = 0;
  check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount");
  for (int d = 0; d < devices; ++d) {
    int reach = d == device ? 1 : 0;
    if (d != device) check(cudaDeviceCanAccessPeer(&reach, d, device), "cudaDeviceCanAccessPeer");
    if (reach) access_.push_back(d);
  }
  const std::size_t granules = std::max<std::size_t>(1, (bytes + granule_ - 1) / granule_);
  reserved_ = granules * granule_;
  CUdeviceptr base = 0;
  check(a.reserve(&base, reserved_, granule_, 0, 0), "cuMemAddressReserve");
  base_ = static_cast<std::uintptr_t>(base);
  held_.assign(granules, 0);
  handle_.assign(granules, 0);
  released_.assign(granules, 0);
  try {
    for (std::size_t g = 0; g < granules; ++g) {
      held_[g] = std::min(granule_, bytes_ > g * granule_ ? bytes_ - g * granule_ : 0);
      map(g);
    }
  } catch (...) {
    unmap_all();
    throw;
  }
}

// Kernels and the groups' copies may still use what is mapped: the device's work ends first.
paged_buffer::~paged_buffer() {
  int current = 0;
  if (cudaGetDevice(&current) == cudaSuccess && cudaSetDevice(device_) == cudaSuccess) {
    cudaDeviceSynchronize();
    cudaSetDevice(current);
  }
  for (auto& p : pending_) cudaEventDestroy(static_cast<cudaEvent_t>(p.event));
  pending_.clear();
  unmap_all();
}

void paged_buffer::unmap_all() noexcept {
  const auto& a = api();
  for (std::size_t g = 0; g < handle_.size(); ++g) {
    if (!handle_[g]) continue;
    a.unmap(static_cast<CUdeviceptr>(base_ + g * granule_), granule_);
    a.release(static_cast<CUmemGenericAllocationHandle>(handle_[g]));
    handle_[g] = 0;
  }
  if (base_) a.free(static_cast<CUdeviceptr>(base_), reserved_);
  base_ = 0;
}

template <class F>
void paged_buffer::for_each_granule(std::size_t offset, std::size_t bytes, F f) const {
  if (offset > bytes_ || bytes > bytes_ - offset)
    throw cuda_error("paged_buffer: bytes [" + std::to_string(offset) + ", " +
                     std::to_string(offset + bytes) + ") outside its " + std::to_string(bytes_));
  for (std::size_t at = offset; at < offset + bytes;) {
    const std::size_t g = at / granule_;
    const std::size_t end = std::min(offset + bytes, (g + 1) * granule_);
    f(g, end - at);
    at = end;
  }
}

std::size_t paged_buffer::granule_bytes(std::size_t g) const {
  return std::min(granule_, bytes_ - g * granule_);
}

// Checked whole before anything changes, the event recorded before it is trusted.
void paged_buffer::release(std::size_t offset, std::size_t bytes, void* stream) {
  reap(0);
  for_each_granule(offset, bytes, [&](std::size_t g, std::size_t n) {
    if (held_[g] < n) throw cuda_error("paged_buffer: a range released that was not held");
  });
  pending p;
  cudaEvent_t e = nullptr;
  check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  if (const cudaError_t r = cudaEventRecord(e, static_cast<cudaStream_t>(stream));
      r != cudaSuccess) {
    cudaEventDestroy(e);
    check(r, "cudaEventRecord");
  }
  p.event = e;
  p.round = round_;
  for_each_granule(offset, bytes, [&](std::size_t g, std::size_t n) {
    held_[g] -= n;
    if (held_[g] == 0) p.granules.emplace_back(g, ++released_[g]);
  });
  if (p.granules.empty()) {
    cudaEventDestroy(e);
    return;
  }
  pending_.push_back(std::move(p));
}

void paged_buffer::acquire(std::size_t offset, std::size_t bytes) {
  reap(0);
  for_each_granule(offset, bytes, [&](std::size_t g, std::size_t n) {
    if (held_[g] + n > granule_bytes(g)) throw cuda_error("paged_buffer: a range acquired twice");
  });
  for_each_granule(offset, bytes, [&](std::size_t g, std::size_t n) {
    if (held_[g] == 0 && !handle_[g]) map(g);  // still mapped: its unmapping is called off
    held_[g] += n;
  });
}

std::size_t paged_buffer::mapped_bytes() {
  reap(0);
  std::size_t n = 0;
  for (const auto h : handle_) n += h ? granule_ : 0;
  return n;
}

// Out of device memory while releases are still waiting for the stream: they are waited for,
// and the granule tried again.
void paged_buffer::map(std::size_t g) {
  const auto& a = api();
  const auto prop = properties(device_);
  CUmemGenericAllocationHandle h = 0;
  CUresult r = a.create(&h, granule_, &prop, 0);
  if (r == CUDA_ERROR_OUT_OF_MEMORY && !pending_.empty()) {
    reap(round_ + 1);
    r = a.create(&h, granule_, &prop, 0);
  }
  check(r, "cuMemCreate");
  const auto at = static_cast<CUdeviceptr>(base_ + g * granule_);
  r = a.map(at, granule_, 0, h, 0);
  if (r != CUDA_SUCCESS) {
    a.release(h);
    check(r, "cuMemMap");
  }
  std::vector<CUmemAccessDesc> access(access_.size());
  for (std::size_t i = 0; i < access_.size(); ++i) {
    access[i].location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access[i].location.id = access_[i];
    access[i].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  }
  r = a.set_access(at, granule_, access.data(), access.size());
  if (r != CUDA_SUCCESS) {
    a.unmap(at, granule_);
    a.release(h);
    check(r, "cuMemSetAccess");
  }
  handle_[g] = h;
}

void paged_buffer::unmap(std::size_t g) {
  const auto& a = api();
  check(a.unmap(static_cast<CUdeviceptr>(base_ + g * granule_), granule_), "cuMemUnmap");
  check(a.release(static_cast<CUmemGenericAllocationHandle>(handle_[g])), "cuMemRelease");
  handle_[g] = 0;
}

void paged_buffer::next_round() {
  ++round_;
  reap(round_ - 1);
}

void paged_buffer::reap(std::uint64_t wait_before) {
  while (!pending_.empty()) {
    auto& p = pending_.front();
    auto e = static_cast<cudaEvent_t>(p.event);
    if (p.round < wait_before) {
      check(cudaEventSynchronize(e), "cudaEventSynchronize");
    } else {
      const cudaError_t q = cudaEventQuery(e);
      if (q == cudaErrorNotReady) return;  // later ones are later on the stream
      check(q, "cudaEventQuery");
    }
    // Not acquired again meanwhile, nor released again since (a later event covers that).
    for (const auto& [g, n] : p.granules)
      if (held_[g] == 0 && handle_[g] && released_[g] == n) unmap(g);
    cudaEventDestroy(e);
    pending_.pop_front();
  }
}

}  // namespace troupe::kernels::cuda
