// CUDA driver API through dlopen; see cuda_driver.hpp.
#include "gpu/cuda_driver.hpp"

#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <utility>
#include <memory>
#include <mutex>

#include "core/config.hpp"
#include "core/log.hpp"

namespace stellar::gpu {

std::string CudaDriver::default_library() {
  return config::text("STELLAR_CUDA_LIBRARY").value_or("libcuda.so.1");
}

namespace {

template <typename F>
bool resolve(void* library, const char* symbol, F& out) {
  out = reinterpret_cast<F>(dlsym(library, symbol));
  return out != nullptr;
}

std::mutex loaded_mutex;
// Loaded drivers by library name, for the life of the process (see load()).
std::map<std::string, std::unique_ptr<CudaDriver>>& loaded() {
  static auto* drivers = new std::map<std::string, std::unique_ptr<CudaDriver>>();  // never destroyed: users may run at exit
  return *drivers;
}

}  // namespace

Result<const CudaDriver*> CudaDriver::load(const std::string& requested) {
  const std::string name = requested.empty() ? default_library() : requested;
  // One lock over the whole load: cuInit is not to be raced by a second dlopen
  // of the same library, and loading happens once per process anyway.
  std::lock_guard lock(loaded_mutex);
  if (auto it = loaded().find(name); it != loaded().end()) return static_cast<const CudaDriver*>(it->second.get());

  void* library = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!library) {
    const char* error = dlerror();
    return Status(Errc::no_device, "CUDA driver not available: cannot load " + name + " (" + (error ? error : "dlopen failed") +
                                       "); GPU memory is unsupported, host memory works");
  }
  std::unique_ptr<CudaDriver> driver(new CudaDriver());
  driver->library_ = name;
  CudaApi& a = driver->api_;
  std::string missing;
  auto need = [&](const char* symbol, auto& out) {
    if (!resolve(library, symbol, out)) missing += std::string(missing.empty() ? "" : ", ") + symbol;
  };
  need("cuInit", a.cuInit);
  need("cuDriverGetVersion", a.cuDriverGetVersion);
  need("cuGetErrorString", a.cuGetErrorString);
  need("cuDeviceGetCount", a.cuDeviceGetCount);
  need("cuDeviceGet", a.cuDeviceGet);
  need("cuDeviceGetAttribute", a.cuDeviceGetAttribute);
  need("cuPointerGetAttribute", a.cuPointerGetAttribute);
  need("cuPointerGetAttributes", a.cuPointerGetAttributes);
  need("cuDevicePrimaryCtxRetain", a.cuDevicePrimaryCtxRetain);
  need("cuDevicePrimaryCtxRelease_v2", a.cuDevicePrimaryCtxRelease);
  need("cuCtxGetCurrent", a.cuCtxGetCurrent);
  need("cuCtxSetCurrent", a.cuCtxSetCurrent);
  need("cuCtxPushCurrent_v2", a.cuCtxPushCurrent);
  need("cuCtxPopCurrent_v2", a.cuCtxPopCurrent);
  need("cuCtxSynchronize", a.cuCtxSynchronize);
  need("cuMemAlloc_v2", a.cuMemAlloc);
  need("cuMemFree_v2", a.cuMemFree);
  need("cuMemHostAlloc", a.cuMemHostAlloc);
  need("cuMemFreeHost", a.cuMemFreeHost);
  need("cuMemcpyHtoD_v2", a.cuMemcpyHtoD);
  need("cuMemcpyDtoH_v2", a.cuMemcpyDtoH);
  need("cuMemcpyHtoDAsync_v2", a.cuMemcpyHtoDAsync);
  need("cuMemcpyDtoHAsync_v2", a.cuMemcpyDtoHAsync);
  need("cuStreamCreate", a.cuStreamCreate);
  need("cuStreamSynchronize", a.cuStreamSynchronize);
  need("cuStreamDestroy_v2", a.cuStreamDestroy);
  need("cuEventCreate", a.cuEventCreate);
  need("cuEventRecord", a.cuEventRecord);
  need("cuEventQuery", a.cuEventQuery);
  need("cuEventSynchronize", a.cuEventSynchronize);
  need("cuEventDestroy_v2", a.cuEventDestroy);
  resolve(library, "cuMemGetHandleForAddressRange", a.cuMemGetHandleForAddressRange);  // optional: R515+
  if (!missing.empty()) {
    dlclose(library);  // nothing of it ran yet, so unloading is safe here
    return Status(Errc::unsupported, name + " is not a usable CUDA driver: it lacks " + missing);
  }
  if (CUresult r = a.cuInit(0); r != CUDA_SUCCESS) {
    Status s = driver->check(r, "cuInit");
    // Keep the library mapped: cuInit may have started threads.
    return Status(Errc::no_device, "CUDA driver " + name + " present but unusable: " + s.message());
  }
  if (a.cuDriverGetVersion(&driver->driver_version_) != CUDA_SUCCESS) driver->driver_version_ = 0;
  log().info("CUDA driver {} loaded (version {})", name, driver->driver_version_);
  const CudaDriver* out = driver.get();
  loaded().emplace(name, std::move(driver));
  return out;
}

