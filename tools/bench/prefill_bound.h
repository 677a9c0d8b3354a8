// The prefill speed a long step allows: the host->device bytes per prompt token the step must
// copy (every RAM-tier expert a layer's rows use crosses PCIe once per long step) over the
// measured pinned H2D rate, and the FLOPs per prompt token over the measured rate of the
// engine's own prefill GEMM path. Copies overlap compute, so the bound is 1 / max, not 1 / sum.
// The model-side arithmetic is here, in plain C++ (tests/bench/bench_prefill_bound_test.cpp
// checks it on synth models by hand-computed numbers); the rates come from the probes.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/formats/tensor_type.h"
#include "tools/bench/bench_engine.h"

namespace moraine::model {
struct Model;
}

namespace moraine::bench {

// What a prompt token costs the GPU, from the model's shapes (trunk layers; nextn layers are not run).
struct PrefillModel {
  // 2 x the weight elements one token multiplies: attention / DeltaNet / MLA projections, dense
  // FFNs, routers, k routed experts, the shared expert; DeltaNet's conv taps.
  double weight_flops = 0;
  // The lm head (2 x n_vocab x n_embd) runs for the last row only: its share of an N-token prefill is 1/N.
  double head_flops = 0;
  // DeltaNet's state work per token, approximately: per value head 7 x dk x dv (decay the state,
  // S^T k, the rank-1 update, S^T q; 1 + 2 + 2 + 2 multiply-adds per state element).
  double deltanet_flops = 0;
  // Causal attention per attention layer: 2 x n_head x (dk + dv) FLOPs per position a query
  // sees (Q K^T and P V), over a window (0: the whole prefix).
  struct Attention {
    double flops_per_position = 0;
    int64_t window = 0;
  };
  std::vector<Attention> attention;
  // The expert shape the GEMM probe times (the first MoE layer's).
  int64_t n_embd = 0, n_ff = 0, n_expert = 0, n_expert_used = 0;
  TensorType gate_type = TensorType::F32, down_type = TensorType::F32;

  // FLOPs per prompt token of an n-token prefill from an empty context.
  double flops_per_token(int64_t n_prompt) const;
  double attention_flops_per_token(int64_t n_prompt) const;
};

PrefillModel prefill_model(const model::Model& m);

// Mean over the queries of an n-token causal prefill of the positions each one sees
// (itself included), min(i, window) for query i = 1..n; window 0 means no window.
double mean_causal_context(int64_t n, int64_t window);

// P(an expert used by at least one of `rows` rows), each row choosing it with probability p.
double expected_use(double p_row, double rows);

// Bytes per prompt token a step of `rows` rows moves from the experts of tier `tier` (1: RAM over
// PCIe, 2: FILE from disk): per layer, the expected distinct experts of that tier the rows use
// (routing by popularity, uniform k/E without it) times the layer's expert bytes, over rows.
double staged_bytes_per_token(const ExpertStaging& s, int64_t rows, uint8_t tier);

// The engine's prefill GEMM rate (PrefillGemm::matmul_experts over a layer's experts) and cuBLAS's
// dense BF16 rate, both measured on this machine; nullopt with a note saying why.
struct GemmRates {
  std::optional<double> engine_flops_s, cublas_bf16_flops_s;
  std::string engine_note, cublas_note;
  int64_t rows_per_expert = 0;   // the probe's rows per expert
};

// Times the engine's prefill GEMM path on this GPU (cuda_probe.cpp): PrefillGemm::matmul_experts
// over all experts of a layer at the model's expert shape and types (random weights), gate + up +
// down with rows_per_expert rows each, best over >= min_ms; and a dense cuBLAS BF16 GEMM's rate.
// Without CUDA or a GPU both are nullopt and the notes say why.
// with_cublas false: only the engine path (a second shape of the same run).
GemmRates measure_prefill_gemm(const PrefillModel& pm, int64_t rows_per_expert, bool with_cublas = true, double min_ms = 200);

struct PrefillBound {
  int64_t n_prompt = 0;
  int64_t step_rows = 0;         // min(n, long_step_rows)
  bool long_step = false;        // the engine runs this prompt in long steps (n > window rows)
  double pcie_bytes_per_token = 0, disk_bytes_per_token = 0, flops_per_token = 0;
  std::optional<double> pcie_s, disk_s, gpu_s;   // seconds per token of each part (nullopt: no rate)
  std::optional<double> tok_s;
  std::string limiting;          // "pcie", "gpu" or "disk"
  std::string why_none;          // set when tok_s is nullopt
  std::optional<double> share;   // measured prefill tok/s over tok_s (filled by the caller)
};

// The bound of an n-token prefill. staging nullopt: n/a with staging_none. The FILE tier's experts
// are read by the cpu workers once per window (each window's hand-off fetches them): the disk part.
PrefillBound prefill_bound(int64_t n_prompt, const PrefillModel& pm, const std::optional<ExpertStaging>& staging,
                           const std::string& staging_none, std::optional<double> pcie_bytes_s,
                           std::optional<double> disk_bytes_s, const GemmRates& gemm);

}  // namespace moraine::bench
