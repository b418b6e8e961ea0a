// A process's device as the rendezvous compares them. See device_chunk.hpp.
#include <xxhash.h>

#include <cstdio>
#include <optional>
#include <string>

#include "engine/chunks/device_chunk.hpp"

namespace troupe::engine {

std::string device_identity(const std::string& bus_id,
                            const std::optional<std::string>& nccl_host_id) {
  if (bus_id.empty() || !nccl_host_id) return bus_id;
  std::string host = nccl_host_id->empty() ? "\"\"" : *nccl_host_id;
  if (host.size() > 32) {
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx",
                  static_cast<unsigned long long>(XXH64(host.data(), host.size(), 0)));
    host = std::string("xxh64:") + hex;
  }
  return bus_id + " on NCCL host " + host;
}

}  // namespace troupe::engine
