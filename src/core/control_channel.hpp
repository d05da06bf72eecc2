// Control-plane plumbing shared by the connection manager (cm.cpp) and the
// collectives' rendezvous (src/coll/): newline-delimited JSON over TCP
// (Asio) with deadline-bounded reads and writes and capped line lengths, a
// server that takes first lines from many connections at once, and the
// RESET/INIT -> RTR -> RTS walk. The messages themselves are checked in
// control_messages.hpp. Internal header.
//
// Everything here is built for a hostile peer: a line longer than the cap
// fails (it is never buffered whole), every wait has a deadline, an idle or
// slow connection delays only itself.
#pragma once

#define ASIO_STANDALONE
#include <asio.hpp>

#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/control_messages.hpp"
#include "stellar/verbs.hpp"

namespace stellar::control {

using asio::ip::tcp;
using Clock = std::chrono::steady_clock;

// One TCP stream with deadline-bounded line I/O. Lines longer than
// `max_line` bytes fail with protocol_error. Used from one thread.
class Channel {
 public:
  Channel(asio::io_context& io, size_t max_line);
  // Adopts a connected socket (of any io_context) and bytes already read
  // from it past the last consumed line.
  Channel(asio::io_context& io, size_t max_line, tcp::socket&& socket, const std::string& leftover);
  tcp::socket& socket() { return socket_; }

  Status write_line(const json& j, Clock::time_point deadline);
  // The next line, parsed by parse_line (an object with a string "type").
  Result<json> read_line(Clock::time_point deadline);
  Status run_until(asio::error_code& ec, Clock::time_point deadline, const char* what);

 private:
  asio::io_context& io_;
  tcp::socket socket_;
  asio::streambuf buffer_;
  size_t max_line_;
};

// A connection whose first line a LineServer accepted.
struct Arrival {
  std::shared_ptr<asio::io_context> io;  // runs the channel's socket (shared by all arrivals with Options::share_io)
  std::unique_ptr<Channel> channel;
  json first;        // the first line, already checked
  std::string peer;  // "address:port", for messages
};

// Accepts TCP connections and reads every connection's first line at the
// same time, each under its own deadline (`first_line_timeout`), so that idle
// or slow connections cost a file descriptor each and keep nobody out. A
// first line that `check` accepts becomes an Arrival; any other (not a line,
// too long, not JSON, refused by `check`) is answered with
// {"type": refusal_type, "reason": why}, logged, remembered in refusals(),
// and closed. At most max_pending connections wait for their first line, and
// no more than max_buffered_bytes / max_line: when full, the oldest that has
// sent nothing at all is dropped, and if every one is talking, accepting
// pauses (the kernel's backlog holds the rest) until one finishes. Used from
// one thread.
class LineServer {
 public:
  using Check = std::function<Status(const json&)>;
  struct Options {
    size_t max_line = max_cm_line_bytes;
    std::chrono::milliseconds first_line_timeout{5000};
    size_t max_pending = 256;
    size_t max_buffered_bytes = size_t(256) << 20;  // bounds max_pending for long lines
    // Every Arrival's channel on one io_context (3 descriptors fewer per
    // connection), for a caller that uses all of them from one thread, as
    // the rendezvous does; else each gets its own (requests handed to
    // other threads).
    bool share_io = false;
    std::string refusal_type = "reject";
    std::string what = "connection manager";  // names the server in log lines
  };
  LineServer(Options options, Check check);
  ~LineServer();
  LineServer(const LineServer&) = delete;
  LineServer& operator=(const LineServer&) = delete;

  // Binds and listens; port 0 picks a free port.
  Status open(const std::string& address, uint16_t port, int backlog = 1024);
  uint16_t port() const;
  // Waits for the next accepted first line until `deadline` (timeout).
  Result<Arrival> next(Clock::time_point deadline);
  // The latest refusals ("peer: reason"), at most 16.
  const std::deque<std::string>& refusals() const { return refusals_; }
  uint64_t refused() const { return refused_count_; }

 private:
  struct Pending;
  void start_accept();
  void start_read(const std::shared_ptr<Pending>& p);
  void finish(const std::shared_ptr<Pending>& p, const asio::error_code& ec, size_t line_bytes);
  void refuse(Pending& p, const std::string& why);
  void forget(Pending& p);
  size_t pending_limit() const;

  Options options_;
  Check check_;
  asio::io_context io_;
  tcp::acceptor acceptor_;
  std::deque<std::shared_ptr<Pending>> pending_;
  std::deque<Arrival> ready_;
  std::deque<std::string> refusals_;
  uint64_t refused_count_ = 0;
  asio::steady_timer retry_timer_;  // accept again after a failed accept
  bool accept_paused_ = false;      // every pending slot holds a talking connection
  std::shared_ptr<asio::io_context> shared_io_;  // Options::share_io
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
Status connect_with_retry(Channel& channel, const std::string& address, uint16_t port, Clock::time_point deadline);

}  // namespace stellar::control
