// moraine-cpu-expert-worker: computes the routed experts it owns (expert_owner() in
// coordinator/group_layout.h) from the RAM arena into the exchange segment's expert_out rows.
// Two ways in, both always served: the request doorbell (default hand-off: the gpu_worker writes
// ExpertRequest and rings; this process derives the same ExpertPlan from the published routing)
// and ZeroMQ ExpertJobList descriptors (the reference path, --handoff zmq on the coordinator).
// A restarted worker finds a request rung but not answered (request bell > done bell) and
// computes it: the inputs are still in shared memory, so the step its predecessor died in
// completes with the same numbers.
#include <sched.h>
#include <numa.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <iostream>
#include <mutex>
#include <thread>

#include "common/messaging/job_channel.h"
#include "common/model/model.h"
#include "common/reference/moe_parts.h"
#include "common/shm/doorbell.h"
#include "common/shm/shm_segment.h"
#include "coordinator/control_server.h"
#include "coordinator/group_layout.h"
#include "coordinator/process_util.h"

namespace {

using namespace moraine;
using Clock = std::chrono::steady_clock;

class ExpertWorker {
 public:
  ExpertWorker(const group::GroupManifest& man, int index, int threads)
      : man_(man), index_(index), model_(model::Model::load(man.model_path)),
        exchange_(shm::ShmSegment::open(man.exchange_locator)),
        arena_(shm::ShmSegment::open(man.arena_locator)),
        xl_(group::ExchangeLayout::build(model_.hp, man.max_tokens, man.n_cpu_workers)),
        al_(group::ArenaLayout::build(model_)), pool_(threads) {
    const model::HParams& hp = model_.hp;
    if (index_ < 0 || index_ >= man.n_cpu_workers) {
      throw std::runtime_error("--index " + std::to_string(index_) + " is outside the group's " +
                               std::to_string(man.n_cpu_workers) + " cpu workers");
    }
    if (exchange_.data_bytes() < xl_.layout.total_bytes() || arena_.data_bytes() < al_.total_bytes) {
      throw std::runtime_error("exchange or arena segment is smaller than this model's layout");
    }
    const int64_t max_slots = int64_t{man.max_tokens} * hp.n_expert_used;
    plan_.reserve(hp.n_expert, max_slots);
    xg_.resize(static_cast<size_t>(man.max_tokens * hp.n_embd));
    scratch_.reserve(man.max_tokens, hp.n_ff_exp);
    for (int64_t il = 0; il < hp.n_layer; ++il) {
      std::array<model::ExpertTensor, 3> t;
      for (int w = 0; w < 3; ++w) t[w] = al_.bind(model_, il, w, arena_.data());
      experts_.push_back(t);
    }
    expert_bytes_ = static_cast<uint64_t>(experts_[0][0].expert(0).n_rows * experts_[0][0].all.row_bytes +
                                          experts_[0][1].expert(0).n_rows * experts_[0][1].all.row_bytes +
                                          experts_[0][2].expert(0).n_rows * experts_[0][2].all.row_bytes);
  }

  messaging::JobLimits limits() const {
    return {{{group::kExchangeSegmentId, exchange_.data_bytes()}},
            static_cast<uint32_t>(model_.hp.n_layer), static_cast<uint32_t>(model_.hp.n_expert),
            static_cast<uint32_t>(man_.max_tokens), static_cast<uint32_t>(model_.hp.n_embd * sizeof(float))};
  }

