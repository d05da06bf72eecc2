// The CUDA driver loader and GPU memory helpers (src/gpu): against a missing
// library, a library that is not a driver, and a fake libcuda built with the
// tests (fake_libcuda.cpp), which exercises the success paths without a GPU.
// The RealGpu tests run only where a CUDA driver and a GPU exist.
#include "gpu/cuda_driver.hpp"
#include "stellar/verbs.hpp"

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>

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
  // Registration caches key a device range by its pages inside its allocation, else by itself.
  const auto inside = page_cover_within(0x10040, 100, 0x10000, 0x8000, 4096);
  EXPECT_EQ(inside.start, 0x10000u);
  EXPECT_EQ(inside.length, 4096u);
  const auto spanning = page_cover_within(0x10ff0, 0x20, 0x10000, 0x8000, 4096);
  EXPECT_EQ(spanning.start, 0x10000u);
  EXPECT_EQ(spanning.length, 8192u);
  const auto ragged_end = page_cover_within(0x10040, 100, 0x10010, 0x200, 4096);  // a small allocation inside a page
  EXPECT_EQ(ragged_end.start, 0x10040u) << "the page would reach past the allocation: the range itself";
  EXPECT_EQ(ragged_end.length, 100u);
  const auto last_page = page_cover_within(0x17f00, 0x80, 0x10000, 0x7f80, 4096);  // allocation ends inside its last page
  EXPECT_EQ(last_page.start, 0x17f00u);
  EXPECT_EQ(last_page.length, 0x80u);
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

// GPU memory over the soft provider, staged through pinned shadows: two
// contexts in this process joined over loopback, device buffers from the
// fake driver (host memory that only cuMemcpy* may touch as far as the
// provider is concerned). Each check reads the device buffer back with
// cuMemcpyDtoH, so a missing copy in either direction shows.
namespace {

struct Side {
  std::shared_ptr<Context> context;
  std::shared_ptr<ProtectionDomain> pd;
  std::shared_ptr<CompletionQueue> cq;
  std::shared_ptr<QueuePair> qp;
};

Side open_side() {
  Side s;
  s.context = Context::open().value();
  s.pd = s.context->allocate_pd().value();
  s.cq = s.context->create_cq(64).value();
  QpInitAttributes attributes;
  attributes.send_cq = attributes.recv_cq = s.cq;
  s.qp = s.pd->create_qp(attributes).value();
  QpModify init;
  init.state = QpState::init;
  EXPECT_TRUE(s.qp->modify(init).ok());
  return s;
}

void connect(Side& a, Side& b) {
  for (auto [x, y] : {std::pair{&a, &b}, std::pair{&b, &a}}) {
    QpModify rtr;
    rtr.state = QpState::rtr;
    rtr.remote = y->qp->local_endpoint();
    ASSERT_TRUE(x->qp->modify(rtr).ok());
  }
  for (Side* x : {&a, &b}) {
    QpModify rts;
    rts.state = QpState::rts;
    ASSERT_TRUE(x->qp->modify(rts).ok());
  }
}

// Polls both sides until `side` has a completion; returns it.
WorkCompletion next_completion(Side& side, Side& other) {
  WorkCompletion wc{};
  for (int i = 0; i < 2'000'000; ++i) {
    other.context->progress();
    if (side.cq->poll({&wc, 1}) == 1) return wc;
  }
  ADD_FAILURE() << "no completion";
  return wc;
}

std::vector<uint8_t> device_bytes(const CudaDriver& d, CUdeviceptr p, size_t n) {
  std::vector<uint8_t> v(n);
  EXPECT_EQ(d.api().cuMemcpyDtoH(v.data(), p, n), CUDA_SUCCESS);
  return v;
}

}  // namespace

