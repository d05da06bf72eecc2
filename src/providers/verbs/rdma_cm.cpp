// cm::Method::rdma_cm: connection management through librdmacm for
// verbs-provider QPs. See rdma_cm.hpp for the model; the flow is rdma_cm's
// own for an id without a QP:
//
//   active                                   passive
//   rdma_resolve_addr -> ADDR_RESOLVED       rdma_bind_addr + rdma_listen
//   rdma_resolve_route -> ROUTE_RESOLVED
//   QP -> INIT (rdma_init_qp_attr)
//   rdma_connect(qp_num, data) ------------> CONNECT_REQUEST (new id, migrated to its own channel)
//                                            QP -> INIT, RTR, RTS
//   CONNECT_RESPONSE <---------------------- rdma_accept(qp_num, data)
//   QP -> RTR, RTS
//   rdma_establish ------------------------> ESTABLISHED
//
// Every id has its own event channel, its fd non-blocking, so each wait has
// a deadline (poll) and connections do not see each other's events. Events
// are acknowledged as soon as their contents are copied.
//
// Private data: the IB CM's fields have a fixed size and rdma_cm hands the
// receiver the whole field (56 bytes of a REQ, 196 of a REP), so the
// caller's bytes travel behind a one-byte length. A reject reason is text
// ending in a NUL.
#include "providers/verbs/rdma_cm.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <rdma/rdma_cma.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>

#include "core/log.hpp"
#include "providers/verbs/translate.hpp"

namespace stellar::provider::verbs {
namespace {

using Clock = std::chrono::steady_clock;

std::string errno_text(int e) { return std::string(std::strerror(e)) + " (errno " + std::to_string(e) + ")"; }

// One rdma_cm id on its own event channel; destroying it disconnects.
struct CmId {
  rdma_event_channel* channel = nullptr;
  rdma_cm_id* id = nullptr;
  bool connected = false;

