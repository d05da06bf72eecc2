// The CUDA driver loader and GPU memory helpers (src/gpu): against a missing
// library, a library that is not a driver, and a fake libcuda built with the
// tests (fake_libcuda.cpp), which exercises the success paths without a GPU.
// The RealGpu tests run only where a CUDA driver and a GPU exist.
#include "gpu/cuda_driver.hpp"

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <optional>
#include <vector>

using namespace stellar;
using namespace stellar::gpu;

namespace {

bool contains(const std::string& haystack, const std::string& needle) { return haystack.find(needle) != std::string::npos; }

// Sets an environment variable for the scope, restoring the old value.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    value ? ::setenv(name, value, 1) : ::unsetenv(name);
  }
  ~ScopedEnv() { old_ ? ::setenv(name_, old_->c_str(), 1) : ::unsetenv(name_); }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

const CudaDriver& fake() {
  auto d = CudaDriver::load(FAKE_LIBCUDA_PATH);
  EXPECT_TRUE(d.ok()) << d.status().to_string();
  return **d;
}

template <typename F>
F fake_control(const char* name) {
  void* handle = dlopen(FAKE_LIBCUDA_PATH, RTLD_NOW | RTLD_NOLOAD);
  EXPECT_NE(handle, nullptr);
  auto f = reinterpret_cast<F>(dlsym(handle, name));
  dlclose(handle);  // drops only the reference RTLD_NOLOAD took
  EXPECT_NE(f, nullptr) << name;
  return f;
}

}  // namespace

TEST(CudaDriver, MissingLibraryFailsCleanly) {
  auto d = CudaDriver::load("libstellar-test-no-such-cuda.so.1");
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), Errc::no_device);
  EXPECT_TRUE(contains(d.status().message(), "cannot load libstellar-test-no-such-cuda.so.1"));
}

TEST(CudaDriver, LibraryNameFromEnvironment) {
  ScopedEnv env("STELLAR_CUDA_LIBRARY", "libstellar-test-absent-cuda.so.1");
  EXPECT_EQ(CudaDriver::default_library(), "libstellar-test-absent-cuda.so.1");
  auto d = CudaDriver::load();
  ASSERT_FALSE(d.ok());
  EXPECT_TRUE(contains(d.status().message(), "libstellar-test-absent-cuda.so.1"));
  int on_stack = 0;
  EXPECT_EQ(memory_kind(&on_stack), MemoryKind::host);  // CUDA absent: everything is host memory
}

TEST(CudaDriver, DefaultLibraryIsLibcuda) {
  ScopedEnv env("STELLAR_CUDA_LIBRARY", nullptr);
  EXPECT_EQ(CudaDriver::default_library(), "libcuda.so.1");
}

TEST(CudaDriver, LibraryWithoutDriverSymbolsIsRejected) {
  auto d = CudaDriver::load("libz.so.1");
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), Errc::unsupported);
  EXPECT_TRUE(contains(d.status().message(), "lacks cuInit"));
}

TEST(CudaDriver, CuInitFailureIsNoDevice) {
  // A second name for the fake, so the loader does not answer from its cache.
  const auto link = std::filesystem::temp_directory_path() / ("libcuda-initfail-" + std::to_string(::getpid()) + ".so");
  std::filesystem::remove(link);
  std::filesystem::create_symlink(FAKE_LIBCUDA_PATH, link);
  ScopedEnv env("FAKE_CUDA_INIT_RESULT", "100");
  auto d = CudaDriver::load(link.string());
  std::filesystem::remove(link);
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), Errc::no_device);
  EXPECT_TRUE(contains(d.status().message(), "cuInit failed: CUDA error 100 (no CUDA-capable device is detected)"));
}

TEST(CudaDriver, FakeDriverLoadsOnce) {
  auto a = CudaDriver::load(FAKE_LIBCUDA_PATH);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  auto b = CudaDriver::load(FAKE_LIBCUDA_PATH);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(*a, *b);
  EXPECT_EQ((*a)->driver_version(), 13000);
  EXPECT_NE((*a)->api().cuMemGetHandleForAddressRange, nullptr);
  const Status s = (*a)->check(1, "cuSomething");
  EXPECT_EQ(s.code(), Errc::io_error);
  EXPECT_TRUE(contains(s.message(), "cuSomething failed: CUDA error 1 (invalid argument)"));
  EXPECT_EQ((*a)->check(801, "x").code(), Errc::unsupported);
}