Status CudaDriver::check(CUresult result, const std::string& what) const {
  if (result == CUDA_SUCCESS) return Status::success();
  const char* text = nullptr;
  if (!api_.cuGetErrorString || api_.cuGetErrorString(result, &text) != CUDA_SUCCESS || !text) text = "unknown error";
  return Status(result == CUDA_ERROR_NOT_SUPPORTED ? Errc::unsupported : Errc::io_error,
                what + " failed: CUDA error " + std::to_string(result) + " (" + text + ")");
}

const char* to_string(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::host: return "host";
    case MemoryKind::device: return "device";
    case MemoryKind::managed: return "managed";
  }
  return "?";
}

Result<PointerInfo> query_pointer(const CudaDriver& driver, const void* pointer) {
  // cuPointerGetAttributes, unlike cuPointerGetAttribute, succeeds for
  // pointers CUDA does not know and leaves their attributes zero.
  unsigned memory_type = 0;
  int ordinal = -1;
  CUdeviceptr start = 0;
  size_t size = 0;
  unsigned long long buffer_id = 0;
  unsigned managed = 0;
  CUpointer_attribute attributes[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                      CU_POINTER_ATTRIBUTE_RANGE_SIZE, CU_POINTER_ATTRIBUTE_BUFFER_ID, CU_POINTER_ATTRIBUTE_IS_MANAGED};
  void* data[] = {&memory_type, &ordinal, &start, &size, &buffer_id, &managed};
  const auto address = static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(pointer));
  if (Status s = driver.check(driver.api().cuPointerGetAttributes(6, attributes, data, address), "cuPointerGetAttributes"); !s) return s;
  PointerInfo info;
  if (managed)
    info.kind = MemoryKind::managed;
  else if (memory_type == CU_MEMORYTYPE_DEVICE)
    info.kind = MemoryKind::device;
  if (info.kind != MemoryKind::host) {
    info.device_ordinal = ordinal;
    info.allocation_start = start;
    info.allocation_size = size;
    info.buffer_id = buffer_id;
  }
  return info;
}

MemoryKind memory_kind(const void* pointer) {
  // Remember failed loads too: this runs per registration, and a failing
  // dlopen searches the library path every time. Keyed by name so a changed
  // STELLAR_CUDA_LIBRARY is honoured.
  static std::mutex mutex;
  static auto* attempted = new std::map<std::string, const CudaDriver*>();  // nullptr: not loadable
  const CudaDriver* driver = nullptr;
  {
    const std::string name = CudaDriver::default_library();
    std::lock_guard lock(mutex);
    auto it = attempted->find(name);
    if (it == attempted->end()) {
      auto loaded = CudaDriver::load(name);
      it = attempted->emplace(name, loaded ? *loaded : nullptr).first;
    }
    driver = it->second;
  }
  if (!driver) return MemoryKind::host;
  auto info = query_pointer(*driver, pointer);
  return info ? info->kind : MemoryKind::host;
}

uint64_t host_page_size() {
  static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return page;
}

PageRange page_align(uint64_t address, uint64_t length, uint64_t page) {
  const uint64_t start = address & ~(page - 1);
  const uint64_t end = (address + length + page - 1) & ~(page - 1);
  return {start, end - start};
}

PageRange page_cover_within(uint64_t address, uint64_t length, uint64_t allocation_start, uint64_t allocation_size, uint64_t page) {
  const PageRange pages = page_align(address, length, page);
  if (pages.start >= allocation_start && pages.start + pages.length <= allocation_start + allocation_size) return pages;
  return {address, length};
}

DmaBuf& DmaBuf::operator=(DmaBuf&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(o.fd_, -1);
    start_ = o.start_, length_ = o.length_, offset_ = o.offset_;
  }
  return *this;
}

DmaBuf::~DmaBuf() {
  if (fd_ >= 0) ::close(fd_);
}

