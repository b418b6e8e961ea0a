// The tensor `troupe bench transport` sends in its bandwidth rows, in the memory state of
// ucx_perftest's send buffer on the same transports (docs/transport.md, "Session 24"). Over
// shared memory ucx_perftest sends from UCX-allocated shared memory that its peer's reads fault
// in: real pages, so ours is a written tensor. Over tcp its sender never writes its buffer (its
// resident memory does not grow with the message size), so the kernel copies every message from
// its zero page, which stays in the cache; ours can then be a mapped, never-written tensor too,
// and `--source written` sends a written one everywhere. No UCX.
#pragma once

#include <cstddef>
#include <memory>

#include "messages/payload.hpp"

namespace troupe::bench {

// `bytes` / 4 floats in aligned storage, written (a ramp of small integers).
std::shared_ptr<messages::payload<float>> written_tensor(std::size_t bytes);
// `bytes` mapped as UCX 1.13 allocates ucx_perftest's buffer over tcp and never written: a
// 2 MiB-aligned block advised to use transparent huge pages where rounding up to 2 MiB less than
// doubles the size (16 MiB), a plain anonymous mapping otherwise (64 KiB, 1 MiB). Throws on
// failure.
std::shared_ptr<messages::payload<float>> unwritten_tensor(std::size_t bytes);
// Bytes of this process's mapping that holds `address` that are resident (/proc/self/smaps
// "Rss"; the kernel's zero page is not counted), or -1 if no mapping holds it.
long long resident_bytes(const void* address);

}  // namespace troupe::bench