  CmId() = default;
  CmId(const CmId&) = delete;
  CmId& operator=(const CmId&) = delete;
  ~CmId() {
    if (id) {
      if (connected) (void)rdma_disconnect(id);
      (void)rdma_destroy_id(id);
    }
    if (channel) rdma_destroy_event_channel(channel);
  }
};

// The error when librdmacm cannot start here: no /dev/infiniband/rdma_cm
// or no RDMA device. Says what to do instead.
Status unavailable(const char* call, int e) {
  return Status(e == ENODEV || e == ENOENT || e == ENXIO ? Errc::no_device : Errc::io_error,
                std::string("rdma_cm: ") + call + ": " + errno_text(e) +
                    " (needs an RDMA device and the rdma_cm kernel module, /dev/infiniband/rdma_cm; "
                    "the tcp connection method works everywhere)");
}

Result<rdma_event_channel*> open_channel() {
  rdma_event_channel* channel = rdma_create_event_channel();
  if (!channel) return unavailable("rdma_create_event_channel", errno);
  const int flags = fcntl(channel->fd, F_GETFL);
  if (flags < 0 || fcntl(channel->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    const int e = errno;
    rdma_destroy_event_channel(channel);
    return Status(Errc::io_error, "rdma_cm: making the event channel non-blocking: " + errno_text(e));
  }
  return channel;
}

Result<std::unique_ptr<CmId>> new_id() {
  auto c = std::make_unique<CmId>();
  auto channel = open_channel();
  if (!channel) return channel.status();
  c->channel = *channel;
  if (rdma_create_id(c->channel, &c->id, nullptr, RDMA_PS_TCP) != 0) {
    c->id = nullptr;
    return unavailable("rdma_create_id", errno);
  }
  return c;
}

// The contents of one event, copied before it is acknowledged.
struct Event {
  rdma_cm_event_type type{};
  int status = 0;
  rdma_cm_id* id = nullptr;  // CONNECT_REQUEST: the new id
  std::vector<uint8_t> private_data;
  uint32_t qp_num = 0;
  uint8_t responder_resources = 0, initiator_depth = 0;
};

Result<Event> next_event(rdma_event_channel* channel, Clock::time_point deadline, const std::string& waiting_for) {
  for (;;) {
    rdma_cm_event* raw = nullptr;
    if (rdma_get_cm_event(channel, &raw) == 0) {
      Event e;
      e.type = raw->event;
      e.status = raw->status;
      e.id = raw->id;
      const rdma_conn_param& p = raw->param.conn;
      if (p.private_data && p.private_data_len)
        e.private_data.assign(static_cast<const uint8_t*>(p.private_data), static_cast<const uint8_t*>(p.private_data) + p.private_data_len);
      e.qp_num = p.qp_num;
      e.responder_resources = p.responder_resources;
      e.initiator_depth = p.initiator_depth;
      (void)rdma_ack_cm_event(raw);
      return e;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return Status(Errc::io_error, "rdma_cm: rdma_get_cm_event: " + errno_text(errno));
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return Status(Errc::timeout, "rdma_cm: no answer while waiting for " + waiting_for);
    pollfd fd{channel->fd, POLLIN, 0};
    (void)::poll(&fd, 1, int(std::min<long long>(left, 1000)));
  }
}

// The error an unexpected event stands for, with rdma_cm's names and status.
Status event_error(const Event& e, const std::string& what) {
  const std::string name = rdma_event_str(e.type);
  switch (e.type) {
    case RDMA_CM_EVENT_REJECTED: {
      std::string reason(e.private_data.begin(), std::find(e.private_data.begin(), e.private_data.end(), uint8_t(0)));
      return Status(Errc::connection_refused, what + ": rejected by peer" + (reason.empty() ? "" : ": " + reason) +
                                                  " (IB CM reason " + std::to_string(e.status) + ")");
    }
    case RDMA_CM_EVENT_UNREACHABLE:
      return Status(Errc::connection_refused, what + ": peer unreachable (" + name + ", status " + std::to_string(e.status) + ")");
    case RDMA_CM_EVENT_ADDR_ERROR:
    case RDMA_CM_EVENT_ROUTE_ERROR:
      return Status(Errc::connection_refused, what + ": " + name + ": " + (e.status < 0 ? errno_text(-e.status) : std::to_string(e.status)));
    default:
      return Status(Errc::protocol_error, what + ": unexpected " + name + " (status " + std::to_string(e.status) + ")");
  }
}

Result<sockaddr_in> ipv4(const std::string& address, uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  if (inet_pton(AF_INET, address.c_str(), &a.sin_addr) != 1) return Status(Errc::invalid_argument, "rdma_cm: '" + address + "' is not an IPv4 address");
  return a;
}

std::string peer_address(rdma_cm_id* id) {
  const sockaddr* a = rdma_get_peer_addr(id);
  char text[INET6_ADDRSTRLEN] = {};
  if (a && a->sa_family == AF_INET) inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a)->sin_addr, text, sizeof text);
  if (a && a->sa_family == AF_INET6) inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr, text, sizeof text);
  return text;
}

// The id must be on the QP's device and port: rdma_cm picked it from the
// route (active) or from where the request arrived (passive).
Status same_device(rdma_cm_id* id, const CmQp& qp, const std::string& peer) {
  if (!id->verbs) return Status(Errc::io_error, "rdma_cm: the id for " + peer + " is bound to no device");
  const std::string device = ibv_get_device_name(id->verbs->device);
  // iWARP's CM drives the QP itself and reports no CONNECT_RESPONSE.
  if (id->verbs->device->transport_type != IBV_TRANSPORT_IB)
    return Status(Errc::unsupported, "rdma_cm: " + device + " is not an InfiniBand/RoCE device (iWARP is not supported)");
  if (device != qp.device || id->port_num != qp.port)
    return Status(Errc::invalid_argument, "rdma_cm: " + peer + " is reached through " + device + " port " + std::to_string(id->port_num) +
                                              ", but the QP lives on " + qp.device + " port " + std::to_string(qp.port) +
                                              " (open the context on that device: ContextOptions::device / bind_address)");
  return {};
}

// One state transition with rdma_cm's attributes. `rd_atomic` (not 0): the
// READ/atomic depth this side agreed on, which the passive side must set
// itself before its REP goes out (at RTR the depth it serves, at RTS the
// depth it initiates), as librdmacm does for QPs it owns.
// `peer_mtu`: the path MTU the peer offered (private data), bytes.
Status step(rdma_cm_id* id, QueuePair& qp, ibv_qp_state state, const QpTiming& timing, uint8_t rd_atomic = 0, uint32_t peer_mtu = 0) {
  ibv_qp_attr attr{};
  int mask = 0;
  attr.qp_state = state;
  if (rdma_init_qp_attr(id, &attr, &mask) != 0) {
    const int e = errno;
    return Status(Errc::io_error, std::string("rdma_cm: rdma_init_qp_attr(") + (state == IBV_QPS_INIT ? "INIT" : state == IBV_QPS_RTR ? "RTR" : "RTS") +
                                      "): " + errno_text(e) + (e == EINVAL ? " (did the peer give up on the connection?)" : ""));
  }
  if (rd_atomic && state == IBV_QPS_RTR) attr.max_dest_rd_atomic = rd_atomic, mask |= IBV_QP_MAX_DEST_RD_ATOMIC;
  if (rd_atomic && state == IBV_QPS_RTS) attr.max_rd_atomic = rd_atomic, mask |= IBV_QP_MAX_QP_RD_ATOMIC;
  return cm_modify(qp, attr, mask, timing, peer_mtu);
}

// The peer as far as the QP's RTR attributes describe it (for logs and
// ConnectionRequest::remote()).
QpEndpoint remote_of(rdma_cm_id* id, uint32_t qp_num) {
  QpEndpoint r;
  r.address = peer_address(id);
  r.udp_port = 4791;
  r.qp_num = qp_num;
  r.mode = Mode::roce;
  ibv_qp_attr attr{};
  int mask = 0;
  attr.qp_state = IBV_QPS_RTR;
  if (rdma_init_qp_attr(id, &attr, &mask) == 0) {
    r.psn = attr.rq_psn;
    r.mtu = mtu_bytes(attr.path_mtu);
    r.lid = attr.ah_attr.dlid;
    if (attr.ah_attr.is_global) {
      Gid g;
      std::memcpy(g.data(), attr.ah_attr.grh.dgid.raw, 16);
      r.gid = format_gid(g);
    }
  }
  return r;
}

class RdmaCmRequest final : public cm::ConnectionRequest {
 public:
  RdmaCmRequest(std::unique_ptr<CmId> id, QpEndpoint remote, CmPrivateData data, uint8_t responder_resources, uint8_t initiator_depth)
      : id_(std::move(id)), remote_(std::move(remote)), data_(std::move(data.data)), peer_mtu_(data.mtu), peer_rd_(responder_resources),
        peer_id_(initiator_depth) {}
  const QpEndpoint& remote() const override { return remote_; }
  const std::vector<uint8_t>& private_data() const override { return data_; }

