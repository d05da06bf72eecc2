#include "stellar/offload/wire.hpp"

#include <zlib.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#include <nmmintrin.h>
#include <wmmintrin.h>
#endif

namespace stellar::offload {
namespace {

// ---- byte order helpers (the wire is big-endian, as IBTA) ----
inline void put16(uint8_t* p, uint16_t v) { p[0] = uint8_t(v >> 8); p[1] = uint8_t(v); }
inline void put24(uint8_t* p, uint32_t v) { p[0] = uint8_t(v >> 16); p[1] = uint8_t(v >> 8); p[2] = uint8_t(v); }
inline void put32(uint8_t* p, uint32_t v) { put16(p, uint16_t(v >> 16)); put16(p + 2, uint16_t(v)); }
inline void put64(uint8_t* p, uint64_t v) { put32(p, uint32_t(v >> 32)); put32(p + 4, uint32_t(v)); }
inline uint16_t get16(const uint8_t* p) { return uint16_t(p[0] << 8 | p[1]); }
inline uint32_t get24(const uint8_t* p) { return uint32_t(p[0]) << 16 | uint32_t(p[1]) << 8 | p[2]; }
inline uint32_t get32(const uint8_t* p) { return uint32_t(get16(p)) << 16 | get16(p + 2); }
inline uint64_t get64(const uint8_t* p) { return uint64_t(get32(p)) << 32 | get32(p + 4); }

// ---- CRC32C for the stellar trailer: hardware on x86-64, table elsewhere ----
constexpr std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr auto crc32c_table = make_crc32c_table();

// All CRC-32C helpers work on the raw register (no pre/post inversion), so a
// checksum can run over several pieces: reg = extend(extend(~0, a), b); ~reg.
uint32_t crc32c_software(uint32_t c, const uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) c = crc32c_table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c;
}

// The two reflected polynomials: CRC-32C (the stellar trailer) and CRC-32
// (IEEE 802.3, the RoCEv2 ICRC).
constexpr uint32_t crc32c_polynomial = 0x82f63b78u, crc32_polynomial = 0xedb88320u;

// GF(2) arithmetic modulo a (reflected) CRC polynomial, to combine the CRCs
// of adjacent blocks: crc(A || B) = crc(A) * x^(8|B|) + crc(B). This is what
// lets three independent hardware CRC streams run in parallel, and gives the
// carry-less folding constants below.
template <uint32_t Polynomial>
uint32_t multiply_mod_by(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ Polynomial : b >> 1;
  }
  return p;
}
uint32_t multiply_mod(uint32_t a, uint32_t b) { return multiply_mod_by<crc32c_polynomial>(a, b); }

// x^(8n) mod P.
template <uint32_t Polynomial>
uint32_t x_pow_8n_by(size_t n) {
  static const auto powers = [] {
    std::array<uint32_t, 64> t{};
    uint32_t p = 1u << 30;  // x^1
    for (auto& v : t) {
      v = p;
      p = multiply_mod_by<Polynomial>(p, p);
    }
    return t;
  }();
  uint32_t result = 1u << 31;  // x^0
  size_t k = 3;                // 8n = n * 2^3
  for (; n; n >>= 1, ++k)
    if (n & 1) result = multiply_mod_by<Polynomial>(powers[k & 63], result);
  return result;
}
uint32_t x_pow_8n(size_t n) { return x_pow_8n_by<crc32c_polynomial>(n); }

// CRC-32 (IEEE, reflected) sliced by 8: one table per byte position, 8
// bytes a step. zlib's crc32 goes about a byte at a time below 200 bytes
// (2 ns a byte here), and most of what the ICRC covers comes in such short
// runs: the 48-byte pseudo header, the rest of the headers, the folding's
// last 16 bytes and tail. A 64-byte packet's ICRC took 207 ns through zlib.
struct Crc32Tables {
  uint32_t t[8][256];
};
constexpr Crc32Tables make_crc32_tables() {
  Crc32Tables x{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = c & 1 ? (c >> 1) ^ 0xedb88320u : c >> 1;
    x.t[0][i] = c;
  }
  for (uint32_t i = 0; i < 256; ++i)
    for (int s = 1; s < 8; ++s) x.t[s][i] = (x.t[s - 1][i] >> 8) ^ x.t[0][x.t[s - 1][i] & 0xff];
  return x;
}
constexpr Crc32Tables crc32_tables = make_crc32_tables();

uint32_t crc32_sliced(uint32_t reg, const uint8_t* p, size_t n) {
  const auto& t = crc32_tables.t;
  if constexpr (std::endian::native == std::endian::little) {
    for (; n >= 8; p += 8, n -= 8) {
      uint64_t v;
      std::memcpy(&v, p, 8);
      v ^= reg;
      reg = t[7][v & 0xff] ^ t[6][(v >> 8) & 0xff] ^ t[5][(v >> 16) & 0xff] ^ t[4][(v >> 24) & 0xff] ^
            t[3][(v >> 32) & 0xff] ^ t[2][(v >> 40) & 0xff] ^ t[1][(v >> 48) & 0xff] ^ t[0][v >> 56];
    }
  }
  for (; n > 0; ++p, --n) reg = (reg >> 8) ^ t[0][(reg ^ *p) & 0xff];
  return reg;
}

// zlib's CRC-32 on the raw register (zlib inverts before and after).
uint32_t crc32_zlib(uint32_t reg, const uint8_t* p, size_t n) {
  uLong c = ~reg & 0xffffffffUL;
  for (; n > 0;) {  // uInt lengths
    const uInt step = uInt(std::min<size_t>(n, 1u << 30));
    c = crc32(c, p, step);
    p += step;
    n -= step;
  }
  return ~uint32_t(c);
}

