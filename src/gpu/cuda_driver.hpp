// The CUDA driver API, loaded at run time (docs/design.md, principle 6): libstellar
// has no link-time CUDA dependency and runs where no GPU or driver exists.
// CudaDriver::load() dlopens libcuda.so.1 and resolves the few entry points
// GPU memory registration needs; the types and constants below carry the
// values of cuda.h (CUDA 12/13; they are ABI and do not change).
//
// On top of the table: is a pointer device memory (query_pointer), a dma-buf
// export of a device range for ibv_reg_dmabuf_mr (export_dmabuf), and pinned
// host staging buffers for the soft provider (PinnedBuffer). docs/gpu.md.
//
// Thread-safety: load() is thread-safe and loads each library once per
// process; the loaded CudaDriver is immutable and its entry points may be
// called from any thread (the CUDA driver API is thread-safe).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "stellar/status.hpp"

namespace stellar::gpu {

// ---- cuda.h types and values ----
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;  // CUdeviceptr_v2 on 64-bit hosts
struct CUctx_st;
using CUcontext = CUctx_st*;
struct CUstream_st;
using CUstream = CUstream_st*;
struct CUevent_st;
using CUevent = CUevent_st*;

inline constexpr CUresult CUDA_SUCCESS = 0;
inline constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
inline constexpr CUresult CUDA_ERROR_NOT_INITIALIZED = 3;
inline constexpr CUresult CUDA_ERROR_NO_DEVICE = 100;
inline constexpr CUresult CUDA_ERROR_NOT_READY = 600;  // cuEventQuery: the work before the event is still running
inline constexpr CUresult CUDA_ERROR_NOT_SUPPORTED = 801;

enum CUpointer_attribute : int {
  CU_POINTER_ATTRIBUTE_CONTEXT = 1,
  CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
  CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3,
  CU_POINTER_ATTRIBUTE_BUFFER_ID = 7,
  CU_POINTER_ATTRIBUTE_IS_MANAGED = 8,
  CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
  CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11,
  CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12,
};
enum CUmemorytype : int { CU_MEMORYTYPE_HOST = 1, CU_MEMORYTYPE_DEVICE = 2, CU_MEMORYTYPE_ARRAY = 3, CU_MEMORYTYPE_UNIFIED = 4 };
enum CUdevice_attribute : int {
  CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41,
  CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_SUPPORTED = 116,
  CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124,
};
enum CUmemRangeHandleType : int { CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 1 };
inline constexpr unsigned CU_MEMHOSTALLOC_PORTABLE = 0x01;
inline constexpr unsigned CU_STREAM_NON_BLOCKING = 0x01;
inline constexpr unsigned CU_EVENT_DISABLE_TIMING = 0x02;

// The resolved entry points. Names are the ABI symbols (cuMemcpyHtoD is
// exported as cuMemcpyHtoD_v2, and so on). All are non-null after a
// successful load except cuMemGetHandleForAddressRange, which drivers before
// CUDA 11.7 (R515) lack.
struct CudaApi {
  CUresult (*cuInit)(unsigned flags);
  CUresult (*cuDriverGetVersion)(int* version);
  CUresult (*cuGetErrorString)(CUresult, const char** text);
  CUresult (*cuDeviceGetCount)(int* count);
  CUresult (*cuDeviceGet)(CUdevice* device, int ordinal);
  CUresult (*cuDeviceGetAttribute)(int* value, CUdevice_attribute, CUdevice);
  CUresult (*cuPointerGetAttribute)(void* data, CUpointer_attribute, CUdeviceptr);
  CUresult (*cuPointerGetAttributes)(unsigned count, CUpointer_attribute* attributes, void** data, CUdeviceptr);
  CUresult (*cuMemGetHandleForAddressRange)(void* handle, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long flags);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);           // cuDevicePrimaryCtxRelease_v2
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxPushCurrent)(CUcontext);                   // cuCtxPushCurrent_v2
  CUresult (*cuCtxPopCurrent)(CUcontext*);                   // cuCtxPopCurrent_v2
  CUresult (*cuCtxSynchronize)();
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t);              // cuMemAlloc_v2
  CUresult (*cuMemFree)(CUdeviceptr);                        // cuMemFree_v2
  CUresult (*cuMemHostAlloc)(void**, size_t, unsigned flags);
  CUresult (*cuMemFreeHost)(void*);
  CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void*, size_t);  // cuMemcpyHtoD_v2
  CUresult (*cuMemcpyDtoH)(void*, CUdeviceptr, size_t);        // cuMemcpyDtoH_v2
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream);  // _v2
  CUresult (*cuMemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream);        // _v2
  CUresult (*cuStreamCreate)(CUstream*, unsigned flags);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuStreamDestroy)(CUstream);                     // cuStreamDestroy_v2
  CUresult (*cuEventCreate)(CUevent*, unsigned flags);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventQuery)(CUevent);                         // CUDA_SUCCESS or CUDA_ERROR_NOT_READY
  CUresult (*cuEventSynchronize)(CUevent);
  CUresult (*cuEventDestroy)(CUevent);                       // cuEventDestroy_v2
};

