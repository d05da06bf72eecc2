// Connection manager in the style of librdmacm: listen / connect / accept by
// address and port, with private data; on success both QPs are in RTS.
// Two methods:
//  - Method::tcp (default, every provider): a small TCP connection (Asio)
//    carries each side's QpEndpoint; up to 4096 bytes of private data.
//  - Method::rdma_cm (verbs provider only): librdmacm's connection protocol
//    (the IB CM over the RDMA device itself): it resolves the route and the
//    source GID through the kernel and picks the starting PSNs; private data
//    is limited to 54 bytes on connect and 194 on accept (IB CM). Both sides
//    must use the same method.
// Blocking calls with timeouts. Thread-safety: a Listener is used from one
// thread at a time; connect() may run on many threads at once.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "stellar/status.hpp"
#include "stellar/verbs.hpp"

namespace stellar::cm {

inline constexpr size_t max_private_data = 4096;
// Method::rdma_cm: the IB CM's private data fields (REQ 56 bytes after
// rdma_cm's header, REP 196, REJ 148) less two bytes (MTU, length); a
// reject reason is text with a NUL.
inline constexpr size_t rdma_cm_max_connect_data = 54;
inline constexpr size_t rdma_cm_max_accept_data = 194;
inline constexpr size_t rdma_cm_max_reject_data = 148;

enum class Method : uint8_t { tcp, rdma_cm };
const char* to_string(Method);
// "tcp" or "rdma_cm" (also "rdmacm"); nullopt otherwise.
std::optional<Method> method_from_string(const std::string&);

struct ConnectOptions {
  std::vector<uint8_t> private_data;
  std::chrono::milliseconds timeout{5000};
  QpTiming timing{};
  Method method = Method::tcp;
};

class ConnectionRequest {
 public:
  virtual ~ConnectionRequest() = default;
  virtual const QpEndpoint& remote() const = 0;
  virtual const std::vector<uint8_t>& private_data() const = 0;
  // Brings `qp` (in RESET or INIT) to RTS towards the requester and answers it.
  // Method::rdma_cm: keep the request while the connection is in use
  // (destroying it disconnects its rdma_cm id, as Connected::connection).
  virtual Status accept(QueuePair& qp, const std::vector<uint8_t>& private_data = {}, const QpTiming& = {}) = 0;
  virtual Status reject(const std::string& reason) = 0;
};

class Listener {
 public:
  // Port 0 picks a free port (see port()). Method::rdma_cm listens in the
  // RDMA CM's TCP port space on the RDMA device that owns `address`.
  static Result<std::unique_ptr<Listener>> listen(const std::string& address, uint16_t port, Method = Method::tcp);
  virtual ~Listener() = default;
  virtual uint16_t port() const = 0;
  // Waits for the next connection request (timeout: Errc::timeout). A zero
  // timeout polls: it never blocks, and repeated calls make progress.
  virtual Result<std::unique_ptr<ConnectionRequest>> get_request(std::chrono::milliseconds timeout) = 0;
};

struct Connected {
  QpEndpoint remote;
  std::vector<uint8_t> private_data;  // the acceptor's
  // Method::rdma_cm: the connection's rdma_cm id. Keep it while the QP is in
  // use; dropping it disconnects (the peer's id sees a disconnect, the QPs
  // themselves are untouched). Empty for Method::tcp.
  std::shared_ptr<void> connection;
};

// Connects `qp` (RESET or INIT) to the listener at address:port; on success
// the QP is in RTS.
Result<Connected> connect(const std::string& address, uint16_t port, QueuePair& qp, const ConnectOptions& = {});

}  // namespace stellar::cm
