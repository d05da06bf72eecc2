// A stand-in for libcuda.so.1 that exports the driver entry points Stellar
// resolves, so the loader's success path, pointer queries, dma-buf export and
// staged copies run in tests on machines without a GPU. "Device memory" is
// one host buffer that cuMemAlloc hands out; copies are memcpy. fake_cuda_*
// functions let the test steer and observe it (dlsym them from the handle).
// Async copies run at once unless fake_cuda_set_deferred(1): then they queue
// on "the stream" and each cuEventQuery runs one of them, so a poller sees
// events complete one at a time, as a copy engine's would. With
// fake_cuda_set_deferred(2) the copy engine stalls: queued copies run only
// when someone synchronizes (stream or event) or the test runs them
// (fake_cuda_run_copies). Synchronous cuMemcpy* never
// wait for queued copies, as CUDA's legacy stream does not wait for a
// non-blocking one.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <vector>

using CUresult = int;
using CUdeviceptr = unsigned long long;

namespace {
constexpr size_t arena_size = 8 << 20;
alignas(65536) unsigned char arena[arena_size];  // the "device memory"
struct Allocation {
  size_t offset, size;
  unsigned long long id;
};
std::vector<Allocation> live;  // page-aligned bump allocation in the arena; reset when all are freed
size_t next_offset = 0;
unsigned long long buffer_id = 1;
int dmabuf_supported = 1;
int primary_retained = 0, streams = 0, pinned = 0, pinned_allocations = 0;
// Trivially destructible on purpose: a thread_local with a destructor in a
// dlopen'ed library left LeakSanitizer reading a stale dynamic-TLS entry at
// exit (the tracer crashed) in some environments.
struct ContextStack {
  void* items[64];
  int depth;
  bool empty() const { return depth == 0; }
  void* back() const { return items[depth - 1]; }
};
thread_local ContextStack context_stack;
CUdeviceptr last_export_start = 0;
size_t last_export_size = 0;
struct Copy {
  void* to;
  const void* from;
  size_t bytes;
};
int deferred = 0;
std::deque<Copy> queued;        // async copies not yet run (deferred mode)
unsigned long long done_copies = 0, queued_copies = 0;
int events = 0;
struct Event {
  unsigned long long after = 0;  // copies that must have run for the event to complete
};
void run_one() {
  if (queued.empty()) return;
  std::memcpy(queued.front().to, queued.front().from, queued.front().bytes);
  queued.pop_front();
  ++done_copies;
}
void run_all() {
  while (!queued.empty()) run_one();
}
CUresult async_copy(void* to, const void* from, size_t n) {
  ++queued_copies;
  queued.push_back(Copy{to, from, n});
  if (!deferred) run_all();
  return 0;
}

const Allocation* allocation_of(CUdeviceptr p) {
  const auto base = reinterpret_cast<uintptr_t>(arena);
  for (const Allocation& a : live)
    if (p >= base + a.offset && p < base + a.offset + a.size) return &a;
  return nullptr;
}
bool in_allocation(CUdeviceptr p) { return allocation_of(p) != nullptr; }
}  // namespace

