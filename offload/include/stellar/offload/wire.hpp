// Wire codecs of the two transport modes. Pure functions over byte buffers:
// no allocation, no I/O. Thread-safe (no shared state).
//
// Both modes share one decoded representation, `Header`, and the RoCE (IBTA
// RC) opcode numbering; they differ in how headers are laid out on the wire
// and in which fields exist:
//   - Mode::roce    BTH [+RETH|AtomicETH|AETH|AtomicAckETH] [+ImmDt] payload ICRC
//                   exactly as a RoCEv2 NIC puts them in a UDP datagram
//                   (destination port 4791). 24-bit PSNs.
//   - Mode::stellar the project's header (docs/wire-format.md): every data
//                   packet says where it goes (message offset, remote address)
//                   so it can be placed in any order; acknowledgements carry a
//                   SACK bitmap and ride on data packets. 32-bit PSNs.
//                   Every packet carries the receiver's 64-bit connection
//                   token (docs/security.md).
#pragma once

#include <cstddef>
#include <cstdint>

namespace stellar::offload {

enum class Mode : uint8_t { stellar, roce };
const char* to_string(Mode);

// IBTA RC opcodes (low 5 bits; transport bits 000 = RC).
namespace opcode {
inline constexpr uint8_t send_first = 0x00;
inline constexpr uint8_t send_middle = 0x01;
inline constexpr uint8_t send_last = 0x02;
inline constexpr uint8_t send_last_imm = 0x03;
inline constexpr uint8_t send_only = 0x04;
inline constexpr uint8_t send_only_imm = 0x05;
inline constexpr uint8_t write_first = 0x06;
inline constexpr uint8_t write_middle = 0x07;
inline constexpr uint8_t write_last = 0x08;
inline constexpr uint8_t write_last_imm = 0x09;
inline constexpr uint8_t write_only = 0x0a;
inline constexpr uint8_t write_only_imm = 0x0b;
inline constexpr uint8_t read_request = 0x0c;
inline constexpr uint8_t read_response_first = 0x0d;
inline constexpr uint8_t read_response_middle = 0x0e;
inline constexpr uint8_t read_response_last = 0x0f;
inline constexpr uint8_t read_response_only = 0x10;
inline constexpr uint8_t acknowledge = 0x11;
inline constexpr uint8_t atomic_acknowledge = 0x12;
inline constexpr uint8_t compare_swap = 0x13;
inline constexpr uint8_t fetch_add = 0x14;
inline constexpr uint8_t last_valid = fetch_add;
// stellar mode only (unassigned in IBTA RC, never sent in roce mode): path
// validation when a peer's address changes (docs/multipath.md, "Address
// change"). A host that sees a connection's packets come from a new address
// sends a challenge there; the peer answers with the same 8 random bytes
// from its new address. Handled by the hosts, not the engines.
inline constexpr uint8_t path_challenge = 0x1e;
inline constexpr uint8_t path_response = 0x1f;
// stellar mode only: path MTU discovery at connection set-up, when both QPs
// advertised it (docs/wire-format.md, "Path MTU"). A probe is padded to
// the datagram size it tests; the peer answers each with a path_size_ack
// of the same size (no amplification). The same pair, unpadded, carries
// the leader's decision (Header::size_set) and its acknowledgement.
// Handled by the hosts, not the engines.
inline constexpr uint8_t path_size = 0x1c;
inline constexpr uint8_t path_size_ack = 0x1d;
}  // namespace opcode
bool opcode_is_path_validation(uint8_t op);  // path_challenge or path_response
bool opcode_is_path_sizing(uint8_t op);      // path_size or path_size_ack
// Packets the hosts answer themselves (validation and sizing): never an engine's.
inline bool opcode_is_host_control(uint8_t op) { return opcode_is_path_validation(op) || opcode_is_path_sizing(op); }

// AETH syndromes (IBTA 9.7.5.1): high 3 bits select ACK / RNR NAK / NAK.
namespace syndrome {
inline constexpr uint8_t ack = 0x1f;              // ACK, credit field "invalid"
inline constexpr uint8_t rnr_nak = 0x20;          // | timer value (low 5 bits)
inline constexpr uint8_t nak_psn_sequence = 0x60;
inline constexpr uint8_t nak_invalid_request = 0x61;
inline constexpr uint8_t nak_remote_access = 0x62;
inline constexpr uint8_t nak_remote_operation = 0x63;
inline bool is_ack(uint8_t s) { return (s & 0xe0) == 0x00; }
inline bool is_rnr(uint8_t s) { return (s & 0xe0) == 0x20; }
inline bool is_nak(uint8_t s) { return (s & 0xe0) == 0x60; }
}  // namespace syndrome

inline constexpr uint16_t roce_udp_port = 4791;
inline constexpr size_t max_header_bytes = 96;  // upper bound of any mode's headers + trailer
// The largest payload per packet (EngineConfig::mtu): 15 pages; with IPv4's
// 20 and UDP's 8 bytes and max_header_bytes the datagram stays under 65535.
inline constexpr uint32_t max_payload_bytes = 61440;
static_assert(max_payload_bytes + max_header_bytes + 28 <= 65535);

// The largest payload per packet whose datagram (IPv4 20 + UDP 8 +
// max_header_bytes + payload) fits a link of `link_mtu` bytes. stellar
// mode: a multiple of 256 from 256 to max_payload_bytes (65536, loopback
// -> 61440; 9000 -> 8704; 1500 -> 1280). roce mode: RoCE's MTUs, a power
// of two from 256 to 4096 (9000 -> 4096, 1500 -> 1024). What the path
// beyond the link carries is settled per connection (docs/wire-format.md,
// "Path MTU").
uint32_t payload_for_link_mtu(uint32_t link_mtu, Mode mode);
inline constexpr uint16_t default_pkey = 0xffff;

// Opcode classification helpers.
bool opcode_is_send(uint8_t op);
bool opcode_is_write(uint8_t op);
bool opcode_is_read_response(uint8_t op);
bool opcode_has_imm(uint8_t op);
bool opcode_is_first(uint8_t op);  // first or only packet of a message
bool opcode_is_last(uint8_t op);   // last or only packet of a message
bool opcode_is_request(uint8_t op);  // travels requester -> responder

// Decoded packet, both modes. Fields a mode or opcode lacks are zero.
struct Header {
  uint8_t opcode = 0;
  bool ack_request = false;
  bool solicited = false;
  uint16_t pkey = default_pkey;  // partition key; carries the tenant
  uint32_t dest_qpn = 0;
  uint32_t psn = 0;
  // stellar mode only: the receiving QP's connection token, a per-connection
  // secret the peer must put on every packet (docs/security.md). Not on the
  // wire in roce mode (decodes as 0).
  uint64_t token = 0;
  // RETH (write first/only, read request) or, in stellar mode, every
  // write/read packet: start address of the message, rkey, total length.
  uint64_t remote_addr = 0;
  uint32_t rkey = 0;
  uint32_t dma_length = 0;
  // stellar mode only: byte offset of this packet in its message and the
  // sequence number of receive-consuming messages (SEND, WRITE_WITH_IMM).
  uint32_t message_offset = 0;
  uint32_t message_length = 0;
  uint32_t receive_sequence = 0;
  // AETH
  uint8_t syndrome = 0;
  uint32_t msn = 0;
  // AtomicETH / AtomicAckETH
  uint64_t swap_add = 0;
  uint64_t compare = 0;
  uint64_t atomic_original = 0;
  // ImmDt (host order)
  uint32_t imm = 0;
  // stellar mode: piggy-backed acknowledgement of the reverse direction.
  bool has_ack = false;
  uint32_t ack_psn = 0;        // every PSN before this one has arrived
  uint64_t sack_bitmap = 0;    // bit i: ack_psn + 1 + sack_offset + i has arrived
  // Where the SACK's 64 PSNs start past ack_psn + 1. 0: right after the
  // first hole; more when packets sprayed over paths of different delays
  // arrive further ahead than 64 PSNs (the responder reports them in turn).
  uint16_t sack_offset = 0;
  // stellar mode, with has_ack: nanoseconds the acknowledging side held the
  // latest request it acknowledges (from its arrival in the kernel to this
  // packet's sending), saturating. The requester takes it out of its RTT
  // sample so that congestion control sees the network, not host delay.
  uint32_t ack_delay_ns = 0;
  // stellar mode: the path (entropy) index the packet left on. The host maps
  // it to one of its UDP source ports, which ECMP hashes onto a route. A
  // request carries the path its sender chose; a response or ACK carries the
  // path of the latest request its sender received, so that both directions
  // of a path fail and recover together. 0 in roce mode (one path).
  uint16_t path = 0;
  // stellar mode: the path index of the latest packet its sender received
  // from us: proof that our path works (the reply path of our ACKs avoids
  // paths that stay unconfirmed). 0 in roce mode.
  uint16_t echo_path = 0;
  // stellar mode: how many of our packets the sender received marked
  // congestion-experienced (ECN CE) since it last sent to us, the latest of
  // them on echo_path (which then names that packet's path); saturating.
  // A path signal: choice avoids marked paths (docs/multipath.md). 0 in roce mode.
  uint16_t ce_count = 0;
  // stellar mode, path_challenge / path_response: the 8 random bytes a
  // challenge carries and its response echoes; path_size / path_size_ack:
  // the probe's or decision's random nonce, echoed by the acknowledgement.
  uint64_t challenge = 0;
  // stellar mode, path_size / path_size_ack: the payload bytes per packet a
  // probe tests (its datagram is padded to what a data packet of that
  // payload would be) or, with size_set, the leader's decision.
  uint32_t size_bytes = 0;
  bool size_set = false;
  // stellar mode: the trailer holds no CRC-32C (flags bit 3). Only between
  // two loopback addresses, where the datagram never leaves memory: there
  // the kernel checksums nothing either (lo marks every packet as verified),
  // so the CRC would guard against nothing the UDP and TCP peers are guarded
  // against. encode() honours it; decode() accepts such a packet only when
  // both of its addresses are loopback (is_loopback), else bad_checksum.
  bool unchecked = false;
  // Payload (points into the decoded buffer).
  const uint8_t* payload = nullptr;
  uint32_t payload_length = 0;
};

// Addresses that enter the RoCEv2 ICRC (the masked IPv4 + UDP pseudo
// header). Network byte order for addresses, host order for ports.
struct IcrcAddresses {
  uint32_t source_ip = 0;
  uint32_t destination_ip = 0;
  uint16_t source_port = 0;
  uint16_t destination_port = roce_udp_port;
};

// Both addresses in 127.0.0.0/8: the datagram goes from memory to memory
// through the kernel's loopback device (Header::unchecked).
bool is_loopback(const IcrcAddresses& addresses);

enum class DecodeError : uint8_t {
  none,
  truncated,
  bad_version,   // stellar: wrong magic or version (a version-1 peer); roce: TVer != 0
  bad_opcode,
  bad_checksum,
  bad_length,
};
const char* to_string(DecodeError);

// Size of the headers (without payload, with trailer) `h` encodes to.
size_t encoded_header_bytes(Mode, const Header& h);

// Writes h and `payload_length` bytes of payload, already placed at
// out + payload_offset(mode, h), into out. Returns the datagram length or 0 if
// `capacity` is too small. Computes the trailer (ICRC / CRC32).
size_t payload_offset(Mode, const Header& h);
size_t encode(Mode, const Header& h, uint8_t* out, size_t capacity, const IcrcAddresses& addresses);

// Zero-copy variant: the payload stays in place as `count` pieces (h.payload_length
// is their total). Writes the headers into out (returns their size, 0 if
// `capacity` is too small) and the trailer — roce: pad + ICRC, stellar:
// CRC-32C — into trailer_out (8 bytes), setting trailer_length. The datagram
// is out[0..header) + pieces + trailer_out[0..trailer_length).
struct PayloadPiece {
  const uint8_t* data = nullptr;
  uint32_t length = 0;
};
size_t encode_scattered(Mode, const Header& h, uint8_t* out, size_t capacity, const PayloadPiece* pieces, size_t count,
                        uint8_t* trailer_out, uint32_t& trailer_length, const IcrcAddresses& addresses);

// Parses and verifies a datagram. On success fills h (payload points into
// data) and returns DecodeError::none.
DecodeError decode(Mode, const uint8_t* data, size_t length, const IcrcAddresses& addresses, Header& h);

// Stellar mode, a datagram the socket put in three places (direct placement:
// offload/host, EngineHost): its headers (exactly header_length bytes),
// its payload (where the kernel wrote it: registered memory) and its 4-byte
// trailer. The same checks as decode(), the CRC-32C over header and payload.
// On success h.payload points at `payload`.
DecodeError decode_placed(const uint8_t* header, size_t header_length, const uint8_t* payload, uint32_t payload_length,
                          const uint8_t* trailer, const IcrcAddresses& addresses, Header& h);

// Stellar mode: where the payload of the WRITE packet whose headers are
// `header` (exactly `length` bytes) belongs, read without verifying
// anything (not the CRC, which covers the payload, nor the token): for
// comparing a packet with the one a host expected. false when these are
// not exactly the headers of a stellar WRITE packet.
// The headers of a stellar-mode WRITE packet without an immediate (first,
// middle, last, only): base header, RETH and segment fields.
inline constexpr size_t stellar_write_header_bytes = 76;
struct WritePlacement {
  uint8_t opcode = 0;
  uint16_t pkey = 0;
  uint32_t dest_qpn = 0, psn = 0, rkey = 0, dma_length = 0, message_offset = 0, message_length = 0;
  uint64_t remote_addr = 0;
};
bool peek_write_placement(const uint8_t* header, size_t length, WritePlacement&);

// Reads only the demultiplexing fields (pkey, destination QPN) without
// verifying anything else (not even the stellar token: the engine checks
// it); false when the datagram is too short.
bool peek_destination(Mode, const uint8_t* data, size_t length, uint16_t& pkey, uint32_t& dest_qpn);

// RoCEv2 ICRC of a complete datagram whose last 4 bytes are the ICRC slot
// (their value is ignored). Exposed for tests and benchmarks.
// ip_id: the IPv4 identification the pseudo header carries (Linux sends 0
// for a lone DF datagram from an unconnected socket; UDP GSO numbers a
// message's segments 0, 1, 2, ...).
uint32_t roce_icrc(const uint8_t* datagram, size_t length, const IcrcAddresses& addresses, uint16_t ip_id = 0);
// What to XOR into the ICRC of a `length`-byte datagram (UDP payload) when
// it leaves with IPv4 id `ip_id` instead of 0: how roce mode sends UDP GSO
// messages (each segment's ICRC fixed for its id) and accepts them.
uint32_t roce_icrc_ip_id_delta(size_t length, uint16_t ip_id);
// IP ids a GSO message can give its segments (its most segments); a roce
// receiver accepts an ICRC computed with any of them.
inline constexpr uint16_t gso_ip_ids = 64;

// CRC-32C (Castagnoli) of a buffer, and the raw-register form for checksums
// over several pieces: ~crc32c_extend(crc32c_extend(~0u, a, n), b, m).
uint32_t crc32c(const uint8_t* data, size_t length);
uint32_t crc32c_extend(uint32_t reg, const uint8_t* data, size_t length);
// CRC-32 (IEEE 802.3, zlib's crc32), the ICRC's, in the same raw-register
// form: zlib's crc32(0, a, n) == ~crc32_extend(~0u, a, n).
uint32_t crc32_extend(uint32_t reg, const uint8_t* data, size_t length);

}  // namespace stellar::offload
