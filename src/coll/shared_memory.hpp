// The collectives' shared-memory channel between ranks on one host (as
// NCCL's SHM transport and UCX's posix transport do). Internal header.
//
// Every rank that allows it (CommunicatorOptions::shared_memory) owns one
// segment in /dev/shm (shm_open, mode 0600): a header, one ring block per
// possible sender, and its landing slots, laid out exactly as the network
// path's landing buffers (the same area is registered for RDMA WRITE, so a
// pair that cannot share memory falls back to its QPs with nothing else
// changed). A sender on the same host maps the receiver's segment and writes
// message m straight into slot m % slots, then publishes it:
//
//   receiver's segment, block for sender s (one cache line each):
//     posted    written by s: messages written so far (release)
//     flags     written by s: bye / abort / direct (it can write into the
//               receiver's own memory, below)
//     consumed  written by the receiver: messages it has consumed = credits
//     adverts   written by the receiver: where its output is, for s's
//               direct gather writes (two lines)
//     meta[k]   written by s before `posted`: immediate and length of slot k
//
// Single copy (as Open MPI's vader and UCX's cma do): a message can also go
// straight from the sender's buffer into the receiver's own memory with
// process_vm_writev(2), one copy by the kernel instead of one into the slot
// and one out of it; the slot then carries only the message's name and
// length, and its credit. The kernel allows it where the sender may ptrace
// the receiver (same user; not where Yama's ptrace_scope, a seccomp profile
// such as Docker's default, or a non-dumpable receiver forbid it), so
// open() probes it: it reads the owner's token at the address the header
// gives, through the pid the header gives, and writes the same value back.
// A pid that names another process (another PID namespace) fails the read's
// comparison before anything is written. The pairs that fail keep to slots.
//
// Each side rings the other's doorbell (a futex word in the segment's
// header) after publishing, and a waiting rank sleeps on its own doorbell:
// the wake-up costs a system call only when the receiver is asleep.
//
// Liveness: the owner holds an open-file-description lock on its segment
// for as long as it lives; a peer whose wait makes no progress asks the
// kernel whether the lock is still held, so a rank killed with -9 becomes an
// error on the others within milliseconds instead of at the timeout.
//
// Thread-safety: a segment is used by one communicator (one thread at a
// time) on each side; the words shared between processes are atomics.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "stellar/status.hpp"

namespace stellar::coll::detail {

// What every segment of a job looks like; both sides compute the layout
// from these, and open() checks the header against them.
struct SegmentShape {
  uint32_t world = 0;          // ranks in the job
  uint32_t slots = 0;          // landing slots per sender
  uint64_t chunk_bytes = 0;    // bytes per slot
  uint64_t landing_bytes() const { return uint64_t(slots) * chunk_bytes * (world - 1); }
};

// One sender's ring in the receiver's segment.
struct alignas(64) RingSenderLine {
  std::atomic<uint64_t> posted;
  std::atomic<uint32_t> flags;
};
struct alignas(64) RingReceiverLine {
  std::atomic<uint64_t> consumed;
};
// Where the receiver's output is for one call (direct gather): its address
// in the receiver's process, its length in bytes, and the call's tag.
struct alignas(64) RingAdvertLines {
  static constexpr uint32_t entries = 4;  // the sender is at most two calls behind (see communicator.cpp)
  std::atomic<uint64_t> posted;           // adverts written so far (release)
  std::atomic<uint64_t> address[entries];
  std::atomic<uint64_t> bytes[entries];
  std::atomic<uint32_t> tag[entries];
};
inline constexpr uint32_t ring_flag_bye = 1;
inline constexpr uint32_t ring_flag_abort = 2;
inline constexpr uint32_t ring_flag_direct = 4;  // the sender passed open()'s probe: it may write into the receiver's memory
// A message's meta word: imm << 32 | length, with this bit of the length set
// when the sender wrote its bytes into the receiver's memory, not the slot.
inline constexpr uint32_t ring_meta_direct = 0x80000000u;

class SharedSegment {
 public:
  // Creates this rank's segment (a fresh random name under /dev/shm),
  // zeroed, and takes its liveness lock. `tag` goes into the name so that
  // `ls /dev/shm` tells whose it is.
  static Result<std::unique_ptr<SharedSegment>> create(const SegmentShape&, const std::string& tag);
  // Maps a peer's segment. Fails (and the pair uses its QPs) when the name
  // is not a Stellar segment name, the file is missing (another /dev/shm:
  // another container), not a regular file of the expected size, or its
  // header disagrees with the shape or the token the peer published. Then,
  // with `probe_direct`, probes whether this process may write into the
  // owner's memory (direct_writable(); false without the probe).
  static Result<std::unique_ptr<SharedSegment>> open(const std::string& name, uint64_t token, const SegmentShape&, bool probe_direct = true);
  ~SharedSegment();
  SharedSegment(const SharedSegment&) = delete;
  SharedSegment& operator=(const SharedSegment&) = delete;

  // Removes the name (the mapping stays): once every peer has mapped it.
  // The destructor does it too when the owner never got that far.
  void unlink();

  const std::string& name() const { return name_; }
  uint64_t token() const { return token_; }
  uint8_t* landing() const { return base_ + header_bytes_; }
  uint64_t landing_bytes() const { return shape_.landing_bytes(); }
  // Landing slots of `sender` in this (the receiver `owner`'s) segment: the
  // same index the network path gives it.
  uint8_t* slots_of(int sender, int owner) const {
    return landing() + uint64_t(sender < owner ? sender : sender - 1) * shape_.slots * shape_.chunk_bytes;
  }

  RingSenderLine& sender_line(int sender) const;
  RingReceiverLine& receiver_line(int sender) const;
  RingAdvertLines& advert_lines(int sender) const;
  std::atomic<uint64_t>& meta(int sender, uint64_t message) const;  // imm << 32 | length of slot message % slots

  // The owner's doorbell: its value now, a ring by a peer, and the owner's
  // sleep until it differs from `seen` (or `timeout` passes).
  uint32_t doorbell() const;
  void ring_doorbell() const;
  void sleep_on_doorbell(uint32_t seen, std::chrono::microseconds timeout) const;

  // Whether the owner still holds its liveness lock (alive and its
  // communicator not destroyed). Meant for a peer's mapping; a system call.
  bool owner_alive() const;

  // Whether open()'s probe found that this process may write into the
  // owner's memory; false for the owner's own mapping.
  bool direct_writable() const { return direct_writable_; }
  // Copies `bytes` from `source` (this process) to `address` in the owner's
  // process, the whole of it or an error: permission_denied when the kernel
  // refuses this process the call (nothing was written), io_error when the
  // owner is gone, invalid_argument when the range is not the owner's
  // writable memory. Only where direct_writable().
  Status write_into_owner(uint64_t address, const void* source, size_t bytes) const;

 private:
  SharedSegment() = default;
  uint8_t* block(int sender) const;

  std::string name_;
  uint64_t token_ = 0;
  SegmentShape shape_;
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  size_t mapped_bytes_ = 0;
  size_t header_bytes_ = 0;
  size_t block_bytes_ = 0;
  bool owner_ = false;
  bool linked_ = false;
  bool direct_writable_ = false;
  int owner_pid_ = 0;  // from the header: the owner's process id as it wrote it
};

// The shape of a valid segment name (what open() accepts from a hello).
bool valid_segment_name(const std::string&);

}  // namespace stellar::coll::detail
