#include "gpu_worker/kernel_trace.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>

#include <cupti.h>

namespace moraine::gpu_worker {

// CUPTI's buffer callbacks carry no user pointer: the one trace of the process lives here.
namespace {
std::atomic<KernelTrace::State*> g_trace{nullptr};
constexpr size_t kBufferBytes = 8u << 20;   // CUPTI fills these and hands them back
}  // namespace

struct KernelTrace::State {
  void* lib = nullptr;
  decltype(&cuptiActivityRegisterCallbacks) register_callbacks = nullptr;
  decltype(&cuptiActivityEnable) enable = nullptr;
  decltype(&cuptiActivityDisable) disable = nullptr;
  decltype(&cuptiActivityFlushAll) flush_all = nullptr;
  decltype(&cuptiActivityGetNextRecord) next_record = nullptr;
  decltype(&cuptiGetResultString) result_string = nullptr;
  std::FILE* out = nullptr;
  std::mutex mu;
  uint64_t max_rows = 0;
  std::atomic<uint64_t> rows{0}, dropped{0};

  template <typename F>
  void load(F& f, const char* name) {
    f = reinterpret_cast<F>(dlsym(lib, name));
    if (f == nullptr) throw std::runtime_error(std::string("--kernel-trace: the CUPTI library has no ") + name);
  }
  void check(CUptiResult r, const char* what) const {
    if (r == CUPTI_SUCCESS) return;
    const char* s = nullptr;
    if (result_string == nullptr || result_string(r, &s) != CUPTI_SUCCESS || s == nullptr) s = "unknown error";
    throw std::runtime_error(std::string("--kernel-trace: ") + what + ": " + s);
  }
  void row(const char* kind, const char* name, uint64_t start, uint64_t end, uint32_t stream, uint32_t graph,
           uint64_t node, int64_t grid, int64_t block) {
    if (rows.load(std::memory_order_relaxed) >= max_rows) {
      dropped.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    // Kernel names are mangled C++ identifiers: no commas or quotes to escape.
    std::fprintf(out, "%s,%s,%llu,%llu,%u,%u,%llu,%lld,%lld\n", kind, name, static_cast<unsigned long long>(start),
                 static_cast<unsigned long long>(end), stream, graph, static_cast<unsigned long long>(node),
                 static_cast<long long>(grid), static_cast<long long>(block));
    rows.fetch_add(1, std::memory_order_relaxed);
  }
  void write(uint8_t* buffer, size_t valid) {
    std::lock_guard lock(mu);
    CUpti_Activity* rec = nullptr;
    while (next_record(buffer, valid, &rec) == CUPTI_SUCCESS) {
      switch (rec->kind) {
        case CUPTI_ACTIVITY_KIND_KERNEL:
        case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
          const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
          row("kernel", k->name != nullptr ? k->name : "?", k->start, k->end, k->streamId, k->graphId, k->graphNodeId,
              int64_t{k->gridX} * k->gridY * k->gridZ, int64_t{k->blockX} * k->blockY * k->blockZ);
          break;
        }
        case CUPTI_ACTIVITY_KIND_MEMCPY: {
          const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
          const char* dir = m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD   ? "HtoD"
                            : m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH ? "DtoH"
                            : m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOD ? "DtoD"
                                                                              : "copy";
          const std::string name = std::string(dir) + " " + std::to_string(m->bytes);
          row("memcpy", name.c_str(), m->start, m->end, m->streamId, m->graphId, m->graphNodeId, 0, 0);
          break;
        }
        case CUPTI_ACTIVITY_KIND_MEMSET: {
          const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
          const std::string name = "memset " + std::to_string(m->bytes);
          row("memset", name.c_str(), m->start, m->end, m->streamId, m->graphId, m->graphNodeId, 0, 0);
          break;
        }
        default:
          break;
      }
    }
  }
};

namespace {

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  // CUPTI wants 8-byte aligned buffers; aligned_alloc gives more.
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(64, kBufferBytes));
  *size = *buffer != nullptr ? kBufferBytes : 0;
  *max_records = 0;   // as many as fit
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  if (KernelTrace::State* s = g_trace.load(); s != nullptr && valid > 0) s->write(buffer, valid);
  std::free(buffer);
}

}  // namespace

KernelTrace::KernelTrace(const std::string& path, uint64_t max_rows) : s_(std::make_unique<State>()) {
  State& s = *s_;
  s.max_rows = max_rows;
  for (const char* name : {"libcupti.so.13", "libcupti.so"}) {
    s.lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (s.lib != nullptr) break;
  }
  if (s.lib == nullptr) {
    throw std::runtime_error(std::string("--kernel-trace: cannot load CUPTI (libcupti.so.13 or libcupti.so): ") +
                             dlerror() + "; put the CUDA toolkit's libcupti on LD_LIBRARY_PATH");
  }
  s.load(s.register_callbacks, "cuptiActivityRegisterCallbacks");
  s.load(s.enable, "cuptiActivityEnable");
  s.load(s.disable, "cuptiActivityDisable");
  s.load(s.flush_all, "cuptiActivityFlushAll");
  s.load(s.next_record, "cuptiActivityGetNextRecord");
  s.load(s.result_string, "cuptiGetResultString");
  s.out = std::fopen(path.c_str(), "w");
  if (s.out == nullptr) throw std::runtime_error("--kernel-trace: cannot write " + path);
  std::fprintf(s.out, "kind,name,start_ns,end_ns,stream,graph_id,graph_node_id,grid,block\n");
  KernelTrace::State* none = nullptr;
  if (!g_trace.compare_exchange_strong(none, &s)) throw std::logic_error("--kernel-trace: one trace per process");
  try {
    s.check(s.register_callbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
    s.check(s.enable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enabling kernel records");
    s.check(s.enable(CUPTI_ACTIVITY_KIND_MEMCPY), "enabling memcpy records");
    s.check(s.enable(CUPTI_ACTIVITY_KIND_MEMSET), "enabling memset records");
  } catch (...) {
    g_trace.store(nullptr);
    std::fclose(s.out);
    throw;
  }
}

KernelTrace::~KernelTrace() {
  State& s = *s_;
  s.flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);   // hands every buffer to buffer_completed
  s.disable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  s.disable(CUPTI_ACTIVITY_KIND_MEMCPY);
  s.disable(CUPTI_ACTIVITY_KIND_MEMSET);
  g_trace.store(nullptr);
  std::lock_guard lock(s.mu);
  std::fclose(s.out);
  // The library stays loaded: CUPTI may still call back during process exit.
}

uint64_t KernelTrace::rows() const { return s_->rows.load(); }
uint64_t KernelTrace::dropped() const { return s_->dropped.load(); }

}  // namespace moraine::gpu_worker
