// The bench's send tensors (transport_source.hpp).
#include "bench/transport_source.hpp"

#include <sys/mman.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <stdexcept>
#include <string>

namespace troupe::bench {
namespace {

constexpr std::size_t huge_page = std::size_t{2} << 20, page = 4096;

// `bytes` in a mapping of their own: 2 MiB aligned and advised to use huge pages when `huge`,
// otherwise page aligned and advised not to. Reserved inaccessible, with room to align and a
// page either side: the tensor's mapping then differs from its neighbours and is not merged with
// them, so smaps shows it alone.
std::shared_ptr<messages::payload<float>> mapped_tensor(std::size_t bytes, bool huge) {
  const std::size_t length =
      huge ? (bytes + huge_page - 1) / huge_page * huge_page : (bytes + page - 1) / page * page;
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
  ::madvise(at, length, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);  // hints; may be ignored
  std::shared_ptr<void> owner(static_cast<void*>(base),
                              [reserved](void* p) { ::munmap(p, reserved); });
  return std::make_shared<messages::payload<float>>(std::move(owner), reinterpret_cast<float*>(at),
                                                    bytes / sizeof(float));
}

std::shared_ptr<messages::payload<float>> with_ramp(std::shared_ptr<messages::payload<float>> t) {
  for (std::size_t i = 0; i < t->size(); ++i) (*t)[i] = static_cast<float>(i % 977);
  return t;
}

// A field of the smaps entry of the mapping that holds `address`, in bytes; -1 if none holds it.
long long mapping_field_bytes(const void* address, const char* field) {
  const auto wanted = reinterpret_cast<std::uintptr_t>(address);
  const std::string format = std::string(field) + ": %lld kB";
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
    if (inside && std::sscanf(line.c_str(), format.c_str(), &kib) == 1) return kib * 1024;
  }
  return -1;
}

}  // namespace

std::shared_ptr<messages::payload<float>> written_tensor(std::size_t bytes) {
  return with_ramp(mapped_tensor(bytes, false));
}

std::shared_ptr<messages::payload<float>> engine_tensor(std::size_t bytes) {
  return with_ramp(std::make_shared<messages::payload<float>>(bytes / sizeof(float)));
}

std::shared_ptr<messages::payload<float>> unwritten_tensor(std::size_t bytes) {
  const std::size_t rounded = (bytes + huge_page - 1) / huge_page * huge_page;
  return mapped_tensor(bytes, rounded < 2 * bytes);  // UCX's "thp" method, as in uct_mem_alloc
}

long long resident_bytes(const void* address) { return mapping_field_bytes(address, "Rss"); }

long long huge_page_bytes(const void* address) {
  return mapping_field_bytes(address, "AnonHugePages");
}

}  // namespace troupe::bench