extern "C" {
// ---- test controls ----
void fake_cuda_set_dmabuf_supported(int v) { dmabuf_supported = v; }
int fake_cuda_primary_retained() { return primary_retained; }
int fake_cuda_streams() { return streams; }
int fake_cuda_pinned() { return pinned; }
int fake_cuda_pinned_allocations() { return pinned_allocations; }  // ever made
int fake_cuda_context_depth() { return context_stack.depth; }
void fake_cuda_set_deferred(int v) {
  deferred = v;
  if (!v) run_all();
}
int fake_cuda_events() { return events; }
unsigned long long fake_cuda_async_copies() { return queued_copies; }
unsigned long long fake_cuda_pending_copies() { return queued.size(); }
void fake_cuda_run_copies(int n) {  // the stalled copy engine moves by n copies
  while (n-- > 0) run_one();
}
void fake_cuda_last_export(CUdeviceptr* start, size_t* size) { *start = last_export_start, *size = last_export_size; }

// ---- driver API ----
CUresult cuInit(unsigned) {
  const char* forced = std::getenv("FAKE_CUDA_INIT_RESULT");
  return forced ? std::atoi(forced) : 0;
}
CUresult cuDriverGetVersion(int* v) { *v = 13000; return 0; }
CUresult cuGetErrorString(CUresult r, const char** text) {
  *text = r == 100 ? "no CUDA-capable device is detected" : r == 1 ? "invalid argument" : "fake error";
  return 0;
}
CUresult cuDeviceGetCount(int* n) { *n = 1; return 0; }
CUresult cuDeviceGet(int* d, int ordinal) { if (ordinal != 0) return 101; *d = 0; return 0; }
CUresult cuDeviceGetAttribute(int* value, int attribute, int) {
  *value = attribute == 124 ? dmabuf_supported : attribute == 41 ? 1 : 0;
  return 0;
}
CUresult cuPointerGetAttribute(void* data, int attribute, CUdeviceptr p) {
  if (attribute != 2) return 1;
  if (!in_allocation(p)) return 1;  // like the real one: an error for unknown pointers
  *static_cast<unsigned*>(data) = 2;
  return 0;
}
CUresult cuPointerGetAttributes(unsigned count, int* attributes, void** data, CUdeviceptr p) {
  const bool device = in_allocation(p);
  for (unsigned i = 0; i < count; ++i) {
    switch (attributes[i]) {
      case 2: *static_cast<unsigned*>(data[i]) = device ? 2 : 0; break;
      case 9: *static_cast<int*>(data[i]) = device ? 0 : -1; break;
      case 11: *static_cast<CUdeviceptr*>(data[i]) = device ? reinterpret_cast<uintptr_t>(arena) + allocation_of(p)->offset : 0; break;
      case 12: *static_cast<size_t*>(data[i]) = device ? allocation_of(p)->size : 0; break;
      case 7: *static_cast<unsigned long long*>(data[i]) = device ? allocation_of(p)->id : 0; break;
      case 8: *static_cast<unsigned*>(data[i]) = 0; break;
      default: return 1;
    }
  }
  return 0;
}
CUresult cuMemGetHandleForAddressRange(void* handle, CUdeviceptr start, size_t size, int type, unsigned long long) {
  const auto page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  if (type != 1 || start % page || size % page || !in_allocation(start) || !in_allocation(start + size - 1)) return 1;
  last_export_start = start, last_export_size = size;
  const int fd = memfd_create("fake-dmabuf", MFD_CLOEXEC);
  if (fd < 0) return 999;
  *static_cast<int*>(handle) = fd;
  return 0;
}
CUresult cuDevicePrimaryCtxRetain(void** ctx, int) { ++primary_retained; *ctx = reinterpret_cast<void*>(0x10); return 0; }
CUresult cuDevicePrimaryCtxRelease_v2(int) { --primary_retained; return 0; }
CUresult cuCtxGetCurrent(void** ctx) { *ctx = context_stack.empty() ? nullptr : context_stack.back(); return 0; }
CUresult cuCtxSetCurrent(void* ctx) {
  if (context_stack.empty()) context_stack.depth = 1;
  context_stack.items[context_stack.depth - 1] = ctx;
  return 0;
}
CUresult cuCtxPushCurrent_v2(void* ctx) {
  if (context_stack.depth == 64) return 1;
  context_stack.items[context_stack.depth++] = ctx;
  return 0;
}
CUresult cuCtxPopCurrent_v2(void** ctx) {
  if (context_stack.empty()) return 201;
  if (ctx) *ctx = context_stack.back();
  --context_stack.depth;
  return 0;
}
CUresult cuCtxSynchronize() { return 0; }
CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
  if (live.empty()) next_offset = 0;  // so a free + alloc returns the same address, as drivers often do
  const size_t offset = (next_offset + 4095) / 4096 * 4096;
  if (bytes == 0 || bytes > arena_size - std::min(offset, arena_size)) return 2;  // out of memory
  live.push_back({offset, bytes, buffer_id++});
  next_offset = offset + bytes;
  *p = reinterpret_cast<uintptr_t>(arena) + offset;
  return 0;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
  for (size_t i = 0; i < live.size(); ++i)
    if (reinterpret_cast<uintptr_t>(arena) + live[i].offset == p) {
      live.erase(live.begin() + long(i));
      return 0;
    }
  return 1;
}
CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned) {
  *p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (!*p) return 2;
  ++pinned;
  ++pinned_allocations;
  return 0;
}
CUresult cuMemFreeHost(void* p) { std::free(p); --pinned; return 0; }
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* s, size_t n) { std::memcpy(reinterpret_cast<void*>(d), s, n); return 0; }
CUresult cuMemcpyDtoH_v2(void* d, CUdeviceptr s, size_t n) { std::memcpy(d, reinterpret_cast<void*>(s), n); return 0; }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* s, size_t n, void* stream) {
  if (!stream || !in_allocation(d) || !in_allocation(d + n - 1)) return 1;
  return async_copy(reinterpret_cast<void*>(d), s, n);
}
CUresult cuMemcpyDtoHAsync_v2(void* d, CUdeviceptr s, size_t n, void* stream) {
  if (!stream || !in_allocation(s) || !in_allocation(s + n - 1)) return 1;
  return async_copy(d, reinterpret_cast<const void*>(s), n);
}
CUresult cuStreamCreate(void** stream, unsigned) { ++streams; *stream = reinterpret_cast<void*>(0x20); return 0; }
CUresult cuStreamSynchronize(void*) {
  run_all();
  return 0;
}
CUresult cuEventCreate(void** event, unsigned) {
  ++events;
  *event = new Event;
  return 0;
}
CUresult cuEventRecord(void* event, void* stream) {
  if (!event || !stream) return 1;
  static_cast<Event*>(event)->after = queued_copies;
  return 0;
}
CUresult cuEventQuery(void* event) {
  Event* e = static_cast<Event*>(event);
  if (done_copies >= e->after) return 0;
  if (deferred == 2) return 600;  // stalled
  run_one();   // the copy engine moves on while the host polls:
  return 600;  // CUDA_ERROR_NOT_READY, seen done by the next query
}
CUresult cuEventSynchronize(void* event) {
  while (done_copies < static_cast<Event*>(event)->after) run_one();
  return 0;
}
CUresult cuEventDestroy_v2(void* event) {
  delete static_cast<Event*>(event);
  --events;
  return 0;
}
CUresult cuStreamDestroy_v2(void*) { --streams; return 0; }
}
