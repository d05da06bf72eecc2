#include "providers/soft/gpu_staging.hpp"

#include <algorithm>

#include "core/log.hpp"

namespace stellar::provider::soft {

// ---- GpuShadow ----

Status GpuShadow::to_host(uint64_t offset, uint64_t length) {
  if (!length) return {};
  auto scope = gpu::ScopedDeviceContext::enter(*driver, ordinal);
  if (!scope) return scope.status();
  Status s = driver->check(driver->api().cuMemcpyDtoHAsync(host() + offset, device + offset, length, stream), "cuMemcpyDtoHAsync (soft provider staging)");
  const Status waited = driver->check(driver->api().cuStreamSynchronize(stream), "cuStreamSynchronize (soft provider staging)");
  return s.ok() ? waited : s;
}

Status GpuShadow::to_device_async(uint64_t offset, uint64_t length) {
  if (!length) return {};
  auto scope = gpu::ScopedDeviceContext::enter(*driver, ordinal);
  if (!scope) return scope.status();
  return driver->check(driver->api().cuMemcpyHtoDAsync(device + offset, host() + offset, length, stream), "cuMemcpyHtoDAsync (soft provider staging)");
}

Status GpuShadow::synchronize() {
  auto scope = gpu::ScopedDeviceContext::enter(*driver, ordinal);
  if (!scope) return scope.status();
  return driver->check(driver->api().cuStreamSynchronize(stream), "cuStreamSynchronize (soft provider staging)");
}

Status GpuShadow::to_device(uint64_t offset, uint64_t length) {
  if (!length) return {};
  Status s = to_device_async(offset, length);
  auto scope = gpu::ScopedDeviceContext::enter(*driver, ordinal);
  if (!scope) return scope.status();
  const Status waited = driver->check(driver->api().cuStreamSynchronize(stream), "cuStreamSynchronize (soft provider staging)");
  return s.ok() ? waited : s;
}

void GpuShadow::mark_dirty(uint64_t offset, uint64_t length) {
  if (!dirty.empty() && dirty.back().second >= offset && dirty.back().first <= offset + length) {
    dirty.back().first = std::min(dirty.back().first, offset);
    dirty.back().second = std::max(dirty.back().second, offset + length);
  } else {
    dirty.emplace_back(offset, offset + length);
  }
}

Status GpuShadow::flush() {
  Status result;
  for (auto [begin, end] : dirty)
    if (Status s = to_device(begin, end - begin); !s.ok() && result.ok()) result = s;
  dirty.clear();
  return result;
}

// ---- GpuCopies ----

bool GpuCopies::queue_copy(const StagedPart& copy) {
  const bool ok = copy.shadow->to_device_async(copy.offset, copy.length).ok();
  wait_on_stream(copy.shadow);
  return ok;
}

void GpuCopies::wait_on_stream(const std::shared_ptr<GpuShadow>& shadow) {
  keep.push_back(shadow);
  const bool seen = std::any_of(events.begin(), events.end(), [&](const auto& e) { return e.first->stream == shadow->stream; });
  if (!seen) events.emplace_back(shadow, nullptr);
}

bool GpuCopies::record_events() {
  bool ok = true;
  for (auto& [shadow, event] : events) {
    const gpu::CudaApi& api = shadow->driver->api();
    auto scope = gpu::ScopedDeviceContext::enter(*shadow->driver, shadow->ordinal);
    if (!scope) {
      ok = false;
      continue;
    }
    if (api.cuEventCreate(&event, gpu::CU_EVENT_DISABLE_TIMING) != gpu::CUDA_SUCCESS) {
      event = nullptr;
    } else if (api.cuEventRecord(event, shadow->stream) != gpu::CUDA_SUCCESS) {
      (void)api.cuEventDestroy(event);
      event = nullptr;
    }
    if (!event) {
      ok = false;
      (void)api.cuStreamSynchronize(shadow->stream);  // no event to wait on: wait now
    }
  }
  return ok;
}

bool GpuCopies::poll(bool wait, bool& failed) {
  for (auto& [shadow, event] : events) {
    if (!event) continue;
    auto scope = gpu::ScopedDeviceContext::enter(*shadow->driver, shadow->ordinal);
    const gpu::CUresult r = !scope ? gpu::CUDA_ERROR_NOT_INITIALIZED
                            : wait ? shadow->driver->api().cuEventSynchronize(event)
                                   : shadow->driver->api().cuEventQuery(event);
    if (r == gpu::CUDA_ERROR_NOT_READY) return false;
    if (r != gpu::CUDA_SUCCESS) {
      log().warn("soft provider: copy of a GPU destination failed: {}", shadow->driver->check(r, "cuEventQuery").to_string());
      failed = true;
    }
    if (scope) (void)shadow->driver->api().cuEventDestroy(event);
    event = nullptr;
  }
  return true;
}

// ---- GpuStaging ----

GpuStaging::GpuStaging()
    : cache_bytes_(std::make_shared<std::atomic<uint64_t>>(0)),
      cache_([bytes = cache_bytes_](std::shared_ptr<GpuShadow>&& shadow) { *bytes -= shadow->pinned.size(); }) {}

GpuStaging::~GpuStaging() {
  for (StagingJob& job : jobs_) drop(job);
  jobs_.clear();
  for (auto& [key, stream] : streams_) {
    auto scope = gpu::ScopedDeviceContext::enter(*key.first, key.second);
    if (scope) (void)key.first->api().cuStreamDestroy(stream);
  }
}

Result<ShadowUse> GpuStaging::shadow_for(const gpu::CudaDriver& driver, const gpu::PointerInfo& info, uint64_t addr, uint64_t length,
                                         std::mutex& lock) {
  // Shadows are keyed by page range: a registration's shadow covers its
  // pages (where they stay inside the CUDA allocation), so another buffer
  // in the same pages shares it. Pinned memory is allocated in pages anyway.
  const gpu::PageRange cover = gpu::page_cover_within(addr, length, info.allocation_start, info.allocation_size, gpu::host_page_size());
  const uint64_t cover_start = cover.start, cover_length = cover.length;
  std::optional<ShadowCache::Reference> use = cache_.lookup(addr, length);
  if (use && (use->handle()->buffer_id != info.buffer_id || use->handle()->driver != &driver)) {
    use.reset();  // that memory was freed and allocated again: its shadow is stale
    cache_.invalidate(cover_start, cover_length);
  }
  if (!use) {
    auto shadow = std::make_shared<GpuShadow>();
    shadow->driver = &driver;
    shadow->device = cover_start;
    shadow->ordinal = info.device_ordinal;
    shadow->buffer_id = info.buffer_id;
    {
      auto scope = gpu::ScopedDeviceContext::enter(driver, info.device_ordinal);
      if (!scope) return scope.status();
      auto pinned = gpu::PinnedBuffer::allocate(driver, cover_length);
      if (!pinned) return pinned.status();
      shadow->pinned = std::move(*pinned);
      std::lock_guard guard(lock);
      auto s = stream(*shadow);
      if (!s) return s.status();
      shadow->stream = *s;
    }
    // No copy now: every path that reads the shadow fills it first (a
    // source at post, a remote READ when it arrives), and every path that
    // writes it copies what it wrote to the device.
    if (*cache_bytes_ + cover_length > shadow_cache_bytes) cache_.flush();  // drop unused shadows
    *cache_bytes_ += cover_length;
    use = cache_.insert(cover_start, cover_length, std::move(shadow));
  }
  ShadowUse result;
  result.shadow = use->handle();
  result.offset = addr - result.shadow->device;
  result.use = std::make_shared<ShadowCache::Reference>(std::move(*use));
  return result;
}

Result<gpu::CUstream> GpuStaging::stream(const GpuShadow& shadow) {
  const auto key = std::make_pair(shadow.driver, shadow.ordinal);
  auto it = streams_.find(key);
  if (it != streams_.end()) return it->second;
  gpu::CUstream s = nullptr;
  if (Status st = shadow.driver->check(shadow.driver->api().cuStreamCreate(&s, gpu::CU_STREAM_NON_BLOCKING), "cuStreamCreate (soft provider staging)"); !st)
    return st;
  streams_.emplace(key, s);
  return s;
}

Status GpuStaging::start(StagingJob& job, const std::vector<StagedPart>& sources) {
  for (const StagedPart& part : sources) {
    GpuShadow& shadow = *part.shadow;
    const gpu::CudaApi& api = shadow.driver->api();
    auto scope = gpu::ScopedDeviceContext::enter(*shadow.driver, shadow.ordinal);
    if (!scope) {
      drop(job);
      return scope.status();
    }
    auto s = stream(shadow);
    if (!s) {
      drop(job);
      return s.status();
    }
    job.keep.push_back(part.shadow);
    for (uint64_t done = 0; done < part.length;) {
      const uint64_t n = std::min(staging_chunk_bytes, part.length - done);
      StagingChunk chunk{uint32_t(part.message_offset + done), uint32_t(part.message_offset + done + n), &shadow, nullptr};
      Status st = shadow.driver->check(api.cuMemcpyDtoHAsync(shadow.host() + part.offset + done, shadow.device + part.offset + done, n, *s),
                                       "cuMemcpyDtoHAsync (soft provider staging)");
      if (st) st = shadow.driver->check(api.cuEventCreate(&chunk.event, gpu::CU_EVENT_DISABLE_TIMING), "cuEventCreate");
      if (st) {
        job.chunks.push_back(chunk);
        st = shadow.driver->check(api.cuEventRecord(chunk.event, *s), "cuEventRecord");
      }
      if (!st) {
        (void)api.cuStreamSynchronize(*s);  // a copy may be queued without its event
        drop(job);
        return st;
      }
      done += n;
    }
  }
  return {};
}

bool GpuStaging::query(StagingJob& job) {
  while (job.next < job.chunks.size()) {
    StagingChunk& chunk = job.chunks[job.next];
    auto scope = gpu::ScopedDeviceContext::enter(*chunk.shadow->driver, chunk.shadow->ordinal);
    const gpu::CUresult r = scope ? chunk.shadow->driver->api().cuEventQuery(chunk.event) : gpu::CUDA_ERROR_NOT_INITIALIZED;
    if (r == gpu::CUDA_ERROR_NOT_READY) break;
    if (r != gpu::CUDA_SUCCESS) {
      log().warn("soft provider: staging copy of a GPU source failed: {}", chunk.shadow->driver->check(r, "cuEventQuery").to_string());
      return false;
    }
    (void)chunk.shadow->driver->api().cuEventDestroy(chunk.event);
    chunk.event = nullptr;
    ++job.next;
  }
  return true;
}

void GpuStaging::drop(StagingJob& job) {
  for (size_t k = job.next; k < job.chunks.size(); ++k) {
    StagingChunk& chunk = job.chunks[k];
    if (!chunk.event) continue;
    auto scope = gpu::ScopedDeviceContext::enter(*chunk.shadow->driver, chunk.shadow->ordinal);
    if (scope) {
      (void)chunk.shadow->driver->api().cuEventSynchronize(chunk.event);  // the copy writes memory `keep` holds
      (void)chunk.shadow->driver->api().cuEventDestroy(chunk.event);
    }
    chunk.event = nullptr;
  }
  job.next = job.chunks.size();
  job.keep.clear();
}

void GpuStaging::drop_owned_by(const void* owner) {
  for (size_t i = 0; i < jobs_.size();) {
    if (jobs_[i].owner != owner) {
      ++i;
      continue;
    }
    drop(jobs_[i]);
    jobs_.erase(jobs_.begin() + long(i));
  }
}

}  // namespace stellar::provider::soft
