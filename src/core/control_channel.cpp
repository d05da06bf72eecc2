#include "core/control_channel.hpp"

#include <thread>

#include "core/log.hpp"

namespace stellar::control {

// ---------------------------------------------------------------- Channel

Channel::Channel(asio::io_context& io, size_t max_line) : io_(io), socket_(io), buffer_(max_line), max_line_(max_line) {}

Channel::Channel(asio::io_context& io, size_t max_line, tcp::socket&& socket, const std::string& leftover)
    : io_(io), socket_(io), buffer_(max_line), max_line_(max_line) {
  // Sockets cannot move between io_contexts; their descriptors can.
  asio::error_code ec;
  const auto protocol = socket.local_endpoint(ec).protocol();
  if (!ec) {
    const auto fd = socket.release(ec);
    if (!ec) socket_.assign(protocol, fd, ec);
  }
  if (!leftover.empty()) {
    std::ostream out(&buffer_);
    out.write(leftover.data(), std::streamsize(leftover.size()));
  }
}

Status Channel::write_line(const json& j, Clock::time_point deadline) {
  const std::string line = j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
  asio::error_code ec = asio::error::would_block;
  asio::async_write(socket_, asio::buffer(line), [&](asio::error_code e, size_t) { ec = e; });
  return run_until(ec, deadline, "send");
}

Result<json> Channel::read_line(Clock::time_point deadline) {
  asio::error_code ec = asio::error::would_block;
  size_t length = 0;
  asio::async_read_until(socket_, buffer_, '\n', [&](asio::error_code e, size_t n) {
    ec = e;
    length = n;
  });
  if (ec == asio::error::would_block || !ec) {
    if (Status s = run_until(ec, deadline, "receive"); !s.ok()) {
      if (ec == asio::error::not_found)  // the streambuf is full and holds no newline
        return Status(Errc::protocol_error, "peer sent a line longer than " + std::to_string(max_line_) + " bytes");
      return s;
    }
  }
  std::string line(asio::buffers_begin(buffer_.data()), asio::buffers_begin(buffer_.data()) + std::ptrdiff_t(length));
  buffer_.consume(length);
  line.pop_back();  // the newline
  return parse_line(line);
}

Status Channel::run_until(asio::error_code& ec, Clock::time_point deadline, const char* what) {
  io_.restart();
  while (ec == asio::error::would_block) {
    if (Clock::now() >= deadline || io_.run_one_until(deadline) == 0) {
      if (ec != asio::error::would_block) break;
      asio::error_code ignore;
      socket_.cancel(ignore);
      io_.restart();
      io_.run();
      return Status(Errc::timeout, std::string("connection manager: timed out during ") + what);
    }
  }
  if (ec) return Status(Errc::io_error, std::string("connection manager ") + what + ": " + ec.message());
  return {};
}

Status connect_with_retry(Channel& channel, const std::string& address, uint16_t port, Clock::time_point deadline) {
  asio::error_code bad;
  const auto ip = asio::ip::make_address(address, bad);
  if (bad) return Status(Errc::invalid_argument, "connect: bad address '" + address + "'");
  for (;;) {
    asio::error_code ec = asio::error::would_block;
    channel.socket().async_connect(tcp::endpoint(ip, port), [&](asio::error_code e) { ec = e; });
    Status s = channel.run_until(ec, deadline, "connect");
    if (s.ok()) return {};
    if (s.code() == Errc::timeout)
      return Status(Errc::connection_refused, "connect to " + address + ":" + std::to_string(port) + ": no listener within the timeout");
    asio::error_code ignore;
    channel.socket().close(ignore);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (Clock::now() >= deadline) return Status(Errc::connection_refused, "connect to " + address + ":" + std::to_string(port) + ": " + s.message());
  }
}

// ---------------------------------------------------------------- LineServer

struct LineServer::Pending {
  Pending(asio::io_context& io, size_t max_line) : socket(io), buffer(max_line), timer(io) {}
  tcp::socket socket;
  asio::streambuf buffer;
  asio::steady_timer timer;
  std::string peer;
  bool done = false;
};

LineServer::LineServer(Options options, Check check)
    : options_(std::move(options)), check_(std::move(check)), acceptor_(io_), retry_timer_(io_) {}

LineServer::~LineServer() {
  asio::error_code ignore;
  acceptor_.close(ignore);
  retry_timer_.cancel();
  for (auto& p : pending_) {
    p->done = true;  // closed by us, not refused: nothing to log or answer
    p->socket.close(ignore);
    p->timer.cancel();
  }
  // Handlers still queued hold shared_ptrs to their Pending and a pointer to
  // this server; running them now (each sees operation_aborted) keeps any
  // from running later.
  io_.restart();
  io_.poll();
}

Status LineServer::open(const std::string& address, uint16_t port, int backlog) {
  asio::error_code ec;
  const auto ip = asio::ip::make_address(address, ec);
  if (ec) return Status(Errc::invalid_argument, "listen: bad address '" + address + "'");
  const tcp::endpoint endpoint(ip, port);
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (!ec) acceptor_.listen(backlog, ec);
  if (ec) return Status(Errc::io_error, "listen on " + address + ":" + std::to_string(port) + ": " + ec.message());
  start_accept();
  return {};
}

uint16_t LineServer::port() const {
  asio::error_code ec;
  return acceptor_.local_endpoint(ec).port();
}

void LineServer::start_accept() {
  auto p = std::make_shared<Pending>(io_, options_.max_line);
  acceptor_.async_accept(p->socket, [this, p](asio::error_code ec) {
    if (ec == asio::error::operation_aborted || !acceptor_.is_open()) return;
    if (ec) {
      // Out of descriptors and the like: say so and try again shortly (at
      // once would spin while the condition lasts; the backlog keeps the
      // others waiting meanwhile).
      log().warn("{}: accept failed: {}; retrying in 100 ms", options_.what, ec.message());
      retry_timer_.expires_after(std::chrono::milliseconds(100));
      retry_timer_.async_wait([this](asio::error_code e) {
        if (!e && acceptor_.is_open()) start_accept();
      });
      return;
    }
    asio::error_code ignore;
    const auto remote = p->socket.remote_endpoint(ignore);
    p->peer = remote.address().to_string() + ":" + std::to_string(remote.port());
    pending_.push_back(p);
    start_read(p);
    if (pending_.size() >= pending_limit()) {
      // Full: drop the oldest connection that has sent nothing at all (an
      // idle one costs the real peers their slot); if all are talking, stop
      // accepting until one finishes.
      for (const auto& q : pending_)
        if (q->buffer.size() == 0 && q != p) {
          std::shared_ptr<Pending> idle = q;
          refuse(*idle, "too many connections waiting to speak; dropped the oldest silent one");
          break;
        }
      if (pending_.size() >= pending_limit()) {
        accept_paused_ = true;
        return;
      }
    }
    start_accept();
  });
}

size_t LineServer::pending_limit() const {
  const size_t by_bytes = options_.max_buffered_bytes / std::max<size_t>(options_.max_line, 1);
  return std::max<size_t>(8, std::min(options_.max_pending, by_bytes));
}

void LineServer::start_read(const std::shared_ptr<Pending>& p) {
  p->timer.expires_after(options_.first_line_timeout);
  p->timer.async_wait([this, p](asio::error_code ec) {
    if (ec || p->done) return;
    refuse(*p, "sent no complete line within " + std::to_string(options_.first_line_timeout.count()) + " ms");
  });
  asio::async_read_until(p->socket, p->buffer, '\n', [this, p](asio::error_code ec, size_t n) { finish(p, ec, n); });
}

void LineServer::finish(const std::shared_ptr<Pending>& p, const asio::error_code& ec, size_t line_bytes) {
  if (p->done) return;
  if (ec == asio::error::not_found) return refuse(*p, "sent a line longer than " + std::to_string(options_.max_line) + " bytes");
  if (ec) return refuse(*p, "closed before a complete line (" + ec.message() + ")");
  std::string line(asio::buffers_begin(p->buffer.data()), asio::buffers_begin(p->buffer.data()) + std::ptrdiff_t(line_bytes));
  p->buffer.consume(line_bytes);
  line.pop_back();
  auto j = parse_line(line);
  Status valid = j ? check_(*j) : j.status();
  if (!valid.ok()) return refuse(*p, valid.message());
  try {
    Arrival a;
    if (options_.share_io) {
      if (!shared_io_) shared_io_ = std::make_shared<asio::io_context>();
      a.io = shared_io_;
    } else {
      a.io = std::make_shared<asio::io_context>();
    }
    std::string leftover(asio::buffers_begin(p->buffer.data()), asio::buffers_end(p->buffer.data()));
    a.channel = std::make_unique<Channel>(*a.io, options_.max_line, std::move(p->socket), leftover);
    a.first = std::move(*j);
    a.peer = p->peer;
    ready_.push_back(std::move(a));
  } catch (const std::exception& e) {  // out of descriptors for an io_context, out of memory
    return refuse(*p, std::string("cannot take the connection: ") + e.what());
  }
  p->done = true;
  p->timer.cancel();
  forget(*p);
}

void LineServer::refuse(Pending& p, const std::string& why) {
  if (p.done) return;
  p.done = true;
  p.timer.cancel();
  log().warn("{}: refused {}: {}", options_.what, p.peer, why);
  ++refused_count_;
  refusals_.push_back(p.peer + ": " + why);
  if (refusals_.size() > 16) refusals_.pop_front();
  // Best effort, never blocking: the peer learns why if its socket has room.
  asio::error_code ignore;
  p.socket.non_blocking(true, ignore);
  const std::string line = json{{"type", options_.refusal_type}, {"reason", why}}.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
  p.socket.write_some(asio::buffer(line), ignore);
  p.socket.shutdown(tcp::socket::shutdown_both, ignore);
  p.socket.close(ignore);
  forget(p);
}

void LineServer::forget(Pending& p) {
  for (auto it = pending_.begin(); it != pending_.end(); ++it)
    if (it->get() == &p) {
      pending_.erase(it);
      break;
    }
  if (accept_paused_ && pending_.size() < pending_limit() && acceptor_.is_open()) {
    accept_paused_ = false;
    start_accept();
  }
}

Result<Arrival> LineServer::next(Clock::time_point deadline) {
  io_.restart();
  while (ready_.empty()) {
    if (Clock::now() >= deadline) {
      // An expired deadline (a zero timeout: a caller that must not block,
      // such as the NCCL plugin's accept) still runs what is ready now, so
      // that polling makes progress.
      io_.poll();
      io_.restart();
      if (!ready_.empty()) break;
      return Status(Errc::timeout, "no connection request within the timeout");
    }
    if (io_.run_one_until(deadline) == 0) io_.restart();
  }
  Arrival a = std::move(ready_.front());
  ready_.pop_front();
  return a;
}

}  // namespace stellar::control