TEST(SoftProviderGpu, WriteReadAndSendBetweenDeviceBuffersAreStaged) {
  ScopedEnv env("STELLAR_CUDA_LIBRARY", FAKE_LIBCUDA_PATH);
  const CudaDriver& d = fake();
  constexpr size_t bytes = 3 * 4096 + 100;  // several packets, not page-sized
  CUdeviceptr source = 0, target = 0, back = 0;
  ASSERT_EQ(d.api().cuMemAlloc(&source, bytes), CUDA_SUCCESS);
  ASSERT_EQ(d.api().cuMemAlloc(&target, bytes), CUDA_SUCCESS);
  ASSERT_EQ(d.api().cuMemAlloc(&back, bytes), CUDA_SUCCESS);
  std::vector<uint8_t> pattern(bytes), zeros(bytes, 0);
  std::iota(pattern.begin(), pattern.end(), uint8_t(7));
  ASSERT_EQ(d.api().cuMemcpyHtoD(source, pattern.data(), bytes), CUDA_SUCCESS);
  ASSERT_EQ(d.api().cuMemcpyHtoD(target, zeros.data(), bytes), CUDA_SUCCESS);
  ASSERT_EQ(d.api().cuMemcpyHtoD(back, zeros.data(), bytes), CUDA_SUCCESS);
  {
    Side a = open_side(), b = open_side();
    connect(a, b);
    auto source_mr = a.pd->register_memory(reinterpret_cast<void*>(source), bytes, access_local_write).value();
    auto back_mr = a.pd->register_memory(reinterpret_cast<void*>(back), bytes, access_local_write).value();
    auto target_mr = b.pd->register_memory(reinterpret_cast<void*>(target), bytes,
                                           access_local_write | access_remote_write | access_remote_read).value();
    EXPECT_EQ(a.pd->register_memory(reinterpret_cast<void*>(source), bytes, access_local_write | access_remote_atomic).status().code(),
              Errc::unsupported) << "staged copies cannot be atomic";

    // WRITE_WITH_IMM device -> device: the target's receive completion means the data is on its device.
    // The receive it consumes has a GPU buffer that the target's own "kernel" changed after
    // registration: a WRITE_WITH_IMM places nothing there, so it must stay as the kernel left it.
    CUdeviceptr spare = 0;
    ASSERT_EQ(d.api().cuMemAlloc(&spare, 4096), CUDA_SUCCESS);
    auto spare_mr = b.pd->register_memory(reinterpret_cast<void*>(spare), 4096, access_local_write).value();
    std::vector<uint8_t> kernel_wrote(4096, 0xab);
    ASSERT_EQ(d.api().cuMemcpyHtoD(spare, kernel_wrote.data(), 4096), CUDA_SUCCESS);
    Sge spare_sge{spare, 4096, spare_mr->lkey()};
    ASSERT_TRUE(b.qp->post_recv(RecvWr{1, {&spare_sge, 1}}).ok());
    Sge sge{source, uint32_t(bytes), source_mr->lkey()};
    SendWr write;
    write.wr_id = 10;
    write.opcode = WrOpcode::rdma_write_with_imm;
    write.sg_list = {&sge, 1};
    write.remote_addr = target;
    write.rkey = target_mr->rkey();
    ASSERT_TRUE(a.qp->post_send(write).ok());
    WorkCompletion wc = next_completion(b, a);
    EXPECT_EQ(wc.status, WcStatus::success);
    EXPECT_EQ(wc.wr_id, 1u);
    EXPECT_EQ(device_bytes(d, target, bytes), pattern);
    EXPECT_EQ(device_bytes(d, spare, 4096), kernel_wrote) << "the consumed receive buffer was not overwritten";
    wc = next_completion(a, b);
    EXPECT_EQ(wc.wr_id, 10u);
    spare_mr.reset();
    EXPECT_EQ(d.api().cuMemFree(spare), CUDA_SUCCESS);

    // The target's owner changes its device buffer; a READ sees the new bytes
    // and lands them on the reader's device when the READ completes.
    std::vector<uint8_t> changed(pattern.rbegin(), pattern.rend());
    ASSERT_EQ(d.api().cuMemcpyHtoD(target, changed.data(), bytes), CUDA_SUCCESS);
    Sge into{back, uint32_t(bytes), back_mr->lkey()};
    SendWr read;
    read.wr_id = 11;
    read.opcode = WrOpcode::rdma_read;
    read.sg_list = {&into, 1};
    read.remote_addr = target;
    read.rkey = target_mr->rkey();
    read.flags = 0;  // unsignaled: the provider still copies at completion, and reports nothing
    ASSERT_TRUE(a.qp->post_send(read).ok());
    // A signaled SEND after it completes after it: by then the READ's data is on the device.
    ASSERT_TRUE(b.qp->post_recv(RecvWr{2, {}}).ok());
    SendWr marker;
    marker.wr_id = 12;
    marker.opcode = WrOpcode::send_with_imm;
    ASSERT_TRUE(a.qp->post_send(marker).ok());
    wc = next_completion(a, b);
    EXPECT_EQ(wc.wr_id, 12u) << "the unsignaled READ reported nothing";
    EXPECT_EQ(device_bytes(d, back, bytes), changed);

    // SEND from device memory into a device receive buffer.
    ASSERT_EQ(d.api().cuMemcpyHtoD(target, zeros.data(), bytes), CUDA_SUCCESS);
    Sge landing{target, uint32_t(bytes), target_mr->lkey()};
    ASSERT_TRUE(b.qp->post_recv(RecvWr{3, {&landing, 1}}).ok());
    (void)next_completion(b, a);  // the marker's receive (wr 2)
    SendWr send;
    send.wr_id = 13;
    send.opcode = WrOpcode::send;
    send.sg_list = {&sge, 1};
    ASSERT_TRUE(a.qp->post_send(send).ok());
    wc = next_completion(b, a);
    EXPECT_EQ(wc.wr_id, 3u);
    EXPECT_EQ(wc.byte_len, bytes);
    EXPECT_EQ(device_bytes(d, target, bytes), pattern);
  }
  for (CUdeviceptr p : {source, target, back}) EXPECT_EQ(d.api().cuMemFree(p), CUDA_SUCCESS);
}

