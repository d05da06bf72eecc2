// GPU memory on the soft provider (docs/gpu.md): the engine works with the
// CPU, so a GPU region is read and written through a pinned host copy (the
// shadow), and the provider keeps the two in step at the points verbs
// semantics make observable. This unit holds the shadows, their cache, the
// staging streams (one per GPU), the pipelined staging of large sources and
// the GPU side of completions held for destination copies. It stays on the
// application side (it uses the CUDA driver wrapper of src/gpu); the engine
// host knows nothing of it.
//
// Not thread-safe unless said otherwise: used under the context mutex.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <atomic>
#include <utility>
#include <vector>

#include "core/registration_cache.hpp"
#include "gpu/cuda_driver.hpp"

namespace stellar::provider::soft {

// GPU memory registered on the soft provider: the engine reads and writes a
// pinned host copy (the shadow) of the region. Sources are copied device ->
// shadow when posted; local destinations shadow -> device when their
// completion is delivered; remote writes mark the shadow dirty and are
// copied to the device before the next receive completion (a receive implies
// earlier writes are in place); remote reads copy device -> shadow first.
// Sources of SEND/WRITE of at least staging_pipeline_bytes are copied
// asynchronously in chunks on a CUDA stream (StagingJob) and go on the wire
// chunk by chunk as the copies land; destinations of at least that size are
// copied asynchronously when the message has arrived and their completion is
// held until the copy is done (GpuCopies); the other copies wait for the
// copy engine.
//
// Every copy of a shadow, waited for or not, goes through one stream per
// GPU (`stream`): stream order is what keeps a READ served from the device
// behind the asynchronous copy of a receive that just landed there, and a
// source's device -> shadow copy behind it too.
struct GpuShadow : std::enable_shared_from_this<GpuShadow> {
  const gpu::CudaDriver* driver = nullptr;
  gpu::PinnedBuffer pinned;
  uint64_t device = 0;  // the device address the shadow starts at
  int ordinal = 0;
  uint64_t buffer_id = 0;  // CUDA's id of the allocation: a new one after free + alloc at the same address
  gpu::CUstream stream = nullptr;  // the context's staging stream for this GPU
  std::vector<std::pair<uint64_t, uint64_t>> dirty;  // [offset, end) written by peers, not yet on the device

  uint8_t* host() const { return static_cast<uint8_t*>(pinned.data()); }
  // Copies device -> shadow and waits.
  Status to_host(uint64_t offset, uint64_t length);
  // Queues the copy of [offset, offset + length) to the device on `stream`.
  Status to_device_async(uint64_t offset, uint64_t length);
  // Waits for every copy queued on the stream (this shadow's and others').
  Status synchronize();
  // Copies shadow -> device and waits.
  Status to_device(uint64_t offset, uint64_t length);
  void mark_dirty(uint64_t offset, uint64_t length);
  // Copies the dirty ranges to the device (and waits).
  Status flush();
};

// Pinned shadows outlive their memory regions in a per-context cache keyed
// by device range, so a framework that registers the same GPU buffer again
// (per step, per call) pays neither the pinning nor the allocation again.
// Keys are not cached: each registration has its own, dead at deregistration.
// A shadow is found again only for the allocation it was made for (same
// CUDA buffer id): memory freed and allocated again at the same address
// gets a new shadow. Unused shadows are dropped when the cache holds more
// than shadow_cache_bytes.
using ShadowCache = RegistrationCache<std::shared_ptr<GpuShadow>>;
constexpr uint64_t shadow_cache_bytes = uint64_t(1) << 30;

// One registration's view of a shadow.
struct ShadowUse {
  std::shared_ptr<GpuShadow> shadow;
  uint64_t offset = 0;  // the region's address - shadow->device (a cached shadow may start lower)
  std::shared_ptr<ShadowCache::Reference> use;  // this region's use of the cached shadow
};

// A part of a WR in a GPU region's shadow.
struct StagedPart {
  std::shared_ptr<GpuShadow> shadow;
  uint64_t offset;
  uint64_t length;
  uint64_t message_offset = 0;  // sources: where the part lies in the message
};

// Pipelined staging of one WR's GPU sources: device -> shadow copies queued
// on a CUDA stream in chunks of staging_chunk_bytes, each followed by an
// event. The WR is with the engine already (SendWork::staged); as events
// complete, the engine is told how many bytes landed (set_ready), so the
// copy of chunk k+1 overlaps the wire carrying chunk k, and post_send never
// waits for the copy engine.
constexpr uint64_t staging_pipeline_bytes = 64 * 1024;
constexpr uint64_t staging_chunk_bytes = 512 * 1024;
struct StagingChunk {
  uint32_t begin = 0, end = 0;  // message bytes the copy fills
  GpuShadow* shadow = nullptr;  // kept alive by StagingJob::keep
  gpu::CUevent event = nullptr;
};
struct StagingJob {
  const void* owner = nullptr;  // the QP that posted the WR
  uint64_t wr_id = 0;           // the engine's (the slot sequence)
  uint32_t total = 0;           // message bytes
  std::vector<StagingChunk> chunks;  // in message order
  size_t next = 0;              // first chunk whose event has not completed
  std::vector<std::shared_ptr<GpuShadow>> keep;  // the pinned memory the copies write
  uint32_t ready() const { return next < chunks.size() ? chunks[next].begin : total; }
};

// The GPU side of a completion whose destination copies still run on
// staging streams: one event per stream copied on (or waited for), and the
// pinned memory the copies read.
struct GpuCopies {
  std::vector<std::pair<std::shared_ptr<GpuShadow>, gpu::CUevent>> events;
  std::vector<std::shared_ptr<GpuShadow>> keep;