  Status accept(QueuePair& qp, const std::vector<uint8_t>& private_data, const QpTiming& timing) override {
    if (answered_) return Status(Errc::wrong_state, "request already answered");
    if (private_data.size() > cm::rdma_cm_max_accept_data)
      return Status(Errc::invalid_argument, "rdma_cm: accept private data above " + std::to_string(cm::rdma_cm_max_accept_data) +
                                                " bytes (IB CM REP, less the MTU and length bytes)");
    auto info = cm_qp(qp);
    if (!info) return Status(Errc::invalid_argument, "rdma_cm accepts with verbs-provider QPs only; the soft provider uses cm::Method::tcp");
    if (info->state != QpState::reset && info->state != QpState::init)
      return Status(Errc::wrong_state, "rdma_cm: accept needs a QP in RESET or INIT");
    answered_ = true;
    bool moved = false;  // past the state the application left the QP in
    auto refuse = [&](Status s) {
      log().warn("cm: rejecting QP {} from {}: {}", remote_.qp_num, remote_.address, s.to_string());
      if (moved) (void)qp.modify(QpModify{QpState::error});  // as librdmacm does with its own QPs; untouched QPs stay usable
      const std::string reason = s.to_string().substr(0, cm::rdma_cm_max_reject_data - 1);
      (void)rdma_reject(id_->id, reason.c_str(), uint8_t(reason.size() + 1));
      return s;
    };
    if (Status s = same_device(id_->id, *info, remote_.address); !s.ok()) return refuse(s);
    // What this side serves is bounded by what the peer asked to have
    // outstanding, and what it initiates by what the peer serves.
    const uint8_t responder_resources = std::min(info->responder_resources, std::max<uint8_t>(peer_id_, 1));
    const uint8_t initiator_depth = std::min(info->initiator_depth, std::max<uint8_t>(peer_rd_, 1));
    if (Status s = step(id_->id, qp, IBV_QPS_INIT, timing); !s.ok()) return refuse(s);
    if (Status s = step(id_->id, qp, IBV_QPS_RTR, timing, responder_resources, peer_mtu_); !s.ok()) return refuse(s);
    moved = true;
    if (Status s = step(id_->id, qp, IBV_QPS_RTS, timing, initiator_depth); !s.ok()) return refuse(s);
    // The MTU both use: what the requester offered, capped by this side (the requester applies it too).
    const std::vector<uint8_t> data = rdma_cm_frame(private_data, std::min(info->mtu, peer_mtu_));
    rdma_conn_param param{};
    param.private_data = data.data();
    param.private_data_len = uint8_t(data.size());
    param.responder_resources = responder_resources;
    param.initiator_depth = initiator_depth;
    param.flow_control = 1;
    param.rnr_retry_count = to_verbs_timing(timing).rnr_retry;
    param.qp_num = qp.qp_num();
    if (rdma_accept(id_->id, &param) != 0) {
      const int e = errno;
      (void)qp.modify(QpModify{QpState::error});
      return Status(Errc::io_error, "rdma_cm: rdma_accept: " + errno_text(e));
    }
    remote_.mtu = std::min(remote_.mtu, std::min(info->mtu, peer_mtu_));
    auto event = next_event(id_->channel, Clock::now() + std::chrono::seconds(10), "the peer's confirmation (ESTABLISHED)");
    if (!event || event->type != RDMA_CM_EVENT_ESTABLISHED) {
      (void)qp.modify(QpModify{QpState::error});
      return event ? event_error(*event, "rdma_cm: accept") : event.status();
    }
    id_->connected = true;
    log().info("cm: accepted QP {} at {} on local QP {} (rdma_cm)", remote_.qp_num, remote_.address, qp.qp_num());
    return {};
  }