// An inline payload from registered device memory is copied to the host
// (staged) when it is posted; one from host memory is sent as it is. The
// provider skips the staging lookup while the tenant has no region in GPU
// memory (a cost on every small send), so it must find one registered later
// and stop looking once the last is gone.
TEST(SoftProviderGpu, InlinePayloadsFromDeviceMemoryAreStagedAndHostOnesAreNot) {
  ScopedEnv env("STELLAR_CUDA_LIBRARY", FAKE_LIBCUDA_PATH);
  const CudaDriver& d = fake();
  auto copies = fake_control<unsigned long long (*)()>("fake_cuda_async_copies");
  constexpr uint32_t bytes = 48;
  CUdeviceptr source = 0;
  ASSERT_EQ(d.api().cuMemAlloc(&source, 4096), CUDA_SUCCESS);
  std::vector<uint8_t> pattern(bytes);
  std::iota(pattern.begin(), pattern.end(), uint8_t(0x40));
  {
    Side a = open_side(), b = open_side();
    connect(a, b);
    std::vector<uint8_t> host_source(bytes, 0x11), target(4096, 0);
    auto target_mr = b.pd->register_memory(target.data(), target.size(), access_local_write | access_remote_write).value();
    auto host_mr = a.pd->register_memory(host_source.data(), bytes, access_local_write).value();
    auto inline_write = [&](uint64_t address, uint32_t lkey, size_t at, uint64_t wr_id) {
      Sge sge{address, bytes, lkey};
      SendWr w;
      w.wr_id = wr_id;
      w.opcode = WrOpcode::rdma_write;
      w.sg_list = {&sge, 1};
      w.remote_addr = reinterpret_cast<uint64_t>(target.data() + at);
      w.rkey = target_mr->rkey();
      w.flags = send_signaled | send_inline;
      ASSERT_TRUE(a.qp->post_send(w).ok());
      const WorkCompletion wc = next_completion(a, b);
      EXPECT_EQ(wc.status, WcStatus::success);
      EXPECT_EQ(wc.wr_id, wr_id);
    };
    const auto host_bytes_at = [&](size_t at) { return std::vector<uint8_t>(target.begin() + long(at), target.begin() + long(at + bytes)); };

    uint64_t before = copies();
    inline_write(reinterpret_cast<uint64_t>(host_source.data()), host_mr->lkey(), 0, 1);
    EXPECT_EQ(copies(), before) << "a host payload was copied through the GPU";
    EXPECT_EQ(host_bytes_at(0), host_source);
    {
      auto device_mr = a.pd->register_memory(reinterpret_cast<void*>(source), 4096, access_local_write).value();
      ASSERT_EQ(d.api().cuMemcpyHtoD(source, pattern.data(), bytes), CUDA_SUCCESS);  // a kernel's output, after registration
      before = copies();
      inline_write(source, device_mr->lkey(), 64, 2);
      EXPECT_GT(copies(), before) << "the device payload was not staged";
      EXPECT_EQ(host_bytes_at(64), pattern);
      before = copies();
      inline_write(reinterpret_cast<uint64_t>(host_source.data()), host_mr->lkey(), 128, 3);
      EXPECT_EQ(copies(), before);
      EXPECT_EQ(host_bytes_at(128), host_source);
    }
    before = copies();
    inline_write(reinterpret_cast<uint64_t>(host_source.data()), host_mr->lkey(), 192, 4);
    EXPECT_EQ(copies(), before);
    EXPECT_EQ(host_bytes_at(192), host_source);
  }
  EXPECT_EQ(d.api().cuMemFree(source), CUDA_SUCCESS);
}

// A peer's plain RDMA WRITE (no later message) reaches the device at the
// latest when the region is deregistered.
TEST(SoftProviderGpu, DeregistrationFlushesPeersWrites) {
  ScopedEnv env("STELLAR_CUDA_LIBRARY", FAKE_LIBCUDA_PATH);
  const CudaDriver& d = fake();
  constexpr size_t bytes = 8192;
  CUdeviceptr target = 0;
  ASSERT_EQ(d.api().cuMemAlloc(&target, bytes), CUDA_SUCCESS);
  std::vector<uint8_t> zeros(bytes, 0), source(bytes);
  std::iota(source.begin(), source.end(), uint8_t(1));
  ASSERT_EQ(d.api().cuMemcpyHtoD(target, zeros.data(), bytes), CUDA_SUCCESS);
  {
    Side a = open_side(), b = open_side();
    connect(a, b);
    auto source_mr = a.pd->register_memory(source.data(), bytes, access_local_write).value();
    auto target_mr = b.pd->register_memory(reinterpret_cast<void*>(target), bytes, access_local_write | access_remote_write).value();
    Sge sge{reinterpret_cast<uint64_t>(source.data()), uint32_t(bytes), source_mr->lkey()};
    SendWr write;
    write.wr_id = 1;
    write.opcode = WrOpcode::rdma_write;
    write.sg_list = {&sge, 1};
    write.remote_addr = target;
    write.rkey = target_mr->rkey();
    ASSERT_TRUE(a.qp->post_send(write).ok());
    EXPECT_EQ(next_completion(a, b).status, WcStatus::success);  // acknowledged: in b's shadow
    target_mr.reset();
  }
  EXPECT_EQ(device_bytes(d, target, bytes), source);
  EXPECT_EQ(d.api().cuMemFree(target), CUDA_SUCCESS);
}