// Multiplication by a fixed x^(8n) is linear over the register's bytes:
// four 256-entry tables make it four lookups.
struct ShiftTable {
  uint32_t t[4][256];
  explicit ShiftTable(size_t bytes) {
    const uint32_t op = x_pow_8n(bytes);
    for (int k = 0; k < 4; ++k)
      for (uint32_t v = 0; v < 256; ++v) t[k][v] = multiply_mod(op, v << (8 * k));
  }
  uint32_t apply(uint32_t r) const { return t[0][r & 0xff] ^ t[1][(r >> 8) & 0xff] ^ t[2][(r >> 16) & 0xff] ^ t[3][r >> 24]; }
};

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42_continue(uint32_t c32, const uint8_t* p, size_t n) {
  uint64_t c = c32;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
  }
  c32 = uint32_t(c);
  for (; n > 0; --n, ++p) c32 = _mm_crc32_u8(c32, *p);
  return c32;
}

// Three interleaved streams over consecutive 256-byte blocks hide the crc32
// instruction's latency (one result per cycle instead of one per three). By
// linearity, reg(c, X|Y|Z) = reg(c, X)*x^(8*512) + reg(0, Y)*x^(8*256) + reg(0, Z),
// with the two constant shifts done by table.
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(uint32_t crc, const uint8_t* p, size_t n) {
  constexpr size_t block = 256;
  static const ShiftTable shift_one(block), shift_two(2 * block);
  for (; n >= 3 * block; n -= 3 * block, p += 3 * block) {
    uint64_t a = crc, b = 0, c = 0;
    for (size_t i = 0; i < block; i += 8) {
      uint64_t x, y, z;
      std::memcpy(&x, p + i, 8);
      std::memcpy(&y, p + block + i, 8);
      std::memcpy(&z, p + 2 * block + i, 8);
      a = _mm_crc32_u64(a, x);
      b = _mm_crc32_u64(b, y);
      c = _mm_crc32_u64(c, z);
    }
    crc = shift_two.apply(uint32_t(a)) ^ shift_one.apply(uint32_t(b)) ^ uint32_t(c);
  }
  return crc32c_sse42_continue(crc, p, n);
}
#endif

}  // namespace

#if defined(__x86_64__)
// Carry-less multiplication folding (Intel's PCLMULQDQ CRC method): four
// 128-bit lanes advance 64 bytes per step, each lane multiplied by
// x^(512 -/+ 32) mod P; then the lanes fold into one by x^(128 -/+ 32) and the
// crc32 instruction reduces the last 128 bits. The constants come from the
// same GF(2) arithmetic as above, so nothing is transcribed.
__attribute__((target("sse4.2,pclmul"))) inline __m128i fold(__m128i x, __m128i k) {
  return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x01), _mm_clmulepi64_si128(x, k, 0x10));
}

// Advances four lanes over p..p+n (64 bytes a step), folds them into one and
// folds in the remaining 16-byte blocks; leaves p and n at the last < 16
// bytes. The constants depend only on the polynomial.
template <uint32_t Polynomial>
__attribute__((target("sse4.2,pclmul"))) __m128i fold_lanes(__m128i x0, __m128i x1, __m128i x2, __m128i x3, const uint8_t*& p, size_t& n) {
  static const __m128i by_four = _mm_set_epi64x(int64_t(uint64_t(x_pow_8n_by<Polynomial>(68)) << 1),
                                                int64_t(uint64_t(x_pow_8n_by<Polynomial>(60)) << 1));
  static const __m128i by_one = _mm_set_epi64x(int64_t(uint64_t(x_pow_8n_by<Polynomial>(20)) << 1),
                                               int64_t(uint64_t(x_pow_8n_by<Polynomial>(12)) << 1));
  auto load = [](const uint8_t* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); };
  for (; n >= 64; p += 64, n -= 64) {
    x0 = _mm_xor_si128(fold(x0, by_four), load(p));
    x1 = _mm_xor_si128(fold(x1, by_four), load(p + 16));
    x2 = _mm_xor_si128(fold(x2, by_four), load(p + 32));
    x3 = _mm_xor_si128(fold(x3, by_four), load(p + 48));
  }
  __m128i x = _mm_xor_si128(fold(x0, by_one), x1);
  x = _mm_xor_si128(fold(x, by_one), x2);
  x = _mm_xor_si128(fold(x, by_one), x3);
  for (; n >= 16; p += 16, n -= 16) x = _mm_xor_si128(fold(x, by_one), load(p));
  return x;
}

__attribute__((target("sse4.2,pclmul"))) uint32_t crc32c_lanes(__m128i x0, __m128i x1, __m128i x2, __m128i x3,
                                                               const uint8_t* p, size_t n) {
  const __m128i x = fold_lanes<crc32c_polynomial>(x0, x1, x2, x3, p, n);
  uint64_t c = _mm_crc32_u64(0, uint64_t(_mm_cvtsi128_si64(x)));
  c = _mm_crc32_u64(c, uint64_t(_mm_extract_epi64(x, 1)));
  return crc32c_sse42_continue(uint32_t(c), p, n);
}

__attribute__((target("sse4.2,pclmul"))) uint32_t crc32c_clmul(uint32_t crc, const uint8_t* p, size_t n) {
  auto load = [](const uint8_t* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); };
  return crc32c_lanes(_mm_xor_si128(load(p), _mm_cvtsi32_si128(int(crc))), load(p + 16), load(p + 32), load(p + 48), p + 64, n - 64);
}

