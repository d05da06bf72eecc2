// API values <-> rdma-core values; device, port and GID choice. See translate.hpp.
#include "providers/verbs/translate.hpp"

#include <arpa/inet.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>


namespace stellar::provider::verbs {

namespace fs = std::filesystem;

// The public access bits were given ibv_access_flags' values on purpose.
static_assert(int(access_local_write) == int(IBV_ACCESS_LOCAL_WRITE) && int(access_remote_write) == int(IBV_ACCESS_REMOTE_WRITE) &&
              int(access_remote_read) == int(IBV_ACCESS_REMOTE_READ) && int(access_remote_atomic) == int(IBV_ACCESS_REMOTE_ATOMIC));

unsigned to_ibv_access(uint32_t access) {
  unsigned out = 0;
  if (access & access_local_write) out |= IBV_ACCESS_LOCAL_WRITE;
  if (access & access_remote_write) out |= IBV_ACCESS_REMOTE_WRITE;
  if (access & access_remote_read) out |= IBV_ACCESS_REMOTE_READ;
  if (access & access_remote_atomic) out |= IBV_ACCESS_REMOTE_ATOMIC;
  return out;
}

ibv_wr_opcode to_ibv_opcode(WrOpcode op) {
  switch (op) {
    case WrOpcode::send: return IBV_WR_SEND;
    case WrOpcode::send_with_imm: return IBV_WR_SEND_WITH_IMM;
    case WrOpcode::rdma_write: return IBV_WR_RDMA_WRITE;
    case WrOpcode::rdma_write_with_imm: return IBV_WR_RDMA_WRITE_WITH_IMM;
    case WrOpcode::rdma_read: return IBV_WR_RDMA_READ;
    case WrOpcode::atomic_fetch_add: return IBV_WR_ATOMIC_FETCH_AND_ADD;
    case WrOpcode::atomic_cmp_swap: return IBV_WR_ATOMIC_CMP_AND_SWP;
  }
  return IBV_WR_SEND;
}

unsigned to_ibv_send_flags(uint32_t flags) {
  unsigned out = 0;
  if (flags & send_signaled) out |= IBV_SEND_SIGNALED;
  if (flags & send_inline) out |= IBV_SEND_INLINE;
  if (flags & send_solicited) out |= IBV_SEND_SOLICITED;
  return out;
}

namespace {
void copy_sges(std::span<const Sge> in, std::span<ibv_sge> out) {
  for (size_t i = 0; i < in.size(); ++i) out[i] = ibv_sge{in[i].addr, in[i].length, in[i].lkey};
}
}  // namespace

Status to_ibv_send_wr(const SendWr& wr, const SendLimits& limits, std::span<ibv_sge> sges, ibv_send_wr& out) {
  const size_t n = wr.sg_list.size();
  if (n > limits.max_send_sge)
    return Status(Errc::invalid_argument, "post_send: " + std::to_string(n) + " SGEs exceed max_send_sge " + std::to_string(limits.max_send_sge));
  if (n > sges.size()) return Status(Errc::invalid_argument, "post_send: " + std::to_string(n) + " SGEs exceed the provider's SGE storage");
  uint64_t total = 0;
  for (const Sge& s : wr.sg_list) total += s.length;
  const bool atomic = wr.opcode == WrOpcode::atomic_fetch_add || wr.opcode == WrOpcode::atomic_cmp_swap;
  const bool writes_local = atomic || wr.opcode == WrOpcode::rdma_read;
  if (wr.flags & send_inline) {
    if (writes_local) return Status(Errc::invalid_argument, "post_send: inline is only for sends and writes");
    if (total > limits.max_inline_data)
      return Status(Errc::invalid_argument, "post_send: inline payload " + std::to_string(total) + " bytes exceeds max_inline_data " +
                                                std::to_string(limits.max_inline_data));
  }
  // The NIC takes an atomic's local buffer from one SGE; more would be ignored or fail late.
  if (atomic && (n != 1 || total != 8 || wr.remote_addr % 8))
    return Status(Errc::invalid_argument, "post_send: atomics need one 8-byte SGE and an 8-byte aligned remote address");

  out = ibv_send_wr{};
  out.wr_id = wr.wr_id;
  out.next = nullptr;
  copy_sges(wr.sg_list, sges);
  out.sg_list = n ? sges.data() : nullptr;
  out.num_sge = int(n);
  out.opcode = to_ibv_opcode(wr.opcode);
  out.send_flags = to_ibv_send_flags(wr.flags);
  switch (wr.opcode) {
    case WrOpcode::send: break;
    case WrOpcode::send_with_imm: out.imm_data = htonl(wr.imm_data); break;
    case WrOpcode::rdma_write_with_imm:
      out.imm_data = htonl(wr.imm_data);
      [[fallthrough]];
    case WrOpcode::rdma_write:
    case WrOpcode::rdma_read:
      out.wr.rdma.remote_addr = wr.remote_addr;
      out.wr.rdma.rkey = wr.rkey;
      break;
    case WrOpcode::atomic_fetch_add:
    case WrOpcode::atomic_cmp_swap:
      out.wr.atomic.remote_addr = wr.remote_addr;
      out.wr.atomic.rkey = wr.rkey;
      out.wr.atomic.compare_add = wr.compare_add;
      out.wr.atomic.swap = wr.opcode == WrOpcode::atomic_cmp_swap ? wr.swap : 0;
      break;
  }
  return {};
}

Status to_ibv_recv_wr(const RecvWr& wr, uint32_t max_recv_sge, std::span<ibv_sge> sges, ibv_recv_wr& out) {
  const size_t n = wr.sg_list.size();
  if (n > max_recv_sge || n > sges.size())
    return Status(Errc::invalid_argument, "post_recv: " + std::to_string(n) + " SGEs exceed max_recv_sge " + std::to_string(max_recv_sge));
  out = ibv_recv_wr{};
  out.wr_id = wr.wr_id;
  out.next = nullptr;
  copy_sges(wr.sg_list, sges);
  out.sg_list = n ? sges.data() : nullptr;
  out.num_sge = int(n);
  return {};
}

WcStatus from_ibv_status(ibv_wc_status s) {
  switch (s) {
    case IBV_WC_SUCCESS: return WcStatus::success;
    case IBV_WC_LOC_LEN_ERR: return WcStatus::local_length_error;
    case IBV_WC_LOC_QP_OP_ERR: return WcStatus::local_qp_operation_error;
    case IBV_WC_LOC_EEC_OP_ERR: return WcStatus::local_qp_operation_error;  // EE contexts: RD only
    case IBV_WC_LOC_PROT_ERR: return WcStatus::local_protection_error;
    case IBV_WC_WR_FLUSH_ERR: return WcStatus::work_request_flushed;
    case IBV_WC_MW_BIND_ERR: return WcStatus::local_protection_error;
    case IBV_WC_BAD_RESP_ERR: return WcStatus::bad_response;
    case IBV_WC_LOC_ACCESS_ERR: return WcStatus::local_protection_error;  // e.g. a READ response into a region without local write
    case IBV_WC_REM_INV_REQ_ERR: return WcStatus::remote_invalid_request;
    case IBV_WC_REM_ACCESS_ERR: return WcStatus::remote_access_error;
    case IBV_WC_REM_OP_ERR: return WcStatus::remote_operation_error;
    case IBV_WC_RETRY_EXC_ERR: return WcStatus::retry_exceeded;
    case IBV_WC_RNR_RETRY_EXC_ERR: return WcStatus::rnr_retry_exceeded;
    case IBV_WC_LOC_RDD_VIOL_ERR: return WcStatus::local_protection_error;  // RD domains: RD only
    case IBV_WC_REM_INV_RD_REQ_ERR: return WcStatus::remote_invalid_request;
    case IBV_WC_REM_ABORT_ERR: return WcStatus::remote_operation_error;
    case IBV_WC_INV_EECN_ERR: return WcStatus::local_qp_operation_error;
    case IBV_WC_INV_EEC_STATE_ERR: return WcStatus::local_qp_operation_error;
    case IBV_WC_FATAL_ERR: return WcStatus::local_qp_operation_error;
    case IBV_WC_RESP_TIMEOUT_ERR: return WcStatus::retry_exceeded;  // the responder never answered
    case IBV_WC_GENERAL_ERR: return WcStatus::local_qp_operation_error;
    case IBV_WC_TM_ERR: return WcStatus::local_qp_operation_error;
    case IBV_WC_TM_RNDV_INCOMPLETE: return WcStatus::local_qp_operation_error;
  }
  return WcStatus::local_qp_operation_error;  // a status newer than these headers
}

std::optional<WcOpcode> from_ibv_opcode(ibv_wc_opcode op) {
  switch (op) {
    case IBV_WC_SEND: return WcOpcode::send;
    case IBV_WC_RDMA_WRITE: return WcOpcode::rdma_write;
    case IBV_WC_RDMA_READ: return WcOpcode::rdma_read;
    case IBV_WC_COMP_SWAP: return WcOpcode::compare_swap;
    case IBV_WC_FETCH_ADD: return WcOpcode::fetch_add;
    case IBV_WC_RECV: return WcOpcode::recv;
    case IBV_WC_RECV_RDMA_WITH_IMM: return WcOpcode::recv_rdma_with_imm;
    default: return std::nullopt;
  }
}

WorkCompletion from_ibv_wc(const ibv_wc& wc) {
  WorkCompletion out;
  out.wr_id = wc.wr_id;
  out.status = from_ibv_status(wc.status);
  out.opcode = from_ibv_opcode(wc.opcode).value_or(WcOpcode::send);
  out.byte_len = wc.byte_len;
  out.has_imm = wc.status == IBV_WC_SUCCESS && (wc.wc_flags & IBV_WC_WITH_IMM);
  out.imm_data = out.has_imm ? ntohl(wc.imm_data) : 0;
  out.qp_num = wc.qp_num;
  if (wc.status != IBV_WC_SUCCESS) {
    out.provider = Provider::verbs;
    out.provider_status = uint32_t(wc.status);
    out.vendor_error = wc.vendor_err;
  }
  return out;
}

std::string describe_ibv_status(uint32_t ibv_status, uint32_t vendor_error) {
  static const char* const names[] = {
      "IBV_WC_SUCCESS",        "IBV_WC_LOC_LEN_ERR",       "IBV_WC_LOC_QP_OP_ERR",   "IBV_WC_LOC_EEC_OP_ERR",
      "IBV_WC_LOC_PROT_ERR",   "IBV_WC_WR_FLUSH_ERR",      "IBV_WC_MW_BIND_ERR",     "IBV_WC_BAD_RESP_ERR",
      "IBV_WC_LOC_ACCESS_ERR", "IBV_WC_REM_INV_REQ_ERR",   "IBV_WC_REM_ACCESS_ERR",  "IBV_WC_REM_OP_ERR",
      "IBV_WC_RETRY_EXC_ERR",  "IBV_WC_RNR_RETRY_EXC_ERR", "IBV_WC_LOC_RDD_VIOL_ERR", "IBV_WC_REM_INV_RD_REQ_ERR",
      "IBV_WC_REM_ABORT_ERR",  "IBV_WC_INV_EECN_ERR",      "IBV_WC_INV_EEC_STATE_ERR", "IBV_WC_FATAL_ERR",
      "IBV_WC_RESP_TIMEOUT_ERR", "IBV_WC_GENERAL_ERR",     "IBV_WC_TM_ERR",          "IBV_WC_TM_RNDV_INCOMPLETE"};
  const auto s = ibv_wc_status(ibv_status);
  char vendor[32];
  std::snprintf(vendor, sizeof vendor, "0x%x", vendor_error);
  const std::string name = ibv_status < std::size(names) ? names[ibv_status] : "ibv_wc_status " + std::to_string(ibv_status);
  return std::string(stellar::to_string(from_ibv_status(s))) + " (" + name + ": " + ibv_wc_status_str(s) + ", vendor_err " + vendor + ")";
}

std::chrono::nanoseconds ib_timeout(uint8_t exponent) {
  // 4.096 us * 2^e, in ns: 4096 << e (fits in 64 bits for e <= 31).
  return std::chrono::nanoseconds(int64_t(4096) << std::min<uint8_t>(exponent, 31));
}

uint8_t ib_timeout_exponent(std::chrono::nanoseconds rto) {
  for (uint8_t e = 1; e < 31; ++e)
    if (ib_timeout(e) >= rto) return e;
  return 31;
}

VerbsTiming to_verbs_timing(const QpTiming& t) {
  VerbsTiming v;
  v.timeout = ib_timeout_exponent(t.rto_min);
  v.retry_cnt = uint8_t(std::min<uint32_t>(t.retry_count, 7));
  v.rnr_retry = uint8_t(std::min<uint32_t>(t.rnr_retry, 7));
  v.min_rnr_timer = 12;
  return v;
}

std::chrono::nanoseconds rnr_timer_delay(uint8_t code) {
  // IBA table 45 (RNR NAK timer field), in units of 10 us.
  static constexpr uint32_t tens_of_us[32] = {65536, 1,    2,    3,    4,    6,    8,    12,   16,   24,   32,
                                              48,    64,   96,   128,  192,  256,  384,  512,  768,  1024, 1536,
                                              2048,  3072, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 49152};
  return std::chrono::microseconds(10 * int64_t(tens_of_us[code & 31]));
}

std::optional<ibv_mtu> ibv_mtu_at_most(uint32_t bytes) {
  if (bytes >= 4096) return IBV_MTU_4096;
  if (bytes >= 2048) return IBV_MTU_2048;
  if (bytes >= 1024) return IBV_MTU_1024;
  if (bytes >= 512) return IBV_MTU_512;
  if (bytes >= 256) return IBV_MTU_256;
  return std::nullopt;
}

uint32_t mtu_bytes(ibv_mtu m) { return m >= IBV_MTU_256 && m <= IBV_MTU_4096 ? 128u << int(m) : 0; }

const char* to_string(GidType t) {
  switch (t) {
    case GidType::ib: return "IB";
    case GidType::roce_v1: return "RoCE v1";
    case GidType::roce_v2: return "RoCE v2";
  }
  return "?";
}

std::string format_gid(const Gid& g) {
  char text[40];
  std::snprintf(text, sizeof text, "%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x", g[0], g[1], g[2], g[3],
                g[4], g[5], g[6], g[7], g[8], g[9], g[10], g[11], g[12], g[13], g[14], g[15]);
  return text;
}

std::optional<Gid> parse_gid(std::string_view text) {
  Gid g{};
  const std::string s(text);
  if (inet_pton(AF_INET6, s.c_str(), g.data()) != 1) return std::nullopt;
  return g;
}

std::optional<std::string> gid_ipv4(const Gid& g) {
  static constexpr uint8_t prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  if (!std::equal(std::begin(prefix), std::end(prefix), g.begin())) return std::nullopt;
  return std::to_string(g[12]) + "." + std::to_string(g[13]) + "." + std::to_string(g[14]) + "." + std::to_string(g[15]);
}

bool gid_is_link_local(const Gid& g) { return g[0] == 0xfe && (g[1] & 0xc0) == 0x80; }

namespace {

std::optional<std::string> read_line(const fs::path& p) {
  std::ifstream in(p);
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  while (!line.empty() && (line.back() == '\n' || line.back() == ' ')) line.pop_back();
  return line;
}

// Directory entries that are decimal numbers, ascending.
std::vector<uint32_t> numbered(const fs::path& dir) {
  std::vector<uint32_t> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!name.empty() && name.find_first_not_of("0123456789") == std::string::npos) out.push_back(uint32_t(std::stoul(name)));
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

std::vector<DeviceGids> read_sysfs_gid_tables(const std::string& sysfs_root) {
  std::vector<DeviceGids> out;
  const fs::path base = fs::path(sysfs_root) / "class" / "infiniband";
  std::error_code ec;
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(base, ec))
    if (e.path().filename().string()[0] != '.') names.push_back(e.path().filename().string());  // not a device: a fixture's .keep
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    DeviceGids device{name, {}};
    for (uint32_t port : numbered(base / name / "ports")) {
      const fs::path p = base / name / "ports" / std::to_string(port);
      const bool infiniband = read_line(p / "link_layer").value_or("") == "InfiniBand";
      const bool active = read_line(p / "state").value_or("").find("ACTIVE") != std::string::npos;
      for (uint32_t index : numbered(p / "gids")) {
        const auto text = read_line(p / "gids" / std::to_string(index));
        const auto type = read_line(p / "gid_attrs" / "types" / std::to_string(index));
        if (!text || !type) continue;
        const auto gid = parse_gid(*text);
        if (!gid || *gid == Gid{}) continue;
        GidEntry entry;
        entry.port = port;
        entry.index = index;
        entry.gid = *gid;
        if (*type == "RoCE v2") entry.type = GidType::roce_v2;
        else if (*type == "IB/RoCE v1") entry.type = infiniband ? GidType::ib : GidType::roce_v1;
        else continue;
        entry.netdev = read_line(p / "gid_attrs" / "ndevs" / std::to_string(index)).value_or("");
        entry.port_active = active;
        device.gids.push_back(std::move(entry));
      }
    }
    out.push_back(std::move(device));
  }
  return out;
}