  // Doorbell path: returns false when it gave up waiting (caller checks liveness and shutdown).
  bool serve_doorbell(std::chrono::milliseconds wait, group::StageRecorder& stage) {
    shm::Doorbell* req = bell(group::ExchangeLayout::request_bell(index_));
    shm::Doorbell* done = bell(group::ExchangeLayout::done_bell(index_));
    const uint64_t answered = done->load();
    if (req->wait_for(answered + 1, wait) != shm::WaitResult::kReady) return false;
    const uint64_t seq = req->load();
    const auto* r = xl_.region("expert_req").at<const group::ExpertRequest>(exchange_.data());
    const auto t0 = Clock::now();
    std::lock_guard lock(compute_mu_);
    if (r->layer >= model_.hp.n_layer || r->n_tokens == 0 || r->n_tokens > static_cast<uint32_t>(man_.max_tokens)) {
      // A corrupt request must not take the worker down; the gpu_worker sees no answer and fails
      // the step with a timeout naming this worker.
      std::cerr << "cpu_expert_worker " << index_ << ": bad expert request (layer " << r->layer
                << ", " << r->n_tokens << " tokens); ignored\n";
      done->ring(seq);
      return true;
    }
    const int64_t k = model_.hp.n_expert_used;
    const int64_t d = model_.hp.n_embd;
    plan_.build(xl_.region("chosen").at<const int32_t>(exchange_.data()), r->n_tokens * k, model_.hp.n_expert);
    const float* hidden = xl_.region("hidden").at<const float>(exchange_.data());
    float* out = xl_.region("expert_out").at<float>(exchange_.data());
    uint64_t computed = 0;
    for (int64_t e = 0; e < model_.hp.n_expert; ++e) {
      if (group::expert_owner(e, man_.n_cpu_workers) != index_ || plan_.count(e) == 0) continue;
      const int32_t m = plan_.count(e);
      for (int32_t j = 0; j < m; ++j) {
        const int64_t t = plan_.slot_of[plan_.start[e] + j] / k;
        std::copy_n(hidden + t * d, d, xg_.data() + j * d);
      }
      compute(r->layer, e, m, out + int64_t{plan_.start[e]} * d);
      ++computed;
    }
    done->ring(seq);
    stage.record(r->n_tokens, computed, computed * expert_bytes_, us_since(t0));
    return true;
  }

  // ZeroMQ path: one validated ExpertJobList.
  void serve_jobs(const jobs::ExpertJobList& list, jobs::JobReply& reply, group::StageRecorder& stage) {
    const auto t0 = Clock::now();
    std::lock_guard lock(compute_mu_);
    const int64_t d = model_.hp.n_embd;
    const float* hidden = reinterpret_cast<const float*>(exchange_.data() + list.activations().offset());
    std::byte* outputs = exchange_.data() + list.outputs().offset();
    for (const jobs::ExpertJob& job : list.jobs()) {
      if (group::expert_owner(job.expert_id(), man_.n_cpu_workers) != index_) {
        throw std::runtime_error("expert " + std::to_string(job.expert_id()) + " is not placed on cpu worker " +
                                 std::to_string(index_));
      }
      const int m = job.token_rows_size();
      for (int j = 0; j < m; ++j) std::copy_n(hidden + int64_t{job.token_rows(j)} * d, d, xg_.data() + j * d);
      compute(list.layer(), job.expert_id(), m, reinterpret_cast<float*>(outputs + job.output_offset()));
    }
    reply.set_done_seq(list.done_seq());
    stage.record(list.n_tokens(), static_cast<uint64_t>(list.jobs_size()),
                 static_cast<uint64_t>(list.jobs_size()) * expert_bytes_, us_since(t0));
  }

  uint64_t shm_mapped() const { return exchange_.data_bytes() + arena_.data_bytes(); }

 private:
  static double us_since(Clock::time_point t0) {
    return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  }
  shm::Doorbell* bell(size_t i) const {
    return shm::Doorbell::at(exchange_.data() + xl_.region("bells").offset + i * sizeof(shm::Doorbell));
  }
  void compute(int64_t il, int64_t e, int64_t m, float* y) {
    const auto& t = experts_[il];
    reference::swiglu_expert(t[0].expert(e), t[1].expert(e), t[2].expert(e), xg_.data(), m, y, scratch_, pool_);
  }

