// gloo_allreduce: Gloo's ring allreduce (gloo::AllreduceRing over its TCP
// transport) on N forked local ranks, in stellar_allreduce's output format:
// the peer bench/allreduce_compare.sh measures Stellar against.
#include <gloo/allreduce_ring.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <vector>

#include "peer_common.hpp"

namespace {

int run_rank(int rank, const peer::Sweep& sweep, const std::string& store_path) {
  gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto device = gloo::transport::tcp::CreateDevice(attr);
  gloo::rendezvous::FileStore store(store_path);
  gloo::rendezvous::PrefixStore prefix("allreduce", store);
  auto context = std::make_shared<gloo::rendezvous::Context>(rank, sweep.ranks);
  context->connectFullMesh(prefix, device);
  if (rank == 0) peer::print_header("gloo_allreduce (gloo::AllreduceRing, TCP)", sweep.ranks);
  std::vector<float> timing(1);
  for (size_t bytes = sweep.min_bytes; bytes <= sweep.max_bytes; bytes = size_t(double(bytes) * sweep.factor)) {
    const size_t count = bytes / sizeof(float);
    std::vector<float> data(count);
    gloo::AllreduceRing<float> allreduce(context, {data.data()}, int(count));
    gloo::AllreduceRing<float> average(context, {timing.data()}, 1);
    for (size_t i = 0; i < count; ++i) data[i] = float((rank * 7 + i * 3) % 5 + 1);
    allreduce.run();  // checked once, before the timed runs change the values
    long wrong = 0;
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int r = 0; r < sweep.ranks; ++r) want += float((r * 7 + i * 3) % 5 + 1);
      wrong += data[i] != want;
    }
    for (int i = 0; i < sweep.warmup; ++i) allreduce.run();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < sweep.iterations; ++i) allreduce.run();
    timing[0] = float(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / sweep.iterations);
    average.run();
    if (rank == 0) peer::print_row(count * sizeof(float), timing[0] / float(sweep.ranks), sweep.ranks, wrong);
    if (count == 0) break;
  }
  // Leave together, through the store rather than the pairs: a rank that
  // exits as soon as its own last allreduce returned closes its connections
  // while a slower peer may still be reading from it, and that peer dies of
  // "Connection closed by peer" (seen about one 4-rank run in three).
  prefix.set("done/" + std::to_string(rank), {1});
  std::vector<std::string> done;
  for (int r = 0; r < sweep.ranks; ++r) done.push_back("done/" + std::to_string(r));
  prefix.wait(done);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const peer::Sweep sweep = peer::parse_sweep(argc, argv);
  const std::string store = std::filesystem::temp_directory_path() / ("gloo_allreduce." + std::to_string(getpid()));
  std::filesystem::create_directories(store);
  std::vector<pid_t> children;
  for (int r = 0; r < sweep.ranks; ++r) {
    const pid_t pid = fork();
    if (pid == 0) std::_Exit(run_rank(r, sweep, store));
    children.push_back(pid);
  }
  int worst = 0;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    worst = std::max(worst, WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
  }
  std::filesystem::remove_all(store);
  return worst;
}
