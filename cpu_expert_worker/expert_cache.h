// One cpu_expert_worker's share of the FILE tier's host cache: its file-cache slots of the arena
// (ArenaLayout::cache_slot) and their directory entries (coordinator/expert_cache_directory.h).
// Which expert a slot holds is decided here, by heat: each FILE-tier expert's uses, halved every
// aging period, seeded from the census the placement read (so the first tokens keep what earlier
// runs used most). A miss evicts the coldest slot not in use (LFU); a read-ahead only takes a
// slot whose expert is no hotter than the one it reads with that read's use counted (an
// admission test: a wrong guess must not push out what is known to be hot). A worker owns its experts (expert_owner), so only it fills
// its slots; the directory makes every slot checkable by anyone mapping the arena.
#pragma once
#include <cstdint>
#include <vector>

#include "coordinator/census.h"
#include "coordinator/expert_cache_directory.h"

namespace moraine::cpu_worker {

class ExpertCache {
 public:
  // `dir` is this worker's part of the directory (one entry per slot it owns). Uses halve every
  // `aging_uses` touches; the census (empty: none) seeds up to kSeedHeat per layer's hottest.
  ExpertCache(group::CacheDirectory dir, std::int64_t n_layer, std::int64_t n_expert, const group::Census& seed,
              std::uint64_t aging_uses);

  // Takes over what the directory says (a restarted worker finds its predecessor's slots):
  // whole slots are cached again, a fill it died in is abandoned. Returns the slots kept.
  std::int64_t adopt();

  std::int64_t slots() const { return dir_.size(); }
  std::int64_t filled() const { return filled_; }
  void touch(std::int64_t il, std::int64_t e);     // one use of FILE-tier expert e of layer il
  double heat(std::int64_t il, std::int64_t e) const { return heat_[index(il, e)]; }

  // The slot holding (il, e) whole and its seqlock token, or slot -1.
  struct Found {
    std::int64_t slot = -1;
    std::uint64_t token = 0;
  };
  Found find(std::int64_t il, std::int64_t e) const;
  bool still_valid(const Found& f) const { return dir_.still_valid(f.slot, f.token); }
  // A slot to read (il, e) into: an empty one, else the coldest not pinned and not being filled;
  // for a read-ahead, only one whose expert's heat is at most (il, e)'s plus the use the read
  // expects. -1: none.
  std::int64_t victim(std::int64_t il, std::int64_t e, bool read_ahead) const;

  // Slot s is refilled with (il, e) (pinned until unpin_all: nothing evicts it before its use).
  void begin_fill(std::int64_t s, std::int64_t il, std::int64_t e);
  void end_fill(std::int64_t s);
  void abandon(std::int64_t s);
  bool filling(std::int64_t s) const { return filling_[static_cast<std::size_t>(s)] != 0; }
  bool holds_expert(std::int64_t s) const { return holds_[static_cast<std::size_t>(s)] >= 0; }
  // Forgets what slot s holds without touching the directory (its bytes were found refilled by
  // another writer: the directory is that writer's now).
  void drop(std::int64_t s) { forget(s); }
  void pin(std::int64_t s) { pinned_[static_cast<std::size_t>(s)] = 1; }
  void unpin_all();
  // Marks of a read-ahead fill: whether the slot's expert was used since it was read ahead.
  void mark_read_ahead(std::int64_t s) { read_ahead_[static_cast<std::size_t>(s)] = 1; }
  bool take_read_ahead(std::int64_t s);   // true once for a read-ahead slot, at its first use

  static constexpr double kSeedHeat = 8.0;

 private:
  std::size_t index(std::int64_t il, std::int64_t e) const { return static_cast<std::size_t>(il * n_expert_ + e); }
  void forget(std::int64_t s);   // the local index drops what slot s held

  group::CacheDirectory dir_;
  std::int64_t n_layer_, n_expert_;
  std::uint64_t aging_uses_, uses_ = 0;
  std::vector<double> heat_;           // [layer * n_expert + expert]
  std::vector<std::int32_t> where_;    // [layer * n_expert + expert]: slot holding it, -1
  std::vector<std::int64_t> holds_;    // [slot]: layer * n_expert + expert, -1
  std::vector<std::uint8_t> pinned_, filling_, read_ahead_;   // [slot]
  std::int64_t filled_ = 0;
};

}  // namespace moraine::cpu_worker