  Status reject(const std::string& reason) override {
    if (answered_) return Status(Errc::wrong_state, "request already answered");
    answered_ = true;
    const std::string text = reason.substr(0, cm::rdma_cm_max_reject_data - 1);
    if (rdma_reject(id_->id, text.c_str(), uint8_t(text.size() + 1)) != 0) return Status(Errc::io_error, "rdma_cm: rdma_reject: " + errno_text(errno));
    return {};
  }

 private:
  std::unique_ptr<CmId> id_;
  QpEndpoint remote_;
  std::vector<uint8_t> data_;
  uint32_t peer_mtu_;          // the requester's path MTU, bytes
  uint8_t peer_rd_, peer_id_;  // the requester's responder resources and initiator depth
  bool answered_ = false;
};

class RdmaCmListener final : public cm::Listener {
 public:
  explicit RdmaCmListener(std::unique_ptr<CmId> id) : id_(std::move(id)) {}
  uint16_t port() const override { return ntohs(rdma_get_src_port(id_->id)); }

  Result<std::unique_ptr<cm::ConnectionRequest>> get_request(std::chrono::milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      auto event = next_event(id_->channel, deadline, "a connection request");
      if (!event) return event.status();
      if (event->type != RDMA_CM_EVENT_CONNECT_REQUEST) {
        log().warn("cm: rdma_cm listener: ignored {} (status {})", rdma_event_str(event->type), event->status);
        if (event->type == RDMA_CM_EVENT_DEVICE_REMOVAL) return Status(Errc::io_error, "rdma_cm: the listener's RDMA device was removed");
        continue;
      }
      // The request gets its own channel, so that accept() waits for its
      // own ESTABLISHED and this listener keeps only requests.
      auto request = std::make_unique<CmId>();
      request->id = event->id;
      auto channel = open_channel();
      if (!channel || rdma_migrate_id(request->id, *channel) != 0) {
        const Status s = channel ? Status(Errc::io_error, "rdma_cm: rdma_migrate_id: " + errno_text(errno)) : channel.status();
        if (channel) rdma_destroy_event_channel(*channel);
        (void)rdma_reject(request->id, nullptr, 0);
        return s;
      }
      request->channel = *channel;
      QpEndpoint remote = remote_of(request->id, event->qp_num);
      auto data = rdma_cm_unframe(event->private_data, "a connection request from " + remote.address);
      if (!data) {
        log().warn("cm: rdma_cm listener: {}", data.status().to_string());
        (void)rdma_reject(request->id, "malformed private data", 23);
        continue;  // as the TCP listener does with a broken client
      }
      return std::unique_ptr<cm::ConnectionRequest>(std::make_unique<RdmaCmRequest>(std::move(request), std::move(remote), std::move(*data),
                                                                                     event->responder_resources, event->initiator_depth));
    }
  }

