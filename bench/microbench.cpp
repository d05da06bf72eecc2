// Hot-path microbenchmarks (Google Benchmark): codecs with checksums, and a
// full engine round trip over an in-memory channel.
#include <benchmark/benchmark.h>

#include "engine_harness.hpp"

using namespace stellar::offload;

static void encode_decode(benchmark::State& state, Mode mode) {
  const uint32_t payload = uint32_t(state.range(0));
  std::vector<uint8_t> buf(payload + max_header_bytes);
  Header h;
  h.opcode = opcode::write_middle;
  h.payload_length = payload;
  h.message_length = payload;
  h.dma_length = payload;
  Header d;
  for (auto _ : state) {
    const size_t n = encode(mode, h, buf.data(), buf.size(), IcrcAddresses{});
    benchmark::DoNotOptimize(decode(mode, buf.data(), n, IcrcAddresses{}, d));
  }
  state.SetItemsProcessed(int64_t(state.iterations()));
  state.SetBytesProcessed(int64_t(state.iterations()) * payload);
}
BENCHMARK_CAPTURE(encode_decode, stellar, Mode::stellar)->Arg(8)->Arg(4096);
BENCHMARK_CAPTURE(encode_decode, roce, Mode::roce)->Arg(8)->Arg(4096);

static void engine_write_1mib(benchmark::State& state, Mode mode) {
  using namespace stellar::test;
  std::vector<uint8_t> target(1 << 20), source(1 << 20, 1);
  for (auto _ : state) {
    Pair p(mode, ChannelFaults{0, 0, 0, 0, 0, 0}, 1);
    const uint32_t rkey = p.memory_b.add(target.data(), target.size(), access_remote_write);
    SendWork w = make_work(WorkOpcode::rdma_write, 1, source.data(), uint32_t(source.size()));
    w.remote_addr = reinterpret_cast<uint64_t>(target.data());
    w.rkey = rkey;
    p.a->post_send(w, p.now);
    p.run([&] { return !p.cq_a.sends.empty(); });
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * (1 << 20));
}
BENCHMARK_CAPTURE(engine_write_1mib, stellar, Mode::stellar);
BENCHMARK_CAPTURE(engine_write_1mib, roce, Mode::roce);

BENCHMARK_MAIN();
