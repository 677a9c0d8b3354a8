#include "common/messaging/job_validation.h"

namespace moraine::messaging {

namespace {

using moraine::jobs::ShmRef;

std::string check_ref(const ShmRef& ref, std::uint64_t min_length, const JobLimits& limits,
                      const char* field) {
  const SegmentBounds* segment = nullptr;
  for (const SegmentBounds& s : limits.segments) {
    if (s.segment_id == ref.segment_id()) segment = &s;
  }
  if (segment == nullptr) {
    return std::string(field) + ": unknown segment id " + std::to_string(ref.segment_id());
  }
  // Written so that no sum can wrap: offset and length come from the wire.
  if (ref.length() > segment->bytes || ref.offset() > segment->bytes - ref.length()) {
    return std::string(field) + ": range [" + std::to_string(ref.offset()) + ", +" +
           std::to_string(ref.length()) + ") is outside segment " + std::to_string(ref.segment_id()) +
           " of " + std::to_string(segment->bytes) + " bytes";
  }
  if (ref.length() < min_length) {
    return std::string(field) + ": length " + std::to_string(ref.length()) + " is less than the " +
           std::to_string(min_length) + " bytes the job needs";
  }
  return {};
}

std::string check_shape(std::uint32_t layer, std::uint32_t n_tokens, std::uint32_t row_bytes,
                        const JobLimits& limits, const char* what) {
  if (layer >= limits.n_layers) {
    return std::string(what) + ".layer " + std::to_string(layer) + " is not below the layer count " +
           std::to_string(limits.n_layers);
  }
  if (n_tokens == 0 || n_tokens > limits.max_tokens) {
    return std::string(what) + ".n_tokens " + std::to_string(n_tokens) + " is outside [1, " +
           std::to_string(limits.max_tokens) + "]";
  }
  if (row_bytes == 0 || row_bytes > limits.max_row_bytes) {
    return std::string(what) + ".row_bytes " + std::to_string(row_bytes) + " is outside [1, " +
           std::to_string(limits.max_row_bytes) + "]";
  }
  return {};
}

std::string validate_layer_step(const moraine::jobs::LayerStep& step, const JobLimits& limits) {
  std::string error = check_shape(step.layer(), step.n_tokens(), step.row_bytes(), limits, "layer_step");
  if (!error.empty()) return error;
  const std::uint64_t rows_bytes = std::uint64_t{step.n_tokens()} * step.row_bytes();
  if (!(error = check_ref(step.activations(), rows_bytes, limits, "layer_step.activations")).empty()) return error;
  return check_ref(step.output(), rows_bytes, limits, "layer_step.output");
}

std::string validate_expert_jobs(const moraine::jobs::ExpertJobList& list, const JobLimits& limits) {
  std::string error = check_shape(list.layer(), list.n_tokens(), list.row_bytes(), limits, "expert_jobs");
  if (!error.empty()) return error;
  const std::uint64_t rows_bytes = std::uint64_t{list.n_tokens()} * list.row_bytes();
  if (!(error = check_ref(list.activations(), rows_bytes, limits, "expert_jobs.activations")).empty()) return error;
  if (!(error = check_ref(list.routing(), 1, limits, "expert_jobs.routing")).empty()) return error;
  if (!(error = check_ref(list.outputs(), 1, limits, "expert_jobs.outputs")).empty()) return error;
  if (list.jobs_size() == 0) return "expert_jobs: no jobs";
  const std::uint64_t outputs_bytes = list.outputs().length();
  for (int i = 0; i < list.jobs_size(); ++i) {
    const auto& job = list.jobs(i);
    const std::string where = "expert_jobs.jobs[" + std::to_string(i) + "]";
    if (job.expert_id() >= limits.n_experts) {
      return where + ".expert_id " + std::to_string(job.expert_id()) + " is not below the expert count " +
             std::to_string(limits.n_experts);
    }
    if (job.token_rows_size() == 0) return where + ": no token rows";
    for (int r = 0; r < job.token_rows_size(); ++r) {
      if (job.token_rows(r) >= list.n_tokens()) {
        return where + ".token_rows[" + std::to_string(r) + "] = " + std::to_string(job.token_rows(r)) +
               " is not below n_tokens " + std::to_string(list.n_tokens());
      }
    }
    // token_rows_size() <= INT_MAX and row_bytes < 2^32: the product fits in 64 bits.
    const std::uint64_t need = std::uint64_t(job.token_rows_size()) * list.row_bytes();
    if (need > outputs_bytes || job.output_offset() > outputs_bytes - need) {
      return where + ": output rows [" + std::to_string(job.output_offset()) + ", +" + std::to_string(need) +
             ") run past expert_jobs.outputs of " + std::to_string(outputs_bytes) + " bytes";
    }
  }
  return {};
}

std::string validate_read_jobs(const moraine::jobs::ReadJobList& list, const JobLimits& limits) {
  if (list.layer() >= limits.n_layers) {
    return "read_jobs.layer " + std::to_string(list.layer()) + " is not below the layer count " +
           std::to_string(limits.n_layers);
  }
  if (list.ranges_size() == 0) return "read_jobs: no ranges";
  for (int i = 0; i < list.ranges_size(); ++i) {
    const auto& range = list.ranges(i);
    const std::string where = "read_jobs.ranges[" + std::to_string(i) + "]";
    std::string error = check_ref(range.dest(), 1, limits, (where + ".dest").c_str());
    if (!error.empty()) return error;
    if (range.file_index() >= limits.file_bytes.size()) {
      return where + ".file_index " + std::to_string(range.file_index()) + " is not below the file count " +
             std::to_string(limits.file_bytes.size());
    }
    const std::uint64_t file = limits.file_bytes[range.file_index()];
    const std::uint64_t length = range.dest().length();
    if (length > file || range.file_offset() > file - length) {
      return where + ": file range [" + std::to_string(range.file_offset()) + ", +" + std::to_string(length) +
             ") runs past the end of file " + std::to_string(range.file_index()) + " of " + std::to_string(file) +
             " bytes";
    }
  }
  return {};
}

}  // namespace

std::string validate_job(const moraine::jobs::JobEnvelope& job, const JobLimits& limits) {
  switch (job.body_case()) {
    case moraine::jobs::JobEnvelope::kLayerStep: return validate_layer_step(job.layer_step(), limits);
    case moraine::jobs::JobEnvelope::kExpertJobs: return validate_expert_jobs(job.expert_jobs(), limits);
    case moraine::jobs::JobEnvelope::kPing: return {};
    case moraine::jobs::JobEnvelope::kReadJobs: return validate_read_jobs(job.read_jobs(), limits);
    case moraine::jobs::JobEnvelope::BODY_NOT_SET: break;
  }
  return "job descriptor has no body";
}

}  // namespace moraine::messaging
