@0xf0dba17f5dc25a86;
# The wire form of every message that crosses a process (messages/pipeline.hpp and
# messages/remote.hpp; hello/welcome/refusal travel in rendezvous.capnp). One frame carries one
# Envelope. The codec is messages/wire_codec.hpp.
#
# Invariants:
#  - Envelope.schema is envelopeSchema and Envelope.version is messages::protocol_version; a
#    reader refuses anything else, naming both values. Change a struct incompatibly: bump
#    protocol_version.
#  - A tensor payload is a Tensor: its element count and its bytes as Data pieces, each under
#    Cap'n Proto's 2^29-byte blob limit, all but the last a multiple of 8 bytes, so that pieces
#    lie back to back in a receive buffer and read as one view: after the header's words in the
#    frame's one segment, or (a message the builder needed several segments for) as consecutive
#    segments of their own. Either way a payload starts at a multiple of 64 bytes in the frame.
#  - Tensors and StepPlan.plan are required: the codec refuses to encode a null payload or plan
#    and to decode an absent one. An empty payload is a Tensor without pieces.
#  - Field order mirrors the C++ structs; ints are Int32 where the C++ field is int.

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("troupe::messages::wire::schema");

const envelopeSchema :UInt64 = 0xf0dba17f5dc25a86;  # this file's id

struct Tensor {
  elements @0 :UInt64;      # float or int32 elements, whichever the field holds
  pieces @1 :List(Data);    # concatenated: the elements, native (little-endian) byte order
}

enum LinkKind { activation @0; gradient @1; }
enum BatchPart { inputs @0; targets @1; }
enum ActionKind { forward @0; backward @1; weight @2; }
enum TraceEventKind { span @0; instant @1; flowOut @2; flowIn @3; }

struct LinkHeader {
  kind @0 :LinkKind;
  step @1 :Int32;
  round @2 :Int32;
  microBatch @3 :Int32;
  virtualStage @4 :Int32;
  replica @5 :Int32;
  eval @6 :Bool;
  shape @7 :List(Int64);
}

struct LinkMessage {
  header @0 :LinkHeader;
  data @1 :Tensor;
  flowId @2 :UInt64;
}

struct LinkCredit {
  header @0 :LinkHeader;
}

struct BatchMessage {
  part @0 :BatchPart;
  step @1 :Int32;
  round @2 :Int32;
  microBatch @3 :Int32;
  replica @4 :Int32;
  eval @5 :Bool;
  b @6 :Int32;
  t @7 :Int32;
  tokens @8 :Tensor;        # int32, b * t of them
  flowId @9 :UInt64;
}

struct BatchCredit {
  part @0 :BatchPart;
  replica @1 :Int32;
}

struct PipelineAction {
  kind @0 :ActionKind;
  virtualStage @1 :Int32;
  microBatch @2 :Int32;
}

# engine::pipeline_plan, structurally; the reader runs engine::check_plan on it.
struct PipelinePlan {
  name @0 :Text;
  ranks @1 :Int32;
  microBatches @2 :Int32;
  virtualStages @3 :Int32;
  splitBackward @4 :Bool;
  actions @5 :List(List(PipelineAction));  # by rank, in order
}

struct StepPlan {
  step @0 :Int32;
  rounds @1 :Int32;
  eval @2 :Bool;
  plan @3 :PipelinePlan;    # required
  lossScale @4 :Float64 = 1.0;
}

struct BeginStep {
  step @0 :Int32;
  rounds @1 :Int32;
  lossScale @2 :Float64 = 1.0;
}

struct BeginEval {
  step @0 :Int32;
  batches @1 :Int32;
}

struct GradsReady {
  step @0 :Int32;
  rank @1 :Int32;
  replica @2 :Int32;
  gradSquareSum @3 :Float64;
  lossSum @4 :Float64;
  losses @5 :Int32;
}

struct ApplyUpdate {
  step @0 :Int32;
  gradNorm @1 :Float64;
  skip @2 :Bool;
  unscale @3 :Float64 = 1.0;
}

struct MemoryReport {
  replica @0 :Int32;
  rank @1 :Int32;
  parameters @2 :Int64;
  gradients @3 :Int64;
  optimizer @4 :Int64;
  buffers @5 :Int64;
  pooled @6 :Int64;
  activations @7 :Int64;
}

struct UpdateDone {
  step @0 :Int32;
  rank @1 :Int32;
  replica @2 :Int32;
  lr @3 :Float64;
  memory @4 :MemoryReport;
}

struct EvalDone {
  step @0 :Int32;
  replica @1 :Int32;
  lossSum @2 :Float64;
  losses @3 :Int32;
}

struct TiedGrad {
  step @0 :Int32;
  replica @1 :Int32;
  data @2 :Tensor;
}

