// Batched UDP I/O for the soft provider: non-blocking IPv4 socket,
// recvmmsg/sendmmsg batches into caller-owned preallocated buffers (no
// allocation or locking per datagram). Not thread-safe: one driver thread.
#pragma once

#include <netinet/in.h>

#include <cstdint>
#include <string>
#include <vector>

#include "stellar/status.hpp"

namespace stellar::io {

struct Datagram {
  uint8_t* data = nullptr;
  uint32_t capacity = 0;
  uint32_t length = 0;
  sockaddr_in peer{};
};

class UdpSocket {
 public:
  UdpSocket() = default;
  ~UdpSocket();
  UdpSocket(const UdpSocket&) = delete;
  UdpSocket& operator=(const UdpSocket&) = delete;

  // Binds address:port (port 0: any). Large socket buffers, DF set.
  Status open(const std::string& address, uint16_t port);
  int fd() const { return fd_; }
  const sockaddr_in& local() const { return local_; }

  // Receives up to count datagrams without blocking; returns how many (0 when
  // none). Fills length and peer of each.
  int receive_batch(Datagram* batch, int count);
  // Sends count datagrams (each to its peer); returns how many the kernel
  // took. Failures other than "would block" are counted by the caller.
  int send_batch(Datagram* batch, int count, int& error);

 private:
  int fd_ = -1;
  sockaddr_in local_{};
  std::vector<struct mmsghdr> messages_;
  std::vector<struct iovec> iovecs_;
};

Result<sockaddr_in> parse_ipv4(const std::string& address, uint16_t port);
std::string format_ipv4(const sockaddr_in&);

}  // namespace stellar::io
