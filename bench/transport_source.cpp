// The bench's send tensors (transport_source.hpp).
#include "bench/transport_source.hpp"

#include <sys/mman.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>

namespace troupe::bench {

std::shared_ptr<messages::payload<float>> written_tensor(std::size_t bytes) {
  auto tensor = std::make_shared<messages::payload<float>>(bytes / sizeof(float));
  for (std::size_t i = 0; i < tensor->size(); ++i) (*tensor)[i] = static_cast<float>(i % 977);
  return tensor;
}

std::shared_ptr<messages::payload<float>> unwritten_tensor(std::size_t bytes) {
  constexpr std::size_t huge_page = std::size_t{2} << 20, page = 4096;
  const std::size_t rounded = (bytes + huge_page - 1) / huge_page * huge_page;
  const bool huge = rounded < 2 * bytes;  // UCX's "thp" method, as in uct_mem_alloc
  const std::size_t length = huge ? rounded : (bytes + page - 1) / page * page;
  // Reserved inaccessible, with room to align and a page either side: the tensor's mapping
  // then differs from its neighbours and is not merged with them, so smaps shows it alone.
  const std::size_t reserved = length + (huge ? huge_page : 0) + 2 * page;
  void* m = ::mmap(nullptr, reserved, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED)
    throw std::runtime_error("transport bench: mapping " + std::to_string(bytes) +
                             " bytes for the send tensor failed");
  auto* base = static_cast<std::byte*>(m);
  std::byte* at = base + page;
  if (huge) at += (huge_page - reinterpret_cast<std::uintptr_t>(at) % huge_page) % huge_page;
  if (::mprotect(at, length, PROT_READ | PROT_WRITE) != 0) {
    ::munmap(base, reserved);
    throw std::runtime_error("transport bench: mprotect of the send tensor failed");
  }
  if (huge) ::madvise(at, length, MADV_HUGEPAGE);  // a hint; the kernel may ignore it
  std::shared_ptr<void> owner(static_cast<void*>(base),
                              [reserved](void* p) { ::munmap(p, reserved); });
  return std::make_shared<messages::payload<float>>(std::move(owner), reinterpret_cast<float*>(at),
                                                    bytes / sizeof(float));
}

long long resident_bytes(const void* address) {
  const auto wanted = reinterpret_cast<std::uintptr_t>(address);
  std::ifstream smaps("/proc/self/smaps");
  bool inside = false;
  for (std::string line; std::getline(smaps, line);) {
    unsigned long long low = 0, high = 0;
    // A mapping's first line starts "low-high "; its fields ("Rss:   12 kB") do not parse so.
    if (std::sscanf(line.c_str(), "%llx-%llx ", &low, &high) == 2) {
      inside = wanted >= low && wanted < high;
      continue;
    }
    long long kib = 0;
    if (inside && std::sscanf(line.c_str(), "Rss: %lld kB", &kib) == 1) return kib * 1024;
  }
  return -1;
}

}  // namespace troupe::bench