  group::GroupManifest man_;
  int index_;
  model::Model model_;   // shapes and types; the expert bytes used are the arena's
  shm::ShmSegment exchange_, arena_;
  group::ExchangeLayout xl_;
  group::ArenaLayout al_;
  reference::ThreadPool pool_;
  std::vector<std::array<model::ExpertTensor, 3>> experts_;
  group::ExpertPlan plan_;
  std::vector<float> xg_;
  reference::ExpertScratch scratch_;
  uint64_t expert_bytes_ = 0;
  std::mutex compute_mu_;
};

int run(const std::string& socket_dir, int index, const std::string& cpus, int numa_node, int threads) {
  if (!cpus.empty()) {
    const std::vector<int> list = group::parse_cpu_list(cpus);
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c : list) CPU_SET(c, &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) throw std::runtime_error("--cpus " + cpus + ": sched_setaffinity failed");
    if (threads <= 0) threads = static_cast<int>(list.size());
  }
  if (numa_node >= 0) {
    if (numa_available() < 0 || numa_node > numa_max_node()) {
      throw std::runtime_error("--numa-node " + std::to_string(numa_node) + ": no such NUMA node on this host");
    }
    numa_run_on_node(numa_node);
    numa_set_preferred(numa_node);
  }
  group::install_stop_signals();
  const std::string instance = group::cpu_worker_instance(index);
  group::ControlServer control(control::ROLE_CPU_EXPERT_WORKER, instance, group::control_address(socket_dir, instance));
  // One stage for both ways in: a group uses one hand-off at a time.
  group::StageRecorder& doorbell_stage = control.add_stage("expert_cpu");
  group::StageRecorder& zmq_stage = doorbell_stage;
  control.set_state(control::LOADING);
  control.start();

  const group::GroupManifest man = group::GroupManifest::read(group::manifest_path(socket_dir));
  ExpertWorker worker(man, index, threads);
  control.set_stats_hook([&](control::StatsReply& r) { r.set_shm_mapped_bytes(worker.shm_mapped()); });
  zmq::context_t ctx(1);
  messaging::JobServer server(ctx, group::jobs_endpoint(socket_dir, instance), worker.limits());
  control.set_state(control::SERVING);

  std::thread bells([&] {
    while (!control.shutdown_requested()) {
      if (!worker.serve_doorbell(std::chrono::milliseconds(100), doorbell_stage) &&
          !shm::process_alive(man.coordinator_pid, man.coordinator_start_ticks)) {
        std::cerr << instance << ": coordinator " << man.coordinator_pid << " is gone; exiting\n";
        control.request_shutdown();
      }
    }
  });
  const auto handler = [&](const jobs::JobEnvelope& job, jobs::JobReply& reply) {
    if (job.has_expert_jobs()) {
      worker.serve_jobs(job.expert_jobs(), reply, zmq_stage);
    } else if (!job.has_ping()) {
      throw std::runtime_error("a cpu_expert_worker takes expert_jobs and ping only");
    }
    reply.set_status(jobs::JOB_OK);
  };
  try {
    while (!control.shutdown_requested()) {
      if (group::signal_received()) control.request_shutdown();
      if (group::serve_one_job(server, handler, std::chrono::milliseconds(100)) == messaging::ServeResult::kRejected) {
        std::cerr << instance << ": rejected a job: " << server.last_error() << "\n";
      }
    }
  } catch (...) {
    control.request_shutdown();
    bells.join();
    throw;
  }
  bells.join();
  control.stop();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moraine-cpu-expert-worker: routed experts from the RAM arena"};
  std::string socket_dir, cpus;
  int index = 0, numa_node = -1, threads = 0;
  app.add_option("--socket-dir", socket_dir, "group socket directory (holds group.json)")->required();
  app.add_option("--index", index, "worker index in the group (0-based)");
  app.add_option("--cpus", cpus, "cores to pin to, e.g. 0-3,8");
  app.add_option("--numa-node", numa_node, "NUMA node whose cores and memory to use");
  app.add_option("--threads", threads, "expert threads (default: the --cpus count, else all)");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(socket_dir, index, cpus, numa_node, threads);
  } catch (const std::exception& e) {
    std::cerr << "moraine-cpu-expert-worker: " << e.what() << "\n";
    return 1;
  }
}
