#include "io/udp_socket.hpp"

#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace stellar::io {

namespace {
constexpr int max_batch = 64;
constexpr int socket_buffer_bytes = 16 << 20;

Status system_error(const char* what) { return Status(Errc::io_error, std::string(what) + ": " + std::strerror(errno)); }
}  // namespace

Result<sockaddr_in> parse_ipv4(const std::string& address, uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  if (inet_pton(AF_INET, address.c_str(), &a.sin_addr) != 1)
    return Status(Errc::invalid_argument, "not an IPv4 address: '" + address + "'");
  return a;
}

std::string format_ipv4(const sockaddr_in& a) {
  char text[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &a.sin_addr, text, sizeof text);
  return text;
}

UdpSocket::~UdpSocket() {
  if (fd_ >= 0) ::close(fd_);
}

Status UdpSocket::open(const std::string& address, uint16_t port) {
  auto bind_to = parse_ipv4(address, port);
  if (!bind_to) return bind_to.status();
  fd_ = ::socket(AF_INET, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd_ < 0) return system_error("socket");
  // Root may exceed rmem_max/wmem_max (FORCE); others get what the limits allow.
  for (int option : {SO_RCVBUFFORCE, SO_SNDBUFFORCE}) {
    if (setsockopt(fd_, SOL_SOCKET, option, &socket_buffer_bytes, sizeof socket_buffer_bytes) != 0) {
      const int fallback = option == SO_RCVBUFFORCE ? SO_RCVBUF : SO_SNDBUF;
      setsockopt(fd_, SOL_SOCKET, fallback, &socket_buffer_bytes, sizeof socket_buffer_bytes);
    }
  }
  // DF without path-MTU state: Linux then writes IP id 0 on unconnected
  // sockets, which the RoCEv2 ICRC pseudo header relies on.
  const int pmtu = IP_PMTUDISC_PROBE;
  setsockopt(fd_, IPPROTO_IP, IP_MTU_DISCOVER, &pmtu, sizeof pmtu);
  if (::bind(fd_, reinterpret_cast<const sockaddr*>(&bind_to.value()), sizeof(sockaddr_in)) != 0)
    return system_error(("bind " + address + ":" + std::to_string(port)).c_str());
  socklen_t length = sizeof local_;
  getsockname(fd_, reinterpret_cast<sockaddr*>(&local_), &length);
  messages_.resize(max_batch);
  iovecs_.resize(max_batch);
  return {};
}

int UdpSocket::receive_batch(Datagram* batch, int count) {
  count = std::min(count, max_batch);
  for (int i = 0; i < count; ++i) {
    iovecs_[size_t(i)] = {batch[i].data, batch[i].capacity};
    msghdr& h = messages_[size_t(i)].msg_hdr;
    h = msghdr{};
    h.msg_name = &batch[i].peer;
    h.msg_namelen = sizeof(sockaddr_in);
    h.msg_iov = &iovecs_[size_t(i)];
    h.msg_iovlen = 1;
  }
  const int n = ::recvmmsg(fd_, messages_.data(), unsigned(count), MSG_DONTWAIT, nullptr);
  if (n <= 0) return 0;
  for (int i = 0; i < n; ++i) {
    // A datagram larger than the buffer is truncated: report it as such so
    // the decoder drops it (MSG_TRUNC).
    batch[i].length = (messages_[size_t(i)].msg_hdr.msg_flags & MSG_TRUNC) ? 0 : messages_[size_t(i)].msg_len;
  }
  return n;
}

int UdpSocket::send_batch(Datagram* batch, int count, int& error) {
  error = 0;
  int sent = 0;
  while (sent < count) {
    const int chunk = std::min(count - sent, max_batch);
    for (int i = 0; i < chunk; ++i) {
      Datagram& d = batch[sent + i];
      iovecs_[size_t(i)] = {d.data, d.length};
      msghdr& h = messages_[size_t(i)].msg_hdr;
      h = msghdr{};
      h.msg_name = &d.peer;
      h.msg_namelen = sizeof(sockaddr_in);
      h.msg_iov = &iovecs_[size_t(i)];
      h.msg_iovlen = 1;
    }
    const int n = ::sendmmsg(fd_, messages_.data(), unsigned(chunk), MSG_DONTWAIT);
    if (n <= 0) {
      error = errno;
      // The datagram is lost to the transport's retransmission, like a full NIC queue.
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != ENOBUFS) ++sent;
      else return sent;
      continue;
    }
    sent += n;
  }
  return sent;
}

}  // namespace stellar::io
