#include "coordinator/batched_request.h"

#include <chrono>
#include <vector>

namespace moraine::group {

namespace {
using Clock = std::chrono::steady_clock;
double us_since(Clock::time_point t0) { return std::chrono::duration<double, std::micro>(Clock::now() - t0).count(); }
}  // namespace

void push_last_chunk(ChunkStreamer& stream, generate::GenerateChunk last, const Sequence& seq, generate::GenerateTiming& timing) {
  timing.set_generated_tokens(seq.generated());
  last.set_finish(seq.finish() == generate::FINISH_REASON_UNSPECIFIED ? generate::FINISH_CANCELLED : seq.finish());
  *last.mutable_timing() = timing;
  stream.push(std::move(last));
}

grpc::Status stream_status(ChunkStreamer& stream) {
  return stream.finish() ? grpc::Status::OK : grpc::Status(grpc::StatusCode::CANCELLED, "the client went away");
}

grpc::Status end_with_error(ChunkStreamer& stream, const std::string& what) {
  generate::GenerateChunk err;
  err.set_finish(generate::FINISH_ERROR);
  err.set_error(what);
  stream.push(std::move(err));
  stream.finish();
  return {grpc::StatusCode::INTERNAL, what};
}

grpc::Status generate_batched(BatchedRequestEnv& env, grpc::ServerContext* ctx,
                              grpc::ServerWriter<generate::GenerateChunk>* writer, Sequence& seq, bool token_only) {
  BatchStepper& stepper = env.stepper;
  const int slot = stepper.acquire_slot([&] { return ctx->IsCancelled(); });
  if (slot == BatchStepper::kQueueFull)
    return {grpc::StatusCode::RESOURCE_EXHAUSTED,
            "the coordinator is busy: " + std::to_string(stepper.slots()) + " requests decoding and " +
                std::to_string(stepper.queue_limit()) + " waiting for a sequence slot (--parallel, --batch-queue); retry later"};
  if (slot < 0) return {grpc::StatusCode::CANCELLED, "the client went away while queued"};
  struct Release {
    BatchStepper& s;
    int slot;
    bool decoding = false;
    ~Release() {
      if (decoding) s.end_decoding();
      s.release_slot(slot);
    }
  } release{stepper, slot};
  ChunkStreamer stream(writer);
  generate::GenerateTiming timing;
  timing.set_prompt_tokens(static_cast<uint32_t>(seq.prompt_tokens()));
  timing.set_context_tokens(static_cast<uint32_t>(env.context_positions));
  const auto finished = [&](generate::GenerateChunk last) {
    push_last_chunk(stream, std::move(last), seq, timing);
    return stream_status(stream);
  };
  try {
    const auto t0 = Clock::now();
    BatchStepper::Row row;
    row.slot = slot;
    row.token_only = token_only;
    if (env.chunked) {
      stepper.prefill(slot, seq.context, token_only, row);
    } else {
      stepper.exclusive([&] { row.out_token = env.exclusive_prefill(slot, seq, token_only, row.logits); });
    }
    int32_t next = row.out_token >= 0 ? row.out_token : seq.sample(row.logits);
    timing.set_prefill_us(static_cast<uint64_t>(us_since(t0)));
    env.prefill.record(seq.context.size(), 0, 0, us_since(t0));
    const auto t1 = Clock::now();
    stepper.begin_decoding();
    release.decoding = true;
    for (int64_t position = static_cast<int64_t>(seq.context.size());; ++position) {
      generate::GenerateChunk chunk;
      if (seq.accept(next, chunk)) {
        timing.set_decode_us(static_cast<uint64_t>(us_since(t1)));
        return finished(std::move(chunk));
      }
      stream.push(std::move(chunk));
      if (ctx->IsCancelled() || stream.broken()) {
        ++env.cancelled;
        timing.set_decode_us(static_cast<uint64_t>(us_since(t1)));
        return finished({});
      }
      row.token = next;
      row.position = position;
      const auto ts = Clock::now();
      stepper.decode(row);
      env.decode.record(1, 0, 0, us_since(ts));
      next = row.out_token >= 0 ? row.out_token : seq.sample(row.logits);
      if (row.out_token >= 0) ++env.greedy_worker_tokens;
    }
  } catch (const std::exception& e) {
    return end_with_error(stream, e.what());
  }
}

}  // namespace moraine::group