// The same with AVX-512 VPCLMULQDQ: four 512-bit registers advance 256 bytes
// per step (x^(2048 -/+ 32) in every 128-bit lane), then fold into the four
// 128-bit lanes of the routines above (x^(512 -/+ 32)); for either polynomial.
#define STELLAR_AVX512 __attribute__((target("sse4.2,pclmul,avx512f,vpclmulqdq")))
template <uint32_t Polynomial>
STELLAR_AVX512 __m512i fold_constant_512(size_t bytes) {
  const int64_t high = int64_t(uint64_t(x_pow_8n_by<Polynomial>(bytes + 4)) << 1),
                low = int64_t(uint64_t(x_pow_8n_by<Polynomial>(bytes - 4)) << 1);
  return _mm512_set_epi64(high, low, high, low, high, low, high, low);
}
STELLAR_AVX512 inline __m512i fold512(__m512i x, __m512i k) {
  return _mm512_xor_si512(_mm512_clmulepi64_epi128(x, k, 0x01), _mm512_clmulepi64_epi128(x, k, 0x10));
}
STELLAR_AVX512 inline __m512i load512(const uint8_t* q) { return _mm512_loadu_si512(q); }

// Folds `reg` and the whole 256-byte blocks of p..p+n (n >= 256) into four
// 128-bit lanes; leaves p and n at what is left (under 256 bytes).
template <uint32_t Polynomial>
STELLAR_AVX512 void fold_blocks_512(uint32_t reg, const uint8_t*& p, size_t& n, __m128i lanes[4]) {
  static const __m512i by_256 = fold_constant_512<Polynomial>(256), by_64 = fold_constant_512<Polynomial>(64);
  __m512i z0 = _mm512_xor_si512(load512(p), _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, int(reg)));
  __m512i z1 = load512(p + 64), z2 = load512(p + 128), z3 = load512(p + 192);
  p += 256;
  n -= 256;
  for (; n >= 256; p += 256, n -= 256) {
    z0 = _mm512_xor_si512(fold512(z0, by_256), load512(p));
    z1 = _mm512_xor_si512(fold512(z1, by_256), load512(p + 64));
    z2 = _mm512_xor_si512(fold512(z2, by_256), load512(p + 128));
    z3 = _mm512_xor_si512(fold512(z3, by_256), load512(p + 192));
  }
  __m512i z = _mm512_xor_si512(fold512(z0, by_64), z1);
  z = _mm512_xor_si512(fold512(z, by_64), z2);
  z = _mm512_xor_si512(fold512(z, by_64), z3);
  _mm512_storeu_si512(lanes, z);
}

STELLAR_AVX512 uint32_t crc32c_vclmul(uint32_t crc, const uint8_t* p, size_t n) {
  __m128i lanes[4];
  fold_blocks_512<crc32c_polynomial>(crc, p, n, lanes);
  return crc32c_lanes(lanes[0], lanes[1], lanes[2], lanes[3], p, n);
}
#undef STELLAR_AVX512

// CRC-32 (IEEE) by the same four-lane folding, with constants from its own
// polynomial; no instruction reduces it, so the sliced tables finish the
// last 128 bits and the tail (under 80 bytes). Several times zlib's speed on a 4 KiB
// packet: the ICRC was the roce mode's largest cost per byte.
__attribute__((target("sse4.2,pclmul"))) uint32_t crc32_clmul(uint32_t reg, const uint8_t* p, size_t n) {
  auto load = [](const uint8_t* q) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(q)); };
  const __m128i first = _mm_xor_si128(load(p), _mm_cvtsi32_si128(int(reg)));
  const __m128i x1 = load(p + 16), x2 = load(p + 32), x3 = load(p + 48);
  p += 64;
  n -= 64;
  const __m128i x = fold_lanes<crc32_polynomial>(first, x1, x2, x3, p, n);
  alignas(16) uint8_t last[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(last), x);
  return crc32_sliced(crc32_sliced(0, last, 16), p, n);
}

// CRC-32 with AVX-512 VPCLMULQDQ: 256 bytes a step, then as crc32_clmul.
// The roce mode computes the ICRC of every packet on both sides: a 4 KiB
// packet's took 481 ns of CPU with crc32_clmul and 246-277 ns with this
// (stellar_microbench checksum_roce_icrc/4096, medians of 5).
__attribute__((target("sse4.2,pclmul,avx512f,vpclmulqdq"))) uint32_t crc32_vclmul(uint32_t reg, const uint8_t* p, size_t n) {
  __m128i lanes[4];
  fold_blocks_512<crc32_polynomial>(reg, p, n, lanes);
  const __m128i x = fold_lanes<crc32_polynomial>(lanes[0], lanes[1], lanes[2], lanes[3], p, n);
  alignas(16) uint8_t last[16];
  _mm_store_si128(reinterpret_cast<__m128i*>(last), x);
  return crc32_sliced(crc32_sliced(0, last, 16), p, n);
}
#endif

uint32_t crc32c_extend(uint32_t reg, const uint8_t* p, size_t n) {
#if defined(__x86_64__)
  static const bool hardware = __builtin_cpu_supports("sse4.2");
  static const bool clmul = hardware && __builtin_cpu_supports("pclmul");
  static const bool vclmul = clmul && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq");
  if (vclmul && n >= 512) return crc32c_vclmul(reg, p, n);
  if (clmul && n >= 256) return crc32c_clmul(reg, p, n);
  if (hardware) return crc32c_sse42(reg, p, n);
#endif
  return crc32c_software(reg, p, n);
}