TEST(CudaDriver, PointerQueries) {
  const CudaDriver& d = fake();
  int on_stack = 0;
  auto host = query_pointer(d, &on_stack);
  ASSERT_TRUE(host.ok());
  EXPECT_EQ(host->kind, MemoryKind::host);

  CUdeviceptr p = 0;
  ASSERT_EQ(d.api().cuMemAlloc(&p, 3 * 4096), CUDA_SUCCESS);
  auto device = query_pointer(d, reinterpret_cast<void*>(p + 100));
  ASSERT_TRUE(device.ok());
  EXPECT_EQ(device->kind, MemoryKind::device);
  EXPECT_EQ(device->device_ordinal, 0);
  EXPECT_EQ(device->allocation_start, p);
  EXPECT_EQ(device->allocation_size, 3u * 4096);
  const uint64_t first_id = device->buffer_id;
  ASSERT_EQ(d.api().cuMemFree(p), CUDA_SUCCESS);
  EXPECT_EQ(query_pointer(d, reinterpret_cast<void*>(p))->kind, MemoryKind::host);  // freed
  ASSERT_EQ(d.api().cuMemAlloc(&p, 4096), CUDA_SUCCESS);
  EXPECT_NE(query_pointer(d, reinterpret_cast<void*>(p))->buffer_id, first_id);  // same address, new allocation
  ASSERT_EQ(d.api().cuMemFree(p), CUDA_SUCCESS);
}

TEST(CudaDriver, DmaBufExportIsPageAligned) {
  const CudaDriver& d = fake();
  const uint64_t page = host_page_size();
  CUdeviceptr p = 0;
  ASSERT_EQ(d.api().cuMemAlloc(&p, 4 * page), CUDA_SUCCESS);
  {
    auto buf = export_dmabuf(d, reinterpret_cast<void*>(p + page + 10), page);  // straddles pages 1 and 2
    ASSERT_TRUE(buf.ok()) << buf.status().to_string();
    EXPECT_GE(buf->fd(), 0);
    EXPECT_EQ(buf->start(), p + page);
    EXPECT_EQ(buf->length(), 2 * page);
    EXPECT_EQ(buf->offset(), 10u);
    CUdeviceptr start = 0;
    size_t size = 0;
    fake_control<void (*)(CUdeviceptr*, size_t*)>("fake_cuda_last_export")(&start, &size);
    EXPECT_EQ(start, p + page);
    EXPECT_EQ(size, 2 * page);
    const int fd = buf->fd();
    DmaBuf moved = std::move(*buf);
    EXPECT_EQ(moved.fd(), fd);
    EXPECT_EQ(buf->fd(), -1);
  }

  auto beyond = export_dmabuf(d, reinterpret_cast<void*>(p + 3 * page), page + 1);
  EXPECT_EQ(beyond.status().code(), Errc::invalid_argument);
  int on_stack = 0;
  EXPECT_EQ(export_dmabuf(d, &on_stack, 4).status().code(), Errc::invalid_argument);
  EXPECT_EQ(export_dmabuf(d, reinterpret_cast<void*>(p), 0).status().code(), Errc::invalid_argument);

  fake_control<void (*)(int)>("fake_cuda_set_dmabuf_supported")(0);
  auto unsupported = export_dmabuf(d, reinterpret_cast<void*>(p), page);
  fake_control<void (*)(int)>("fake_cuda_set_dmabuf_supported")(1);
  EXPECT_EQ(unsupported.status().code(), Errc::unsupported);
  EXPECT_TRUE(contains(unsupported.status().message(), "nvidia-peermem"));
  ASSERT_EQ(d.api().cuMemFree(p), CUDA_SUCCESS);
}

