// Connection manager: a three-message exchange over TCP (Asio), one JSON
// object per line (nlohmann/json), every line checked by control_messages:
//   connector -> listener  {"type":"connect", endpoint..., "private_data":hex}
//   listener  -> connector {"type":"accept", endpoint..., "private_data":hex} | {"type":"reject","reason":...}
//   connector -> listener  {"type":"ready"}   (the connector's QP is in RTS)
// The listener's accept() returns after "ready", like RDMA_CM_EVENT_ESTABLISHED,
// so neither side sends before the other can receive.
#include "core/control_channel.hpp"
#include "core/log.hpp"
#include "core/providers.hpp"
#include "stellar/cm.hpp"

namespace stellar::cm {
namespace {

using control::Channel;
using control::Clock;
using control::json;
using control::to_rts;

class Request final : public ConnectionRequest {
 public:
  Request(control::Arrival arrival, control::EndpointMessage message)
      : arrival_(std::move(arrival)), remote_(std::move(message.endpoint)), data_(std::move(message.private_data)) {}
  const QpEndpoint& remote() const override { return remote_; }
  const std::vector<uint8_t>& private_data() const override { return data_; }

  Status accept(QueuePair& qp, const std::vector<uint8_t>& private_data, const QpTiming& timing) override {
    if (answered_) return Status(Errc::wrong_state, "request already answered");
    if (private_data.size() > max_private_data) return Status(Errc::invalid_argument, "private data above 4096 bytes");
    answered_ = true;
    Channel& channel = *arrival_.channel;
    if (Status s = to_rts(qp, remote_, timing); !s.ok()) {
      log().warn("cm: rejecting QP {} from {}: {}", remote_.qp_num, arrival_.peer, s.to_string());
      (void)channel.write_line(json{{"type", "reject"}, {"reason", s.to_string()}}, Clock::now() + std::chrono::seconds(1));
      return s;
    }
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    if (Status s = channel.write_line(control::endpoint_message_json("accept", qp.local_endpoint(), private_data), deadline); !s.ok())
      return s;
    // A QP whose peer never confirms is the caller's to destroy (it may
    // share a CQ with live QPs, which moving it to ERROR would flood with
    // flushed receives).
    auto ready = channel.read_line(deadline);
    if (!ready) return ready.status();
    if ((*ready)["type"] != "ready") return Status(Errc::protocol_error, "peer did not confirm the connection");
    log().info("cm: accepted QP {} at {}:{} on local QP {}", remote_.qp_num, remote_.address, remote_.udp_port, qp.qp_num());
    return {};
  }

  Status reject(const std::string& reason) override {
    if (answered_) return Status(Errc::wrong_state, "request already answered");
    answered_ = true;
    return arrival_.channel->write_line(json{{"type", "reject"}, {"reason", reason}}, Clock::now() + std::chrono::seconds(2));
  }

 private:
  control::Arrival arrival_;
  QpEndpoint remote_;
  std::vector<uint8_t> data_;
  bool answered_ = false;
};

// Serves connection attempts concurrently (control::LineServer): a client
// that connects and says nothing, says too much, or says something malformed
// is refused on its own connection and keeps nobody else waiting.
class TcpListener final : public Listener {
 public:
  TcpListener()
      : server_({}, [](const json& j) { return control::parse_endpoint_message(j, "connect").status(); }) {}
  Status open(const std::string& address, uint16_t port) { return server_.open(address, port, 64); }
  uint16_t port() const override { return server_.port(); }

  Result<std::unique_ptr<ConnectionRequest>> get_request(std::chrono::milliseconds timeout) override {
    auto arrival = server_.next(Clock::now() + timeout);
    if (!arrival) return arrival.status();
    auto message = control::parse_endpoint_message(arrival->first, "connect");  // checked by the server: cannot fail
    if (!message) return message.status();
    return std::unique_ptr<ConnectionRequest>(std::make_unique<Request>(std::move(*arrival), std::move(*message)));
  }

 private:
  control::LineServer server_;
};

}  // namespace

const char* to_string(Method m) { return m == Method::rdma_cm ? "rdma_cm" : "tcp"; }

std::optional<Method> method_from_string(const std::string& s) {
  if (s == "tcp") return Method::tcp;
  if (s == "rdma_cm" || s == "rdmacm") return Method::rdma_cm;
  return std::nullopt;
}

Result<std::unique_ptr<Listener>> Listener::listen(const std::string& address, uint16_t port, Method method) {
  if (method != Method::tcp) {  // a provider's own method
    const provider::Ops* ops = provider::find(method);
    if (!ops || !ops->cm_listen) return Status(Errc::unsupported, std::string("connection method ") + to_string(method) + " is not built in");
    return ops->cm_listen(address, port);
  }
  auto l = std::make_unique<TcpListener>();
  if (Status s = l->open(address, port); !s.ok()) return s;
  return std::unique_ptr<Listener>(std::move(l));
}

Result<Connected> connect(const std::string& address, uint16_t port, QueuePair& qp, const ConnectOptions& options) {
  if (options.method != Method::tcp) {  // a provider's own method
    const provider::Ops* ops = provider::find(options.method);
    if (!ops || !ops->cm_connect) return Status(Errc::unsupported, std::string("connection method ") + to_string(options.method) + " is not built in");
    return ops->cm_connect(address, port, qp, options);
  }
  if (options.private_data.size() > max_private_data) return Status(Errc::invalid_argument, "private data above 4096 bytes");
  const auto deadline = Clock::now() + options.timeout;
  asio::io_context io;
  Channel channel(io, control::max_cm_line_bytes);
  if (Status s = control::connect_with_retry(channel, address, port, deadline); !s.ok()) return s;
  if (Status s = channel.write_line(control::endpoint_message_json("connect", qp.local_endpoint(), options.private_data), deadline); !s.ok())
    return s;
  auto reply = channel.read_line(deadline);
  if (!reply) return reply.status();
  if ((*reply)["type"] == "reject") return Status(Errc::connection_refused, "rejected by peer: " + control::read_reason(*reply));
  auto accepted = control::parse_endpoint_message(*reply, "accept");
  if (!accepted) return Status(Errc::protocol_error, "malformed reply from " + address + ":" + std::to_string(port) + ": " + accepted.status().message());
  if (Status s = to_rts(qp, accepted->endpoint, options.timing); !s.ok()) return s;
  if (Status s = channel.write_line(json{{"type", "ready"}}, deadline); !s.ok()) return s;
  const QpEndpoint& remote = accepted->endpoint;
  log().info("cm: connected QP {} to {}:{} QP {}", qp.qp_num(), remote.address, remote.udp_port, remote.qp_num);
  return Connected{remote, std::move(accepted->private_data), nullptr};
}

}  // namespace stellar::cm
