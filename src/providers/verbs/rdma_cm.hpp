// Connection management through librdmacm for verbs-provider QPs
// (cm::Method::rdma_cm; docs/verbs-provider.md). The QP is the
// application's own (made from its PD before connecting), so rdma_cm runs
// in its "no QP on the id" mode: it resolves address and route, runs the IB
// CM exchange (REQ/REP/RTU) carrying the QP number, starting PSNs and
// private data, and hands out the attributes of each state transition
// (rdma_init_qp_attr), which this library applies to the QP with its own
// choices (QpTiming, traffic class, MTU cap) laid over them.
#pragma once

#include <infiniband/verbs.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "stellar/cm.hpp"
#include "stellar/verbs.hpp"

namespace stellar::provider::verbs {

// What the rdma_cm path needs to know of a verbs QP (verbs_provider.cpp).
struct CmQp {
  std::string device;        // the ibv device the QP lives on
  uint8_t port = 0;          // and its port
  std::string source_address;  // the IPv4 the context's GID carries (else its bind_address)
  uint32_t mtu = 4096;         // the path MTU this side offers, bytes
  QpState state = QpState::reset;
  uint8_t initiator_depth = 1;      // READ/atomics this QP may have outstanding (<= 16 and the device's)
  uint8_t responder_resources = 1;  // and serve for its peer
};
// nullopt for a QP of another provider.
std::optional<CmQp> cm_qp(QueuePair&);
// Moves a verbs QP to attr.qp_state with rdma_init_qp_attr's attributes and
// mask, overriding: at INIT the access flags (all four, as QpModify's
// default; refused if rdma_cm's partition is not the tenant's), at RTR the
// path MTU (capped by the context's and by `peer_mtu`, bytes, 0 = none) and
// the traffic class ($STELLAR_VERBS_TC), at RTS the retransmission timer
// and retry counts (`timing`, as the TCP method maps them).
Status cm_modify(QueuePair&, ibv_qp_attr attr, int mask, const QpTiming& timing, uint32_t peer_mtu = 0);

// Private data on the wire: the sender's path MTU (an ibv_mtu code, 1..5),
// a length byte, then the caller's bytes. The receiver gets the IB CM's
// whole fixed-size field and takes them back out (protocol_error if the MTU
// code or the length does not fit).
struct CmPrivateData {
  uint32_t mtu = 0;  // bytes
  std::vector<uint8_t> data;
};
std::vector<uint8_t> rdma_cm_frame(const std::vector<uint8_t>& data, uint32_t mtu);
Result<CmPrivateData> rdma_cm_unframe(const std::vector<uint8_t>& field, const std::string& what);

Result<std::unique_ptr<cm::Listener>> rdma_cm_listen(const std::string& address, uint16_t port);
Result<cm::Connected> rdma_cm_connect(const std::string& address, uint16_t port, QueuePair&, const cm::ConnectOptions&);

}  // namespace stellar::provider::verbs