uint32_t crc32c(const uint8_t* p, size_t n) { return ~crc32c_extend(~0u, p, n); }

uint32_t crc32_extend(uint32_t reg, const uint8_t* p, size_t n) {
#if defined(__x86_64__)
  static const bool clmul = __builtin_cpu_supports("sse4.2") && __builtin_cpu_supports("pclmul");
  static const bool vclmul = clmul && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("vpclmulqdq");
  if (vclmul && n >= 512) return crc32_vclmul(reg, p, n);
  if (clmul && n >= 256) return crc32_clmul(reg, p, n);
#endif
  if (n < 256) return crc32_sliced(reg, p, n);
  return crc32_zlib(reg, p, n);
}

namespace {

// ---- header sizes ----
constexpr size_t roce_bth = 12, roce_reth = 16, roce_aeth = 4, roce_atomic_eth = 28, roce_atomic_ack = 8,
                 imm_bytes = 4, trailer = 4;
constexpr uint8_t stellar_flag_unchecked = 8;  // flags (byte 3) bit 3: Header::unchecked
constexpr size_t stellar_base = 48, stellar_reth = 16, stellar_segment = 12, stellar_challenge = 8, stellar_sizing = 16;
constexpr uint8_t stellar_magic = 0x53;  // 'S'
static_assert(stellar_write_header_bytes == stellar_base + stellar_reth + stellar_segment);
// 2: the 64-bit connection token at offset 32 (base header 40 bytes).
// 3: the path (entropy) index at offset 40, the SACK offset at 42, the echoed
// path at 44 and 2 reserved bytes (base header 48 bytes). An older peer's
// packets are refused as bad_version.
constexpr uint8_t stellar_version = 3;

bool roce_has_reth(uint8_t op) {
  return op == opcode::write_first || op == opcode::write_only || op == opcode::write_only_imm ||
         op == opcode::read_request;
}
bool roce_has_aeth(uint8_t op) {
  return op == opcode::acknowledge || op == opcode::atomic_acknowledge || op == opcode::read_response_first ||
         op == opcode::read_response_last || op == opcode::read_response_only;
}
bool is_atomic_request(uint8_t op) { return op == opcode::compare_swap || op == opcode::fetch_add; }
bool carries_payload(uint8_t op) {
  return opcode_is_send(op) || opcode_is_write(op) || opcode_is_read_response(op);
}

size_t roce_header_bytes(const Header& h) {
  size_t n = roce_bth;
  if (roce_has_reth(h.opcode)) n += roce_reth;
  if (is_atomic_request(h.opcode)) n += roce_atomic_eth;
  if (roce_has_aeth(h.opcode)) n += roce_aeth;
  if (h.opcode == opcode::atomic_acknowledge) n += roce_atomic_ack;
  if (opcode_has_imm(h.opcode)) n += imm_bytes;
  return n;
}

size_t stellar_header_bytes(const Header& h) {
  size_t n = stellar_base;
  if (opcode_is_write(h.opcode) || h.opcode == opcode::read_request) n += stellar_reth;
  if (carries_payload(h.opcode)) n += stellar_segment;
  if (opcode_has_imm(h.opcode)) n += imm_bytes;
  if (is_atomic_request(h.opcode)) n += roce_atomic_eth;
  if (h.opcode == opcode::acknowledge || h.opcode == opcode::atomic_acknowledge) n += roce_aeth;
  if (h.opcode == opcode::atomic_acknowledge) n += roce_atomic_ack;
  if (opcode_is_path_validation(h.opcode)) n += stellar_challenge;
  if (opcode_is_path_sizing(h.opcode)) n += stellar_sizing;
  return n;
}

uint8_t* put_atomic_eth(uint8_t* p, const Header& h) {
  put64(p, h.remote_addr);
  put32(p + 8, h.rkey);
  put64(p + 12, h.swap_add);
  put64(p + 20, h.compare);
  return p + roce_atomic_eth;
}
const uint8_t* get_atomic_eth(const uint8_t* p, Header& h) {
  h.remote_addr = get64(p);
  h.rkey = get32(p + 8);
  h.swap_add = get64(p + 12);
  h.compare = get64(p + 20);
  return p + roce_atomic_eth;
}

}  // namespace

const char* to_string(Mode m) { return m == Mode::roce ? "roce" : "stellar"; }

const char* to_string(DecodeError e) {
  switch (e) {
    case DecodeError::none: return "none";
    case DecodeError::truncated: return "truncated";
    case DecodeError::bad_version: return "bad version";
    case DecodeError::bad_opcode: return "bad opcode";
    case DecodeError::bad_checksum: return "bad checksum";
    case DecodeError::bad_length: return "bad length";
  }
  return "?";
}

