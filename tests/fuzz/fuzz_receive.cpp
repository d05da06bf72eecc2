// libFuzzer target: the packet decoders and the engine's receive path, both
// modes. The first input byte picks the mode (bit 0: roce) and, in stellar
// mode, the engine's connection token (bit 1: `fuzz_token`, else 0, which is
// what generated packets carry), and with bit 2 loopback addresses and a QP
// that takes packets without the CRC; the rest is one datagram fed to a connected
// responder/requester with registered memory, receives posted and work
// outstanding, so that every branch of the receive path is reachable, the
// token check included. Nothing may crash, and memory outside the registered
// region stays intact.
#include <arpa/inet.h>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "stellar/offload/engine.hpp"

using namespace stellar::offload;

namespace {

struct Memory : MemoryAccess {
  alignas(8) uint8_t region[3 * 4096];  // middle page registered, outer pages are guards
  Memory() { std::memset(region, 0xab, sizeof region); }
  uint8_t* resolve(uint32_t rkey, uint64_t address, uint64_t length, uint32_t) override {
    const uint64_t base = reinterpret_cast<uint64_t>(region + 4096);
    if (rkey != 0x1234 || address < base || length > 4096 || address - base > 4096 - length) return nullptr;
    return reinterpret_cast<uint8_t*>(address);
  }
  bool guards_intact() const {
    for (size_t i = 0; i < 4096; ++i)
      if (region[i] != 0xab || region[2 * 4096 + i] != 0xab) return false;
    return true;
  }
};

// The stellar connection token of inputs whose first byte has bit 1 set
// (corpus/stellar-token-*: datagrams that carry it).
constexpr uint64_t fuzz_token = 0x5eed5eed5eed5eedull;

struct Sink : CompletionSink {
  void deliver(const Completion&) override {}
};

struct Rig {
  Memory memory;
  Sink sink;
  std::unique_ptr<QpEngine> engine;
  std::vector<uint8_t> local = std::vector<uint8_t>(64 * 1024);
  std::vector<uint8_t> out = std::vector<uint8_t>(8192);
  Rig(Mode mode, uint64_t token, bool loopback) {
    EngineConfig c;
    c.mode = mode;
    c.loopback_unchecked = loopback;
    c.local_token = token;
    c.remote_token = token;
    c.local_qpn = 7;
    c.remote_qpn = 9;
    c.send_psn = 100;
    c.receive_psn = 0;
    c.window_packets = 1024;
    engine = std::make_unique<QpEngine>(c, memory, sink);
  }
  void prime() {
    // Outstanding work of every kind, so responses and ACKs find something.
    for (auto op : {WorkOpcode::rdma_write, WorkOpcode::rdma_read, WorkOpcode::atomic_fetch_add, WorkOpcode::send}) {
      SendWork w;
      w.opcode = op;
      w.segment_count = 1;
      w.segments[0] = Segment{local.data(), op == WorkOpcode::atomic_fetch_add ? 8u : 9000u};
      engine->post_send(w, 0);
    }
    ReceiveWork r;
    r.segment_count = 1;
    r.segments[0] = Segment{local.data() + 32768, 16384};
    engine->post_receive(r);
    TxBuffer b{out.data(), uint32_t(out.size()), 0};
    while (engine->transmit(&b, 1, 1) == 1) {}
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const Mode mode = (data[0] & 1) ? Mode::roce : Mode::stellar;
  const uint64_t token = (data[0] & 2) ? fuzz_token : 0;
  // Bit 2: between loopback addresses, with a QP that agreed to take
  // packets without the CRC (corpus/stellar-token-unchecked-*): the
  // unchecked flag's paths (docs/wire-format.md, "The CRC on loopback").
  const bool loopback = (data[0] & 4) != 0;
  IcrcAddresses addresses;
  if (loopback) addresses.source_ip = addresses.destination_ip = htonl(INADDR_LOOPBACK);
  Header h;
  (void)decode(mode, data + 1, size - 1, addresses, h);
  Rig rig(mode, token, loopback);
  rig.prime();
  rig.engine->receive(data + 1, size - 1, addresses, 10);
  // The same bytes as a datagram received into place (EngineHost's direct
  // placement): headers, payload and trailer in three pieces.
  if (mode == Mode::stellar && size - 1 >= stellar_write_header_bytes + 4)
    rig.engine->receive_placed(data + 1, stellar_write_header_bytes, data + 1 + stellar_write_header_bytes,
                               uint32_t(size - 1 - stellar_write_header_bytes - 4), data + size - 4, addresses, 12);
  // The decoded form skips the checksum, reaching deeper engine states.
  if (decode(mode, data + 1, size - 1, addresses, h) != DecodeError::none && size > 8) {
    Header forged;
    std::memcpy(&forged.psn, data + 1, 4);
    forged.opcode = uint8_t(data[5] % (opcode::last_valid + 1));
    forged.dest_qpn = 7;
    forged.pkey = default_pkey;
    forged.token = (data[7] & 0x1f) == 0x1f ? ~token : token;  // now and then a wrong one: dropped, changes nothing
    std::memcpy(&forged.remote_addr, data + 1, std::min<size_t>(8, size - 1));
    forged.rkey = data[6] & 1 ? 0x1234 : 0;
    forged.dma_length = data[7] * 64u;
    forged.has_ack = data[8] & 1;
    forged.ack_psn = forged.psn;
    forged.payload = data + 1;
    forged.payload_length = uint32_t(std::min<size_t>(size - 1, 4096));
    forged.message_length = forged.payload_length + (data[8] & 0xf0) * 16u;
    forged.message_offset = data[8] & 0x0f;
    if (forged.message_offset + forged.payload_length > forged.message_length) forged.message_offset = 0;
    rig.engine->receive_decoded(forged, 20);
  }
  std::vector<uint8_t> out(8192);
  TxBuffer b{out.data(), uint32_t(out.size()), 0};
  for (int i = 0; i < 64 && rig.engine->transmit(&b, 1, 30) == 1; ++i) {}
  if (!rig.memory.guards_intact()) std::abort();
  return 0;
}
