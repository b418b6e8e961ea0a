@0x96829e3555171361;
# Rendezvous frames (transport/rendezvous.cpp): every process except rank 0 connects to rank 0 over
# TCP and sends one Hello; rank 0 answers each with a Refusal (and closes), or, once all `world`
# processes have joined, with the same Welcome. One frame per direction, a plain Cap'n Proto
# stream message (segment table + segments). Limits the reader applies are in rendezvous.cpp.

$import "/capnp/c++.capnp".namespace("troupe::messages::rendezvous_wire");

# Frame.magic is always this value ("troupeRV" in ASCII): anything else is not a rendezvous frame.
const rendezvousMagic :UInt64 = 0x74726f7570655256;

# Bumped when this file changes incompatibly; rank 0 refuses a Hello with another value.
const rendezvousSchemaVersion :UInt32 = 2;

struct Hello {
  schemaVersion @0 :UInt32;     # rendezvousSchemaVersion of the sender
  protocolVersion @1 :UInt32;   # messages::protocol_version of the sender
  token @2 :Text;               # job token (launch_env.job_token)
  rank @3 :Int32;
  world @4 :Int32;
  replica @5 :Int32;
  pipelineRank @6 :Int32;
  host @7 :Text;
  workerAddress @8 :Data;       # UCX worker address blob
  device @9 :Text;              # its chunks' CUDA device (PCI bus id, NCCL host id); empty: none
  ncclIds @10 :List(Data);      # rank 0's own hello only: ids offered (128 bytes each)
  resume @11 :Text;             # the checkpoint it resumes ("step-N, manifest xxh64 H"); empty:
                                # a fresh start. Every process of a job must name the same one.
}

struct Peer {
  rank @0 :Int32;
  host @1 :Text;
  workerAddress @2 :Data;
  device @3 :Text;
}

struct Welcome {
  peers @0 :List(Peer);         # every process, by rank
  ncclIds @1 :List(Data);       # one per communicator across processes (links, groups), in
                                # the job's order; empty: staged through host memory
}

struct Refusal {
  reason @0 :Text;
}

struct Frame {
  magic @0 :UInt64;
  union {
    hello @1 :Hello;
    welcome @2 :Welcome;
    refusal @3 :Refusal;
  }
}
