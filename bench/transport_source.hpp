// The tensors `troupe bench transport` sends in its bandwidth rows, in the write state of
// ucx_perftest's send buffer on the same transports (docs/transport.md): over
// shared memory ucx_perftest sends from memory UCX allocated in 4 KiB pages, written (its peer's
// reads fault them in), so ours is written too: by default (`--source engine`) in the engine's
// own payload storage (messages/payload_memory.hpp: huge pages where the kernel gives them),
// what a training job sends; with `--source as-peer` in 4 KiB pages like ucx_perftest's
// (docs/transport.md). Over tcp its sender never writes its buffer (its resident
// memory does not grow with the message size), so the kernel copies every message from its zero
// page, which stays in the cache; ours is then a mapped, never-written tensor too (whoever
// allocated it, it sends the zero page). `--source written` sends a written tensor in 4 KiB pages
// everywhere. No UCX.
#pragma once

#include <cstddef>
#include <memory>

#include "messages/payload.hpp"

namespace troupe::bench {

// `bytes` / 4 floats written (a ramp of small integers) in a page-aligned mapping of their own,
// advised not to use huge pages: 4 KiB pages, as ucx_perftest's shared-memory send buffer.
std::shared_ptr<messages::payload<float>> written_tensor(std::size_t bytes);
// The same ramp in a payload's own storage (payload_memory: advised to use huge pages).
std::shared_ptr<messages::payload<float>> engine_tensor(std::size_t bytes);
// `bytes` mapped as UCX 1.13 allocates ucx_perftest's buffer over tcp and never written: a
// 2 MiB-aligned block advised to use transparent huge pages where rounding up to 2 MiB less than
// doubles the size (16 MiB), a plain anonymous mapping otherwise (64 KiB, 1 MiB). Throws on
// failure.
std::shared_ptr<messages::payload<float>> unwritten_tensor(std::size_t bytes);
// Bytes of this process's mapping that holds `address` that are resident (/proc/self/smaps
// "Rss"; the kernel's zero page is not counted), or -1 if no mapping holds it.
long long resident_bytes(const void* address);
// Bytes of that mapping in transparent huge pages (smaps "AnonHugePages"), or -1.
long long huge_page_bytes(const void* address);

}  // namespace troupe::bench