struct SnapshotRequest {
  step @0 :Int32;
  state @1 :Bool;           # a checkpoint's: moments too, pieces where ZeRO shards hold them
  capture @2 :Bool;         # the checkpoint's first phase: take the state aside, answer empty
  partDir @3 :Text;         # with state: write it as a part file there, answer with its name
}

struct TensorPiece {
  role @0 :Int32;           # messages::tensor_role
  name @1 :Text;
  offset @2 :Int64;
  data @3 :Tensor;
}

struct NamedTensor {
  name @0 :Text;
  data @1 :Tensor;
}

struct StageSnapshot {
  rank @0 :Int32;
  replica @1 :Int32;
  parameters @2 :List(NamedTensor);
  pieces @3 :List(TensorPiece);
  part @4 :Text;            # the part file written (snapshot_request's partDir): name, size, xxh64
  partBytes @5 :UInt64;
  partXxh64 @6 :UInt64;
}

# engine::trace::event, field by field.
struct TraceEvent {
  kind @0 :TraceEventKind;
  track @1 :Int32;
  category @2 :Text;
  name @3 :Text;
  tsUs @4 :Float64;
  durUs @5 :Float64;
  flowId @6 :UInt64;
  step @7 :Int32;
  microBatch @8 :Int32;
  virtualStage @9 :Int32;
  bytes @10 :Int64;
}

struct TraceBatch {
  events @0 :List(TraceEvent);
}

# engine::step_metrics.
struct StepReport {
  step @0 :Int32;
  totalSteps @1 :Int32;
  loss @2 :Float64;
  hasValLoss @3 :Bool;
  valLoss @4 :Float64;
  lr @5 :Float64;
  gradNorm @6 :Float64;
  tokensPerS @7 :Float64;
  stepMs @8 :Float64;
  elapsedS @9 :Float64;
  tokens @10 :Int64;
  flopsPerS @11 :Float64;
  memory @12 :List(MemoryReport);
  skipped @13 :Text;          # why the update was skipped; empty when it applied
  hasLossScale @14 :Bool;
  lossScale @15 :Float64;
}

struct Heartbeat {
  rank @0 :Int32;
  sequence @1 :UInt64;
}

struct ActorDown {
  actor @0 :UInt32;
  reason @1 :Text;
}

struct ErrorReport {
  rank @0 :Int32;
  message @1 :Text;
}

struct JobShutdown {
  ok @0 :Bool;
  message @1 :Text;
}

struct RingChunk {
  step @0 :Int32;
  rank @1 :Int32;
  bucket @2 :Int32;
  fromReplica @3 :Int32;
  phase @4 :Int32;
  chunk @5 :Int32;
  data @6 :Tensor;
  collective @7 :Int32;  # ZeRO: which collective (0 buckets, 1 train gathers, 2 eval, 3 final)
}

struct CheckpointChunk {
  step @0 :Int32;
  file @1 :Text;
  offset @2 :UInt64;
  xxhash @3 :UInt64;
  data @4 :Tensor;
}

struct TensorExchange {
  seq @0 :UInt64;     # the group's collective number
  from @1 :Int32;     # the sending member
  op @2 :Int32;       # 0 float sum, 1 double sum (bytes as floats), 2 float max, 3 abort
  data @3 :Tensor;
  reason @4 :Text;    # abort: why the member stopped
}

struct Envelope {
  schema @0 :UInt64;        # envelopeSchema
  version @1 :UInt32;       # messages::protocol_version
  target @2 :UInt32;        # job-wide actor id at the receiver; 0: the receiving gateway
  sourceRank @3 :Int32;
  correlation @4 :UInt64;   # 0: none
  reply @5 :Bool;
  body :union {
    linkMessage @6 :LinkMessage;
    linkCredit @7 :LinkCredit;
    batchMessage @8 :BatchMessage;
    batchCredit @9 :BatchCredit;
    stepPlan @10 :StepPlan;
    beginStep @11 :BeginStep;
    beginEval @12 :BeginEval;
    gradsReady @13 :GradsReady;
    applyUpdate @14 :ApplyUpdate;
    updateDone @15 :UpdateDone;
    evalDone @16 :EvalDone;
    tiedGrad @17 :TiedGrad;
    snapshotRequest @18 :SnapshotRequest;
    stageSnapshot @19 :StageSnapshot;
    traceBatch @20 :TraceBatch;
    stepReport @21 :StepReport;
    heartbeat @22 :Heartbeat;
    actorDown @23 :ActorDown;
    errorReport @24 :ErrorReport;
    jobShutdown @25 :JobShutdown;
    ringChunk @26 :RingChunk;
    checkpointChunk @27 :CheckpointChunk;
    tensorExchange @28 :TensorExchange;
  }
}