// A large WRITE from device memory is staged in chunks on a stream and goes
// on the wire chunk by chunk: post_send returns before any copy ran, the
// first packets leave while later chunks are still being copied, and the
// bytes land exact, host SGEs around the device one included. The fake
// driver runs one queued copy per event query (fake_cuda_set_deferred).
TEST(SoftProviderGpu, LargeSourcesArePipelinedChunkByChunk) {
  ScopedEnv env("STELLAR_CUDA_LIBRARY", FAKE_LIBCUDA_PATH);
  const CudaDriver& d = fake();
  auto set_deferred = fake_control<void (*)(int)>("fake_cuda_set_deferred");
  auto async_copies = fake_control<unsigned long long (*)()>("fake_cuda_async_copies");
  auto pending_copies = fake_control<unsigned long long (*)()>("fake_cuda_pending_copies");
  auto events = fake_control<int (*)()>("fake_cuda_events");
  constexpr size_t device_bytes_n = (2 << 20) + 300;  // 5 chunks of 512 KiB
  constexpr size_t head = 5000, tail = 100, total = head + device_bytes_n + tail;
  CUdeviceptr source = 0, target = 0;
  ASSERT_EQ(d.api().cuMemAlloc(&source, device_bytes_n), CUDA_SUCCESS);
  ASSERT_EQ(d.api().cuMemAlloc(&target, total), CUDA_SUCCESS);
  std::vector<uint8_t> expected(total), zeros(total, 0);
  std::iota(expected.begin(), expected.end(), uint8_t(3));
  for (size_t i = 0; i < total; i += 7) expected[i] ^= uint8_t(i >> 12);
  std::vector<uint8_t> host_head(expected.begin(), expected.begin() + head);
  std::vector<uint8_t> host_tail(expected.end() - tail, expected.end());
  ASSERT_EQ(d.api().cuMemcpyHtoD(source, expected.data() + head, device_bytes_n), CUDA_SUCCESS);
  ASSERT_EQ(d.api().cuMemcpyHtoD(target, zeros.data(), total), CUDA_SUCCESS);
  {
    Side a = open_side(), b = open_side();
    connect(a, b);
    auto source_mr = a.pd->register_memory(reinterpret_cast<void*>(source), device_bytes_n, access_local_write).value();
    auto head_mr = a.pd->register_memory(host_head.data(), head, access_local_write).value();
    auto tail_mr = a.pd->register_memory(host_tail.data(), tail, access_local_write).value();
    auto target_mr = b.pd->register_memory(reinterpret_cast<void*>(target), total, access_local_write | access_remote_write).value();
    ASSERT_TRUE(b.qp->post_recv(RecvWr{1, {}}).ok());
    Sge sges[3] = {{reinterpret_cast<uint64_t>(host_head.data()), uint32_t(head), head_mr->lkey()},
                   {source, uint32_t(device_bytes_n), source_mr->lkey()},
                   {reinterpret_cast<uint64_t>(host_tail.data()), uint32_t(tail), tail_mr->lkey()}};
    SendWr write;
    write.wr_id = 7;
    write.opcode = WrOpcode::rdma_write_with_imm;
    write.sg_list = sges;
    write.remote_addr = target;
    write.rkey = target_mr->rkey();
    // The copy engine stalls and moves only when the test says: whether
    // chunk 0 overlaps the later copies must not depend on how fast this
    // host's loopback turns packets around (it did under load).
    set_deferred(2);
    const unsigned long long copies_before = async_copies();
    const uint64_t tx_before = a.context->counters().tx_bytes;
    ASSERT_TRUE(a.qp->post_send(write).ok());
    EXPECT_EQ(async_copies() - copies_before, 5u) << "one async copy per 512 KiB chunk";
    EXPECT_EQ(pending_copies(), 5u) << "post_send did not wait for the copies";
    for (int i = 0; i < 1000; ++i) {
      a.context->progress();
      b.context->progress();
    }
    EXPECT_LT(a.context->counters().tx_bytes - tx_before, head + (64u << 10)) << "no chunk goes out before its copy ran";
    fake_control<void (*)(int)>("fake_cuda_run_copies")(1);  // chunk 0 is in the shadow
    bool overlapped = false;
    for (int i = 0; i < 100000 && !overlapped; ++i) {
      a.context->progress();
      b.context->progress();
      // Everything up to chunk 0's end but the packet that straddles it
      // (it waits for chunk 1): one MTU short of head + 512 KiB at most.
      overlapped = a.context->counters().tx_bytes - tx_before > head + (512u << 10) - a.context->options().mtu;
    }
    EXPECT_TRUE(overlapped) << "chunk 0 went on the wire while later chunks were still copying";
    EXPECT_EQ(pending_copies(), 4u);
    set_deferred(1);  // the rest one per event query, as a copy engine's complete
    for (int i = 0; i < 100000 && pending_copies() > 0; ++i) {
      a.context->progress();
      b.context->progress();
    }
    WorkCompletion wc = next_completion(b, a);
    EXPECT_EQ(wc.status, WcStatus::success);
    EXPECT_EQ(wc.wr_id, 1u);
    EXPECT_EQ(device_bytes(d, target, total), expected);
    wc = next_completion(a, b);
    EXPECT_EQ(wc.wr_id, 7u);
    EXPECT_EQ(wc.status, WcStatus::success);
    EXPECT_EQ(events(), 0) << "every chunk's event destroyed";
    set_deferred(0);
  }
  for (CUdeviceptr p : {source, target}) EXPECT_EQ(d.api().cuMemFree(p), CUDA_SUCCESS);
}

