// One direction of a pipeline link between two GPU chunks (docs/gpu.md): the payload (an
// activation, or its gradient) moves from the sender's device buffer into the receiver's on the
// GPU, while the typed header that says what it is travels as a message. The link moves bytes
// only, in the order they were sent: both ends issue their transfers in the pipeline plan's
// order, the sender before it sends the header, the receiver when the header arrives.
//
// Invariants:
//  - Nothing here blocks the host on the GPU: every call enqueues work and returns an event.
//    Streams wait on events (cudaStreamWaitEvent captures the event as recorded at that call),
//    so a returned event stays meaningful for waits issued before the link's next call.
//  - send(data, bytes, ready): reads `data` after `ready` (an event of the producer's stream).
//    The returned event fires once the link no longer reads `data`: the producer's stream waits
//    on it before it overwrites the buffer.
//  - receive(data, bytes, ready): writes the oldest payload not yet received into `data`
//    after `ready` (an event of the consumer's stream: the buffer is free). The returned event
//    fires once `data` holds it: the consumer's stream waits on it before reading. The sizes of
//    a send and its receive must agree (checked by the local link; NCCL's receive fails).
//  - Two kinds: a local link, whose both ends live in this process (one device or two): the
//    payload is staged in a device buffer of the link's, so send's event fires without waiting
//    for the receiver; and an NCCL link (ncclSend / ncclRecv on an nccl_group, across devices or
//    processes, non-blocking, aborted past a deadline as nccl_group does).
// Host code; needs the CUDA headers, not nvcc.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <string>

namespace troupe::kernels::cuda {

class nccl_group;

class activation_link {
 public:
  virtual ~activation_link() = default;
  virtual cudaEvent_t send(const void* data, std::size_t bytes, cudaEvent_t ready) = 0;
  virtual cudaEvent_t receive(void* data, std::size_t bytes, cudaEvent_t ready) = 0;
  // "local, device 0 -> device 0", "nccl group pp-0-1, rank 0 -> 1".
  virtual std::string describe() const = 0;
};

// Both ends in this process: the sender on `send_device`, the receiver on `receive_device`.
// One object serves both ends (thread-safe: stage actors run on different threads).
std::shared_ptr<activation_link> make_local_link(int send_device, int receive_device);

// This process's end of a link to `peer` in `group` (which must outlive the link): sends and
// receives go through ncclSend / ncclRecv on the group's stream.
std::shared_ptr<activation_link> make_nccl_link(nccl_group& group, int peer);

}  // namespace troupe::kernels::cuda
