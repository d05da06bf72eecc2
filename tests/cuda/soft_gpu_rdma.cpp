// Two processes doing RDMA WRITE and READ between cudaMalloc buffers over the
// soft provider (GPU memory staged through pinned shadows), with byte-exact
// verification on the devices, then the staged WRITE bandwidth next to plain
// cudaMemcpy of the same size. Run by scripts/gpu-check.sh on GPU hosts.
//
//   soft_gpu_rdma [BYTES] [ITERATIONS]      (default 64 MiB, 20)
//
// Exit status: 0 pass, 1 fail, 77 no GPU (skipped). Forks before either side
// touches CUDA (a CUDA context does not survive fork).
#include <cuda_runtime.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "stellar/stellar.hpp"

using namespace stellar;
using Clock = std::chrono::steady_clock;

namespace {

constexpr uint32_t done_imm = 1, bye_imm = 2;

struct Exposed {
  uint64_t addr;
  uint32_t rkey;
  uint32_t host_rkey;  // a host buffer of the same size: the unstaged baseline
  uint64_t host_addr;
};

[[noreturn]] void fail(const char* side, const std::string& what) {
  std::fprintf(stderr, "soft_gpu_rdma %s: %s\n", side, what.c_str());
  std::_Exit(1);
}

template <typename T>
T must(Result<T> r, const char* side, const char* what) {
  if (!r) fail(side, std::string(what) + ": " + r.status().to_string());
  return std::move(r).value();
}

void must(Status s, const char* side, const char* what) {
  if (!s.ok()) fail(side, std::string(what) + ": " + s.to_string());
}

void must(cudaError_t e, const char* side, const char* what) {
  if (e != cudaSuccess) fail(side, std::string(what) + ": " + cudaGetErrorString(e));
}

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

std::vector<uint8_t> pattern(size_t n) {
  std::vector<uint8_t> v(n);
  std::mt19937 r(42);
  for (auto& x : v) x = uint8_t(r());
  return v;
}

WorkCompletion wait_one(CompletionQueue& cq, const char* side, const char* what) {
  WorkCompletion wc{};
  auto n = cq.wait({&wc, 1}, std::chrono::seconds(60));
  if (!n) fail(side, std::string("waiting for ") + what + ": " + n.status().to_string());
  if (wc.status != WcStatus::success) fail(side, std::string(what) + " completed with " + to_string(wc.status));
  return wc;
}

struct Endpoint {
  std::shared_ptr<Context> context;
  std::shared_ptr<ProtectionDomain> pd;
  std::shared_ptr<CompletionQueue> cq;
  std::shared_ptr<QueuePair> qp;
};

Endpoint open_endpoint(const char* side) {
  Endpoint e;
  e.context = must(Context::open(), side, "Context::open");
  e.pd = must(e.context->allocate_pd(), side, "allocate_pd");
  e.cq = must(e.context->create_cq(256), side, "create_cq");
  QpInitAttributes a;
  a.send_cq = a.recv_cq = e.cq;
  e.qp = must(e.pd->create_qp(a), side, "create_qp");
  return e;
}

int server(uint16_t port, size_t bytes) {
  const char* side = "server";
  if (!have_gpu()) return 77;
  void* target = nullptr;
  must(cudaMalloc(&target, bytes), side, "cudaMalloc");
  must(cudaMemset(target, 0, bytes), side, "cudaMemset");
  Endpoint e = open_endpoint(side);
  auto mr = must(e.pd->register_memory(target, bytes, access_local_write | access_remote_write | access_remote_read), side, "register GPU memory");
  std::vector<uint8_t> host_target(bytes);
  auto host_mr = must(e.pd->register_memory(host_target.data(), bytes, access_local_write | access_remote_write), side, "register host memory");
  QpModify init;
  init.state = QpState::init;
  must(e.qp->modify(init), side, "INIT");
  for (uint64_t i = 0; i < 64; ++i) must(e.qp->post_recv(RecvWr{i, {}}), side, "post_recv");
  auto listener = must(cm::Listener::listen("127.0.0.1", port), side, "listen");
  auto request = must(listener->get_request(std::chrono::milliseconds(30000)), side, "get_request");
  Exposed exposed{reinterpret_cast<uint64_t>(target), mr->rkey(), host_mr->rkey(), reinterpret_cast<uint64_t>(host_target.data())};
  std::vector<uint8_t> data(sizeof exposed);
  std::memcpy(data.data(), &exposed, sizeof exposed);
  must(request->accept(*e.qp, data), side, "accept");
  // The first "done" follows the verification WRITE: by its receive
  // completion the data must be on this GPU.
  WorkCompletion wc = wait_one(*e.cq, side, "the client's first message");
  if (!wc.has_imm || wc.imm_data != done_imm) fail(side, "unexpected first message");
  std::vector<uint8_t> landed(bytes);
  must(cudaMemcpy(landed.data(), target, bytes, cudaMemcpyDeviceToHost), side, "cudaMemcpy D2H");
  if (landed != pattern(bytes)) fail(side, "the RDMA WRITE did not land byte-exact in GPU memory");
  std::printf("server: RDMA WRITE of %zu bytes landed byte-exact in GPU memory\n", bytes);
  // Serve the client's READs and bandwidth WRITEs until it says bye.
  for (uint64_t next = 64;; ++next) {
    must(e.qp->post_recv(RecvWr{next, {}}), side, "post_recv");
    wc = wait_one(*e.cq, side, "the client's messages");
    if (wc.has_imm && wc.imm_data == bye_imm) break;
  }
  must(cudaFree(target), side, "cudaFree");
  return 0;
}

int client(uint16_t port, size_t bytes, int iterations) {
  const char* side = "client";
  if (!have_gpu()) return 77;
  const std::vector<uint8_t> expected = pattern(bytes);
  void *source = nullptr, *back = nullptr, *copy = nullptr;
  must(cudaMalloc(&source, bytes), side, "cudaMalloc");
  must(cudaMalloc(&back, bytes), side, "cudaMalloc");
  must(cudaMalloc(&copy, bytes), side, "cudaMalloc");
  must(cudaMemcpy(source, expected.data(), bytes, cudaMemcpyHostToDevice), side, "cudaMemcpy H2D");
  must(cudaMemset(back, 0, bytes), side, "cudaMemset");
  Endpoint e = open_endpoint(side);
  auto source_mr = must(e.pd->register_memory(source, bytes, access_local_write), side, "register GPU source");
  auto back_mr = must(e.pd->register_memory(back, bytes, access_local_write), side, "register GPU destination");
  cm::ConnectOptions options;
  options.timeout = std::chrono::milliseconds(30000);
  auto connected = must(cm::connect("127.0.0.1", port, *e.qp, options), side, "connect");
  Exposed remote;
  if (connected.private_data.size() != sizeof remote) fail(side, "bad private data");
  std::memcpy(&remote, connected.private_data.data(), sizeof remote);

  Sge from{reinterpret_cast<uint64_t>(source), uint32_t(bytes), source_mr->lkey()};
  SendWr write;
  write.wr_id = 1;
  write.opcode = WrOpcode::rdma_write;
  write.sg_list = {&from, 1};
  write.remote_addr = remote.addr;
  write.rkey = remote.rkey;
  SendWr done;
  done.wr_id = 2;
  done.opcode = WrOpcode::send_with_imm;
  done.imm_data = done_imm;
  must(e.qp->post_send(write), side, "post WRITE");
  must(e.qp->post_send(done), side, "post SEND");
  wait_one(*e.cq, side, "the WRITE");
  wait_one(*e.cq, side, "the SEND");

  Sge into{reinterpret_cast<uint64_t>(back), uint32_t(bytes), back_mr->lkey()};
  SendWr read;
  read.wr_id = 3;
  read.opcode = WrOpcode::rdma_read;
  read.sg_list = {&into, 1};
  read.remote_addr = remote.addr;
  read.rkey = remote.rkey;
  must(e.qp->post_send(read), side, "post READ");
  wait_one(*e.cq, side, "the READ");
  std::vector<uint8_t> got(bytes);
  must(cudaMemcpy(got.data(), back, bytes, cudaMemcpyDeviceToHost), side, "cudaMemcpy D2H");
  if (got != expected) fail(side, "the RDMA READ did not bring the GPU buffer back byte-exact");
  std::printf("client: RDMA READ of %zu bytes came back byte-exact into GPU memory\n", bytes);

  // Seconds for `iterations` WRITEs of `wr`, each followed by a SEND whose
  // receive makes the server copy GPU-bound data to its device.
  auto timed_writes = [&](const SendWr& wr) {
    const auto start = Clock::now();
    for (int i = 0; i < iterations; ++i) {
      must(e.qp->post_send(wr), side, "post WRITE");
      must(e.qp->post_send(done), side, "post SEND");
      wait_one(*e.cq, side, "a WRITE");
      wait_one(*e.cq, side, "a SEND");
    }
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  const double staged_s = timed_writes(write);  // GPU -> GPU, staged
  // The same transport between host buffers: what the wire alone gives here.
  std::vector<uint8_t> host_source(expected);
  auto host_mr = must(e.pd->register_memory(host_source.data(), bytes, access_local_write), side, "register host source");
  Sge from_host{reinterpret_cast<uint64_t>(host_source.data()), uint32_t(bytes), host_mr->lkey()};
  SendWr host_write = write;
  host_write.sg_list = {&from_host, 1};
  host_write.remote_addr = remote.host_addr;
  host_write.rkey = remote.host_rkey;
  const double host_s = timed_writes(host_write);
  // What staging costs per message, done by hand: device -> pinned host -> device.
  void* pinned = nullptr;
  must(cudaMallocHost(&pinned, bytes), side, "cudaMallocHost");
  auto t0 = Clock::now();
  for (int i = 0; i < iterations; ++i) {
    must(cudaMemcpy(pinned, source, bytes, cudaMemcpyDeviceToHost), side, "cudaMemcpy D2H");
    must(cudaMemcpy(copy, pinned, bytes, cudaMemcpyHostToDevice), side, "cudaMemcpy H2D");
  }
  const double bounce_s = std::chrono::duration<double>(Clock::now() - t0).count();
  t0 = Clock::now();
  for (int i = 0; i < iterations; ++i) must(cudaMemcpy(copy, source, bytes, cudaMemcpyDeviceToDevice), side, "cudaMemcpy D2D");
  must(cudaDeviceSynchronize(), side, "cudaDeviceSynchronize");
  const double d2d_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const double total = double(bytes) * iterations / 1e9;
  std::printf("client: %zu-byte messages, %d iterations (GB/s, 1e9):\n", bytes, iterations);
  std::printf("  soft provider, GPU -> GPU RDMA WRITE (staged)   %8.2f   (staged / host = %.2f)\n", total / staged_s, host_s / staged_s);
  std::printf("  soft provider, host -> host RDMA WRITE          %8.2f\n", total / host_s);
  std::printf("  cudaMemcpy D2H + H2D through pinned memory      %8.2f   (staged / this = %.2f)\n", total / bounce_s,
              (total / staged_s) / (total / bounce_s));
  std::printf("  cudaMemcpy D2D                                  %8.2f\n", total / d2d_s);
  SendWr bye = done;
  bye.imm_data = bye_imm;
  must(e.qp->post_send(bye), side, "post SEND");
  wait_one(*e.cq, side, "the last SEND");
  cudaFreeHost(pinned);
  cudaFree(source);
  cudaFree(back);
  cudaFree(copy);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // the children end with _Exit: nothing may wait in a buffer
  const size_t bytes = argc > 1 ? std::strtoull(argv[1], nullptr, 0) : size_t(64) << 20;
  const int iterations = argc > 2 ? std::atoi(argv[2]) : 20;
  if (bytes == 0 || bytes > (size_t(1) << 31) || iterations <= 0) {
    std::fprintf(stderr, "usage: soft_gpu_rdma [BYTES <= 2 GiB] [ITERATIONS]\n");
    return 2;
  }
  const uint16_t port = uint16_t(20000 + getpid() % 20000);
  const pid_t server_pid = fork();
  if (server_pid == 0) std::_Exit(server(port, bytes));
  const pid_t client_pid = fork();
  if (client_pid == 0) std::_Exit(client(port, bytes, iterations));
  int worst = 0;
  for (pid_t pid : {server_pid, client_pid}) {
    int status = 0;
    waitpid(pid, &status, 0);
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 1;
    if (code == 77 && worst == 0) worst = 77;
    else if (code != 0 && code != 77) worst = 1;
  }
  if (worst == 77) std::printf("soft_gpu_rdma: no GPU here: skipped\n");
  else std::printf("soft_gpu_rdma: %s\n", worst ? "FAILED" : "passed");
  return worst;
}
