// The device scratch of one decode layer's chain of kernels (rms_norm -> quantize -> q|k|v matvec
// -> qk_norm_rope_store -> attention_decode -> quantize -> o matvec -> norm -> router -> top-k ->
// expert rows -> moe_combine), one set that every layer reuses, as the CUDA backend's scratch is.
// The chain benches (pdl_chain_bench.cu, mixer_bench_chain.cu) and tests/cuda/pdl_chain_test.cpp
// allocated the same set each (review duplicates D2 / D7 of session 9); they derive from this
// and add what is theirs (weights, caches, the test's embedding and head). Host code.
#pragma once
#include <algorithm>
#include <cstdint>

#include "common/formats/quant.h"
#include "kernels/cuda/attention_scratch.h"
#include "kernels/cuda/device_buffer.h"

namespace moraine::kernel_bench {

struct DecodeChainBuffers {
  int64_t scratch_floats = 0;   // attention_decode's split records for one row at max_ctx
  cuda::DeviceBuffer<float> x;          // [embd] the residual (callers upload its start)
  cuda::DeviceBuffer<float> h;          // [embd] normalised rows
  cuda::DeviceBuffer<float> qkv_out;    // [q_dim + 2 kv_dim] the stacked projection's output
  cuda::DeviceBuffer<float> q, attn;    // [q_dim] q after norm / RoPE, the attention's output
  cuda::DeviceBuffer<float> scratch;    // [scratch_floats]
  cuda::DeviceBuffer<float> logits;     // [experts] the router's
  cuda::DeviceBuffer<float> weight;     // [top_k]
  cuda::DeviceBuffer<float> slots;      // [top_k][embd] the chosen experts' rows
  cuda::DeviceBuffer<uint8_t> act;      // one Q8_0 row of the widest matvec input (embd or q_dim)
  cuda::DeviceBuffer<int32_t> chosen;   // [chosen_rows][top_k]
  cuda::DeviceBuffer<int32_t> pos;      // [1] the step's position

  // chosen_rows: routings kept at once (1: each layer overwrites the last; the layer count when
  // a caller compares every layer's routing after the step).
  DecodeChainBuffers(const cuda::AttentionShape& s, int64_t embd, int64_t experts, int64_t top_k, int64_t max_ctx,
                     int64_t chosen_rows = 1)
      : scratch_floats(cuda::attention_decode_scratch_floats(s, 1, max_ctx)),
        x(static_cast<size_t>(embd)),
        h(static_cast<size_t>(embd)),
        qkv_out(static_cast<size_t>((s.n_head + 2 * s.n_head_kv) * s.head_dim)),
        q(static_cast<size_t>(s.n_head * s.head_dim)),
        attn(static_cast<size_t>(s.n_head * s.head_dim)),
        scratch(static_cast<size_t>(scratch_floats)),
        logits(static_cast<size_t>(experts)),
        weight(static_cast<size_t>(top_k)),
        slots(static_cast<size_t>(top_k * embd)),
        act(row_bytes(TensorType::Q8_0, std::max(embd, s.n_head * s.head_dim))),
        chosen(static_cast<size_t>(chosen_rows * top_k)),
        pos(1) {}
};

}  // namespace moraine::kernel_bench