  // Puts a shadow -> device copy on its shadow's stream; false when it
  // could not be queued.
  bool queue_copy(const StagedPart& copy);
  // Adds a stream to wait for, without a copy.
  void wait_on_stream(const std::shared_ptr<GpuShadow>& shadow);
  // Records one event per stream after all of it. False when an event could
  // not be recorded: that stream is waited for at once.
  bool record_events();
  // True when every copy has completed (with `wait`: waits for them);
  // `failed` is set when one failed. Destroys the events it saw complete.
  bool poll(bool wait, bool& failed);
};

// One context's GPU staging: the shadow cache, the staging streams (one per
// GPU, made on first use) and the pipelined source copies in flight.
class GpuStaging {
 public:
  GpuStaging();
  ~GpuStaging();  // waits for the copies in flight, destroys the streams
  GpuStaging(const GpuStaging&) = delete;
  GpuStaging& operator=(const GpuStaging&) = delete;

  // The shadow of device memory [addr, addr + length) (from the cache, or
  // pinned now). Takes `lock` (the context mutex) only to find the stream.
  Result<ShadowUse> shadow_for(const gpu::CudaDriver&, const gpu::PointerInfo&, uint64_t addr, uint64_t length, std::mutex& lock);

  // Under the context mutex from here on.
  Result<gpu::CUstream> stream(const GpuShadow&);
  // Queues the copies of `sources` into `job`; on failure the job is dropped.
  Status start(StagingJob& job, const std::vector<StagedPart>& sources);
  void add(StagingJob&& job) { jobs_.push_back(std::move(job)); }
  bool empty() const { return jobs_.empty(); }
  // Advances jobs whose chunks landed: `advance(job, failed)` is called for
  // each job whose copies failed or made progress, with job.ready() the
  // bytes in place; it returns false when the WR is gone (the job is then
  // dropped). Finished jobs are dropped.
  template <typename F>
  void poll(F&& advance) {
    for (size_t i = 0; i < jobs_.size();) {
      StagingJob& job = jobs_[i];
      const uint32_t before = job.ready();
      const bool failed = !query(job);
      bool keep = !failed && job.next < job.chunks.size();
      if (failed || job.ready() != before) keep = advance(job, failed) && keep;
      if (keep) {
        ++i;
        continue;
      }
      drop(job);
      jobs_.erase(jobs_.begin() + long(i));
    }
  }
  // Waits for a job's copies and frees its events.
  static void drop(StagingJob& job);
  // Drops the jobs of `owner` (a QP being destroyed).
  void drop_owned_by(const void* owner);

 private:
  // Advances job.next past the chunks whose copies completed; false when one failed.
  static bool query(StagingJob& job);

  std::vector<StagingJob> jobs_;
  std::map<std::pair<const gpu::CudaDriver*, int>, gpu::CUstream> streams_;
  // GPU registrations' pinned shadows (ShadowCache); bytes of the cached ones.
  std::shared_ptr<std::atomic<uint64_t>> cache_bytes_;
  ShadowCache cache_;
};

}  // namespace stellar::provider::soft