Result<DmaBuf> export_dmabuf(const CudaDriver& driver, const void* address, size_t length) {
  const CudaApi& api = driver.api();
  if (length == 0) return Status(Errc::invalid_argument, "dma-buf export of an empty range");
  auto info = query_pointer(driver, address);
  if (!info) return info.status();
  if (info->kind != MemoryKind::device)
    return Status(Errc::invalid_argument, std::string("dma-buf export needs device memory, the pointer is ") + to_string(info->kind) + " memory");
  if (!api.cuMemGetHandleForAddressRange)
    return Status(Errc::unsupported, "the CUDA driver lacks cuMemGetHandleForAddressRange (dma-buf needs driver R515 / CUDA 11.7 or newer)");
  CUdevice device = 0;
  if (Status s = driver.check(api.cuDeviceGet(&device, info->device_ordinal), "cuDeviceGet"); !s) return s;
  int supported = 0;
  if (Status s = driver.check(api.cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, device), "cuDeviceGetAttribute(DMA_BUF_SUPPORTED)"); !s)
    return s;
  if (!supported)
    return Status(Errc::unsupported, "GPU " + std::to_string(info->device_ordinal) +
                                         " does not support dma-buf (needs the open kernel modules and Linux >= 5.12); use nvidia-peermem");

  // cuMemGetHandleForAddressRange wants host-page-aligned ranges. The rounded
  // range must stay inside the allocation: pages beyond it may belong to
  // another allocation (or none), and exporting those would be wrong.
  const auto requested = static_cast<uint64_t>(reinterpret_cast<uintptr_t>(address));
  const PageRange range = page_align(requested, length, host_page_size());
  const PageRange allocation = page_align(info->allocation_start, info->allocation_size, host_page_size());
  if (range.start < allocation.start || range.start + range.length > allocation.start + allocation.length)
    return Status(Errc::invalid_argument, "dma-buf export range leaves its device allocation (" + std::to_string(info->allocation_size) + " bytes)");

  int fd = -1;
  if (Status s = driver.check(api.cuMemGetHandleForAddressRange(&fd, range.start, range.length, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0),
                              "cuMemGetHandleForAddressRange(DMA_BUF_FD)");
      !s)
    return s;
  return DmaBuf(fd, range.start, range.length, requested - range.start);
}

Result<PinnedBuffer> PinnedBuffer::allocate(const CudaDriver& driver, size_t bytes) {
  if (bytes == 0) return Status(Errc::invalid_argument, "pinned buffer of 0 bytes");
  void* data = nullptr;
  if (Status s = driver.check(driver.api().cuMemHostAlloc(&data, bytes, CU_MEMHOSTALLOC_PORTABLE), "cuMemHostAlloc"); !s) return s;
  PinnedBuffer b;
  b.driver_ = &driver;
  b.data_ = data;
  b.size_ = bytes;
  return b;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    if (data_) driver_->api().cuMemFreeHost(data_);
    driver_ = std::exchange(o.driver_, nullptr);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() {
  if (data_) driver_->api().cuMemFreeHost(data_);
}

Result<ScopedDeviceContext> ScopedDeviceContext::enter(const CudaDriver& driver, int ordinal) {
  const CudaApi& api = driver.api();
  CUdevice device = 0;
  if (Status s = driver.check(api.cuDeviceGet(&device, ordinal), "cuDeviceGet"); !s) return s;
  CUcontext context = nullptr;
  if (Status s = driver.check(api.cuDevicePrimaryCtxRetain(&context, device), "cuDevicePrimaryCtxRetain"); !s) return s;
  if (Status s = driver.check(api.cuCtxPushCurrent(context), "cuCtxPushCurrent"); !s) {
    api.cuDevicePrimaryCtxRelease(device);
    return s;
  }
  return ScopedDeviceContext(&driver, device);
}

ScopedDeviceContext::~ScopedDeviceContext() {
  if (!driver_) return;
  CUcontext popped = nullptr;
  driver_->api().cuCtxPopCurrent(&popped);
  driver_->api().cuDevicePrimaryCtxRelease(device_);
}

namespace {

// Copies in staging-sized chunks on a private stream: the user's memory is
// pageable, so it goes through the pinned buffer, which the copy engine can
// read and write without the driver bouncing it again.
Status staged_copy(const CudaDriver& driver, bool to_device, CUdeviceptr device, void* host, size_t bytes, const PinnedBuffer& staging) {
  const CudaApi& api = driver.api();
  if (bytes && (!staging.data() || staging.size() == 0)) return Status(Errc::invalid_argument, "staged copy without a staging buffer");
  CUstream stream = nullptr;
  if (Status s = driver.check(api.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate"); !s) return s;
  Status result;
  for (size_t done = 0; done < bytes && result.ok();) {
    const size_t chunk = std::min(bytes - done, staging.size());
    auto* h = static_cast<unsigned char*>(host) + done;
    if (to_device) {
      std::memcpy(staging.data(), h, chunk);
      result = driver.check(api.cuMemcpyHtoDAsync(device + done, staging.data(), chunk, stream), "cuMemcpyHtoDAsync");
      if (result) result = driver.check(api.cuStreamSynchronize(stream), "cuStreamSynchronize");
    } else {
      result = driver.check(api.cuMemcpyDtoHAsync(staging.data(), device + done, chunk, stream), "cuMemcpyDtoHAsync");
      if (result) result = driver.check(api.cuStreamSynchronize(stream), "cuStreamSynchronize");
      if (result) std::memcpy(h, staging.data(), chunk);
    }
    done += chunk;
  }
  api.cuStreamDestroy(stream);
  return result;
}

}  // namespace

Status copy_to_device(const CudaDriver& driver, CUdeviceptr destination, const void* source, size_t bytes, const PinnedBuffer& staging) {
  return staged_copy(driver, true, destination, const_cast<void*>(source), bytes, staging);
}

Status copy_from_device(const CudaDriver& driver, void* destination, CUdeviceptr source, size_t bytes, const PinnedBuffer& staging) {
  return staged_copy(driver, false, source, destination, bytes, staging);
}

}  // namespace stellar::gpu
