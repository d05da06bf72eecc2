// Hot-path microbenchmarks (Google Benchmark): codecs with checksums, and a
// full engine round trip over an in-memory channel.
#include <arpa/inet.h>
#include <benchmark/benchmark.h>

#include "core/registration_cache.hpp"

#include "engine_harness.hpp"
#include "stellar/offload/cc.hpp"
#include "stellar/stellar.hpp"

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

// A latency test's traffic through the engines alone (no sockets): one
// 8-byte inline WRITE each way per iteration, each carrying the
// acknowledgement of the one before, between loopback addresses (no CRC),
// as stellar_write_lat sends them; both sides post, transmit, take the
// peer's packet and complete. Items are one-way trips; the host's and the
// kernel's share of a one-way is not in it.
static void engine_pingpong_8b(benchmark::State& state) {
  using namespace stellar::test;
  EngineConfig config;
  config.loopback_unchecked = true;
  const uint32_t lo = htonl(0x7f000001);
  config.tx_addresses = IcrcAddresses{lo, lo, 40000, 40001};
  Pair p(Mode::stellar, ChannelFaults{}, 1, config);
  p.rx_a = p.rx_b = config.tx_addresses;
  std::vector<uint8_t> at_a(64), at_b(64), source(8, 1);
  const uint32_t key_a = p.memory_a.add(at_a.data(), at_a.size(), access_remote_write);
  const uint32_t key_b = p.memory_b.add(at_b.data(), at_b.size(), access_remote_write);
  SendWork to_b = make_work(WorkOpcode::rdma_write, 1, source.data(), 8);
  to_b.remote_addr = reinterpret_cast<uint64_t>(at_b.data());
  to_b.rkey = key_b;
  to_b.inline_data = true;
  SendWork to_a = to_b;
  to_a.remote_addr = reinterpret_cast<uint64_t>(at_a.data());
  to_a.rkey = key_a;
  std::vector<uint8_t> flat(256);
  auto one_way = [&](QpEngine& from, QpEngine& to, const SendWork& w, const IcrcAddresses& rx) {
    from.post_send(w, p.now);
    const size_t n = from.transmit(p.tx.data(), 4, p.now);
    for (size_t i = 0; i < n; ++i) to.receive(flat.data(), flatten(p.tx[i], flat.data(), flat.size()), rx, p.now);
    p.now += 1000;  // under the ACK delay: every acknowledgement rides on the next WRITE
  };
  for (auto _ : state) {
    one_way(*p.a, *p.b, to_b, p.rx_b);
    one_way(*p.b, *p.a, to_a, p.rx_a);
    p.cq_a.sends.clear();
    p.cq_b.sends.clear();
  }
  state.SetItemsProcessed(int64_t(state.iterations()) * 2);
}
BENCHMARK(engine_pingpong_8b);

static void checksum_crc32c(benchmark::State& state) {
  std::vector<uint8_t> data(size_t(state.range(0)), 7);
  uint32_t reg = ~0u;
  for (auto _ : state) benchmark::DoNotOptimize(reg = crc32c_extend(reg, data.data(), data.size()));
  state.SetItemsProcessed(int64_t(state.iterations()));
  state.SetBytesProcessed(int64_t(state.iterations()) * state.range(0));
}
BENCHMARK(checksum_crc32c)->Arg(64)->Arg(4096);

static void checksum_roce_icrc(benchmark::State& state) {
  std::vector<uint8_t> data(size_t(state.range(0)), 7);
  for (auto _ : state) benchmark::DoNotOptimize(roce_icrc(data.data(), data.size(), IcrcAddresses{}));
  state.SetItemsProcessed(int64_t(state.iterations()));
  state.SetBytesProcessed(int64_t(state.iterations()) * state.range(0));
}
BENCHMARK(checksum_roce_icrc)->Arg(64)->Arg(4096);

// One congestion-control update per acknowledgement, as the engine does.
static void congestion_control_ack(benchmark::State& state, CcAlgorithm algorithm) {
  auto cc = make_congestion_control(algorithm, CcConfig{});
  uint64_t now = 1'000'000;
  for (auto _ : state) {
    now += 1000;
    cc->on_send(now, 4096);
    cc->on_ack(now, 4096, 20'000 + (now / 1000) % 30'000);
    if ((now / 1000) % 64 == 0) cc->on_congestion_notification(now);
    cc->on_tick(now);
    benchmark::DoNotOptimize(cc->can_send(now, 64 * 4096, 4096));
  }
  state.SetItemsProcessed(int64_t(state.iterations()));
}
BENCHMARK_CAPTURE(congestion_control_ack, dcqcn, CcAlgorithm::dcqcn);
BENCHMARK_CAPTURE(congestion_control_ack, swift, CcAlgorithm::swift);

