#pragma once
// Wire format of data-plane job descriptors: one ZeroMQ frame holding a serialised
// moraine.jobs.JobEnvelope (proto/jobs.proto).
//
// Why protobuf and not a fixed little-endian struct: an expert job list is variable-length
// (expert ids x token rows: 1 to 8 experts a token in decode, thousands of rows in a prefill
// chunk), which a fixed struct could only carry with a second hand-rolled layout and its own
// bounds checks; the parser already rejects malformed and truncated input (a length prefix that
// runs past the end fails), the schema is shared with the gRPC control plane, and fields can be
// added without breaking an older peer. It costs ~2% of a socket hop (0.76-1.4 us for a decode
// step's list against a 49-58 us ZeroMQ round trip; docs/perf-log.md#job-codec-cost). The per-layer
// hot path, where the hop itself matters, is the shared-memory doorbell (common/shm/doorbell.h).
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "proto/jobs.pb.h"

namespace moraine::messaging {

inline constexpr std::uint32_t kJobProtocolVersion = 1;
// Largest descriptor accepted: a prefill chunk of 8192 tokens x top-8 routing is 65536 row
// indices, at most 5 bytes each as varints (320 KiB); 1 MiB leaves room and caps what a bad peer
// can make us parse.
inline constexpr std::size_t kDefaultMaxJobBytes = std::size_t{1} << 20;

// Serialises into `out` (its capacity is reused between calls).
void encode_job(const moraine::jobs::JobEnvelope& job, std::string& out);

// Parses `bytes` into `out`. Returns an empty string on success, else a message saying what is
// wrong (oversized, not a JobEnvelope, wrong version). Structural only: ranges are checked by
// validate_job().
std::string decode_job(std::span<const std::byte> bytes, std::size_t max_bytes,
                       moraine::jobs::JobEnvelope& out);

std::string decode_reply(std::span<const std::byte> bytes, std::size_t max_bytes,
                         moraine::jobs::JobReply& out);

}  // namespace moraine::messaging
