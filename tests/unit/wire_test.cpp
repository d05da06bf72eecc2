// Wire codecs: every opcode round-trips in both modes; truncation, bad
// opcodes and flipped bits are detected.
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <zlib.h>

#include <cstring>
#include <vector>

#include "stellar/offload/wire.hpp"

using namespace stellar::offload;

namespace {

Header sample(uint8_t op) {
  Header h;
  h.opcode = op;
  h.ack_request = true;
  h.pkey = 0x8001;
  h.dest_qpn = 0x123456;
  h.psn = 0xabcdef;
  h.remote_addr = 0x1122334455667788ull;
  h.rkey = 0xdeadbeef;
  h.dma_length = 5000;
  h.syndrome = syndrome::nak_remote_access;
  h.msn = 77;
  h.swap_add = 5;
  h.compare = 9;
  h.atomic_original = 0xfeed;
  h.imm = 0xcafe;
  h.message_offset = 0;
  h.message_length = 5000;
  h.receive_sequence = 3;
  h.has_ack = true;
  h.ack_psn = 42;
  h.sack_bitmap = 0x5;
  h.ack_delay_ns = 123'456;
  h.token = 0x0123456789abcdefull;
  h.path = 0xbeef;
  h.sack_offset = 0x1234;
  h.echo_path = 0x4321;
  return h;
}

bool carries(uint8_t op) { return opcode_is_send(op) || opcode_is_write(op) || opcode_is_read_response(op); }

class WireModes : public ::testing::TestWithParam<Mode> {};

TEST_P(WireModes, EveryOpcodeRoundTrips) {
  const Mode mode = GetParam();
  const IcrcAddresses addresses{0x0100007f, 0x0200007f, 5000, roce_udp_port};
  for (uint8_t op = 0; op <= opcode::last_valid; ++op) {
    Header h = sample(op);
    h.payload_length = carries(op) ? 13 : 0;
    std::vector<uint8_t> buf(256);
    const size_t at = payload_offset(mode, h);
    for (uint32_t i = 0; i < h.payload_length; ++i) buf[at + i] = uint8_t(i * 7);
    const size_t n = encode(mode, h, buf.data(), buf.size(), addresses);
    ASSERT_GT(n, 0u) << int(op);
    Header d;
    ASSERT_EQ(decode(mode, buf.data(), n, addresses, d), DecodeError::none) << int(op);
    EXPECT_EQ(d.opcode, op);
    EXPECT_EQ(d.dest_qpn, h.dest_qpn);
    EXPECT_EQ(d.psn, h.psn & (mode == Mode::roce ? 0xffffffu : 0xffffffffu));
    EXPECT_EQ(d.pkey, h.pkey);
    EXPECT_EQ(d.payload_length, h.payload_length);
    for (uint32_t i = 0; i < d.payload_length; ++i) EXPECT_EQ(d.payload[i], uint8_t(i * 7));
    if (opcode_has_imm(op)) {
      EXPECT_EQ(d.imm, h.imm);
    }
    if (op == opcode::compare_swap || op == opcode::fetch_add) {
      EXPECT_EQ(d.remote_addr, h.remote_addr);
      EXPECT_EQ(d.rkey, h.rkey);
      EXPECT_EQ(d.swap_add, h.swap_add);
      EXPECT_EQ(d.compare, h.compare);
    }
    if (op == opcode::atomic_acknowledge) {
      EXPECT_EQ(d.atomic_original, h.atomic_original);
    }
    if (op == opcode::acknowledge) {
      EXPECT_EQ(d.syndrome, h.syndrome);
      EXPECT_EQ(d.msn, h.msn);
    }
    if (op == opcode::read_request || op == opcode::write_first || op == opcode::write_only) {
      EXPECT_EQ(d.remote_addr, h.remote_addr);
      EXPECT_EQ(d.rkey, h.rkey);
      EXPECT_EQ(d.dma_length, h.dma_length);
    }
    if (mode == Mode::stellar) {
      EXPECT_TRUE(d.has_ack);
      EXPECT_EQ(d.ack_psn, 42u);
      EXPECT_EQ(d.sack_bitmap, 5u);
      EXPECT_EQ(d.ack_delay_ns, 123'456u);
      EXPECT_EQ(d.token, 0x0123456789abcdefull);
      EXPECT_EQ(d.path, 0xbeef);
      EXPECT_EQ(d.sack_offset, 0x1234);
      EXPECT_EQ(d.echo_path, 0x4321);
    } else {
      EXPECT_EQ(d.token, 0u) << "roce mode has no token on the wire";
      EXPECT_EQ(d.path, 0u) << "roce mode is one path";
    }
    // Every truncation is caught.
    for (size_t cut = 0; cut < n; ++cut) EXPECT_NE(decode(mode, buf.data(), cut, addresses, d), DecodeError::none) << cut;
    // Every single-bit flip is caught (CRC), or at worst decodes to a
    // different valid header; never crashes.
    for (size_t byte = 0; byte < n; ++byte) {
      if (mode == Mode::roce && byte == 4) continue;  // FECN/BECN/reserved: variant, outside the ICRC by design
      buf[byte] ^= 0x10;
      EXPECT_NE(decode(mode, buf.data(), n, addresses, d), DecodeError::none) << "byte " << byte;
      buf[byte] ^= 0x10;
    }
  }
}

TEST_P(WireModes, UnknownOpcodeRejected) {
  std::vector<uint8_t> buf(128, 0);
  Header h = sample(opcode::acknowledge);
  const size_t n = encode(GetParam(), h, buf.data(), buf.size(), {});
  // 0x1b is unassigned in both modes; 0x1c-0x1f are the stellar mode's path
  // sizing and validation opcodes, which roce mode refuses.
  for (uint8_t op : {uint8_t(0x1b), opcode::path_size, opcode::path_size_ack, opcode::path_challenge, opcode::path_response}) {
    if (GetParam() == Mode::stellar && opcode_is_host_control(op)) continue;
    buf[GetParam() == Mode::roce ? 0 : 2] = op;
    Header d;
    EXPECT_EQ(decode(GetParam(), buf.data(), n, {}, d), DecodeError::bad_opcode) << int(op);
  }
}

// Path validation (docs/multipath.md, "Address change"): base header + the
// 8 challenge bytes + CRC; any other length is refused.
TEST(StellarWire, PathChallengeCarriesEightBytes) {
  for (uint8_t op : {opcode::path_challenge, opcode::path_response}) {
    Header h;
    h.opcode = op;
    h.pkey = 0x8001;
    h.dest_qpn = 0x123456;
    h.token = 0x1122334455667788ull;
    h.challenge = 0xa5a5f00dcafe0001ull;
    std::vector<uint8_t> buf(128, 0);
    const size_t n = encode(Mode::stellar, h, buf.data(), buf.size(), {});
    ASSERT_EQ(n, 48u + 8u + 4u);
    EXPECT_EQ(buf[2], op);
    EXPECT_EQ(buf[6] << 8 | buf[7], 56) << "header length";
    uint64_t on_wire = 0;
    for (int i = 0; i < 8; ++i) on_wire = on_wire << 8 | buf[48 + size_t(i)];
    EXPECT_EQ(on_wire, h.challenge);
    Header d;
    ASSERT_EQ(decode(Mode::stellar, buf.data(), n, {}, d), DecodeError::none);
    EXPECT_EQ(d.opcode, op);
    EXPECT_EQ(d.challenge, h.challenge);
    EXPECT_EQ(d.token, h.token);
    EXPECT_EQ(d.dest_qpn, h.dest_qpn);
    EXPECT_EQ(d.payload_length, 0u);
    for (size_t cut = 0; cut < n; ++cut) EXPECT_NE(decode(Mode::stellar, buf.data(), cut, {}, d), DecodeError::none) << cut;
    buf[50] ^= 4;
    EXPECT_EQ(decode(Mode::stellar, buf.data(), n, {}, d), DecodeError::bad_checksum);
  }
}

// Path MTU discovery (docs/wire-format.md, "Path MTU"): base header, 16
// bytes of nonce, size and kind, then padding (a probe is as large as the
// packets it tests), then the CRC over all of it.
TEST(StellarWire, PathSizeProbesArePaddedAndChecked) {
  for (uint8_t op : {opcode::path_size, opcode::path_size_ack}) {
    for (uint32_t padding : {0u, 8704u}) {
      Header h;
      h.opcode = op;
      h.pkey = 0x8001;
      h.dest_qpn = 0x123456;
      h.token = 0x1122334455667788ull;
      h.path = 7;
      h.challenge = 0xa5a5f00dcafe0001ull;
      h.size_bytes = 8704;
      h.size_set = padding == 0;
      h.payload_length = padding;
      std::vector<uint8_t> buf(64 + padding + 4, 0x5a);
      const size_t n = encode(Mode::stellar, h, buf.data(), buf.size(), {});
      ASSERT_EQ(n, 48u + 16u + padding + 4u);
      EXPECT_EQ(buf[6] << 8 | buf[7], 64) << "header length";
      Header d;
      ASSERT_EQ(decode(Mode::stellar, buf.data(), n, {}, d), DecodeError::none);
      EXPECT_EQ(d.opcode, op);
      EXPECT_EQ(d.challenge, h.challenge);
      EXPECT_EQ(d.size_bytes, 8704u);
      EXPECT_EQ(d.size_set, h.size_set);
      EXPECT_EQ(d.path, 7);
      EXPECT_EQ(d.payload_length, padding);
      for (size_t cut = 0; cut < 64 + 4; ++cut) EXPECT_NE(decode(Mode::stellar, buf.data(), cut, {}, d), DecodeError::none) << cut;
      buf[n - 5] ^= 1;  // the padding, or the kind byte: under the CRC either way
      EXPECT_EQ(decode(Mode::stellar, buf.data(), n, {}, d), DecodeError::bad_checksum);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, WireModes, ::testing::Values(Mode::stellar, Mode::roce));

TEST(RoceWire, LayoutMatchesIbta) {
  // RDMA WRITE ONLY: BTH(12) RETH(16) payload(pad to 4) ICRC(4), on UDP 4791.
  Header h;
  h.opcode = opcode::write_only;
  h.dest_qpn = 0x000102;
  h.psn = 0x030405;
  h.ack_request = true;
  h.remote_addr = 0x1000;
  h.rkey = 0x42;
  h.dma_length = 3;
  h.payload_length = 3;
  std::vector<uint8_t> buf(64, 0);
  const size_t n = encode(Mode::roce, h, buf.data(), buf.size(), {});
  ASSERT_EQ(n, 12u + 16u + 4u + 4u);
  EXPECT_EQ(buf[0], 0x0a);                // opcode RC RDMA WRITE Only
  EXPECT_EQ((buf[1] >> 4) & 3, 1);        // pad count
  EXPECT_EQ(buf[1] & 0x0f, 0);            // transport header version 0
  EXPECT_EQ(buf[2], 0xff);                // default P_Key
  EXPECT_EQ(buf[3], 0xff);
  EXPECT_EQ(buf[7], 0x02);                // destination QP
  EXPECT_EQ(buf[8], 0x80);                // AckReq
  EXPECT_EQ(buf[11], 0x05);               // PSN
  EXPECT_EQ(buf[12 + 7], 0x00);           // VA big-endian ...
  EXPECT_EQ(buf[12 + 6], 0x10);
  EXPECT_EQ(buf[12 + 11], 0x42);          // R_Key
  EXPECT_EQ(buf[12 + 15], 0x03);          // DMA length
}

// UDP GSO gives segment k of a message IP id k, which the ICRC covers. The
// fix a sender applies (roce_icrc_ip_id_delta) turns the id-0 ICRC into
// exactly the ICRC over id k; a receiver accepts ids a GSO message can give
// (below gso_ip_ids) and nothing else.
TEST(RoceWire, IcrcFollowsTheIpIdOfGsoSegments) {
  const IcrcAddresses a{0x0100007f, 0x0200007f, 49152, 4791};
  for (uint32_t payload : {4u, 1000u, 4096u}) {
    Header h;
    h.opcode = opcode::write_only;
    h.dest_qpn = 7;
    h.psn = 11;
    h.remote_addr = 0x1000;
    h.rkey = 0x42;
    h.dma_length = payload;
    h.payload_length = payload;
    std::vector<uint8_t> buf(payload + 128, 0);
    const size_t n = encode(Mode::roce, h, buf.data(), buf.size(), a);
    ASSERT_GT(n, 0u);
    uint32_t icrc0;
    std::memcpy(&icrc0, buf.data() + n - 4, 4);
    ASSERT_EQ(icrc0, roce_icrc(buf.data(), n, a, 0));
    for (uint16_t id : {uint16_t(1), uint16_t(2), uint16_t(37), uint16_t(63), uint16_t(64), uint16_t(4660)}) {
      const uint32_t fixed = icrc0 ^ roce_icrc_ip_id_delta(n, id);
      EXPECT_EQ(fixed, roce_icrc(buf.data(), n, a, id)) << "payload " << payload << " id " << id;
      std::vector<uint8_t> segment(buf.begin(), buf.begin() + long(n));
      std::memcpy(segment.data() + n - 4, &fixed, 4);
      Header d;
      EXPECT_EQ(decode(Mode::roce, segment.data(), n, a, d), id < gso_ip_ids ? DecodeError::none : DecodeError::bad_checksum)
          << "payload " << payload << " id " << id;
    }
    std::vector<uint8_t> flipped(buf.begin(), buf.begin() + long(n));
    flipped[n - 5] ^= 1;  // a payload bit
    Header d;
    EXPECT_EQ(decode(Mode::roce, flipped.data(), n, a, d), DecodeError::bad_checksum);
  }
}

}  // namespace

namespace {
// The stellar trailer is CRC-32C of everything before it, checked against a
// bitwise reference for lengths around the three-stream path's thresholds.
TEST(StellarWire, TrailerIsCrc32c) {
  using namespace stellar::offload;
  Header h;
  h.opcode = opcode::write_only;
  for (uint32_t len : {0u, 7u, 700u, 767u, 768u, 769u, 1000u, 4096u, 4099u, 9000u}) {
    std::vector<uint8_t> buf(len + 200);
    h.payload_length = len;
    h.message_length = len;
    h.dma_length = len;
    const size_t at = payload_offset(Mode::stellar, h);
    for (uint32_t i = 0; i < len; ++i) buf[at + i] = uint8_t(i * 31 + 1);
    const size_t n = encode(Mode::stellar, h, buf.data(), buf.size(), {});
    // Reference: bitwise CRC-32C.
    uint32_t c = ~0u;
    for (size_t i = 0; i + 4 < n + 0 && i < n - 4; ++i) {
      c ^= buf[i];
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
    }
    c = ~c;
    const uint32_t stored = uint32_t(buf[n - 4]) << 24 | uint32_t(buf[n - 3]) << 16 | uint32_t(buf[n - 2]) << 8 | buf[n - 1];
    EXPECT_EQ(stored, c) << "payload " << len;
  }
}

// Between loopback addresses a packet may go without its CRC-32C (flags bit
// 3, trailer zero): accepted only when both addresses are in 127.0.0.0/8,
// refused as a bad checksum from anywhere else; a packet with the flag
// clear is checked on loopback as everywhere.
TEST(StellarWire, UncheckedPacketsAreTakenOnlyBetweenLoopbackAddresses) {
  using namespace stellar::offload;
  auto ip = [](uint8_t a, uint8_t b, uint8_t c, uint8_t d) {
    uint32_t v;
    const uint8_t bytes[4] = {a, b, c, d};
    std::memcpy(&v, bytes, 4);
    return v;
  };
  const IcrcAddresses loopback{ip(127, 0, 0, 1), ip(127, 0, 0, 2), 40000, 40001};
  const IcrcAddresses half{ip(10, 0, 0, 1), ip(127, 0, 0, 1), 40000, 40001};
  const IcrcAddresses remote{ip(10, 0, 0, 1), ip(10, 0, 0, 2), 40000, 40001};
  EXPECT_TRUE(is_loopback(loopback));
  EXPECT_FALSE(is_loopback(half));
  EXPECT_FALSE(is_loopback(remote));
  EXPECT_FALSE(is_loopback(IcrcAddresses{}));

  Header h;
  h.opcode = opcode::write_only;
  h.payload_length = h.message_length = h.dma_length = 100;
  h.unchecked = true;
  std::vector<uint8_t> buf(400);
  const size_t at = payload_offset(Mode::stellar, h);
  for (uint32_t i = 0; i < 100; ++i) buf[at + i] = uint8_t(i + 1);
  const size_t n = encode(Mode::stellar, h, buf.data(), buf.size(), loopback);
  ASSERT_GT(n, 0u);
  EXPECT_EQ(buf[3] & 8, 8) << "flags bit 3";
  EXPECT_EQ(buf[n - 4] | buf[n - 3] | buf[n - 2] | buf[n - 1], 0) << "no CRC in the trailer";
  Header d;
  ASSERT_EQ(decode(Mode::stellar, buf.data(), n, loopback, d), DecodeError::none);
  EXPECT_TRUE(d.unchecked);
  EXPECT_EQ(d.payload_length, 100u);
  EXPECT_EQ(decode(Mode::stellar, buf.data(), n, half, d), DecodeError::bad_checksum);
  EXPECT_EQ(decode(Mode::stellar, buf.data(), n, remote, d), DecodeError::bad_checksum);

  // Scattered encoding (payload in registered memory) leaves it out too.
  std::vector<uint8_t> payload(100, 7), head(200), trailer_bytes(8, 0xee);
  PayloadPiece piece{payload.data(), uint32_t(payload.size())};
  uint32_t trailer_length = 0;
  const size_t header = encode_scattered(Mode::stellar, h, head.data(), head.size(), &piece, 1, trailer_bytes.data(), trailer_length, loopback);
  ASSERT_EQ(trailer_length, 4u);
  EXPECT_EQ(trailer_bytes[0] | trailer_bytes[1] | trailer_bytes[2] | trailer_bytes[3], 0);
  std::vector<uint8_t> whole(head.begin(), head.begin() + long(header));
  whole.insert(whole.end(), payload.begin(), payload.end());
  whole.insert(whole.end(), trailer_bytes.begin(), trailer_bytes.begin() + 4);
  EXPECT_EQ(decode(Mode::stellar, whole.data(), whole.size(), loopback, d), DecodeError::none);
  EXPECT_EQ(decode(Mode::stellar, whole.data(), whole.size(), remote, d), DecodeError::bad_checksum);

  // The flag clear: the CRC is written and checked, loopback or not.
  h.unchecked = false;
  const size_t m = encode(Mode::stellar, h, buf.data(), buf.size(), loopback);
  EXPECT_EQ(buf[3] & 8, 0);
  ASSERT_EQ(decode(Mode::stellar, buf.data(), m, loopback, d), DecodeError::none);
  EXPECT_FALSE(d.unchecked);
  buf[at + 5] ^= 1;
  EXPECT_EQ(decode(Mode::stellar, buf.data(), m, loopback, d), DecodeError::bad_checksum);
}
}  // namespace

namespace {
// crc32c_extend over pieces equals the bitwise reference for every length up
// to 2 KiB and any starting register (all code paths: table, crc32, folding).
TEST(StellarWire, Crc32cMatchesReferenceEverywhere) {
  using namespace stellar::offload;
  std::vector<uint8_t> data(2200);
  for (size_t i = 0; i < data.size(); ++i) data[i] = uint8_t(i * 131 + (i >> 3));
  auto reference = [&](uint32_t c, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      c ^= data[i];
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
    }
    return c;
  };
  for (size_t n = 0; n <= 2100; n += (n < 300 ? 1 : 7)) {
    for (uint32_t start : {~0u, 0u, 0x12345678u}) {
      ASSERT_EQ(crc32c_extend(start, data.data(), n), reference(start, n)) << "length " << n << " start " << start;
    }
  }
  // Split into pieces at arbitrary points: same result.
  const uint32_t whole = crc32c_extend(~0u, data.data(), 2000);
  EXPECT_EQ(crc32c_extend(crc32c_extend(~0u, data.data(), 700), data.data() + 700, 1300), whole);
  EXPECT_EQ(~whole, crc32c(data.data(), 2000));
}

// The ICRC's CRC-32 (folded with carry-less multiplication from 256 bytes)
// equals zlib's for every length and split, and any starting register.
TEST(StellarWire, Crc32MatchesZlibEverywhere) {
  using namespace stellar::offload;
  std::vector<uint8_t> data(20000);
  for (size_t i = 0; i < data.size(); ++i) data[i] = uint8_t(i * 197 + (i >> 5) + 3);
  for (size_t n = 0; n <= data.size(); n += (n < 600 ? 1 : 61)) {
    ASSERT_EQ(~crc32_extend(~0u, data.data(), n), uint32_t(crc32(0L, data.data(), uInt(n)))) << "length " << n;
    const uLong seeded = crc32(0x12345678UL, data.data(), uInt(n));
    ASSERT_EQ(~crc32_extend(~0x12345678u, data.data(), n), uint32_t(seeded)) << "length " << n << ", seeded";
  }
  const uint32_t whole = crc32_extend(~0u, data.data(), 9000);
  EXPECT_EQ(crc32_extend(crc32_extend(~0u, data.data(), 4097), data.data() + 4097, 9000 - 4097), whole);
}
}  // namespace

namespace {
using namespace stellar::offload;

// The connection token: 8 bytes at offset 32 of the version-3 base header
// (48 bytes), big-endian, under the CRC like everything else; roce mode stays
// byte-exact RoCEv2 (no token). The path index follows at offset 40.
TEST(StellarWire, TokenSitsAtOffset32AndRoundTrips) {
  Header h;
  h.opcode = opcode::acknowledge;
  h.syndrome = syndrome::ack;
  for (uint64_t token : {0ull, 1ull, 0x8000000000000000ull, 0xfedcba9876543210ull, ~0ull}) {
    h.token = token;
    h.path = uint16_t(token >> 48);
    std::vector<uint8_t> buf(128, 0);
    const size_t n = encode(Mode::stellar, h, buf.data(), buf.size(), {});
    ASSERT_EQ(n, 48u + 4u + 4u) << "base 48, AETH 4, CRC 4";
    EXPECT_EQ(buf[0], 0x53);
    EXPECT_EQ(buf[1], 3) << "version 3";
    EXPECT_EQ(buf[6] << 8 | buf[7], 52) << "header length";
    EXPECT_EQ(buf[40] << 8 | buf[41], h.path) << "path, big-endian";
    EXPECT_EQ(buf[46] | buf[47], 0) << "no congestion marks echoed";
    uint64_t on_wire = 0;
    for (int i = 0; i < 8; ++i) on_wire = on_wire << 8 | buf[32 + size_t(i)];
    EXPECT_EQ(on_wire, token);
    Header d;
    ASSERT_EQ(decode(Mode::stellar, buf.data(), n, {}, d), DecodeError::none);
    EXPECT_EQ(d.token, token);
    EXPECT_EQ(d.path, h.path);
    // A token changed in flight without fixing the CRC is caught as corruption.
    buf[39] ^= 1;
    EXPECT_EQ(decode(Mode::stellar, buf.data(), n, {}, d), DecodeError::bad_checksum);
  }
  // roce: the token does not change a byte.
  std::vector<uint8_t> with(128, 0), without(128, 0);
  Header r = sample(opcode::write_only);
  r.payload_length = 0;
  const size_t a = encode(Mode::roce, r, without.data(), without.size(), {});
  r.token = 0xfedcba9876543210ull;
  const size_t b = encode(Mode::roce, r, with.data(), with.size(), {});
  ASSERT_EQ(a, b);
  EXPECT_EQ(with, without);
}

// A version-1 peer (32-byte base header, no token) is refused as bad_version,
// whatever its length, rather than misread as truncated or corrupt.
TEST(StellarWire, VersionOnePacketsAreRefused) {
  // A well-formed version-1 ACK: base 32 + AETH 4 + CRC-32C 4.
  std::vector<uint8_t> v1(40, 0);
  v1[0] = 0x53;
  v1[1] = 1;
  v1[2] = opcode::acknowledge;
  v1[4] = v1[5] = 0xff;  // pkey
  v1[7] = 36;            // header length
  v1[11] = 0x22;         // destination QPN
  v1[32] = syndrome::ack;
  const uint32_t crc = crc32c(v1.data(), 36);
  for (int i = 0; i < 4; ++i) v1[36 + size_t(i)] = uint8_t(crc >> (24 - 8 * i));
  Header d;
  EXPECT_EQ(decode(Mode::stellar, v1.data(), v1.size(), {}, d), DecodeError::bad_version);
  for (size_t cut = 2; cut < v1.size(); ++cut)
    EXPECT_EQ(decode(Mode::stellar, v1.data(), cut, {}, d), DecodeError::bad_version) << cut;
  // A version-3 packet relabelled as an older version (CRC recomputed) too, and any other version.
  Header h = sample(opcode::write_only);
  h.payload_length = 0;
  h.message_length = 0;
  std::vector<uint8_t> buf(128, 0);
  const size_t n = encode(Mode::stellar, h, buf.data(), buf.size(), {});
  for (uint8_t version : {uint8_t(0), uint8_t(1), uint8_t(2), uint8_t(4), uint8_t(0xff)}) {
    buf[1] = version;
    const uint32_t c = crc32c(buf.data(), n - 4);
    for (int i = 0; i < 4; ++i) buf[n - 4 + size_t(i)] = uint8_t(c >> (24 - 8 * i));
    EXPECT_EQ(decode(Mode::stellar, buf.data(), n, {}, d), DecodeError::bad_version) << int(version);
  }
}
// The echo of ECN CE marks (docs/wire-format.md, offset 46): a count, with
// the marked packet's path in the echoed-path field.
TEST(StellarWire, CongestionMarkCountSitsAtOffset46) {
  Header h;
  h.opcode = opcode::acknowledge;
  h.syndrome = syndrome::ack;
  h.echo_path = 7;
  h.ce_count = 0x1234;
  std::vector<uint8_t> buf(128, 0);
  const size_t n = encode(Mode::stellar, h, buf.data(), buf.size(), {});
  ASSERT_GT(n, 0u);
  EXPECT_EQ(buf[46] << 8 | buf[47], 0x1234);
  EXPECT_EQ(buf[44] << 8 | buf[45], 7);
  Header d;
  ASSERT_EQ(decode(Mode::stellar, buf.data(), n, {}, d), DecodeError::none);
  EXPECT_EQ(d.ce_count, 0x1234);
  EXPECT_EQ(d.echo_path, 7);
}
}  // namespace

// Direct placement receives a WRITE packet in three places (headers, the
// payload in registered memory, the trailer): decode_placed must check and
// read it exactly as decode reads the contiguous datagram, and
// peek_write_placement must read where its payload belongs.
TEST(StellarWire, APacketReceivedInPiecesDecodesAsTheWholeDoes) {
  using namespace stellar::offload;
  Header h;
  h.opcode = opcode::write_middle;
  h.psn = 0xfffffffe;  // wraps: stellar PSNs are 32 bits
  h.dest_qpn = 0x123456;
  h.pkey = 0x8001;
  h.token = 0x0123456789abcdefull;
  h.remote_addr = 0x7f0012345000ull;
  h.rkey = 0xabcd;
  h.message_length = h.dma_length = 3 * 4096;
  h.message_offset = 4096;
  h.payload_length = 4096;
  h.has_ack = true;
  h.ack_psn = 77;
  std::vector<uint8_t> buf(8192);
  const size_t header = payload_offset(Mode::stellar, h);
  ASSERT_EQ(header, stellar_write_header_bytes);
  for (uint32_t i = 0; i < h.payload_length; ++i) buf[header + i] = uint8_t(i * 7 + 3);
  const size_t n = encode(Mode::stellar, h, buf.data(), buf.size(), {});
  ASSERT_EQ(n, header + 4096 + 4);
  Header whole, pieces;
  ASSERT_EQ(decode(Mode::stellar, buf.data(), n, {}, whole), DecodeError::none);
  const std::vector<uint8_t> placed(buf.begin() + long(header), buf.begin() + long(header) + 4096);  // "registered memory"
  ASSERT_EQ(decode_placed(buf.data(), header, placed.data(), 4096, buf.data() + n - 4, {}, pieces), DecodeError::none);
  EXPECT_EQ(pieces.payload, placed.data());
  EXPECT_EQ(pieces.payload_length, whole.payload_length);
  EXPECT_EQ(pieces.psn, whole.psn);
  EXPECT_EQ(pieces.token, whole.token);
  EXPECT_EQ(pieces.remote_addr, whole.remote_addr);
  EXPECT_EQ(pieces.message_offset, whole.message_offset);
  EXPECT_EQ(pieces.ack_psn, whole.ack_psn);
  EXPECT_TRUE(pieces.has_ack);

  WritePlacement p;
  ASSERT_TRUE(peek_write_placement(buf.data(), header, p));
  EXPECT_EQ(p.opcode, opcode::write_middle);
  EXPECT_EQ(p.psn, h.psn);
  EXPECT_EQ(p.dest_qpn, h.dest_qpn);
  EXPECT_EQ(p.pkey, h.pkey);
  EXPECT_EQ(p.rkey, h.rkey);
  EXPECT_EQ(p.remote_addr, h.remote_addr);
  EXPECT_EQ(p.message_offset, h.message_offset);
  EXPECT_EQ(p.message_length, h.message_length);
  EXPECT_FALSE(peek_write_placement(buf.data(), header - 1, p)) << "not exactly the headers";
  EXPECT_FALSE(peek_write_placement(buf.data(), header + 4, p));

  // The CRC covers the payload where it landed: one changed byte there, or
  // a payload shorter than the headers say, is refused.
  std::vector<uint8_t> changed = placed;
  changed[1000] ^= 1;
  EXPECT_EQ(decode_placed(buf.data(), header, changed.data(), 4096, buf.data() + n - 4, {}, pieces), DecodeError::bad_checksum);
  EXPECT_EQ(decode_placed(buf.data(), header - 4, placed.data(), 4096, buf.data() + n - 4, {}, pieces), DecodeError::bad_length);
  EXPECT_NE(decode_placed(buf.data(), header, placed.data(), 4000, buf.data() + n - 4, {}, pieces), DecodeError::none);

  // Unchecked (between loopback addresses): taken only from loopback, with a zero trailer.
  const uint32_t lo = htonl(INADDR_LOOPBACK);
  const IcrcAddresses loopback{lo, lo, 40000, 40001};
  h.unchecked = true;
  ASSERT_EQ(encode(Mode::stellar, h, buf.data(), buf.size(), loopback), n);
  EXPECT_EQ(decode_placed(buf.data(), header, placed.data(), 4096, buf.data() + n - 4, loopback, pieces), DecodeError::none);
  EXPECT_EQ(decode_placed(buf.data(), header, placed.data(), 4096, buf.data() + n - 4, {}, pieces), DecodeError::bad_checksum);
  const uint8_t nonzero[4] = {1, 0, 0, 0};
  EXPECT_EQ(decode_placed(buf.data(), header, placed.data(), 4096, nonzero, loopback, pieces), DecodeError::bad_checksum);
}

TEST(PacketSize, TheLargestPayloadALinkCarriesIsInMultiplesOf256UpTo61440) {
  // Loopback's 65536 and IPv4's largest datagram: 15 pages, whose datagram
  // (61440 + 96 + 28 = 61564 bytes) fits where 16 pages would not.
  EXPECT_EQ(payload_for_link_mtu(65536, Mode::stellar), 61440u);
  EXPECT_EQ(payload_for_link_mtu(65535, Mode::stellar), 61440u);
  EXPECT_EQ(payload_for_link_mtu(9000, Mode::stellar), 8704u);   // jumbo frames
  EXPECT_EQ(payload_for_link_mtu(8192 + 124, Mode::stellar), 8192u);
  EXPECT_EQ(payload_for_link_mtu(8192 + 123, Mode::stellar), 7936u);  // one byte short: the next multiple of 256 down
  EXPECT_EQ(payload_for_link_mtu(4000, Mode::stellar), 3840u);
  EXPECT_EQ(payload_for_link_mtu(1500, Mode::stellar), 1280u);   // Ethernet
  EXPECT_EQ(payload_for_link_mtu(576, Mode::stellar), 256u);
  EXPECT_EQ(payload_for_link_mtu(100, Mode::stellar), 256u) << "never below 256 (the bind reports a link that small)";
  // roce mode: RoCE's MTUs, 4096 at most.
  EXPECT_EQ(payload_for_link_mtu(65536, Mode::roce), 4096u);
  EXPECT_EQ(payload_for_link_mtu(9000, Mode::roce), 4096u);
  EXPECT_EQ(payload_for_link_mtu(1500, Mode::roce), 1024u);
  for (uint32_t link = 300; link <= 65536; link += 97) {
    const uint32_t p = payload_for_link_mtu(link, Mode::stellar);
    EXPECT_EQ(p % 256, 0u) << link;
    if (link >= 256 + 124) {
      EXPECT_LE(p + 124, link) << link;
      if (p < max_payload_bytes) {
        EXPECT_GT(p + 256 + 124, link) << link << ": a larger multiple of 256 fits";
      }
    }
    EXPECT_LE(p, max_payload_bytes);
    const uint32_t r = payload_for_link_mtu(link, Mode::roce);
    EXPECT_TRUE(r >= 256 && r <= 4096 && (r & (r - 1)) == 0) << link;
  }
}
