// Control-plane plumbing shared by the connection manager (cm.cpp) and the
// collectives' rendezvous (src/coll/): newline-delimited JSON over a TCP
// stream (Asio) with deadline-bounded reads and writes, the JSON form of a
// QpEndpoint, and the RESET/INIT -> RTR -> RTS walk. Internal header.
//
// Endpoint JSON: address, udp_port, qp_num, psn, mtu, pkey, mode, and, for
// verbs endpoints only, "gid" (sysfs form) and "lid". Soft endpoints leave
// the two out, so their messages are byte-for-byte what they were before
// the verbs provider; a reader treats missing ones as ""/0.
#pragma once

#define ASIO_STANDALONE
#include <asio.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <string>
#include <thread>

#include "stellar/verbs.hpp"

namespace stellar::control {

using asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using json = nlohmann::json;

inline json endpoint_json(const QpEndpoint& e) {
  json j{{"address", e.address}, {"udp_port", e.udp_port}, {"qp_num", e.qp_num}, {"psn", e.psn},
         {"mtu", e.mtu},         {"pkey", e.pkey},         {"mode", to_string(e.mode)}};
  if (!e.gid.empty()) {
    j["gid"] = e.gid;
    j["lid"] = e.lid;
  }
  return j;
}

inline Result<QpEndpoint> endpoint_from(const json& j) {
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
    e.gid = j.value("gid", std::string());
    e.lid = j.value("lid", uint16_t(0));
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

inline Status to_rts(QueuePair& qp, const QpEndpoint& remote, const QpTiming& timing) {
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

// Connects `channel`'s socket to address:port, retrying refused attempts
// until the deadline (the server may still be starting).
inline Status connect_with_retry(Channel& channel, const std::string& address, uint16_t port, Clock::time_point deadline) {
  asio::error_code bad;
  const auto ip = asio::ip::make_address(address, bad);
  if (bad) return Status(Errc::invalid_argument, "connect: bad address '" + address + "'");
  for (;;) {
    asio::error_code ec = asio::error::would_block;
    channel.socket().async_connect(tcp::endpoint(ip, port), [&](asio::error_code e) { ec = e; });
    Status s = channel.run_until(ec, deadline, "connect");
    if (s.ok()) return {};
    if (s.code() == Errc::timeout) return Status(Errc::connection_refused, "connect to " + address + ":" + std::to_string(port) + ": no listener within the timeout");
    asio::error_code ignore;
    channel.socket().close(ignore);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (Clock::now() >= deadline) return Status(Errc::connection_refused, "connect to " + address + ":" + std::to_string(port) + ": " + s.message());
  }
}

}  // namespace stellar::control
