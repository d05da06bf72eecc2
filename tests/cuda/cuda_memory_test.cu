// GPU memory support against the real CUDA runtime (built with
// -DSTELLAR_CUDA=ON by nvcc; scripts/gpu-check.sh runs it). Memory comes from
// the CUDA runtime as an application would allocate it; Stellar's own code
// sees it only through the dlopen'ed driver API, as in production.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "core/registration_cache.hpp"
#include "gpu/cuda_driver.hpp"

using namespace stellar;
using namespace stellar::gpu;

namespace {

const CudaDriver* driver_or_skip() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) return nullptr;
  auto d = CudaDriver::load();
  return d ? *d : nullptr;
}

#define REQUIRE_GPU(d)                                        \
  const CudaDriver* d = driver_or_skip();                     \
  if (!d) GTEST_SKIP() << "no CUDA device or driver on this host"

}  // namespace

TEST(CudaMemory, PointerKinds) {
  REQUIRE_GPU(d);
  void* device = nullptr;
  void* managed = nullptr;
  void* pinned = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 1 << 20), cudaSuccess);
  ASSERT_EQ(cudaMallocManaged(&managed, 1 << 20), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(&pinned, 1 << 20), cudaSuccess);
  std::vector<char> pageable(4096);

  auto info = query_pointer(*d, static_cast<char*>(device) + 4096);
  ASSERT_TRUE(info.ok()) << info.status().to_string();
  EXPECT_EQ(info->kind, MemoryKind::device);
  EXPECT_EQ(info->allocation_start, reinterpret_cast<uintptr_t>(device));
  EXPECT_GE(info->allocation_size, 1u << 20);
  EXPECT_EQ(memory_kind(managed), MemoryKind::managed);
  EXPECT_EQ(memory_kind(pinned), MemoryKind::host);
  EXPECT_EQ(memory_kind(pageable.data()), MemoryKind::host);

  cudaFree(device);
  cudaFree(managed);
  cudaFreeHost(pinned);
}

TEST(CudaMemory, DmaBufExport) {
  REQUIRE_GPU(d);
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 4 << 20), cudaSuccess);
  auto buf = export_dmabuf(*d, static_cast<char*>(device) + 100, 1 << 20);
  int supported = 0;
  d->api().cuDeviceGetAttribute(&supported, CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, 0);
  if (supported) {
    ASSERT_TRUE(buf.ok()) << buf.status().to_string();
    EXPECT_GE(buf->fd(), 0);
    EXPECT_EQ(buf->start(), reinterpret_cast<uintptr_t>(device));
    EXPECT_EQ(buf->offset(), 100u);
    EXPECT_EQ(buf->length() % host_page_size(), 0u);
  } else {
    EXPECT_EQ(buf.status().code(), Errc::unsupported) << buf.status().to_string();
  }
  cudaFree(device);
}

TEST(CudaMemory, StagedCopyThroughPinnedBuffer) {
  REQUIRE_GPU(d);
  void* device = nullptr;
  const size_t bytes = 3'000'000;
  ASSERT_EQ(cudaMalloc(&device, bytes), cudaSuccess);
  auto staging = PinnedBuffer::allocate(*d, 1 << 20);
  ASSERT_TRUE(staging.ok()) << staging.status().to_string();
  std::vector<unsigned char> in(bytes), out(bytes);
  std::iota(in.begin(), in.end(), 3);
  const auto address = static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(device));
  ASSERT_TRUE(copy_to_device(*d, address, in.data(), bytes, *staging).ok());
  std::vector<unsigned char> check(bytes);
  ASSERT_EQ(cudaMemcpy(check.data(), device, bytes, cudaMemcpyDeviceToHost), cudaSuccess);  // the runtime agrees
  EXPECT_EQ(check, in);
  ASSERT_TRUE(copy_from_device(*d, out.data(), address, bytes, *staging).ok());
  EXPECT_EQ(out, in);
  cudaFree(device);
}

// Free and allocate again at the same address: the cache must not return the
// registration of the old allocation once the free was reported.
TEST(CudaMemory, RegistrationCacheAcrossFree) {
  REQUIRE_GPU(d);
  std::vector<uint64_t> deregistered;
  RegistrationCache<uint64_t> cache([&](uint64_t&& buffer_id) { deregistered.push_back(buffer_id); });
  void* device = nullptr;
  ASSERT_EQ(cudaMalloc(&device, 1 << 21), cudaSuccess);
  const auto address = reinterpret_cast<uintptr_t>(device);
  auto first = query_pointer(*d, device);
  ASSERT_TRUE(first.ok());
  cache.insert(address, 1 << 21, first->buffer_id);
  cudaFree(device);
  cache.invalidate(address, 1 << 21);
  ASSERT_EQ(cudaMalloc(&device, 1 << 21), cudaSuccess);
  EXPECT_FALSE(cache.lookup(reinterpret_cast<uintptr_t>(device), 1 << 21));
  auto second = query_pointer(*d, device);
  ASSERT_TRUE(second.ok());
  EXPECT_NE(second->buffer_id, first->buffer_id);
  EXPECT_EQ(deregistered, std::vector<uint64_t>({first->buffer_id}));
  cudaFree(device);
}