// Large GPU destinations are copied to the device asynchronously: the
// completion waits for the copy, the progress loop does not. With the fake
// copy engine stalled, the receiver keeps acknowledging, serving READs and
// taking later messages; its receive completions stay back, in order, until
// the copy has run. A READ of the landing buffer meanwhile returns the
// landed bytes (the stream orders its device -> shadow copy behind the
// pending shadow -> device one); a plain synchronous copy would have read
// the device's stale bytes.
TEST(SoftProviderGpu, LargeDestinationsAreCopiedAsynchronouslyAndCompleteInOrder) {
  ScopedEnv env("STELLAR_CUDA_LIBRARY", FAKE_LIBCUDA_PATH);
  const CudaDriver& d = fake();
  auto set_deferred = fake_control<void (*)(int)>("fake_cuda_set_deferred");
  auto pending_copies = fake_control<unsigned long long (*)()>("fake_cuda_pending_copies");
  auto events = fake_control<int (*)()>("fake_cuda_events");
  constexpr size_t bytes = 256 * 1024 + 100;
  CUdeviceptr landing = 0, read_target = 0;
  ASSERT_EQ(d.api().cuMemAlloc(&landing, bytes), CUDA_SUCCESS);
  ASSERT_EQ(d.api().cuMemAlloc(&read_target, bytes), CUDA_SUCCESS);
  std::vector<uint8_t> pattern(bytes), zeros(bytes, 0), read_back(bytes, 0);
  std::iota(pattern.begin(), pattern.end(), uint8_t(5));
  for (size_t i = 0; i < bytes; i += 11) pattern[i] ^= uint8_t(i >> 10);
  ASSERT_EQ(d.api().cuMemcpyHtoD(landing, zeros.data(), bytes), CUDA_SUCCESS);
  ASSERT_EQ(d.api().cuMemcpyHtoD(read_target, zeros.data(), bytes), CUDA_SUCCESS);
  {
    Side a = open_side(), b = open_side();
    connect(a, b);
    auto source_mr = a.pd->register_memory(pattern.data(), bytes, access_local_write).value();
    auto back_mr = a.pd->register_memory(read_back.data(), bytes, access_local_write).value();
    auto landing_mr = b.pd->register_memory(reinterpret_cast<void*>(landing), bytes, access_local_write | access_remote_read).value();
    Sge into{landing, uint32_t(bytes), landing_mr->lkey()};
    ASSERT_TRUE(b.qp->post_recv(RecvWr{1, {&into, 1}}).ok());
    ASSERT_TRUE(b.qp->post_recv(RecvWr{2, {}}).ok());

    set_deferred(2);  // the copy engine stalls until someone synchronizes
    Sge from{reinterpret_cast<uint64_t>(pattern.data()), uint32_t(bytes), source_mr->lkey()};
    SendWr send;
    send.wr_id = 10;
    send.opcode = WrOpcode::send;
    send.sg_list = {&from, 1};
    ASSERT_TRUE(a.qp->post_send(send).ok());
    SendWr small;
    small.wr_id = 11;
    small.opcode = WrOpcode::send_with_imm;
    small.imm_data = 77;
    ASSERT_TRUE(a.qp->post_send(small).ok());
    // Both sends are acknowledged (b's progress loop ran on), while b's
    // receive completions wait for the stalled copy.
    WorkCompletion wc = next_completion(a, b);
    EXPECT_EQ(wc.wr_id, 10u);
    EXPECT_EQ(wc.status, WcStatus::success);
    wc = next_completion(a, b);
    EXPECT_EQ(wc.wr_id, 11u);
    EXPECT_EQ(pending_copies(), 1u) << "the landed message is copied to the device asynchronously";
    for (int i = 0; i < 1000; ++i) b.context->progress();
    EXPECT_EQ(b.cq->poll({&wc, 1}), 0) << "no receive completion before its data is on the device, nor one behind it";

    // A peer READs the landing buffer meanwhile: it gets the landed bytes.
    Sge back{reinterpret_cast<uint64_t>(read_back.data()), uint32_t(bytes), back_mr->lkey()};
    SendWr read;
    read.wr_id = 12;
    read.opcode = WrOpcode::rdma_read;
    read.sg_list = {&back, 1};
    read.remote_addr = landing;
    read.rkey = landing_mr->rkey();
    ASSERT_TRUE(a.qp->post_send(read).ok());
    wc = next_completion(a, b);
    EXPECT_EQ(wc.wr_id, 12u);
    EXPECT_EQ(wc.status, WcStatus::success);
    EXPECT_TRUE(read_back == pattern) << "the READ saw the device before the landed message's copy";

    // The copy engine runs again: the completions come, in order, with the data on the device.
    set_deferred(1);
    wc = next_completion(b, a);
    EXPECT_EQ(wc.wr_id, 1u);
    EXPECT_EQ(wc.status, WcStatus::success);
    EXPECT_EQ(wc.byte_len, bytes);
    EXPECT_EQ(device_bytes(d, landing, bytes), pattern);
    wc = next_completion(b, a);
    EXPECT_EQ(wc.wr_id, 2u);
    EXPECT_TRUE(wc.has_imm);
    EXPECT_EQ(wc.imm_data, 77u);

    // A large READ into device memory: same path on the send queue, and a
    // SEND posted after it completes after it.
    auto target_mr = a.pd->register_memory(reinterpret_cast<void*>(read_target), bytes, access_local_write).value();
    Sge target{read_target, uint32_t(bytes), target_mr->lkey()};
    read.wr_id = 13;
    read.sg_list = {&target, 1};
    ASSERT_TRUE(b.qp->post_recv(RecvWr{3, {}}).ok());
    set_deferred(2);
    ASSERT_TRUE(a.qp->post_send(read).ok());
    small.wr_id = 14;
    ASSERT_TRUE(a.qp->post_send(small).ok());
    wc = next_completion(b, a);  // the SEND arrived: the READ's responses came before it
    EXPECT_EQ(wc.wr_id, 3u);
    for (int i = 0; i < 1000; ++i) a.context->progress();
    EXPECT_EQ(a.cq->poll({&wc, 1}), 0) << "the READ waits for its copy, the SEND for the READ";
    set_deferred(1);
    wc = next_completion(a, b);
    EXPECT_EQ(wc.wr_id, 13u);
    EXPECT_EQ(device_bytes(d, read_target, bytes), pattern);
    wc = next_completion(a, b);
    EXPECT_EQ(wc.wr_id, 14u);
    set_deferred(0);
    EXPECT_EQ(events(), 0) << "every held completion's event destroyed";
  }
  for (CUdeviceptr p : {landing, read_target}) EXPECT_EQ(d.api().cuMemFree(p), CUDA_SUCCESS);
}

// Another QP of the same side, in INIT (same context, PD and CQ).
std::shared_ptr<QueuePair> another_qp(Side& s, QpCapabilities cap = {}) {
  QpInitAttributes attributes;
  attributes.send_cq = attributes.recv_cq = s.cq;
  attributes.cap = cap;
  auto qp = s.pd->create_qp(attributes).value();
  QpModify init;
  init.state = QpState::init;
  EXPECT_TRUE(qp->modify(init).ok());
  return qp;
}