class CudaDriver {
 public:
  // The library load() opens when its argument is empty: $STELLAR_CUDA_LIBRARY
  // if set (tests point it at a fake or a missing name), else "libcuda.so.1".
  static std::string default_library();

  // dlopens `library` (a soname searched like dlopen does, or a path), resolves
  // the entry points and calls cuInit(0). The first successful load of a name
  // is kept for the process (never dlclosed: the driver's threads and atexit
  // handlers must not outlive its code), so pointers returned stay valid.
  // Failures are not cached, and say what is missing:
  //   no_device   the library is absent (the usual case without a GPU driver),
  //               or cuInit failed (no GPU, driver/library mismatch)
  //   unsupported a required entry point is missing
  static Result<const CudaDriver*> load(const std::string& library = {});

  const CudaApi& api() const { return api_; }
  const std::string& library() const { return library_; }
  int driver_version() const { return driver_version_; }  // e.g. 13000 for CUDA 13.0

  // Status::success() for CUDA_SUCCESS, else io_error (unsupported for
  // CUDA_ERROR_NOT_SUPPORTED) naming `what`, the code and cuGetErrorString's text.
  Status check(CUresult, const std::string& what) const;

 private:
  CudaDriver() = default;
  CudaApi api_{};
  std::string library_;
  int driver_version_ = 0;
};

// ---- Is this pointer GPU memory? ----
enum class MemoryKind {
  host,     // ordinary or CUDA-pinned host memory; also every pointer when CUDA is absent
  device,   // cuMemAlloc'd device memory: register with dma-buf / peer memory, or stage
  managed,  // cudaMallocManaged: migrates between host and device; treated as host by RDMA paths
};
const char* to_string(MemoryKind);

struct PointerInfo {
  MemoryKind kind = MemoryKind::host;
  int device_ordinal = -1;        // device memory: the GPU it lives on
  uint64_t allocation_start = 0;  // device memory: the allocation containing the pointer
  uint64_t allocation_size = 0;   // bytes
  uint64_t buffer_id = 0;         // process-unique id of the allocation; a new one after free + alloc
};

// CU_POINTER_ATTRIBUTE_MEMORY_TYPE and friends. Pointers CUDA does not know
// (malloc'd memory) are host. Fails only when the driver call itself fails.
Result<PointerInfo> query_pointer(const CudaDriver&, const void* pointer);

// The process's answer: loads the default library on first use (one attempt
// per library name, failures remembered) and says host for every pointer
// when CUDA is absent or the query fails. Thread-safe.
MemoryKind memory_kind(const void* pointer);

// ---- dma-buf export of device memory (for ibv_reg_dmabuf_mr) ----

