// moraine-io-worker: fills slots of the expert arena from the model file (file-resident experts).
// It joins the group like the cpu_expert_workers: reads <socket-dir>/group.json, maps the arena
// segment, serves Control as "io_worker-0" and exits when the coordinator is gone. Clients
// (the cpu_expert_workers) send ReadJobList descriptors over ZeroMQ to
// jobs_endpoint(socket_dir, "io_worker-0"): every range (model shard, file offset, arena
// destination) is validated, all of a job's ranges are read with io_uring, several in flight
// (io_worker/uring_reader.h), and the reply (JOB_OK with bytes_read) goes back once every byte
// has landed. One REP socket serves all clients in turn: their REQ sockets queue fairly.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <iostream>
#include <mutex>

#include "common/messaging/job_channel.h"
#include "common/model/model.h"
#include "common/shm/shm_segment.h"
#include "coordinator/control_server.h"
#include "coordinator/group_layout.h"
#include "coordinator/process_util.h"
#include "io_worker/uring_reader.h"

namespace {

using namespace moraine;

constexpr const char* kInstance = "io_worker-0";

struct Options {
  std::string socket_dir;
  io::UringReaderOptions reader;
  bool buffered = false;
};

class IoWorker {
 public:
  IoWorker(const group::GroupManifest& man, const io::UringReaderOptions& options)
      : model_(model::Model::load(man.model_path)), arena_(shm::ShmSegment::open(man.arena_locator)),
        reader_(model_.file.paths(), options) {}

  messaging::JobLimits limits() const {
    messaging::JobLimits l;
    l.segments = {{group::kArenaSegmentId, arena_.data_bytes()}};
    l.n_layers = static_cast<std::uint32_t>(model_.hp.n_layer);
    for (std::size_t i = 0; i < reader_.file_count(); ++i) l.file_bytes.push_back(reader_.file_bytes(i));
    return l;
  }

  // One validated ReadJobList: every range lands in the arena before the reply is sent.
  void serve(const jobs::ReadJobList& list, jobs::JobReply& reply, group::StageRecorder& stage) {
    ranges_.clear();
    for (const jobs::ReadRange& r : list.ranges()) {
      ranges_.push_back({r.file_index(), r.file_offset(), r.dest().length(), arena_.data() + r.dest().offset()});
    }
    latency_.assign(ranges_.size(), 0.0);
    std::uint64_t bytes = 0;
    try {
      bytes = reader_.read(ranges_, latency_);
    } catch (...) {
      publish();
      throw;   // JOB_FAILED with the IoError's message (file, range, cause)
    }
    for (std::size_t i = 0; i < ranges_.size(); ++i) stage.record(0, 0, ranges_[i].length, latency_[i]);
    reply.set_bytes_read(bytes);
    ++jobs_;
    publish();
  }

  void stats(control::StatsReply& r) {
    r.set_shm_mapped_bytes(arena_.data_bytes());
    std::lock_guard lock(mu_);
    auto& c = *r.mutable_counters();
    c["jobs"] = published_jobs_;
    c["reads"] = published_.reads;
    c["bounce_bytes"] = published_.bounce_bytes;
    c["short_reads"] = published_.short_reads;
    c["o_direct"] = reader_.all_direct() ? 1 : 0;
    c["io_uring"] = reader_.uring() ? 1 : 0;
  }

  std::string describe() const { return reader_.describe(); }

 private:
  // The reader's counters are touched by the serving thread only; Stats reads this copy.
  void publish() {
    std::lock_guard lock(mu_);
    published_ = reader_.stats();
    published_jobs_ = jobs_;
  }

  model::Model model_;   // shard paths and layer count
  shm::ShmSegment arena_;
  io::UringReader reader_;
  std::vector<io::ReadRange> ranges_;
  std::vector<double> latency_;
  std::uint64_t jobs_ = 0;
  std::mutex mu_;
  io::UringReaderStats published_;
  std::uint64_t published_jobs_ = 0;
};

int run(const Options& o) {
  group::install_stop_signals();
  group::ControlServer control(control::ROLE_IO_WORKER, kInstance, group::control_address(o.socket_dir, kInstance));
  group::StageRecorder& stage = control.add_stage("io");
  control.set_state(control::LOADING);
  control.start();

  const group::GroupManifest man = group::GroupManifest::read(group::manifest_path(o.socket_dir));
  IoWorker worker(man, o.reader);
  std::cerr << kInstance << ": " << worker.describe() << std::endl;
  control.set_stats_hook([&](control::StatsReply& r) { worker.stats(r); });
  zmq::context_t ctx(1);
  messaging::JobServer server(ctx, group::jobs_endpoint(o.socket_dir, kInstance), worker.limits());
  control.set_state(control::SERVING);

  const auto handler = [&](const jobs::JobEnvelope& job, jobs::JobReply& reply) {
    if (job.has_read_jobs()) {
      worker.serve(job.read_jobs(), reply, stage);
    } else if (!job.has_ping()) {
      throw std::runtime_error("an io_worker takes read_jobs and ping only");
    }
  };
  while (!control.shutdown_requested()) {
    if (group::signal_received()) {
      control.request_shutdown();
      break;
    }
    const messaging::ServeResult served = group::serve_one_job(server, handler, std::chrono::milliseconds(100));
    if (served == messaging::ServeResult::kRejected) {
      std::cerr << kInstance << ": rejected a job: " << server.last_error() << "\n";
    } else if (served == messaging::ServeResult::kIdle &&
               !shm::process_alive(man.coordinator_pid, man.coordinator_start_ticks)) {
      std::cerr << kInstance << ": coordinator " << man.coordinator_pid << " is gone; exiting\n";
      control.request_shutdown();
    }
  }
  control.stop();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"moraine-io-worker: fills expert arena slots from the model file (io_uring)"};
  Options o;
  std::size_t chunk_kib = o.reader.chunk_bytes >> 10;
  app.add_option("--socket-dir", o.socket_dir, "group socket directory (holds group.json)")->required();
  app.add_option("--queue-depth", o.reader.queue_depth, "reads in flight")->check(CLI::Range(1u, 4096u));
  app.add_option("--chunk-kib", chunk_kib, "largest single read, KiB")->check(CLI::Range(std::size_t{4}, std::size_t{1} << 20));
  app.add_flag("--buffered", o.buffered, "do not use O_DIRECT (read through the page cache)");
  CLI11_PARSE(app, argc, argv);
  o.reader.chunk_bytes = chunk_kib << 10;
  o.reader.direct = !o.buffered;
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::cerr << "moraine-io-worker: " << e.what() << "\n";
    return 1;
  }
}
