// Connection manager in the style of librdmacm: listen / connect / accept by
// address and port, with private data. The exchange runs over a small TCP
// connection (Asio) that carries each side's QpEndpoint; on success both QPs
// are in RTS. Blocking calls with timeouts. Thread-safety: a Listener is used
// from one thread at a time; connect() may run on many threads at once.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "stellar/status.hpp"
#include "stellar/verbs.hpp"

namespace stellar::cm {

inline constexpr size_t max_private_data = 4096;

struct ConnectOptions {
  std::vector<uint8_t> private_data;
  std::chrono::milliseconds timeout{5000};
  QpTiming timing{};
};

class ConnectionRequest {
 public:
  virtual ~ConnectionRequest() = default;
  virtual const QpEndpoint& remote() const = 0;
  virtual const std::vector<uint8_t>& private_data() const = 0;
  // Brings `qp` (in RESET or INIT) to RTS towards the requester and answers it.
  virtual Status accept(QueuePair& qp, const std::vector<uint8_t>& private_data = {}, const QpTiming& = {}) = 0;
  virtual Status reject(const std::string& reason) = 0;
};

class Listener {
 public:
  // Port 0 picks a free port (see port()).
  static Result<std::unique_ptr<Listener>> listen(const std::string& address, uint16_t port);
  virtual ~Listener() = default;
  virtual uint16_t port() const = 0;
  // Waits for the next connection request.
  virtual Result<std::unique_ptr<ConnectionRequest>> get_request(std::chrono::milliseconds timeout) = 0;
};

struct Connected {
  QpEndpoint remote;
  std::vector<uint8_t> private_data;  // the acceptor's
};

// Connects `qp` (RESET or INIT) to the listener at address:port; on success
// the QP is in RTS.
Result<Connected> connect(const std::string& address, uint16_t port, QueuePair& qp, const ConnectOptions& = {});

}  // namespace stellar::cm