bool opcode_is_send(uint8_t op) { return op <= opcode::send_only_imm; }
bool opcode_is_write(uint8_t op) { return op >= opcode::write_first && op <= opcode::write_only_imm; }
bool opcode_is_read_response(uint8_t op) {
  return op >= opcode::read_response_first && op <= opcode::read_response_only;
}
bool opcode_has_imm(uint8_t op) {
  return op == opcode::send_last_imm || op == opcode::send_only_imm || op == opcode::write_last_imm ||
         op == opcode::write_only_imm;
}
bool opcode_is_first(uint8_t op) {
  switch (op) {
    case opcode::send_first: case opcode::send_only: case opcode::send_only_imm:
    case opcode::write_first: case opcode::write_only: case opcode::write_only_imm:
    case opcode::read_response_first: case opcode::read_response_only:
      return true;
    default: return false;
  }
}
bool opcode_is_last(uint8_t op) {
  switch (op) {
    case opcode::send_last: case opcode::send_last_imm: case opcode::send_only: case opcode::send_only_imm:
    case opcode::write_last: case opcode::write_last_imm: case opcode::write_only: case opcode::write_only_imm:
    case opcode::read_response_last: case opcode::read_response_only:
      return true;
    default: return false;
  }
}
bool is_loopback(const IcrcAddresses& a) {
  // Network byte order: the first octet is the lowest-addressed byte.
  auto first_octet = [](uint32_t ip) { return reinterpret_cast<const uint8_t*>(&ip)[0]; };
  return first_octet(a.source_ip) == 127 && first_octet(a.destination_ip) == 127;
}

bool opcode_is_path_validation(uint8_t op) { return op == opcode::path_challenge || op == opcode::path_response; }
bool opcode_is_path_sizing(uint8_t op) { return op == opcode::path_size || op == opcode::path_size_ack; }

bool opcode_is_request(uint8_t op) {
  return opcode_is_send(op) || opcode_is_write(op) || op == opcode::read_request || is_atomic_request(op);
}

size_t encoded_header_bytes(Mode mode, const Header& h) {
  return (mode == Mode::roce ? roce_header_bytes(h) : stellar_header_bytes(h)) + trailer;
}

size_t payload_offset(Mode mode, const Header& h) {
  return mode == Mode::roce ? roce_header_bytes(h) : stellar_header_bytes(h);
}

namespace {

// ICRC of a datagram made of `header` (BTH first), payload pieces, `pad`
// zero bytes, and the 4-byte ICRC slot; `length` is the whole datagram.
uint32_t roce_icrc_pieces(const uint8_t* header, size_t header_length, const PayloadPiece* pieces, size_t count, uint32_t pad,
                          size_t length, const IcrcAddresses& a, uint16_t ip_id = 0) {
  // The ICRC covers a dummy all-ones LRH, the IPv4 and UDP headers with their
  // variant fields (TOS, TTL, checksums) forced to ones, and the BTH with its
  // reserved byte forced to ones (IBTA Annex A17.3.3). We send from unconnected
  // sockets with DF set, for which Linux writes IP id 0, so the pseudo header
  // is fully determined by addresses and length.
  uint8_t pseudo[8 + 20 + 8 + roce_bth];
  std::memset(pseudo, 0xff, 8);
  uint8_t* ip = pseudo + 8;
  const uint16_t udp_length = uint16_t(8 + length);
  ip[0] = 0x45;
  ip[1] = 0xff;
  put16(ip + 2, uint16_t(20 + udp_length));
  put16(ip + 4, ip_id);
  put16(ip + 6, 0x4000);
  ip[8] = 0xff;
  ip[9] = 17;
  put16(ip + 10, 0xffff);
  std::memcpy(ip + 12, &a.source_ip, 4);
  std::memcpy(ip + 16, &a.destination_ip, 4);
  uint8_t* udp = ip + 20;
  put16(udp, a.source_port);
  put16(udp + 2, a.destination_port);
  put16(udp + 4, udp_length);
  put16(udp + 6, 0xffff);
  uint8_t* bth = udp + 8;
  std::memcpy(bth, header, roce_bth);
  bth[4] = 0xff;
  uint32_t reg = crc32_extend(~0u, pseudo, sizeof pseudo);
  reg = crc32_extend(reg, header + roce_bth, header_length - roce_bth);
  for (size_t i = 0; i < count; ++i) reg = crc32_extend(reg, pieces[i].data, pieces[i].length);
  static const uint8_t zeros[4] = {};
  reg = crc32_extend(reg, zeros, pad);
  return ~reg;
}

// Writes every header of h (everything before the payload); returns its size.
size_t write_headers(Mode mode, const Header& h, uint8_t* out, uint32_t pad) {
  const size_t header = payload_offset(mode, h);
  uint8_t* p = out;
  if (mode == Mode::roce) {
    p[0] = h.opcode;
    p[1] = uint8_t((h.solicited ? 0x80 : 0) | 0x40 /* MigReq */ | pad << 4);
    put16(p + 2, h.pkey);
    p[4] = 0;
    put24(p + 5, h.dest_qpn);
    p[8] = h.ack_request ? 0x80 : 0;
    put24(p + 9, h.psn & 0xffffff);
    p += roce_bth;
    if (roce_has_reth(h.opcode)) {
      put64(p, h.remote_addr);
      put32(p + 8, h.rkey);
      put32(p + 12, h.dma_length);
      p += roce_reth;
    }
    if (is_atomic_request(h.opcode)) p = put_atomic_eth(p, h);
    if (roce_has_aeth(h.opcode)) {
      p[0] = h.syndrome;
      put24(p + 1, h.msn);
      p += roce_aeth;
    }
    if (h.opcode == opcode::atomic_acknowledge) {
      put64(p, h.atomic_original);
      p += roce_atomic_ack;
    }
    if (opcode_has_imm(h.opcode)) put32(p, h.imm);
    return header;
  }
  p[0] = stellar_magic;
  p[1] = stellar_version;
  p[2] = h.opcode;
  p[3] = uint8_t((h.ack_request ? 1 : 0) | (h.solicited ? 2 : 0) | (h.has_ack ? 4 : 0) | (h.unchecked ? 8 : 0));
  put16(p + 4, h.pkey);
  put16(p + 6, uint16_t(header));
  put32(p + 8, h.dest_qpn);
  put32(p + 12, h.psn);
  put32(p + 16, h.has_ack ? h.ack_psn : 0);
  put64(p + 20, h.has_ack ? h.sack_bitmap : 0);
  put32(p + 28, h.has_ack ? h.ack_delay_ns : 0);
  put64(p + 32, h.token);
  put16(p + 40, h.path);
  put16(p + 42, h.has_ack ? h.sack_offset : 0);
  put16(p + 44, h.echo_path);
  put16(p + 46, h.ce_count);
  p += stellar_base;
  if (opcode_is_write(h.opcode) || h.opcode == opcode::read_request) {
    put64(p, h.remote_addr);
    put32(p + 8, h.rkey);
    put32(p + 12, h.dma_length);
    p += stellar_reth;
  }
  if (carries_payload(h.opcode)) {
    put32(p, h.message_offset);
    put32(p + 4, h.message_length);
    put32(p + 8, h.receive_sequence);
    p += stellar_segment;
  }
  if (opcode_has_imm(h.opcode)) {
    put32(p, h.imm);
    p += imm_bytes;
  }
  if (is_atomic_request(h.opcode)) p = put_atomic_eth(p, h);
  if (h.opcode == opcode::acknowledge || h.opcode == opcode::atomic_acknowledge) {
    p[0] = h.syndrome;
    put24(p + 1, h.msn);
    p += roce_aeth;
  }
  if (h.opcode == opcode::atomic_acknowledge) put64(p, h.atomic_original);
  if (opcode_is_path_validation(h.opcode)) put64(p, h.challenge);
  if (opcode_is_path_sizing(h.opcode)) {
    put64(p, h.challenge);
    put32(p + 8, h.size_bytes);
    p[12] = h.size_set ? 1 : 0;
    p[13] = p[14] = p[15] = 0;
  }
  return header;
}

// Pad (roce) and checksum trailer over header + pieces; returns its size.
uint32_t write_trailer(Mode mode, const uint8_t* header, size_t header_length, const PayloadPiece* pieces, size_t count,
                       uint32_t payload_length, uint8_t* out, const IcrcAddresses& addresses) {
  if (mode == Mode::roce) {
    const uint32_t pad = (4 - (payload_length & 3)) & 3;
    size_t piece_bytes = 0;
    for (size_t i = 0; i < count; ++i) piece_bytes += pieces[i].length;
    const size_t total = header_length + piece_bytes + pad + trailer;
    std::memset(out, 0, pad);
    const uint32_t icrc = roce_icrc_pieces(header, header_length, pieces, count, pad, total, addresses);
    std::memcpy(out + pad, &icrc, 4);  // little-endian, as rxe and NICs emit it
    return pad + trailer;
  }
  if (header[3] & stellar_flag_unchecked) {  // between loopback addresses (Header::unchecked)
    put32(out, 0);
    return trailer;
  }
  uint32_t reg = crc32c_extend(~0u, header, header_length);
  for (size_t i = 0; i < count; ++i) reg = crc32c_extend(reg, pieces[i].data, pieces[i].length);
  put32(out, ~reg);
  return trailer;
}

}  // namespace

