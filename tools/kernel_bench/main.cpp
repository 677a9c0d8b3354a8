// moraine-kernel-bench: one subcommand per kernel backend.
#include <CLI/CLI.hpp>

#include <exception>
#include <iostream>

#include "tools/kernel_bench/cpu_bench.h"
#include "tools/kernel_bench/sampling_bench.h"
#ifdef MORAINE_HAVE_CUDA
#include "tools/kernel_bench/cuda_bench.h"
#endif

int main(int argc, char** argv) {
  CLI::App app{"moraine-kernel-bench: kernel throughput against the memory bandwidth it is bound by"};
  app.require_subcommand(1);
  moraine::kernel_bench::CpuBenchOptions cpu;
  moraine::kernel_bench::add_cpu_subcommand(app, cpu);
  moraine::kernel_bench::SamplingBenchOptions sampling;
  moraine::kernel_bench::add_sampling_subcommand(app, sampling);
#ifdef MORAINE_HAVE_CUDA
  moraine::kernel_bench::CudaBenchOptions cuda;
  moraine::kernel_bench::add_cuda_subcommand(app, cuda);
#endif
  CLI11_PARSE(app, argc, argv);
  try {
    if (app.got_subcommand("cpu")) return moraine::kernel_bench::run_cpu_bench(cpu);
    if (app.got_subcommand("sampling")) return moraine::kernel_bench::run_sampling_bench(sampling);
#ifdef MORAINE_HAVE_CUDA
    if (app.got_subcommand("cuda")) return moraine::kernel_bench::run_cuda_bench(cuda);
#endif
  } catch (const std::exception& e) {
    std::cerr << "moraine-kernel-bench: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