// Owns a dma-buf file descriptor; closes it on destruction. Move-only.
class DmaBuf {
 public:
  DmaBuf() = default;
  DmaBuf(int fd, uint64_t start, uint64_t length, uint64_t offset) : fd_(fd), start_(start), length_(length), offset_(offset) {}
  DmaBuf(DmaBuf&& o) noexcept { *this = std::move(o); }
  DmaBuf& operator=(DmaBuf&&) noexcept;
  DmaBuf(const DmaBuf&) = delete;
  DmaBuf& operator=(const DmaBuf&) = delete;
  ~DmaBuf();
  int fd() const { return fd_; }
  uint64_t start() const { return start_; }    // page-aligned device address the fd begins at
  uint64_t length() const { return length_; }  // page-aligned bytes the fd covers
  // Where the requested address lies in the fd: ibv_reg_dmabuf_mr(pd, offset(),
  // requested length, iova = requested address, fd(), access).
  uint64_t offset() const { return offset_; }

 private:
  int fd_ = -1;
  uint64_t start_ = 0, length_ = 0, offset_ = 0;
};

// Rounds [address, address+length) out to host pages; the range must lie in
// one device allocation, on a GPU whose CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED
// is set. invalid_argument: not device memory, empty, or the rounded range
// leaves the allocation; unsupported: no dma-buf on this GPU or driver.
Result<DmaBuf> export_dmabuf(const CudaDriver&, const void* address, size_t length);

// [start, end) rounded out to multiples of `page` (a power of two).
struct PageRange {
  uint64_t start = 0, length = 0;
};
PageRange page_align(uint64_t address, uint64_t length, uint64_t page);
// What a registration cache keys a device range by: its pages when they lie
// inside the allocation [allocation_start, +allocation_size), so that other
// buffers in the same pages find the entry; else the range itself (pages
// past the allocation may belong to another one).
PageRange page_cover_within(uint64_t address, uint64_t length, uint64_t allocation_start, uint64_t allocation_size, uint64_t page);
uint64_t host_page_size();

// ---- staging for the soft provider: pinned host memory ----

// Page-locked host memory from cuMemHostAlloc (portable: usable with every
// context), the bounce buffer for copies between the wire and device memory.
// Frees with cuMemFreeHost on destruction. Move-only.
class PinnedBuffer {
 public:
  static Result<PinnedBuffer> allocate(const CudaDriver&, size_t bytes);
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& o) noexcept { *this = std::move(o); }
  PinnedBuffer& operator=(PinnedBuffer&&) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer();
  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const CudaDriver* driver_ = nullptr;
  void* data_ = nullptr;
  size_t size_ = 0;
};

// Makes the primary context of `device` current on the calling thread for the
// scope (cuDevicePrimaryCtxRetain + cuCtxPushCurrent) and restores the
// previous one on destruction. Copies and stream calls need a current context.
class ScopedDeviceContext {
 public:
  static Result<ScopedDeviceContext> enter(const CudaDriver&, int device_ordinal);
  ScopedDeviceContext(ScopedDeviceContext&& o) noexcept : driver_(o.driver_), device_(o.device_) { o.driver_ = nullptr; }
  ScopedDeviceContext& operator=(ScopedDeviceContext&&) = delete;
  ~ScopedDeviceContext();

 private:
  ScopedDeviceContext(const CudaDriver* d, CUdevice device) : driver_(d), device_(device) {}
  const CudaDriver* driver_ = nullptr;
  CUdevice device_ = 0;
};

// Synchronous copies between host and device memory through `staging`
// (pinned, so the DMA engine reads it directly) in chunks of staging.size().
// The caller's context must be current (ScopedDeviceContext).
Status copy_to_device(const CudaDriver&, CUdeviceptr destination, const void* source, size_t bytes, const PinnedBuffer& staging);
Status copy_from_device(const CudaDriver&, void* destination, CUdeviceptr source, size_t bytes, const PinnedBuffer& staging);

}  // namespace stellar::gpu
