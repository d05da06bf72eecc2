// Connection manager: a three-message exchange over TCP (Asio), one JSON
// object per line (nlohmann/json):
//   connector -> listener  {"type":"connect", endpoint..., "private_data":hex}
//   listener  -> connector {"type":"accept", endpoint..., "private_data":hex} | {"type":"reject","reason":...}
//   connector -> listener  {"type":"ready"}   (the connector's QP is in RTS)
// The listener's accept() returns after "ready", like RDMA_CM_EVENT_ESTABLISHED,
// so neither side sends before the other can receive.
#include "core/control_channel.hpp"
#include "core/log.hpp"
#include "providers/verbs/rdma_cm.hpp"
#include "stellar/cm.hpp"

namespace stellar::cm {
namespace {

using control::Channel;
using control::Clock;
using control::endpoint_from;
using control::endpoint_json;
using control::json;
using control::tcp;
using control::to_rts;

std::string to_hex(const std::vector<uint8_t>& bytes) {
  static const char digits[] = "0123456789abcdef";
  std::string s;
  for (uint8_t b : bytes) s += {digits[b >> 4], digits[b & 15]};
  return s;
}

Result<std::vector<uint8_t>> from_hex(const std::string& s) {
  if (s.size() % 2 || s.size() / 2 > max_private_data) return Status(Errc::protocol_error, "bad private data");
  std::vector<uint8_t> out;
  for (size_t i = 0; i < s.size(); i += 2) {
    auto nibble = [](char c) -> int { return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; };
    const int hi = nibble(s[i]), lo = nibble(s[i + 1]);
    if (hi < 0 || lo < 0) return Status(Errc::protocol_error, "bad private data");
    out.push_back(uint8_t(hi << 4 | lo));
  }
  return out;
}

class Request final : public ConnectionRequest {
 public:
  Request(std::unique_ptr<asio::io_context> io, std::unique_ptr<Channel> channel, QpEndpoint remote, std::vector<uint8_t> data)
      : io_(std::move(io)), channel_(std::move(channel)), remote_(std::move(remote)), data_(std::move(data)) {}
  const QpEndpoint& remote() const override { return remote_; }
  const std::vector<uint8_t>& private_data() const override { return data_; }

  Status accept(QueuePair& qp, const std::vector<uint8_t>& private_data, const QpTiming& timing) override {
    if (answered_) return Status(Errc::wrong_state, "request already answered");
    if (private_data.size() > max_private_data) return Status(Errc::invalid_argument, "private data above 4096 bytes");
    answered_ = true;
    if (Status s = to_rts(qp, remote_, timing); !s.ok()) {
      log().warn("cm: rejecting QP {} from {}:{}: {}", remote_.qp_num, remote_.address, remote_.udp_port, s.to_string());
      (void)channel_->write_line(json{{"type", "reject"}, {"reason", s.to_string()}}, Clock::now() + std::chrono::seconds(1));
      return s;
    }
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    json reply = endpoint_json(qp.local_endpoint());
    reply["type"] = "accept";
    reply["private_data"] = to_hex(private_data);
    if (Status s = channel_->write_line(reply, deadline); !s.ok()) return s;
    auto ready = channel_->read_line(deadline);
    if (!ready) return ready.status();
    if ((*ready)["type"] != "ready") return Status(Errc::protocol_error, "peer did not confirm the connection");
    log().info("cm: accepted QP {} at {}:{} on local QP {}", remote_.qp_num, remote_.address, remote_.udp_port, qp.qp_num());
    return {};
  }

  Status reject(const std::string& reason) override {
    if (answered_) return Status(Errc::wrong_state, "request already answered");
    answered_ = true;
    return channel_->write_line(json{{"type", "reject"}, {"reason", reason}}, Clock::now() + std::chrono::seconds(2));
  }

 private:
  std::unique_ptr<asio::io_context> io_;
  std::unique_ptr<Channel> channel_;
  QpEndpoint remote_;
  std::vector<uint8_t> data_;
  bool answered_ = false;
};

class TcpListener final : public Listener {
 public:
  TcpListener() : acceptor_(io_) {}
  Status open(const std::string& address, uint16_t port) {
    asio::error_code ec;
    const auto ip = asio::ip::make_address(address, ec);
    if (ec) return Status(Errc::invalid_argument, "listen: bad address '" + address + "'");
    const tcp::endpoint endpoint(ip, port);
    acceptor_.open(endpoint.protocol(), ec);
    if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) acceptor_.bind(endpoint, ec);
    if (!ec) acceptor_.listen(64, ec);
    if (ec) return Status(Errc::io_error, "listen on " + address + ":" + std::to_string(port) + ": " + ec.message());
    return {};
  }
  uint16_t port() const override { return acceptor_.local_endpoint().port(); }