// A receive says every earlier WRITE of the peer is in place, whichever QP
// of the tenant it arrives on: a receive on QP 2 must not be reported while
// a receive on QP 1 is still copying the dirty ranges of an earlier WRITE
// to the device (the communicator stripes one peer over several QPs of a
// PD: data on one, the notification on another).
TEST(SoftProviderGpu, AReceiveOnAnyQpOfTheTenantWaitsForEarlierFlushes) {
  ScopedEnv env("STELLAR_CUDA_LIBRARY", FAKE_LIBCUDA_PATH);
  const CudaDriver& d = fake();
  auto set_deferred = fake_control<void (*)(int)>("fake_cuda_set_deferred");
  auto pending_copies = fake_control<unsigned long long (*)()>("fake_cuda_pending_copies");
  auto events = fake_control<int (*)()>("fake_cuda_events");
  constexpr size_t bytes = 256 * 1024;
  CUdeviceptr region = 0;
  ASSERT_EQ(d.api().cuMemAlloc(&region, bytes), CUDA_SUCCESS);
  std::vector<uint8_t> pattern(bytes), zeros(bytes, 0);
  std::iota(pattern.begin(), pattern.end(), uint8_t(1));
  ASSERT_EQ(d.api().cuMemcpyHtoD(region, zeros.data(), bytes), CUDA_SUCCESS);
  {
    Side a = open_side(), b = open_side();
    connect(a, b);
    Side a2 = a, b2 = b;
    a2.qp = another_qp(a);
    b2.qp = another_qp(b);
    connect(a2, b2);
    auto source_mr = a.pd->register_memory(pattern.data(), bytes, access_local_write).value();
    auto region_mr = b.pd->register_memory(reinterpret_cast<void*>(region), bytes, access_local_write | access_remote_write).value();
    ASSERT_TRUE(b.qp->post_recv(RecvWr{1, {}}).ok());
    ASSERT_TRUE(b2.qp->post_recv(RecvWr{2, {}}).ok());
    Sge from{reinterpret_cast<uint64_t>(pattern.data()), uint32_t(bytes), source_mr->lkey()};
    SendWr write;
    write.wr_id = 10;
    write.opcode = WrOpcode::rdma_write;
    write.sg_list = {&from, 1};
    write.remote_addr = region;
    write.rkey = region_mr->rkey();
    ASSERT_TRUE(a2.qp->post_send(write).ok());
    EXPECT_EQ(next_completion(a, b).wr_id, 10u);  // in b's shadow, dirty

    set_deferred(2);
    SendWr note;
    note.wr_id = 11;
    note.opcode = WrOpcode::send_with_imm;
    ASSERT_TRUE(a.qp->post_send(note).ok());  // QP 1: its receive flushes the dirty range, held
    EXPECT_EQ(next_completion(a, b).wr_id, 11u);
    EXPECT_EQ(pending_copies(), 1u);
    note.wr_id = 12;
    ASSERT_TRUE(a2.qp->post_send(note).ok());  // QP 2: nothing dirty left, but the flush still runs
    EXPECT_EQ(next_completion(a, b).wr_id, 12u);
    WorkCompletion wc{};
    for (int i = 0; i < 1000; ++i) b.context->progress();
    EXPECT_EQ(b.cq->poll({&wc, 1}), 0) << "a receive was reported before the peer's earlier WRITE reached the device";

    set_deferred(1);
    std::vector<uint64_t> seen;
    for (int k = 0; k < 2; ++k) {
      wc = next_completion(b, a);
      EXPECT_EQ(wc.status, WcStatus::success);
      seen.push_back(wc.wr_id);
      EXPECT_EQ(device_bytes(d, region, bytes), pattern) << "receive " << wc.wr_id;
    }
    std::sort(seen.begin(), seen.end());
    EXPECT_EQ(seen, std::vector<uint64_t>({1, 2}));

    // Deregistration waits for copies still queued for the region.
    ASSERT_TRUE(b.qp->post_recv(RecvWr{3, {}}).ok());
    ASSERT_EQ(d.api().cuMemcpyHtoD(region, zeros.data(), bytes), CUDA_SUCCESS);
    ASSERT_TRUE(a2.qp->post_send(write).ok());
    EXPECT_EQ(next_completion(a, b).wr_id, 10u);
    set_deferred(2);
    note.wr_id = 13;
    ASSERT_TRUE(a.qp->post_send(note).ok());
    EXPECT_EQ(next_completion(a, b).wr_id, 13u);
    EXPECT_EQ(pending_copies(), 1u);
    region_mr.reset();
    EXPECT_EQ(pending_copies(), 0u) << "deregistration waited for the queued copy";
    EXPECT_EQ(device_bytes(d, region, bytes), pattern);
    set_deferred(1);
    EXPECT_EQ(next_completion(b, a).wr_id, 3u);
    set_deferred(0);
    EXPECT_EQ(events(), 0);
  }
  EXPECT_EQ(d.api().cuMemFree(region), CUDA_SUCCESS);
}

