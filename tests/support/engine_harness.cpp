#include "engine_harness.hpp"

#include <cstdlib>

namespace stellar::test {

uint32_t FakeMemory::add(void* base, uint64_t length, uint32_t access) {
  const uint32_t key = next_key_ += 0x9e37;
  regions_[key] = Region{reinterpret_cast<uint64_t>(base), length, access};
  return key;
}

void FakeMemory::remove(uint32_t key) {
  regions_.erase(key);
  ++generation_;
}

uint8_t* FakeMemory::resolve(uint32_t rkey, uint64_t address, uint64_t length, uint32_t access) {
  auto it = regions_.find(rkey);
  if (it == regions_.end()) return nullptr;
  const Region& r = it->second;
  if ((r.access & access) != access) return nullptr;
  if (address < r.address || length > r.length || address - r.address > r.length - length) return nullptr;
  return reinterpret_cast<uint8_t*>(address);
}

void Channel::send(const uint8_t* data, size_t length, uint64_t now, uint16_t path) {
  ++sent_per_path[path];
  if (filter && filter(data, length)) return;
  if (chance(faults_.drop)) return;
  const PathFault* pf = paths.empty() ? nullptr : &paths[path % paths.size()];
  if (pf && (pf->dead || chance(pf->drop))) return;
  const uint64_t departure = std::max(now, last_departure_ + faults_.spacing_ns);
  last_departure_ = departure;
  Datagram d{std::vector<uint8_t>(data, data + length), departure + faults_.delay_ns + jitter()};
  if (chance(faults_.corrupt) && length > 0) {
    std::uniform_int_distribution<size_t> at(0, length - 1);
    d.bytes[at(rng_)] ^= uint8_t(1u << (rng_() % 8));
  }
  if (chance(faults_.reorder)) d.due += faults_.delay_ns * 3 + 5'000;  // overtaken by later ones
  if (faults_.slow_every && ++sent_ % faults_.slow_every == 0) d.due += faults_.slow_extra_ns;
  if (pf) d.due += pf->extra_ns;
  if (pf && chance(pf->mark)) d.mark = true;
  if (chance(faults_.duplicate)) queue_.push_back(Datagram{d.bytes, d.due + 1'000});
  queue_.push_back(std::move(d));
}

bool Channel::chance(double p) { return p > 0 && std::uniform_real_distribution<double>(0, 1)(rng_) < p; }

uint64_t Channel::jitter() { return faults_.jitter_ns ? rng_() % faults_.jitter_ns : 0; }

Pair::Pair(Mode mode, ChannelFaults faults, uint64_t seed, EngineConfig base) : a_to_b(faults, seed), b_to_a(faults, seed * 7 + 1) {
  base.mode = mode;
  EngineConfig ca = base, cb = base;
  ca.local_qpn = 0x11;
  ca.remote_qpn = 0x22;
  cb.local_qpn = 0x22;
  cb.remote_qpn = 0x11;
  ca.send_psn = cb.receive_psn = mode == Mode::roce ? 0xfffff0 : 0xfffffff0;  // exercise wrap-around
  // stellar: every packet carries the receiver's connection token, as the
  // soft provider configures it (unless the test chose its own).
  if (mode == Mode::stellar && base.local_token == 0 && base.remote_token == 0) {
    ca.local_token = cb.remote_token = token_a;
    cb.local_token = ca.remote_token = token_b;
  }
  cb.send_psn = ca.receive_psn = 77;
  a = std::make_unique<QpEngine>(ca, memory_a, cq_a);
  b = std::make_unique<QpEngine>(cb, memory_b, cq_b);
  buffers.resize(32, std::vector<uint8_t>(base.mtu + max_header_bytes + 64));
  for (auto& buffer : buffers) tx.push_back(TxBuffer{buffer.data(), uint32_t(buffer.size()), 0});
}

void Pair::pump(QpEngine& e, Channel& out) {
  for (;;) {
    const size_t n = e.transmit(tx.data(), tx.size(), now);
    for (size_t i = 0; i < n; ++i) {
      flat.resize(tx[i].length);
      // A datagram the engine cannot flatten into its own length is a bug
      // in the engine's bookkeeping: stop at once, under any test runner.
      if (flatten(tx[i], flat.data(), flat.size()) != tx[i].length) std::abort();
      out.send(flat.data(), flat.size(), now, tx[i].path);
    }
    if (n < tx.size()) break;
  }
}

void Pair::step() {
  pump(*a, a_to_b);
  if (b_alive) pump(*b, b_to_a);
  if (settle_after_transmit) {
    a->settle_acknowledgement();
    if (b_alive) b->settle_acknowledgement();
  }
  a_to_b.deliver_due(now, [&](const uint8_t* d, size_t n, bool mark) {
    if (b_alive) b->receive(d, n, rx_b, now, 0, mark);
  });
  b_to_a.deliver_due(now, [&](const uint8_t* d, size_t n, bool mark) { a->receive(d, n, rx_a, now, 0, mark); });
  // Jump to the next event when nothing is in the channel.
  uint64_t next = std::min(a->next_wakeup_ns(now), b_alive ? b->next_wakeup_ns(now) : UINT64_MAX);
  if (!a_to_b.empty() || !b_to_a.empty()) next = std::min(next, now + 500);
  now = std::max(now + 100, std::min(next, now + 1'000'000));
}

std::vector<uint8_t> pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  std::mt19937 r(seed);
  for (auto& x : v) x = uint8_t(r());
  return v;
}

SendWork make_work(WorkOpcode op, uint64_t wr_id, void* local, uint32_t length) {
  SendWork w;
  w.wr_id = wr_id;
  w.opcode = op;
  w.segment_count = 1;
  w.segments[0] = Segment{static_cast<uint8_t*>(local), length};
  return w;
}

}  // namespace stellar::test