uint32_t roce_icrc(const uint8_t* datagram, size_t length, const IcrcAddresses& a, uint16_t ip_id) {
  return roce_icrc_pieces(datagram, length - trailer, nullptr, 0, 0, length, a, ip_id);
}

// The ICRC is linear in its input: an IP id of k instead of 0 flips it by
// the CRC of the id's two bytes shifted past everything that follows them
// (the rest of the pseudo IPv4 header, UDP, and the datagram but its ICRC:
// 18 + length bytes). One table per datagram length per thread: a bulk
// stream's packets are nearly all one length.
static_assert(gso_ip_ids == 64, "the delta table is built from six id bits");

uint32_t roce_icrc_ip_id_delta(size_t length, uint16_t ip_id) {
  if (ip_id == 0) return 0;
  auto delta = [](uint32_t shift, uint16_t id) {
    const uint8_t bytes[2] = {uint8_t(id >> 8), uint8_t(id)};
    return multiply_mod_by<crc32_polynomial>(shift, crc32_sliced(0, bytes, 2));
  };
  if (ip_id >= gso_ip_ids) return delta(x_pow_8n_by<crc32_polynomial>(18 + length), ip_id);
  // Linear in the id too: six basis deltas (one per bit) make the table, so
  // a new length (a run's short last segment, or garbage of every length at
  // the roce port) costs one power and six products, not 64 of each.
  thread_local size_t cached_length = 0;
  thread_local std::array<uint32_t, gso_ip_ids> cached{};
  if (cached_length != length) {
    const uint32_t shift = x_pow_8n_by<crc32_polynomial>(18 + length);
    uint32_t basis[6];
    for (int b = 0; b < 6; ++b) basis[b] = delta(shift, uint16_t(1u << b));
    for (uint16_t k = 0; k < gso_ip_ids; ++k) {
      uint32_t d = 0;
      for (int b = 0; b < 6; ++b)
        if (k >> b & 1) d ^= basis[b];
      cached[k] = d;
    }
    cached_length = length;
  }
  return cached[ip_id];
}

