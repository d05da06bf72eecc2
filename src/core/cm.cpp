// Connection manager: a three-message exchange over TCP (Asio), one JSON
// object per line (nlohmann/json):
//   connector -> listener  {"type":"connect", endpoint..., "private_data":hex}
//   listener  -> connector {"type":"accept", endpoint..., "private_data":hex} | {"type":"reject","reason":...}
//   connector -> listener  {"type":"ready"}   (the connector's QP is in RTS)
// The listener's accept() returns after "ready", like RDMA_CM_EVENT_ESTABLISHED,
// so neither side sends before the other can receive.
#define ASIO_STANDALONE
#include <asio.hpp>
#include <nlohmann/json.hpp>

#include "core/log.hpp"
#include "stellar/cm.hpp"

namespace stellar::cm {
namespace {

using asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

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

json endpoint_json(const QpEndpoint& e) {
  return json{{"address", e.address}, {"udp_port", e.udp_port}, {"qp_num", e.qp_num}, {"psn", e.psn},
              {"mtu", e.mtu},         {"pkey", e.pkey},         {"mode", to_string(e.mode)}};
}

Result<QpEndpoint> endpoint_from(const json& j) {
  try {
    QpEndpoint e;
    e.address = j.at("address").get<std::string>();
    e.udp_port = j.at("udp_port").get<uint16_t>();
    e.qp_num = j.at("qp_num").get<uint32_t>();
    e.psn = j.at("psn").get<uint32_t>();
    e.mtu = j.at("mtu").get<uint32_t>();
    e.pkey = j.at("pkey").get<uint16_t>();
    auto mode = parse_mode(j.at("mode").get<std::string>());
    if (!mode) return mode.status();
    e.mode = *mode;
    return e;
  } catch (const std::exception& ex) {
    return Status(Errc::protocol_error, std::string("malformed endpoint: ") + ex.what());
  }
}

// One TCP stream with deadline-bounded line I/O.
class Channel {
 public:
  explicit Channel(asio::io_context& io) : io_(io), socket_(io) {}
  tcp::socket& socket() { return socket_; }

  Status write_line(const json& j, Clock::time_point deadline) {
    const std::string line = j.dump() + "\n";
    asio::error_code ec = asio::error::would_block;
    asio::async_write(socket_, asio::buffer(line), [&](asio::error_code e, size_t) { ec = e; });
    return run_until(ec, deadline, "send");
  }

  Result<json> read_line(Clock::time_point deadline) {
    asio::error_code ec = asio::error::would_block;
    asio::async_read_until(socket_, buffer_, '\n', [&](asio::error_code e, size_t) { ec = e; });
    if (Status s = run_until(ec, deadline, "receive"); !s.ok()) return s;
    std::istream in(&buffer_);
    std::string line;
    std::getline(in, line);
    json j = json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("type")) return Status(Errc::protocol_error, "malformed connection message");
    return j;
  }

  Status run_until(asio::error_code& ec, Clock::time_point deadline, const char* what) {
    io_.restart();
    while (ec == asio::error::would_block) {
      if (Clock::now() >= deadline || io_.run_one_until(deadline) == 0) {
        if (ec != asio::error::would_block) break;
        socket_.cancel();
        io_.restart();
        io_.run();
        return Status(Errc::timeout, std::string("connection manager: timed out during ") + what);
      }
    }
    if (ec) return Status(Errc::io_error, std::string("connection manager ") + what + ": " + ec.message());
    return {};
  }

 private:
  asio::io_context& io_;
  tcp::socket socket_;
  asio::streambuf buffer_;
};

Status to_rts(QueuePair& qp, const QpEndpoint& remote, const QpTiming& timing) {
  if (qp.state() == QpState::reset) {
    QpModify init;
    init.state = QpState::init;
    if (Status s = qp.modify(init); !s.ok()) return s;
  }
  QpModify rtr;
  rtr.state = QpState::rtr;
  rtr.remote = remote;
  rtr.timing = timing;
  if (Status s = qp.modify(rtr); !s.ok()) return s;
  QpModify rts;
  rts.state = QpState::rts;
  return qp.modify(rts);
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

Result<std::unique_ptr<Listener>> Listener::listen(const std::string& address, uint16_t port) {
  auto l = std::make_unique<TcpListener>();
  if (Status s = l->open(address, port); !s.ok()) return s;
  return std::unique_ptr<Listener>(std::move(l));
}

Result<Connected> connect(const std::string& address, uint16_t port, QueuePair& qp, const ConnectOptions& options) {
  if (options.private_data.size() > max_private_data) return Status(Errc::invalid_argument, "private data above 4096 bytes");
  const auto deadline = Clock::now() + options.timeout;
  asio::io_context io;
  Channel channel(io);
  asio::error_code bad;
  const auto ip = asio::ip::make_address(address, bad);
  if (bad) return Status(Errc::invalid_argument, "connect: bad address '" + address + "'");
  // Retry refused connections until the deadline: the server may still be starting.
  for (;;) {
    asio::error_code ec = asio::error::would_block;
    channel.socket().async_connect(tcp::endpoint(ip, port), [&](asio::error_code e) { ec = e; });
    Status s = channel.run_until(ec, deadline, "connect");
    if (s.ok()) break;
    if (s.code() == Errc::timeout) return Status(Errc::connection_refused, "connect to " + address + ":" + std::to_string(port) + ": no listener within the timeout");
    asio::error_code ignore;
    channel.socket().close(ignore);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (Clock::now() >= deadline) return Status(Errc::connection_refused, "connect to " + address + ":" + std::to_string(port) + ": " + s.message());
  }
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
  return Connected{*remote, std::move(*data)};
}

}  // namespace stellar::cm
