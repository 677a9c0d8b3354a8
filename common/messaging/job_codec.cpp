#include "common/messaging/job_codec.h"

namespace moraine::messaging {

void encode_job(const moraine::jobs::JobEnvelope& job, std::string& out) {
  out.clear();
  job.SerializeToString(&out);
}

namespace {
template <typename Message>
std::string decode_message(std::span<const std::byte> bytes, std::size_t max_bytes, Message& out,
                           const char* what) {
  if (bytes.size() > max_bytes) {
    return std::string(what) + " of " + std::to_string(bytes.size()) + " bytes exceeds the limit of " +
           std::to_string(max_bytes) + " bytes";
  }
  if (bytes.size() > static_cast<std::size_t>(INT32_MAX)) return std::string(what) + " too large to parse";
  if (!out.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return std::string(what) + " of " + std::to_string(bytes.size()) +
           " bytes is malformed or truncated (protobuf parse failed)";
  }
  return {};
}
}  // namespace

std::string decode_job(std::span<const std::byte> bytes, std::size_t max_bytes,
                       moraine::jobs::JobEnvelope& out) {
  if (bytes.empty()) return "job descriptor is empty";
  std::string error = decode_message(bytes, max_bytes, out, "job descriptor");
  if (!error.empty()) return error;
  if (out.version() != kJobProtocolVersion) {
    return "job descriptor version " + std::to_string(out.version()) + ", expected " +
           std::to_string(kJobProtocolVersion);
  }
  if (out.body_case() == moraine::jobs::JobEnvelope::BODY_NOT_SET) {
    return "job descriptor seq " + std::to_string(out.seq()) + " has no body (truncated?)";
  }
  return {};
}

std::string decode_reply(std::span<const std::byte> bytes, std::size_t max_bytes,
                         moraine::jobs::JobReply& out) {
  std::string error = decode_message(bytes, max_bytes, out, "job reply");
  if (!error.empty()) return error;
  if (out.status() == moraine::jobs::JOB_STATUS_UNSPECIFIED) return "job reply has no status (truncated?)";
  return {};
}

}  // namespace moraine::messaging