size_t encode(Mode mode, const Header& h, uint8_t* out, size_t capacity, const IcrcAddresses& addresses) {
  const size_t header = payload_offset(mode, h);
  const uint32_t pad = mode == Mode::roce ? (4 - (h.payload_length & 3)) & 3 : 0;
  const size_t total = header + h.payload_length + pad + trailer;
  if (total > capacity) return 0;
  write_headers(mode, h, out, pad);
  // The payload already sits at out + header: checksum it as part of the header run.
  write_trailer(mode, out, header + h.payload_length, nullptr, 0, h.payload_length, out + header + h.payload_length, addresses);
  return total;
}

size_t encode_scattered(Mode mode, const Header& h, uint8_t* out, size_t capacity, const PayloadPiece* pieces, size_t count,
                        uint8_t* trailer_out, uint32_t& trailer_length, const IcrcAddresses& addresses) {
  const size_t header = payload_offset(mode, h);
  if (header > capacity) return 0;
  const uint32_t pad = mode == Mode::roce ? (4 - (h.payload_length & 3)) & 3 : 0;
  write_headers(mode, h, out, pad);
  trailer_length = write_trailer(mode, out, header, pieces, count, h.payload_length, trailer_out, addresses);
  return header;
}

namespace {
DecodeError stellar_header_form(const uint8_t* data, Header& h, size_t& header);
void stellar_fields(const uint8_t* data, Header& h);
DecodeError stellar_payload_checks(const Header& h);
}  // namespace

DecodeError decode(Mode mode, const uint8_t* data, size_t length, const IcrcAddresses& addresses, Header& h) {
  h = Header{};
  if (mode == Mode::roce) {
    if (length < roce_bth + trailer) return DecodeError::truncated;
    h.opcode = data[0];
    if (h.opcode > opcode::last_valid) return DecodeError::bad_opcode;
    if ((data[1] & 0x0f) != 0) return DecodeError::bad_version;  // TVer must be 0
    const size_t header = roce_header_bytes(h);
    const uint32_t pad = (data[1] >> 4) & 3;
    if (length < header + pad + trailer) return DecodeError::truncated;
    uint32_t icrc;
    std::memcpy(&icrc, data + length - trailer, 4);
    // A datagram that left as segment k of a UDP GSO message carries IP id
    // k, which the ICRC covers and a socket does not show: accept the ICRC
    // of any id a GSO message gives (0 .. gso_ip_ids - 1).
    if (const uint32_t difference = icrc ^ roce_icrc(data, length, addresses); difference != 0) {
      bool segment = false;
      for (uint16_t k = 1; k < gso_ip_ids && !segment; ++k) segment = roce_icrc_ip_id_delta(length, k) == difference;
      if (!segment) return DecodeError::bad_checksum;
    }
    h.solicited = data[1] & 0x80;
    h.pkey = get16(data + 2);
    h.dest_qpn = get24(data + 5);
    h.ack_request = data[8] & 0x80;
    h.psn = get24(data + 9);
    const uint8_t* p = data + roce_bth;
    if (roce_has_reth(h.opcode)) {
      h.remote_addr = get64(p);
      h.rkey = get32(p + 8);
      h.dma_length = get32(p + 12);
      p += roce_reth;
    }
    if (is_atomic_request(h.opcode)) p = get_atomic_eth(p, h);
    if (roce_has_aeth(h.opcode)) {
      h.syndrome = p[0];
      h.msn = get24(p + 1);
      p += roce_aeth;
    }
    if (h.opcode == opcode::atomic_acknowledge) {
      h.atomic_original = get64(p);
      p += roce_atomic_ack;
    }
    if (opcode_has_imm(h.opcode)) {
      h.imm = get32(p);
      p += imm_bytes;
    }
    h.payload = p;
    h.payload_length = uint32_t(length - header - pad - trailer);
    if (h.payload_length != 0 && !carries_payload(h.opcode)) return DecodeError::bad_length;
    return DecodeError::none;
  }

  // Version first, so that a version-1 peer's packets (shorter base header)
  // are told apart from truncated ones.
  if (length < 2) return DecodeError::truncated;
  if (data[0] != stellar_magic || data[1] != stellar_version) return DecodeError::bad_version;
  if (length < stellar_base + trailer) return DecodeError::truncated;
  size_t header = 0;
  if (const DecodeError e = stellar_header_form(data, h, header); e != DecodeError::none) return e;
  if (length < header + trailer) return DecodeError::truncated;
  h.unchecked = data[3] & stellar_flag_unchecked;
  // An unchecked packet from anywhere but loopback to loopback is refused
  // as if its CRC were wrong: off the host only the CRC protects the bytes.
  const uint32_t stored = get32(data + length - trailer);
  if (h.unchecked ? (!is_loopback(addresses) || stored != 0) : stored != crc32c(data, length - trailer))
    return DecodeError::bad_checksum;
  stellar_fields(data, h);
  h.payload = data + header;
  h.payload_length = uint32_t(length - header - trailer);
  return stellar_payload_checks(h);
}

DecodeError decode_placed(const uint8_t* header_bytes, size_t header_length, const uint8_t* payload, uint32_t payload_length,
                          const uint8_t* trailer_bytes, const IcrcAddresses& addresses, Header& h) {
  h = Header{};
  if (header_length < 2) return DecodeError::truncated;
  if (header_bytes[0] != stellar_magic || header_bytes[1] != stellar_version) return DecodeError::bad_version;
  if (header_length < stellar_base) return DecodeError::truncated;
  size_t header = 0;
  if (const DecodeError e = stellar_header_form(header_bytes, h, header); e != DecodeError::none) return e;
  if (header_length != header) return DecodeError::bad_length;
  h.unchecked = header_bytes[3] & stellar_flag_unchecked;
  const uint32_t stored = get32(trailer_bytes);
  if (h.unchecked ? (!is_loopback(addresses) || stored != 0)
                  : stored != ~crc32c_extend(crc32c_extend(~0u, header_bytes, header_length), payload, payload_length))
    return DecodeError::bad_checksum;
  stellar_fields(header_bytes, h);
  h.payload = payload;
  h.payload_length = payload_length;
  return stellar_payload_checks(h);
}