Status no_device_status(const std::string& detail) {
  return Status(Errc::no_device, "verbs provider: no RDMA device found (" + detail +
                                     "); use the soft provider (--provider soft) on machines without an RDMA NIC");
}

Result<GidChoice> select_gid(const std::vector<DeviceGids>& devices, const std::string& device, const std::string& address) {
  if (devices.empty()) return no_device_status("ibv_get_device_list returned none");
  std::string all_names;
  for (const auto& d : devices) all_names += (all_names.empty() ? "" : ", ") + d.device;
  std::vector<const DeviceGids*> candidates;
  for (const auto& d : devices)
    if (device.empty() || d.device == device) candidates.push_back(&d);
  if (candidates.empty()) return Status(Errc::not_found, "verbs provider: no RDMA device named '" + device + "' (found: " + all_names + ")");
  const std::string scope = device.empty() ? "devices " + all_names : "device " + device;

  auto choose = [](const DeviceGids& d, const GidEntry& e) {
    return GidChoice{d.device, e, gid_ipv4(e.gid).value_or("")};
  };

  const bool wildcard = address.empty() || address == "0.0.0.0" || address == "127.0.0.1";
  if (!address.empty()) {
    in_addr ip{};
    if (inet_pton(AF_INET, address.c_str(), &ip) != 1)
      return Status(Errc::invalid_argument, "verbs provider: bind address '" + address + "' is not an IPv4 address");
    const Gid wanted = *parse_gid("::ffff:" + address);
    std::optional<GidChoice> down_choice, v1_choice;
    for (const DeviceGids* d : candidates)
      for (const GidEntry& e : d->gids) {
        if (e.gid != wanted) continue;
        if (e.type == GidType::roce_v2 && e.port_active) return choose(*d, e);
        if (e.type == GidType::roce_v2 && !down_choice) down_choice = choose(*d, e);
        if (e.type == GidType::roce_v1 && !v1_choice) v1_choice = choose(*d, e);
      }
    if (down_choice)
      return Status(Errc::not_found, "verbs provider: " + address + " is the RoCE v2 GID " + std::to_string(down_choice->entry.index) + " of " +
                                         down_choice->device + " port " + std::to_string(down_choice->entry.port) + ", but that port is not ACTIVE");
    if (v1_choice)
      return Status(Errc::not_found, "verbs provider: " + address + " has only a RoCE v1 GID (" + v1_choice->device + " port " +
                                         std::to_string(v1_choice->entry.port) + " index " + std::to_string(v1_choice->entry.index) +
                                         "); Stellar uses RoCE v2 (routable, UDP 4791): enable it for that netdev");
    if (!wildcard) {
      std::string seen;
      for (const DeviceGids* d : candidates)
        for (const GidEntry& e : d->gids)
          if (e.type == GidType::roce_v2)
            if (auto ip4 = gid_ipv4(e.gid))
              seen += (seen.empty() ? "" : ", ") + d->device + " port " + std::to_string(e.port) + ": " + *ip4;
      return Status(Errc::not_found, "verbs provider: no RoCE v2 GID carries " + address + " on " + scope +
                                         (seen.empty() ? std::string(" (they carry no IPv4 RoCE v2 GID)") : " (IPv4 RoCE v2 GIDs: " + seen + ")") +
                                         "; bind the address of an RDMA netdev or leave it empty");
    }
  }

  // Any GID will do: rank the candidates.
  auto rank = [](const GidEntry& e) {
    if (!e.port_active) return 0;
    if (e.type == GidType::roce_v2) return gid_ipv4(e.gid) ? 5 : gid_is_link_local(e.gid) ? 3 : 4;
    if (e.type == GidType::ib) return e.index == 0 ? 2 : 1;
    return 0;  // RoCE v1: never chosen
  };
  const DeviceGids* best_device = nullptr;
  const GidEntry* best = nullptr;
  int best_rank = 0;
  for (const DeviceGids* d : candidates)
    for (const GidEntry& e : d->gids)
      if (int r = rank(e); r > best_rank) best_rank = r, best = &e, best_device = d;
  if (!best)
    return Status(Errc::not_found, "verbs provider: " + scope +
                                       " has no usable GID (no RoCE v2 GID or InfiniBand port that is ACTIVE); check `rdma link` and the port state");
  return choose(*best_device, *best);
}

}  // namespace stellar::provider::verbs