// A completion held for its GPU copy still occupies its queue: the CQ was
// sized for max_recv_wr outstanding receives.
TEST(SoftProviderGpu, HeldCompletionsStillCountAgainstTheQueue) {
  ScopedEnv env("STELLAR_CUDA_LIBRARY", FAKE_LIBCUDA_PATH);
  const CudaDriver& d = fake();
  auto set_deferred = fake_control<void (*)(int)>("fake_cuda_set_deferred");
  constexpr size_t bytes = 128 * 1024;
  CUdeviceptr landing = 0;
  ASSERT_EQ(d.api().cuMemAlloc(&landing, bytes), CUDA_SUCCESS);
  std::vector<uint8_t> pattern(bytes, 0x5a);
  {
    Side a = open_side(), b = open_side();
    QpCapabilities one;
    one.max_recv_wr = 1;
    b.qp = another_qp(b, one);
    connect(a, b);
    auto source_mr = a.pd->register_memory(pattern.data(), bytes, access_local_write).value();
    auto landing_mr = b.pd->register_memory(reinterpret_cast<void*>(landing), bytes, access_local_write).value();
    Sge into{landing, uint32_t(bytes), landing_mr->lkey()};
    ASSERT_TRUE(b.qp->post_recv(RecvWr{1, {&into, 1}}).ok());
    set_deferred(2);
    Sge from{reinterpret_cast<uint64_t>(pattern.data()), uint32_t(bytes), source_mr->lkey()};
    SendWr send;
    send.wr_id = 10;
    send.opcode = WrOpcode::send;
    send.sg_list = {&from, 1};
    ASSERT_TRUE(a.qp->post_send(send).ok());
    EXPECT_EQ(next_completion(a, b).wr_id, 10u);  // the receive is done in the engine, held for its copy
    EXPECT_EQ(b.qp->post_recv(RecvWr{2, {&into, 1}}).code(), Errc::queue_full);
    set_deferred(1);
    EXPECT_EQ(next_completion(b, a).wr_id, 1u);
    EXPECT_TRUE(b.qp->post_recv(RecvWr{2, {&into, 1}}).ok());
    set_deferred(0);
  }
  EXPECT_EQ(d.api().cuMemFree(landing), CUDA_SUCCESS);
}

// A QP destroyed with a completion held for its destination copy waits for
// the copy and still delivers the completion.
TEST(SoftProviderGpu, DestroyingAQpWithHeldCompletionsDeliversThem) {
  ScopedEnv env("STELLAR_CUDA_LIBRARY", FAKE_LIBCUDA_PATH);
  const CudaDriver& d = fake();
  auto set_deferred = fake_control<void (*)(int)>("fake_cuda_set_deferred");
  auto pending_copies = fake_control<unsigned long long (*)()>("fake_cuda_pending_copies");
  auto events = fake_control<int (*)()>("fake_cuda_events");
  constexpr size_t bytes = 128 * 1024;
  CUdeviceptr landing = 0;
  ASSERT_EQ(d.api().cuMemAlloc(&landing, bytes), CUDA_SUCCESS);
  std::vector<uint8_t> pattern(bytes);
  std::iota(pattern.begin(), pattern.end(), uint8_t(9));
  {
    Side a = open_side(), b = open_side();
    connect(a, b);
    auto source_mr = a.pd->register_memory(pattern.data(), bytes, access_local_write).value();
    auto landing_mr = b.pd->register_memory(reinterpret_cast<void*>(landing), bytes, access_local_write).value();
    Sge into{landing, uint32_t(bytes), landing_mr->lkey()};
    ASSERT_TRUE(b.qp->post_recv(RecvWr{1, {&into, 1}}).ok());
    set_deferred(2);
    Sge from{reinterpret_cast<uint64_t>(pattern.data()), uint32_t(bytes), source_mr->lkey()};
    SendWr send;
    send.wr_id = 10;
    send.opcode = WrOpcode::send;
    send.sg_list = {&from, 1};
    ASSERT_TRUE(a.qp->post_send(send).ok());
    EXPECT_EQ(next_completion(a, b).wr_id, 10u);
    EXPECT_EQ(pending_copies(), 1u);
    b.qp.reset();
    EXPECT_EQ(pending_copies(), 0u) << "the QP waited for the copy";
    EXPECT_EQ(events(), 0);
    WorkCompletion wc{};
    ASSERT_EQ(b.cq->poll({&wc, 1}), 1);
    EXPECT_EQ(wc.wr_id, 1u);
    EXPECT_EQ(wc.status, WcStatus::success);
    EXPECT_EQ(device_bytes(d, landing, bytes), pattern);
    set_deferred(0);
  }
  EXPECT_EQ(d.api().cuMemFree(landing), CUDA_SUCCESS);
}

// A QP destroyed while its chunks are still copying waits for them before
// the pinned shadow they write can go, and leaks no event.
TEST(SoftProviderGpu, DestroyingAQpWithCopiesInFlightWaitsForThem) {
  ScopedEnv env("STELLAR_CUDA_LIBRARY", FAKE_LIBCUDA_PATH);
  const CudaDriver& d = fake();
  auto set_deferred = fake_control<void (*)(int)>("fake_cuda_set_deferred");
  auto pending_copies = fake_control<unsigned long long (*)()>("fake_cuda_pending_copies");
  auto events = fake_control<int (*)()>("fake_cuda_events");
  constexpr size_t bytes = 1 << 20;
  CUdeviceptr source = 0;
  ASSERT_EQ(d.api().cuMemAlloc(&source, bytes), CUDA_SUCCESS);
  std::vector<uint8_t> target(bytes);
  {
    Side a = open_side(), b = open_side();
    connect(a, b);
    auto source_mr = a.pd->register_memory(reinterpret_cast<void*>(source), bytes, access_local_write).value();
    auto target_mr = b.pd->register_memory(target.data(), bytes, access_local_write | access_remote_write).value();
    Sge sge{source, uint32_t(bytes), source_mr->lkey()};
    SendWr write;
    write.wr_id = 1;
    write.opcode = WrOpcode::rdma_write;
    write.sg_list = {&sge, 1};
    write.remote_addr = reinterpret_cast<uint64_t>(target.data());
    write.rkey = target_mr->rkey();
    set_deferred(1);
    ASSERT_TRUE(a.qp->post_send(write).ok());
    EXPECT_EQ(pending_copies(), 2u);
    a.qp.reset();
    EXPECT_EQ(pending_copies(), 0u) << "the QP waited for its copies";
    EXPECT_EQ(events(), 0);
    set_deferred(0);
  }
  EXPECT_EQ(d.api().cuMemFree(source), CUDA_SUCCESS);
}