bool peek_write_placement(const uint8_t* header, size_t length, WritePlacement& w) {
  if (length < stellar_base || header[0] != stellar_magic || header[1] != stellar_version) return false;
  Header h;
  size_t bytes = 0;
  if (stellar_header_form(header, h, bytes) != DecodeError::none || bytes != length || !opcode_is_write(h.opcode)) return false;
  w.opcode = h.opcode;
  w.pkey = get16(header + 4);
  w.dest_qpn = get32(header + 8);
  w.psn = get32(header + 12);
  const uint8_t* p = header + stellar_base;
  w.remote_addr = get64(p);
  w.rkey = get32(p + 8);
  w.dma_length = get32(p + 12);
  p += stellar_reth;
  w.message_offset = get32(p);
  w.message_length = get32(p + 4);
  return true;
}

namespace {

// The form of a stellar header at data (at least stellar_base bytes, magic
// and version checked): a known opcode and the header length its opcode
// gives (header).
DecodeError stellar_header_form(const uint8_t* data, Header& h, size_t& header) {
  h.opcode = data[2];
  if (h.opcode > opcode::last_valid && !opcode_is_host_control(h.opcode)) return DecodeError::bad_opcode;
  header = stellar_header_bytes(h);
  if (get16(data + 6) != header) return DecodeError::bad_length;
  return DecodeError::none;
}

// Every field of a stellar header whose form and checksum were checked.
void stellar_fields(const uint8_t* data, Header& h) {
  const uint8_t flags = data[3];
  h.ack_request = flags & 1;
  h.solicited = flags & 2;
  h.has_ack = flags & 4;
  h.pkey = get16(data + 4);
  h.dest_qpn = get32(data + 8);
  h.psn = get32(data + 12);
  h.ack_psn = get32(data + 16);
  h.sack_bitmap = get64(data + 20);
  h.ack_delay_ns = get32(data + 28);
  h.token = get64(data + 32);
  h.path = get16(data + 40);
  h.sack_offset = get16(data + 42);
  h.echo_path = get16(data + 44);
  h.ce_count = get16(data + 46);
  const uint8_t* p = data + stellar_base;
  if (opcode_is_write(h.opcode) || h.opcode == opcode::read_request) {
    h.remote_addr = get64(p);
    h.rkey = get32(p + 8);
    h.dma_length = get32(p + 12);
    p += stellar_reth;
  }
  if (carries_payload(h.opcode)) {
    h.message_offset = get32(p);
    h.message_length = get32(p + 4);
    h.receive_sequence = get32(p + 8);
    p += stellar_segment;
  }
  if (opcode_has_imm(h.opcode)) {
    h.imm = get32(p);
    p += imm_bytes;
  }
  if (is_atomic_request(h.opcode)) p = get_atomic_eth(p, h);
  if (h.opcode == opcode::acknowledge || h.opcode == opcode::atomic_acknowledge) {
    h.syndrome = p[0];
    h.msn = get24(p + 1);
    p += roce_aeth;
  }
  if (h.opcode == opcode::atomic_acknowledge) h.atomic_original = get64(p);
  if (opcode_is_path_validation(h.opcode)) h.challenge = get64(p);
  if (opcode_is_path_sizing(h.opcode)) {
    h.challenge = get64(p);
    h.size_bytes = get32(p + 8);
    h.size_set = p[12] == 1;
  }
}

DecodeError stellar_payload_checks(const Header& h) {
  // A sizing probe's payload is padding (its size is the point).
  if (h.payload_length != 0 && !carries_payload(h.opcode) && !opcode_is_path_sizing(h.opcode)) return DecodeError::bad_length;
  if (carries_payload(h.opcode) &&
      (h.message_offset > h.message_length || h.payload_length > h.message_length - h.message_offset))
    return DecodeError::bad_length;
  return DecodeError::none;
}

}  // namespace

uint32_t payload_for_link_mtu(uint32_t link_mtu, Mode mode) {
  const uint32_t overhead = 28 + uint32_t(max_header_bytes);
  const uint32_t room = link_mtu > overhead ? link_mtu - overhead : 0;
  if (mode == Mode::roce) {  // RoCE's MTUs: powers of two, 256 to 4096
    uint32_t payload = 4096;
    while (payload > 256 && payload > room) payload /= 2;
    return payload;
  }
  // stellar mode is bound to no MTU enumeration: every byte the link
  // carries is used, in multiples of 256 (cache-line aligned places), so
  // that 1500-byte Ethernet carries 1280 bytes a packet, not 1024 (a
  // quarter fewer packets per byte), and jumbo frames 8704, not 8192.
  return std::clamp<uint32_t>(room / 256 * 256, 256, max_payload_bytes);
}

bool peek_destination(Mode mode, const uint8_t* data, size_t length, uint16_t& pkey, uint32_t& dest_qpn) {
  if (mode == Mode::roce) {
    if (length < roce_bth) return false;
    pkey = get16(data + 2);
    dest_qpn = get24(data + 5);
    return true;
  }
  if (length < stellar_base) return false;
  pkey = get16(data + 4);
  dest_qpn = get32(data + 8);
  return true;
}

}  // namespace stellar::offload