TEST(CudaDriver, StagedCopiesRoundTrip) {
  const CudaDriver& d = fake();
  CUdeviceptr p = 0;
  constexpr size_t bytes = 10'000;
  ASSERT_EQ(d.api().cuMemAlloc(&p, bytes), CUDA_SUCCESS);
  std::vector<unsigned char> in(bytes), out(bytes, 0);
  std::iota(in.begin(), in.end(), 0);
  {
    auto context = ScopedDeviceContext::enter(d, 0);
    ASSERT_TRUE(context.ok()) << context.status().to_string();
    EXPECT_EQ(fake_control<int (*)()>("fake_cuda_context_depth")(), 1);
    auto staging = PinnedBuffer::allocate(d, 4096);  // smaller than the data: three chunks
    ASSERT_TRUE(staging.ok());
    EXPECT_EQ(fake_control<int (*)()>("fake_cuda_pinned")(), 1);
    ASSERT_TRUE(copy_to_device(d, p, in.data(), bytes, *staging).ok());
    ASSERT_TRUE(copy_from_device(d, out.data(), p, bytes, *staging).ok());
    EXPECT_EQ(in, out);
    // Past the allocation: the driver's error comes back as a Status.
    EXPECT_EQ(copy_to_device(d, p + bytes - 10, in.data(), 100, *staging).code(), Errc::io_error);
  }
  EXPECT_EQ(fake_control<int (*)()>("fake_cuda_pinned")(), 0);
  EXPECT_EQ(fake_control<int (*)()>("fake_cuda_streams")(), 0);
  EXPECT_EQ(fake_control<int (*)()>("fake_cuda_context_depth")(), 0);
  EXPECT_EQ(fake_control<int (*)()>("fake_cuda_primary_retained")(), 0);
  EXPECT_EQ(PinnedBuffer::allocate(d, 0).status().code(), Errc::invalid_argument);
  ASSERT_EQ(d.api().cuMemFree(p), CUDA_SUCCESS);
}

TEST(CudaDriver, PageAlign) {
  EXPECT_EQ(page_align(4096, 4096, 4096).start, 4096u);
  EXPECT_EQ(page_align(4096, 4096, 4096).length, 4096u);
  EXPECT_EQ(page_align(4097, 1, 4096).start, 4096u);
  EXPECT_EQ(page_align(4097, 1, 4096).length, 4096u);
  EXPECT_EQ(page_align(4095, 2, 4096).start, 0u);
  EXPECT_EQ(page_align(4095, 2, 4096).length, 8192u);
}

// ---- with a real GPU ----

TEST(RealGpu, DeviceMemoryIsDetectedAndExported) {
  ScopedEnv env("STELLAR_CUDA_LIBRARY", nullptr);
  auto loaded = CudaDriver::load();
  if (!loaded) GTEST_SKIP() << loaded.status().message();
  const CudaDriver& d = **loaded;
  int count = 0;
  if (d.api().cuDeviceGetCount(&count) != CUDA_SUCCESS || count == 0) GTEST_SKIP() << "no GPU";
  auto context = ScopedDeviceContext::enter(d, 0);
  ASSERT_TRUE(context.ok()) << context.status().to_string();
  CUdeviceptr p = 0;
  const size_t bytes = 1 << 21;
  ASSERT_TRUE(d.check(d.api().cuMemAlloc(&p, bytes), "cuMemAlloc").ok());
  auto info = query_pointer(d, reinterpret_cast<void*>(p));
  ASSERT_TRUE(info.ok());
  EXPECT_EQ(info->kind, MemoryKind::device);
  EXPECT_EQ(memory_kind(reinterpret_cast<void*>(p)), MemoryKind::device);
  int host_value = 0;
  EXPECT_EQ(memory_kind(&host_value), MemoryKind::host);

  auto staging = PinnedBuffer::allocate(d, 64 << 10);
  ASSERT_TRUE(staging.ok());
  std::vector<unsigned char> in(300'000), out(in.size());
  std::iota(in.begin(), in.end(), 7);
  ASSERT_TRUE(copy_to_device(d, p, in.data(), in.size(), *staging).ok());
  ASSERT_TRUE(copy_from_device(d, out.data(), p, out.size(), *staging).ok());
  EXPECT_EQ(in, out);

  auto buf = export_dmabuf(d, reinterpret_cast<void*>(p + 100), 8192);
  if (buf.ok()) {
    EXPECT_GE(buf->fd(), 0);
    EXPECT_EQ(buf->offset(), 100u);
  } else {
    EXPECT_EQ(buf.status().code(), Errc::unsupported) << buf.status().to_string();  // proprietary modules: no dma-buf
  }
  EXPECT_TRUE(d.check(d.api().cuMemFree(p), "cuMemFree").ok());
}
