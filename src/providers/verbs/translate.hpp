// The verbs provider's pure half: everything that turns Stellar's API values
// into rdma-core's and back, and the choice of device, port and GID. None of
// it opens a device, so all of it is unit-tested on machines without an RDMA
// NIC (tests/unit/verbs_translate_test.cpp). verbs_provider.cpp holds the
// half that calls into libibverbs. docs/verbs-provider.md has the tables.
//
// Thread-safety: plain functions on values; the sysfs readers only read files.
#pragma once

#include <infiniband/verbs.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "stellar/verbs.hpp"

namespace stellar::provider::verbs {

// ---- memory access and work requests ----

// Access bits -> IBV_ACCESS_* (the same bit values, by design). Unknown bits
// are refused by the caller before this, as the soft provider does.
unsigned to_ibv_access(uint32_t access);
ibv_wr_opcode to_ibv_opcode(WrOpcode);
unsigned to_ibv_send_flags(uint32_t flags);  // SendFlags -> IBV_SEND_*

// What the QP was created with: requests beyond these are refused at post
// time with invalid_argument (as the soft provider does) instead of letting
// the NIC fail them later.
struct SendLimits {
  uint32_t max_send_sge = 16;
  uint32_t max_inline_data = 256;
};

// Fills `out` (next = nullptr) and out.sg_list from `wr`, using `sges` as the
// storage of the SGE list (needs wr.sg_list.size() entries; it must live
// until ibv_post_send returns). imm_data goes to network order, as
// ibv_send_wr requires. Refuses, with invalid_argument and `out` untouched in
// meaning: too many SGEs, inline payloads above the limit or on READ/atomics,
// atomics without exactly one 8-byte SGE or with a remote address not
// 8-byte aligned.
Status to_ibv_send_wr(const SendWr& wr, const SendLimits& limits, std::span<ibv_sge> sges, ibv_send_wr& out);
Status to_ibv_recv_wr(const RecvWr& wr, uint32_t max_recv_sge, std::span<ibv_sge> sges, ibv_recv_wr& out);

// ---- work completions ----

// Every ibv_wc_status to the nearest WcStatus (several fold into one; the
// exact value is kept in WorkCompletion::provider_status).
WcStatus from_ibv_status(ibv_wc_status);
// The opcodes an RC QP posted through this API can complete with; nullopt for
// the rest (memory windows, tag matching, TSO, driver-private).
std::optional<WcOpcode> from_ibv_opcode(ibv_wc_opcode);
// A full completion. imm_data back to host order; has_imm from
// IBV_WC_WITH_IMM. ibv_poll_cq(3) leaves the opcode undefined in error
// completions; it is translated when it is one of ours and is `send`
// otherwise, so read wr_id and status, not opcode, on errors.
WorkCompletion from_ibv_wc(const ibv_wc&);
// "remote access error (IBV_WC_REM_ACCESS_ERR: remote access error, vendor_err 0x88)" etc.
std::string describe_ibv_status(uint32_t ibv_status, uint32_t vendor_error);

// ---- QP timing ----

// The InfiniBand local ACK timeout: 4.096 us * 2^exponent (exponent 1..31; 0
// means "wait forever" and is never chosen). The NIC retransmits after this
// long without an ACK, at the same interval every time (no backoff).
std::chrono::nanoseconds ib_timeout(uint8_t exponent);
// The smallest exponent whose timeout is at least `rto` (so the NIC never
// retransmits sooner than asked): 1 ms -> 8 (1.05 ms), 4 s -> 20 (4.3 s).
uint8_t ib_timeout_exponent(std::chrono::nanoseconds rto);

struct VerbsTiming {
  uint8_t timeout = 0;        // ibv_qp_attr.timeout (exponent)
  uint8_t retry_cnt = 0;      // 0..7
  uint8_t rnr_retry = 0;      // 0..7, 7 = forever
  uint8_t min_rnr_timer = 0;  // the RNR NAK delay this side asks of its peer (code, see rnr_timer_delay)
};
// QpTiming -> RTR/RTS attributes: timeout from rto_min (rto_max has no verbs
// counterpart), retry_count and rnr_retry clamped to the 3-bit fields (7),
// min_rnr_timer 12 (0.64 ms, as perftest and NCCL use).
VerbsTiming to_verbs_timing(const QpTiming&);
// The IB RNR NAK timer code (0..31) -> the delay it stands for (code 0 is 655.36 ms).
std::chrono::nanoseconds rnr_timer_delay(uint8_t code);

// ---- MTU ----

// The largest IB MTU (256..4096 bytes) not above `bytes`; nullopt below 256.
std::optional<ibv_mtu> ibv_mtu_at_most(uint32_t bytes);
uint32_t mtu_bytes(ibv_mtu);

// ---- GIDs, devices, ports ----

using Gid = std::array<uint8_t, 16>;

enum class GidType { ib, roce_v1, roce_v2 };
const char* to_string(GidType);

// One populated GID table entry of one port.
struct GidEntry {
  uint32_t port = 0;   // 1-based, as verbs numbers ports
  uint32_t index = 0;  // the GID index (ibv_global_route.sgid_index)
  Gid gid{};
  GidType type = GidType::ib;
  std::string netdev;  // the Ethernet device behind a RoCE GID ("" if unknown)
  bool port_active = false;
};

struct DeviceGids {
  std::string device;  // "mlx5_0"
  std::vector<GidEntry> gids;  // ordered by port, then index
};

// sysfs GID form: 8 groups of 4 hex digits, "fe80:0000:0000:0000:0a00:00ff:fe00:0001".
std::string format_gid(const Gid&);
// Any textual IPv6 form (the sysfs one included); nullopt if malformed.
std::optional<Gid> parse_gid(std::string_view);
// "10.0.0.1" for ::ffff:10.0.0.1; nullopt for other GIDs.
std::optional<std::string> gid_ipv4(const Gid&);
bool gid_is_link_local(const Gid&);  // fe80::/10

// Reads every device's GID tables from a sysfs tree: <sysfs_root>/class/
// infiniband/<device>/ports/<port>/{gids/<i>, gid_attrs/types/<i>,
// gid_attrs/ndevs/<i>, link_layer, state}. Empty (all-zero) entries and
// entries without a type (sysfs answers EINVAL for those) are skipped; a
// "IB/RoCE v1" entry is ib on an InfiniBand port and roce_v1 on Ethernet.
// `sysfs_root` is "/sys" on a live system and a fixture tree in tests. A
// missing class/infiniband folder is an empty list, not an error.
std::vector<DeviceGids> read_sysfs_gid_tables(const std::string& sysfs_root);

// The device, port and GID a context uses.
struct GidChoice {
  std::string device;
  GidEntry entry;
  std::string ipv4;  // the IPv4 the GID carries ("" for IPv6 / IB GIDs)
};

// Picks the device, port and GID:
//  - `device` names a device ("" = any). An unknown name is not_found and
//    lists the devices found.
//  - `address` is an IPv4 address: the RoCE v2 GID ::ffff:<address> (active
//    ports first) decides device and port. A match that is only RoCE v1, or
//    only on a port that is down, is a not_found that says so. When no device
//    carries it and `address` is "", "0.0.0.0" or "127.0.0.1" (the soft
//    provider's default), any GID will do: the first RoCE v2 GID of an active
//    port, IPv4-mapped first, then global IPv6, then link-local IPv6; on an
//    InfiniBand port its GID index 0.
//  - No device at all is no_device with a pointer to --provider soft.
Result<GidChoice> select_gid(const std::vector<DeviceGids>& devices, const std::string& device, const std::string& address);

// The no-device status open_verbs returns (one place for its wording).
Status no_device_status(const std::string& detail);

}  // namespace stellar::provider::verbs