// SACK bookkeeping: ACK packets each advancing 16 PSNs with 63 SACKed beyond
// a hole, fed to a requester with 2048 packets outstanding; items = ACKs.
static void engine_sack_processing(benchmark::State& state) {
  using namespace stellar::test;
  std::vector<uint8_t> target(8 << 20), source(8 << 20, 1);
  std::unique_ptr<Pair> pair;
  for (auto _ : state) {
    state.PauseTiming();
    pair.reset();  // tearing the previous one down is not what is measured
    pair = std::make_unique<Pair>(Mode::stellar, ChannelFaults{}, 1);
    Pair& p = *pair;
    const uint32_t rkey = p.memory_b.add(target.data(), target.size(), access_remote_write);
    SendWork w = make_work(WorkOpcode::rdma_write, 1, source.data(), 8 << 20);
    w.remote_addr = reinterpret_cast<uint64_t>(target.data());
    w.rkey = rkey;
    p.a->post_send(w, p.now);
    p.pump(*p.a, p.a_to_b);  // 2048 packets in flight
    Header ack;
    ack.opcode = opcode::acknowledge;
    ack.dest_qpn = 0x11;
    ack.syndrome = syndrome::ack;
    ack.has_ack = true;
    state.ResumeTiming();
    for (uint32_t i = 0; i < 120; ++i) {
      ack.ack_psn = 0xfffffff0u + i * 16;  // cumulative, with SACK bits beyond
      ack.sack_bitmap = 0xfffffffffffffffeull;
      p.a->receive_decoded(ack, p.now + i);
    }
  }
  state.SetItemsProcessed(int64_t(state.iterations()) * 120);
}
BENCHMARK(engine_sack_processing)->Unit(benchmark::kMicrosecond);

// Completion-queue polling through the public API with nothing to find: the
// cost of one busy-poll iteration (includes the provider's receive syscall).
static void cq_poll_empty(benchmark::State& state) {
  auto ctx = stellar::Context::open().value();
  auto cq = ctx->create_cq(256).value();
  stellar::WorkCompletion wc[16];
  for (auto _ : state) benchmark::DoNotOptimize(cq->poll(wc));
  state.SetItemsProcessed(int64_t(state.iterations()));
}
BENCHMARK(cq_poll_empty);

// Registering and deregistering a region (random keys, tenant tables). The
// per-packet rkey lookup itself is private to the provider (one hash lookup
// and bounds checks inside engine_write_1mib's per-packet cost).
static void mr_register_deregister(benchmark::State& state) {
  auto ctx = stellar::Context::open().value();
  auto pd = ctx->allocate_pd().value();
  std::vector<uint8_t> buffer(4096);
  for (auto _ : state) {
    auto mr = pd->register_memory(buffer.data(), buffer.size(), stellar::access_local_write | stellar::access_remote_write);
    benchmark::DoNotOptimize(mr.ok());
  }
  state.SetItemsProcessed(int64_t(state.iterations()));
}
BENCHMARK(mr_register_deregister);

// MR lookup by address range: the registration cache a framework hits when it
// registers the same buffers again (src/core/registration_cache.hpp), with
// state.range(0) registrations of 1 MiB each in the index, looking up a
// 64 KiB range inside one of them (a hit, then the reference is dropped).
static void mr_cache_lookup(benchmark::State& state) {
  stellar::RegistrationCache<uint32_t> cache([](uint32_t&&) {});
  const uint64_t base = 1ull << 40, region = 1ull << 20;
  for (int64_t i = 0; i < state.range(0); ++i) cache.insert(base + uint64_t(i) * region, region, uint32_t(i));
  uint64_t i = 0;
  for (auto _ : state) {
    const uint64_t which = (i++ * 2654435761u) % uint64_t(state.range(0));
    auto hit = cache.lookup(base + which * region + 4096, 64 * 1024);
    benchmark::DoNotOptimize(hit.has_value());
  }
  state.SetItemsProcessed(int64_t(state.iterations()));
}
BENCHMARK(mr_cache_lookup)->Arg(16)->Arg(1024);

BENCHMARK_MAIN();
