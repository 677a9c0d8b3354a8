// `moraine-kernel-bench cuda`: GB/s of quantized weight bytes the decode matrix-vector kernels
// (kernels/cuda/matvec.h) consume, per format and shape, beside the device memory bandwidth
// measured on the same card with a plain read kernel and a device-to-device copy.
#pragma once
#include <string>
#include <vector>

#include "tools/kernel_bench/moe_fused_bench.h"

#include "tools/kernel_bench/gemm_prefill_bench.h"

namespace CLI {
class App;
}

namespace moraine::kernel_bench {

struct CudaBenchOptions {
  bool json = false;
  int set_mib = 1024;  // distinct weight bytes cycled per measurement point: >> the 60 MB L2
  std::vector<std::string> formats{"q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "mxfp4"};
  double min_ms = 30.0;  // timed span per measurement point
  bool gemm_only = false;  // only the prefill GEMM section (gemm_prefill_bench.h)
  GemmBenchSelection gemm;  // which of its rows (gemm_prefill_bench.h)
  bool moe_only = false;  // only the fused MoE layer (after the bandwidth measure)
  bool backend_only = false;  // only the backend kernels section (backend_kernels_bench.h)
  bool pdl_only = false;  // only the PDL decode-chain section (pdl_chain_bench.h)
  bool mixer_only = false;  // only the attention/router small kernels, old vs new (mixer_bench.h)
  bool mixer_ncu = false;   // with mixer_only: a few plain launches each, for ncu
  MoeBenchSelection moe;    // the fused MoE rows to time (moe_fused_bench.h)
};

void add_cuda_subcommand(CLI::App& app, CudaBenchOptions& opt);
int run_cuda_bench(const CudaBenchOptions& opt);

}  // namespace moraine::kernel_bench