// Registering the same GPU buffer again reuses its pinned shadow (no new
// pinned allocation), sub-ranges included; memory freed and allocated again
// at the same address gets a fresh shadow, and every READ sees the device's
// current bytes.
TEST(SoftProviderGpu, ReRegistrationReusesTheShadowAndFreedMemoryGetsANewOne) {
  ScopedEnv env("STELLAR_CUDA_LIBRARY", FAKE_LIBCUDA_PATH);
  const CudaDriver& d = fake();
  auto pinned = fake_control<int (*)()>("fake_cuda_pinned_allocations");
  constexpr size_t bytes = 64 * 1024;
  CUdeviceptr buffer = 0;
  ASSERT_EQ(d.api().cuMemAlloc(&buffer, bytes), CUDA_SUCCESS);
  std::vector<uint8_t> first(bytes), second(bytes);
  std::iota(first.begin(), first.end(), uint8_t(1));
  std::iota(second.rbegin(), second.rend(), uint8_t(9));
  ASSERT_EQ(d.api().cuMemcpyHtoD(buffer, first.data(), bytes), CUDA_SUCCESS);
  Side a = open_side(), b = open_side();
  connect(a, b);
  std::vector<uint8_t> local(bytes);
  auto local_mr = a.pd->register_memory(local.data(), bytes, access_local_write).value();
  auto read_back = [&](const MemoryRegion& mr, uint64_t address, size_t n) {
    std::fill(local.begin(), local.end(), 0);
    Sge into{reinterpret_cast<uint64_t>(local.data()), uint32_t(n), local_mr->lkey()};
    SendWr read;
    read.wr_id = 5;
    read.opcode = WrOpcode::rdma_read;
    read.sg_list = {&into, 1};
    read.remote_addr = address;
    read.rkey = mr.rkey();
    EXPECT_TRUE(a.qp->post_send(read).ok());
    EXPECT_EQ(next_completion(a, b).status, WcStatus::success);
    return std::vector<uint8_t>(local.begin(), local.begin() + long(n));
  };
  const int pinned_before = pinned();
  auto mr1 = b.pd->register_memory(reinterpret_cast<void*>(buffer), bytes, access_local_write | access_remote_read).value();
  EXPECT_EQ(pinned(), pinned_before + 1);
  const uint32_t old_rkey = mr1->rkey();
  mr1.reset();
  auto mr2 = b.pd->register_memory(reinterpret_cast<void*>(buffer), bytes, access_local_write | access_remote_read).value();
  auto mr3 = b.pd->register_memory(reinterpret_cast<void*>(buffer + 4096), 8192, access_local_write | access_remote_read).value();
  EXPECT_EQ(pinned(), pinned_before + 1) << "the cached shadow was reused";
  EXPECT_NE(mr2->rkey(), old_rkey) << "keys are never cached";
  EXPECT_EQ(read_back(*mr2, buffer, bytes), first);
  EXPECT_EQ(read_back(*mr3, buffer + 4096, 8192), std::vector<uint8_t>(first.begin() + 4096, first.begin() + 4096 + 8192));
  mr2.reset();
  mr3.reset();
  // Shadows are keyed by page range: two small buffers in one page of an
  // allocation share a shadow; a buffer in the next page gets its own.
  CUdeviceptr pool = 0;
  ASSERT_EQ(d.api().cuMemAlloc(&pool, 8 * 4096), CUDA_SUCCESS);
  ASSERT_EQ(d.api().cuMemcpyHtoD(pool, first.data(), 8 * 4096), CUDA_SUCCESS);
  {
    const int pinned_pages = pinned();
    auto small1 = b.pd->register_memory(reinterpret_cast<void*>(pool + 3 * 4096 + 16), 100, access_local_write | access_remote_read).value();
    auto small2 = b.pd->register_memory(reinterpret_cast<void*>(pool + 3 * 4096 + 2048), 512, access_local_write | access_remote_read).value();
    EXPECT_EQ(pinned(), pinned_pages + 1) << "one shadow for the page both buffers lie in";
    auto small3 = b.pd->register_memory(reinterpret_cast<void*>(pool + 5 * 4096 + 16), 100, access_local_write | access_remote_read).value();
    EXPECT_EQ(pinned(), pinned_pages + 2);
    EXPECT_EQ(read_back(*small2, pool + 3 * 4096 + 2048, 512),
              std::vector<uint8_t>(first.begin() + 3 * 4096 + 2048, first.begin() + 3 * 4096 + 2048 + 512));
    EXPECT_EQ(read_back(*small1, pool + 3 * 4096 + 16, 100), std::vector<uint8_t>(first.begin() + 3 * 4096 + 16, first.begin() + 3 * 4096 + 116));
  }
  ASSERT_EQ(d.api().cuMemFree(pool), CUDA_SUCCESS);
  // Free and allocate again: the fake hands out the same address with a new buffer id.
  ASSERT_EQ(d.api().cuMemFree(buffer), CUDA_SUCCESS);
  CUdeviceptr again = 0;
  ASSERT_EQ(d.api().cuMemAlloc(&again, bytes), CUDA_SUCCESS);
  ASSERT_EQ(again, buffer) << "the test needs the address reused";
  ASSERT_EQ(d.api().cuMemcpyHtoD(again, second.data(), bytes), CUDA_SUCCESS);
  const int pinned_before_again = pinned();
  auto mr4 = b.pd->register_memory(reinterpret_cast<void*>(again), bytes, access_local_write | access_remote_read).value();
  EXPECT_EQ(pinned(), pinned_before_again + 1) << "a new allocation gets a new shadow";
  EXPECT_EQ(read_back(*mr4, again, bytes), second);
  mr4.reset();
  EXPECT_EQ(d.api().cuMemFree(again), CUDA_SUCCESS);
}