 private:
  std::unique_ptr<CmId> id_;
};

}  // namespace

std::vector<uint8_t> rdma_cm_frame(const std::vector<uint8_t>& data, uint32_t mtu) {
  std::vector<uint8_t> out;
  out.reserve(data.size() + 2);
  out.push_back(uint8_t(ibv_mtu_at_most(mtu).value_or(IBV_MTU_256)));
  out.push_back(uint8_t(data.size()));
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

Result<CmPrivateData> rdma_cm_unframe(const std::vector<uint8_t>& field, const std::string& what) {
  if (field.size() < 2 || field[0] < IBV_MTU_256 || field[0] > IBV_MTU_4096 || size_t(field[1]) + 2 > field.size())
    return Status(Errc::protocol_error, "rdma_cm: " + what + " carries private data Stellar did not frame (is the peer a Stellar process?)");
  return CmPrivateData{mtu_bytes(ibv_mtu(field[0])), std::vector<uint8_t>(field.begin() + 2, field.begin() + 2 + field[1])};
}

Result<std::unique_ptr<cm::Listener>> rdma_cm_listen(const std::string& address, uint16_t port) {
  auto where = ipv4(address, port);
  if (!where) return where.status();
  auto id = new_id();
  if (!id) return id.status();
  if (rdma_bind_addr((*id)->id, reinterpret_cast<sockaddr*>(&*where)) != 0) {
    const int e = errno;
    return Status(e == EADDRINUSE ? Errc::io_error : e == EADDRNOTAVAIL || e == ENODEV ? Errc::no_device : Errc::io_error,
                  "rdma_cm: rdma_bind_addr(" + address + ":" + std::to_string(port) + "): " + errno_text(e) +
                      (e == EADDRNOTAVAIL || e == ENODEV ? " (no RDMA device owns that address)" : ""));
  }
  if (rdma_listen((*id)->id, 64) != 0) return Status(Errc::io_error, "rdma_cm: rdma_listen: " + errno_text(errno));
  log().info("cm: listening on {}:{} (rdma_cm)", address, ntohs(rdma_get_src_port((*id)->id)));
  return std::unique_ptr<cm::Listener>(std::make_unique<RdmaCmListener>(std::move(*id)));
}

Result<cm::Connected> rdma_cm_connect(const std::string& address, uint16_t port, QueuePair& qp, const cm::ConnectOptions& options) {
  if (options.private_data.size() > cm::rdma_cm_max_connect_data)
    return Status(Errc::invalid_argument, "rdma_cm: connect private data above " + std::to_string(cm::rdma_cm_max_connect_data) +
                                              " bytes (IB CM REQ, less rdma_cm's header and the MTU and length bytes)");
  auto info = cm_qp(qp);
  if (!info) return Status(Errc::invalid_argument, "rdma_cm connects verbs-provider QPs only; the soft provider uses cm::Method::tcp");
  if (info->state != QpState::reset && info->state != QpState::init) return Status(Errc::wrong_state, "rdma_cm: connect needs a QP in RESET or INIT");
  auto destination = ipv4(address, port);
  if (!destination) return destination.status();
  const auto deadline = Clock::now() + options.timeout;
  const int step_ms = int(std::clamp<long long>(options.timeout.count(), 100, 5000));
  auto id = new_id();
  if (!id) return id.status();
  CmId& c = **id;
  // Resolve from the context's address where it names one, so the route
  // leaves through the device the QP lives on.
  std::optional<sockaddr_in> source;
  if (info->source_address != "" && info->source_address != "0.0.0.0" && info->source_address != "127.0.0.1") {
    auto s = ipv4(info->source_address, 0);
    if (s) source = *s;
  }
  const std::string peer = address + ":" + std::to_string(port);
  if (rdma_resolve_addr(c.id, source ? reinterpret_cast<sockaddr*>(&*source) : nullptr, reinterpret_cast<sockaddr*>(&*destination), step_ms) != 0)
    return Status(Errc::connection_refused, "rdma_cm: rdma_resolve_addr(" + peer + "): " + errno_text(errno));
  auto event = next_event(c.channel, deadline, "address resolution of " + peer);
  if (!event) return event.status();
  if (event->type != RDMA_CM_EVENT_ADDR_RESOLVED) return event_error(*event, "rdma_cm: resolving " + peer);
  if (rdma_resolve_route(c.id, step_ms) != 0) return Status(Errc::connection_refused, "rdma_cm: rdma_resolve_route(" + peer + "): " + errno_text(errno));
  event = next_event(c.channel, deadline, "route resolution to " + peer);
  if (!event) return event.status();
  if (event->type != RDMA_CM_EVENT_ROUTE_RESOLVED) return event_error(*event, "rdma_cm: route to " + peer);
  if (Status s = same_device(c.id, *info, peer); !s.ok()) return s;
  if (Status s = step(c.id, qp, IBV_QPS_INIT, options.timing); !s.ok()) return s;

  const VerbsTiming timing = to_verbs_timing(options.timing);
  const std::vector<uint8_t> data = rdma_cm_frame(options.private_data, info->mtu);
  rdma_conn_param param{};
  param.private_data = data.data();
  param.private_data_len = uint8_t(data.size());
  param.responder_resources = info->responder_resources;
  param.initiator_depth = info->initiator_depth;
  param.flow_control = 1;
  param.retry_count = timing.retry_cnt;
  param.rnr_retry_count = timing.rnr_retry;
  param.qp_num = qp.qp_num();
  if (rdma_connect(c.id, &param) != 0) return Status(Errc::connection_refused, "rdma_cm: rdma_connect(" + peer + "): " + errno_text(errno));
  event = next_event(c.channel, deadline, "the answer of " + peer);
  if (!event) return event.status();
  // Without a QP on the id, rdma_cm reports the peer's REP as CONNECT_RESPONSE
  // and leaves RTR/RTS and the RTU (rdma_establish) to us.
  if (event->type != RDMA_CM_EVENT_CONNECT_RESPONSE) return event_error(*event, "rdma_cm: connecting to " + peer);
  QpEndpoint remote = remote_of(c.id, event->qp_num);
  auto answer = rdma_cm_unframe(event->private_data, "the answer of " + peer);
  if (!answer) {
    (void)rdma_reject(c.id, nullptr, 0);
    return answer.status();
  }
  remote.mtu = std::min(remote.mtu, answer->mtu);
  if (Status s = step(c.id, qp, IBV_QPS_RTR, options.timing, 0, answer->mtu); !s.ok()) return s;
  // Past INIT the QP points at a peer that drops its side when this fails:
  // ERROR, as on the accepting side (until RTR it stays usable for a retry).
  auto abandon = [&](Status s) {
    (void)qp.modify(QpModify{QpState::error});
    return s;
  };
  if (Status s = step(c.id, qp, IBV_QPS_RTS, options.timing); !s.ok()) return abandon(s);
  if (rdma_establish(c.id) != 0) return abandon(Status(Errc::io_error, "rdma_cm: rdma_establish: " + errno_text(errno)));
  c.connected = true;
  log().info("cm: connected QP {} to {} QP {} (rdma_cm)", qp.qp_num(), peer, remote.qp_num);
  return cm::Connected{std::move(remote), std::move(answer->data), std::shared_ptr<CmId>(std::move(*id))};
}

}  // namespace stellar::provider::verbs