  Result<std::unique_ptr<ConnectionRequest>> get_request(std::chrono::milliseconds timeout) override {
    const auto deadline = Clock::now() + timeout;
    for (;;) {
      auto io = std::make_unique<asio::io_context>();
      auto channel = std::make_unique<Channel>(*io);
      asio::error_code ec = asio::error::would_block;
      acceptor_.async_accept(channel->socket(), [&](asio::error_code e) { ec = e; });
      io_.restart();
      while (ec == asio::error::would_block && Clock::now() < deadline) io_.run_one_until(deadline);
      if (ec == asio::error::would_block) {
        acceptor_.cancel();
        io_.restart();
        io_.run();
        return Status(Errc::timeout, "no connection request within the timeout");
      }
      if (ec) return Status(Errc::io_error, "accept: " + ec.message());
      // The socket lives in the request's own io_context (accepted across contexts).
      auto& own = channel;
      auto hello = own->read_line(std::min(deadline, Clock::now() + std::chrono::seconds(5)));
      if (!hello || (*hello)["type"] != "connect") {  // a stray or broken client: ignore it
        log().warn("cm: ignored a connection without a valid request: {}", hello ? "wrong message type" : hello.status().to_string());
        continue;
      }
      auto remote = endpoint_from(*hello);
      auto data = from_hex(hello->value("private_data", ""));
      if (!remote || !data) {
        log().warn("cm: ignored a malformed connection request");
        continue;
      }
      return std::unique_ptr<ConnectionRequest>(std::make_unique<Request>(std::move(io), std::move(own), *remote, std::move(*data)));
    }
  }

 private:
  asio::io_context io_;
  tcp::acceptor acceptor_;
};

}  // namespace

const char* to_string(Method m) { return m == Method::rdma_cm ? "rdma_cm" : "tcp"; }

std::optional<Method> method_from_string(const std::string& s) {
  if (s == "tcp") return Method::tcp;
  if (s == "rdma_cm" || s == "rdmacm") return Method::rdma_cm;
  return std::nullopt;
}

Result<std::unique_ptr<Listener>> Listener::listen(const std::string& address, uint16_t port, Method method) {
  if (method == Method::rdma_cm) return provider::verbs::rdma_cm_listen(address, port);
  auto l = std::make_unique<TcpListener>();
  if (Status s = l->open(address, port); !s.ok()) return s;
  return std::unique_ptr<Listener>(std::move(l));
}

Result<Connected> connect(const std::string& address, uint16_t port, QueuePair& qp, const ConnectOptions& options) {
  if (options.method == Method::rdma_cm) return provider::verbs::rdma_cm_connect(address, port, qp, options);
  if (options.private_data.size() > max_private_data) return Status(Errc::invalid_argument, "private data above 4096 bytes");
  const auto deadline = Clock::now() + options.timeout;
  asio::io_context io;
  Channel channel(io);
  if (Status s = control::connect_with_retry(channel, address, port, deadline); !s.ok()) return s;
  json hello = endpoint_json(qp.local_endpoint());
  hello["type"] = "connect";
  hello["private_data"] = to_hex(options.private_data);
  if (Status s = channel.write_line(hello, deadline); !s.ok()) return s;
  auto reply = channel.read_line(deadline);
  if (!reply) return reply.status();
  if ((*reply)["type"] == "reject")
    return Status(Errc::connection_refused, "rejected by peer: " + reply->value("reason", std::string("no reason")));
  if ((*reply)["type"] != "accept") return Status(Errc::protocol_error, "unexpected reply to connect");
  auto remote = endpoint_from(*reply);
  if (!remote) return remote.status();
  auto data = from_hex(reply->value("private_data", ""));
  if (!data) return data.status();
  if (Status s = to_rts(qp, *remote, options.timing); !s.ok()) return s;
  if (Status s = channel.write_line(json{{"type", "ready"}}, deadline); !s.ok()) return s;
  log().info("cm: connected QP {} to {}:{} QP {}", qp.qp_num(), remote->address, remote->udp_port, remote->qp_num);
  return Connected{*remote, std::move(*data), nullptr};
}

}  // namespace stellar::cm
