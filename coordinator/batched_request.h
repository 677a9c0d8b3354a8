// One request of --batch-decode (issue 33; the scheduler is coordinator/batch_stepper.h), apart
// from coordinator.cpp: it holds a sequence slot, its prompt goes in chunks of the batched steps
// (or, with --prefill-chunk 0, in steps of its own between them), then each token is a decode row
// of a batched step. No speculation, prefix or conversation cache. Also the stream helpers both
// request paths end with.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <string>

#include <grpcpp/grpcpp.h>

#include "coordinator/batch_stepper.h"
#include "coordinator/chunk_streamer.h"
#include "coordinator/control_server.h"
#include "coordinator/sequence.h"
#include "proto/generate.grpc.pb.h"

namespace moraine::group {

// A request's last chunk: why it finished (cancelled where the sequence did not end) and its timing.
void push_last_chunk(ChunkStreamer& stream, generate::GenerateChunk last, const Sequence& seq, generate::GenerateTiming& timing);
// The call's status once its stream is done: cancelled where the client went away first.
grpc::Status stream_status(ChunkStreamer& stream);
// A request that failed on the way: an error chunk naming why ends its stream, and the call's
// status says the same.
grpc::Status end_with_error(ChunkStreamer& stream, const std::string& what);

// What a batched request needs of the coordinator.
struct BatchedRequestEnv {
  BatchStepper& stepper;
  bool chunked = true;   // prompts in chunks of the batched steps (BatchStepper::prefill)
  // chunked false: runs the prompt as steps of its own on `slot` (inside BatchStepper::exclusive)
  // and returns its greedy token, or -1 with the last row's logits in `logits`.
  std::function<int32_t(int slot, const Sequence& seq, bool token_only, std::vector<float>& logits)> exclusive_prefill;
  int64_t context_positions = 0;
  StageRecorder& prefill;
  StageRecorder& decode;
  std::atomic<uint64_t>& cancelled;
  std::atomic<uint64_t>& greedy_worker_tokens;
};

grpc::Status generate_batched(BatchedRequestEnv& env, grpc::ServerContext* ctx,
                              grpc::ServerWriter<generate::GenerateChunk>* writer, Sequence& seq, bool token_only);

}  // namespace moraine::group
