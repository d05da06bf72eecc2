#include "host/udp_socket.hpp"

#include <fcntl.h>

#include <arpa/inet.h>
#include <netinet/udp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace stellar::host {

namespace {
constexpr int max_batch = UdpSocket::max_batch;
constexpr int socket_buffer_bytes = 16 << 20;
constexpr size_t control_bytes =
    CMSG_SPACE(sizeof(uint16_t)) + CMSG_SPACE(sizeof(int)) + CMSG_SPACE(sizeof(timespec)) + CMSG_SPACE(sizeof(int));  // + IP_TOS
constexpr uint32_t gso_max_bytes = 65000;  // UDP payload of one GSO message
constexpr int gso_max_segments = 64;
constexpr size_t max_parts = 20;          // iovecs of one datagram (header, payload pieces, trailer)
constexpr size_t max_message_iovecs = 1024;  // UIO_MAXIOV
#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#ifndef UDP_GRO
#define UDP_GRO 104
#endif

SocketError system_error(const std::string& what) { return SocketError{false, what + ": " + std::strerror(errno)}; }
}  // namespace

std::optional<sockaddr_in> parse_ipv4(const std::string& address, uint16_t port) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  if (inet_pton(AF_INET, address.c_str(), &a.sin_addr) != 1) return std::nullopt;
  return a;
}

std::string format_ipv4(const sockaddr_in& a) {
  char text[INET_ADDRSTRLEN] = {};
  inet_ntop(AF_INET, &a.sin_addr, text, sizeof text);
  return text;
}

UdpSocket::~UdpSocket() { close(); }

std::optional<SocketError> UdpSocket::rebind(const std::string& address, uint16_t port) {
  if (fd_ < 0) return open(address, port);
  UdpSocket fresh;
  if (auto e = fresh.open(address, port)) return e;
  return adopt(fresh);
}

std::optional<SocketError> UdpSocket::adopt(UdpSocket& fresh) {
  if (fd_ < 0 || fresh.fd_ < 0) return SocketError{false, "adopt: a socket is not open"};
  // dup3, not dup2: the descriptor stays close-on-exec.
  if (::dup3(fresh.fd_, fd_, O_CLOEXEC) < 0) return system_error("dup3");
  // fd_ now names the new socket; fresh closes its own number of it.
  local_ = fresh.local_;
  gso_supported_ = fresh.gso_supported_;
  gro_supported_ = fresh.gro_supported_;
  gro_ = fresh.gro_;
  gso_ = gso_wanted_ && gso_supported_;  // sends that failed as the address went may have turned it off
  prepared_ = nullptr;  // the receive headers point at the batch, not the socket: rebuilt anyway
  prepared_count_ = 0;
  sparse_ = false;
  quiet_receives_ = 0;
  address_error_ = false;
  connected_ = false;  // the new socket is not
  same_peer_sends_ = 0;
  if (send_only_) send_only();
  if (ecn_) enable_ecn();
  fresh.close();
  return std::nullopt;
}

void UdpSocket::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  local_ = sockaddr_in{};
  gso_ = gso_supported_ = gro_ = gro_supported_ = false;
  prepared_ = nullptr;
  prepared_count_ = 0;
  sparse_ = false;
  send_only_ = address_error_ = ecn_ = connected_ = false;
  same_peer_sends_ = 0;
  quiet_receives_ = 0;
}

void UdpSocket::enable_ecn() {
  ecn_ = true;
  const int ect0 = 0x02;  // TOS byte: DSCP 0, ECN field ECT(0)
  const int on = 1;
  ::setsockopt(fd_, IPPROTO_IP, IP_TOS, &ect0, sizeof ect0);
  ::setsockopt(fd_, IPPROTO_IP, IP_RECVTOS, &on, sizeof on);
}

void UdpSocket::send_only() {
  send_only_ = true;
  const int smallest = 1;  // the kernel rounds it up to its minimum
  ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &smallest, sizeof smallest);
}

namespace {
bool same_peer(const sockaddr_in& a, const sockaddr_in& b) { return a.sin_addr.s_addr == b.sin_addr.s_addr && a.sin_port == b.sin_port; }
}  // namespace

void UdpSocket::note_destination(const sockaddr_in& peer) {
  if (connected_ && same_peer(peer, connected_peer_)) return;
  if (!same_peer(peer, last_peer_)) {
    last_peer_ = peer;
    same_peer_sends_ = 0;
  }
  // One connect per run of connect_after_sends messages at most, however
  // the destinations alternate (a connect costs about one send).
  if (++same_peer_sends_ < connect_after_sends) return;
  same_peer_sends_ = 0;
  if (::connect(fd_, reinterpret_cast<const sockaddr*>(&peer), sizeof peer) == 0) {
    connected_ = true;
    connected_peer_ = peer;
  } else {
    connected_ = false;  // e.g. no route now: addressed sends, as before
  }
}

std::optional<SocketError> UdpSocket::open(const std::string& address, uint16_t port) {
  auto bind_to = parse_ipv4(address, port);
  if (!bind_to) return SocketError{true, "not an IPv4 address: '" + address + "'"};
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
    return system_error("bind " + address + ":" + std::to_string(port));
  socklen_t length = sizeof local_;
  getsockname(fd_, reinterpret_cast<sockaddr*>(&local_), &length);
  const int on = 1;
  // GRO starts off: it costs about 0.1 us per datagram on a ping-pong and is
  // switched on by receive_batch when datagrams arrive in bulk.
  gro_supported_ = setsockopt(fd_, IPPROTO_UDP, UDP_GRO, &on, sizeof on) == 0;
  // Arrival timestamps let the engine tell time spent waiting for this
  // process to poll (host delay) from time on the network.
  setsockopt(fd_, SOL_SOCKET, SO_TIMESTAMPNS, &on, sizeof on);
  set_gro(false);
  // GSO needs no option; probe that the kernel knows UDP_SEGMENT.
  int segment = 0;
  socklen_t segment_length = sizeof segment;
  gso_supported_ = getsockopt(fd_, IPPROTO_UDP, UDP_SEGMENT, &segment, &segment_length) == 0;
  messages_.resize(max_batch);
  // iovecs_ grows in send_batch to what a call needs: sized here for the
  // worst case (every message a full GSO run of many-part datagrams) it was
  // 1.3 MB zero-filled per socket, for every path socket, a tenth of a short
  // program's CPU time.
  iovecs_.resize(max_batch);
  controls_.resize(size_t(max_batch) * control_bytes);
  rx_messages_.resize(max_batch);
  rx_iovecs_.resize(max_batch);
  rx_controls_.resize(size_t(max_batch) * control_bytes);
  return {};
}

void UdpSocket::set_gro(bool on) {
  const int value = on ? 1 : 0;
  if (setsockopt(fd_, IPPROTO_UDP, UDP_GRO, &value, sizeof value) == 0) {
    if (gro_ && !on) gro_draining_ = true;  // until a receive with control messages finds the queue empty
    gro_ = on;
  }
  quiet_receives_ = 0;
  prepared_ = nullptr;  // control buffers change with GRO
}

int UdpSocket::receive_first(Datagram* batch) {
  prepare_receive(batch, 1);
  msghdr& h = rx_messages_[0].msg_hdr;
  h.msg_namelen = sizeof(sockaddr_in);
  h.msg_controllen = control_bytes;
  const ssize_t r = ::recvmsg(fd_, &h, MSG_DONTWAIT);
  if (r < 0) {
    if (errno == EAGAIN) gro_draining_ = false;
    return 0;
  }
  finish_received(h, unsigned(r), batch[0]);
  if (batch[0].congestion_mark) metadata_calls_ = ecn_watch_calls;
  return 1;
}

void UdpSocket::prepare_receive(Datagram* batch, int count) {
  // Busy-polling calls this millions of times mostly to find nothing: build
  // the headers once per batch array, then reset only what the kernel writes.
  if (prepared_ != batch || prepared_count_ < count) {
    for (int i = 0; i < count; ++i) {
      rx_iovecs_[size_t(i)] = {batch[i].data, batch[i].capacity};
      msghdr& h = rx_messages_[size_t(i)].msg_hdr;
      h = msghdr{};
      h.msg_name = &batch[i].peer;
      h.msg_iov = &rx_iovecs_[size_t(i)];
      h.msg_iovlen = 1;
      h.msg_control = &rx_controls_[size_t(i) * control_bytes];
    }
    prepared_ = batch;
    prepared_count_ = count;
  }
}

int UdpSocket::receive_batch(Datagram* batch, int count, bool fresh) {
  count = std::min(count, max_batch);
  prepare_receive(batch, count);
  // Sparse (ping-pong): one message per call, so only the first is reset.
  for (int i = 0, used = sparse_ ? 1 : count; i < used; ++i) {
    msghdr& h = rx_messages_[size_t(i)].msg_hdr;
    h.msg_namelen = sizeof(sockaddr_in);
    h.msg_controllen = control_bytes;  // always: a coalesced datagram may still be queued after GRO went off
  }
  // When traffic is sparse (ping-pong), plain recvmsg is cheaper than
  // recvmmsg; switch to batches as soon as one datagram was waiting.
  int n;
  if (metadata_calls_ > 0) --metadata_calls_;
  const bool lean = sparse_ && fresh && !gro_ && !gro_draining_ && metadata_calls_ == 0 &&
                    !(ecn_ && ++lean_calls_ % ecn_sample_calls == 0);
  if (lean) {
    // MSG_TRUNC: the datagram's real length, so that one larger than the
    // buffer is reported truncated (and dropped) as recvmsg would.
    Datagram& d = batch[0];
    socklen_t name_length = sizeof(sockaddr_in);
    const ssize_t r = ::recvfrom(fd_, d.data, d.capacity, MSG_DONTWAIT | MSG_TRUNC, reinterpret_cast<sockaddr*>(&d.peer), &name_length);
    if (r < 0) {
      sparse_ = true;
      return 0;
    }
    d.length = uint32_t(r) > d.capacity ? 0 : uint32_t(r);
    d.segment_size = 0;
    d.arrival_realtime_ns = 0;
    d.congestion_mark = false;
    sparse_ = false;  // as after any lone datagram: the next call looks for a batch
    return 1;
  }
  if (sparse_) {
    const ssize_t r = ::recvmsg(fd_, &rx_messages_[0].msg_hdr, MSG_DONTWAIT);
    n = r < 0 ? 0 : 1;
    if (n) rx_messages_[0].msg_len = unsigned(r);
    else if (errno == EAGAIN) gro_draining_ = false;
  } else {
    const int r = ::recvmmsg(fd_, rx_messages_.data(), unsigned(count), MSG_DONTWAIT, nullptr);
    n = std::max(0, r);
    if (r < 0 && errno == EAGAIN) gro_draining_ = false;
  }
  uint32_t datagrams = 0;  // GRO may pack many datagrams into one message
  for (int i = 0; i < n; ++i) {
    finish_received(rx_messages_[size_t(i)].msg_hdr, rx_messages_[size_t(i)].msg_len, batch[i]);
    if (batch[i].congestion_mark) metadata_calls_ = ecn_watch_calls;
    datagrams += batch[i].segment_size ? (batch[i].length + batch[i].segment_size - 1) / batch[i].segment_size : 1;
  }
  sparse_ = datagrams <= 1 && !sparse_ ? true : datagrams == 0;
  if (datagrams >= 4) {
    quiet_receives_ = 0;
    if (!gro_ && gro_supported_) set_gro(true);
  } else if (datagrams == 1 && gro_ && ++quiet_receives_ > 4096) {
    set_gro(false);  // thousands of lone datagrams in a row: latency matters more
  }
  return n;
}

void UdpSocket::finish_received(const msghdr& h, unsigned length, Datagram& d) {
  // A datagram larger than the buffer is truncated: report it as such so
  // the decoder drops it (MSG_TRUNC).
  d.length = (h.msg_flags & MSG_TRUNC) ? 0 : length;
  d.segment_size = 0;
  d.arrival_realtime_ns = 0;
  d.congestion_mark = false;
  msghdr& m = const_cast<msghdr&>(h);  // CMSG_NXTHDR takes a non-const header
  for (cmsghdr* c = m.msg_controllen ? CMSG_FIRSTHDR(&m) : nullptr; c; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level == IPPROTO_UDP && c->cmsg_type == UDP_GRO) {
      int size = 0;
      std::memcpy(&size, CMSG_DATA(c), sizeof size);
      d.segment_size = uint32_t(size);
    } else if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_TIMESTAMPNS) {
      timespec t;
      std::memcpy(&t, CMSG_DATA(c), sizeof t);
      d.arrival_realtime_ns = uint64_t(t.tv_sec) * 1'000'000'000u + uint64_t(t.tv_nsec);
    } else if (c->cmsg_level == IPPROTO_IP && c->cmsg_type == IP_TOS) {
      d.congestion_mark = (*CMSG_DATA(c) & 0x03) == 0x03;  // CE
    }
  }
}

int UdpSocket::receive_scattered_batch(Datagram* batch, const ScatterLayout* layouts, int count) {
  if (count < 1 || count > max_scattered_batch) return 0;
  mmsghdr messages[max_scattered_batch];
  iovec v[max_scatter + max_scattered_batch];  // each layout's parts, then a piece for the rest
  alignas(cmsghdr) char control[max_scattered_batch][control_bytes];
  int used = 0;
  for (int k = 0; k < count; ++k) {
    const ScatterLayout& l = layouts[k];
    Datagram& d = batch[k];
    if (l.count < 0 || used - k + l.count > max_scatter || l.bytes > d.capacity) return 0;
    iovec* mine = v + used;
    std::copy(l.parts, l.parts + l.count, mine);
    mine[l.count] = {d.data + l.bytes, d.capacity - l.bytes};  // whatever is longer than the layout
    used += l.count + 1;
    msghdr& h = messages[k].msg_hdr;
    h = msghdr{};
    h.msg_name = &d.peer;
    h.msg_namelen = sizeof(sockaddr_in);
    h.msg_iov = mine;
    h.msg_iovlen = size_t(l.count) + 1;
    h.msg_control = control[k];
    h.msg_controllen = control_bytes;
  }
  // One datagram: recvmsg (recvmmsg costs a little more for a single one).
  int n;
  if (count == 1) {
    const ssize_t r = ::recvmsg(fd_, &messages[0].msg_hdr, MSG_DONTWAIT);
    n = r < 0 ? 0 : 1;
    if (n) messages[0].msg_len = unsigned(r);
  } else {
    n = std::max(0, ::recvmmsg(fd_, messages, unsigned(count), MSG_DONTWAIT, nullptr));
  }
  for (int k = 0; k < n; ++k) finish_received(messages[k].msg_hdr, messages[k].msg_len, batch[k]);
  return n;
}

namespace {
// Where a datagram's last bytes live (its trailer): two datagrams with the
// same are one datagram sent twice.
const void* last_bytes(const Datagram& d) { return d.part_count ? d.parts[d.part_count - 1].iov_base : d.data; }
}  // namespace

int UdpSocket::send_batch(Datagram* batch, int count, int& error) {
  error = 0;
  // The usual lone datagram (a ping-pong's turn, an ACK): one contiguous
  // buffer without control messages goes straight to sendto, without the
  // message build below. A failure takes the general path, which sends it
  // again and sorts the error out (the pending error of a connected
  // socket, EAGAIN, a vanished address) as for any other datagram.
  if (count == 1 && batch[0].part_count == 0 && batch[0].tos == 0) {
    const Datagram& d = batch[0];
    const bool kept_route = connected_ && same_peer(d.peer, connected_peer_);
    if (::sendto(fd_, d.data, d.length, MSG_DONTWAIT, kept_route ? nullptr : reinterpret_cast<const sockaddr*>(&d.peer),
                 kept_route ? 0 : socklen_t(sizeof d.peer)) >= 0) {
      if (send_only_) note_destination(d.peer);
      return 1;
    }
  }
  // Every call below starts again at iovecs_[0]; none takes more than all
  // the datagrams' parts together. Grown before any msghdr points into it.
  size_t parts_needed = 0;
  for (int i = 0; i < count; ++i) parts_needed += batch[i].part_count ? batch[i].part_count : 1;
  if (parts_needed > iovecs_.size()) iovecs_.resize(std::min(parts_needed, size_t(max_batch) * gso_max_segments * max_parts));
  int done = 0;  // datagrams handed to the kernel (or given up on)
  bool retried = false;  // see the connected socket's pending error below
  while (done < count) {
    // Build up to max_batch messages; with GSO one message carries a run of
    // equal-sized datagrams to the same peer (the last may be shorter).
    int messages = 0;
    size_t iov = 0;
    int firsts[max_batch];
    int sizes[max_batch];
    int next = done;
    while (next < count && messages < max_batch) {
      const Datagram& first = batch[next];
      if (fixup_ && next > done && last_bytes(first) == last_bytes(batch[next - 1])) break;  // its twin is in this call
      int run = 1;
      uint32_t bytes = first.length;
      size_t parts = first.part_count ? first.part_count : 1;
      if (gso_) {
        while (next + run < count && run < gso_max_segments) {
          const Datagram& d = batch[next + run];
          const size_t more = d.part_count ? d.part_count : 1;
          if (d.length > first.length || bytes + d.length > gso_max_bytes || parts + more > max_message_iovecs ||
              d.peer.sin_addr.s_addr != first.peer.sin_addr.s_addr || d.peer.sin_port != first.peer.sin_port ||
              d.tos != first.tos)
            break;
          if (batch[next + run - 1].length != first.length) break;  // only the last may be shorter
          if (fixup_ && last_bytes(d) == last_bytes(batch[next + run - 1])) break;
          bytes += d.length;
          parts += more;
          ++run;
        }
      }
      msghdr& h = messages_[size_t(messages)].msg_hdr;
      h = msghdr{};
      if (!connected_ || !same_peer(first.peer, connected_peer_)) {  // to the connected peer: no address, the kept route
        h.msg_name = const_cast<sockaddr_in*>(&first.peer);
        h.msg_namelen = sizeof(sockaddr_in);
      }
      h.msg_iov = &iovecs_[iov];
      h.msg_iovlen = parts;
      for (int k = 0; k < run; ++k) {
        const Datagram& d = batch[next + k];
        if (d.part_count) {
          for (uint32_t j = 0; j < d.part_count; ++j) iovecs_[iov++] = d.parts[j];
        } else {
          iovecs_[iov++] = {d.data, d.length};
        }
      }
      if (run > 1 || first.tos) {
        char* control = &controls_[size_t(messages) * control_bytes];
        std::memset(control, 0, control_bytes);
        h.msg_control = control;
        h.msg_controllen = (run > 1 ? CMSG_SPACE(sizeof(uint16_t)) : 0) + (first.tos ? CMSG_SPACE(sizeof(int)) : 0);
        cmsghdr* c = CMSG_FIRSTHDR(&h);
        if (run > 1) {
          c->cmsg_level = IPPROTO_UDP;
          c->cmsg_type = UDP_SEGMENT;
          c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
          const uint16_t segment = uint16_t(first.length);
          std::memcpy(CMSG_DATA(c), &segment, sizeof segment);
          c = CMSG_NXTHDR(&h, c);
        }
        if (first.tos) {
          // The traffic class's DSCP for this datagram alone (the flow
          // scheduler's class), without a setsockopt per class change.
          c->cmsg_level = IPPROTO_IP;
          c->cmsg_type = IP_TOS;
          c->cmsg_len = CMSG_LEN(sizeof(int));
          const int tos = first.tos;
          std::memcpy(CMSG_DATA(c), &tos, sizeof tos);
        }
      }
      firsts[messages] = next;
      sizes[messages] = run;
      ++messages;
      next += run;
    }
    auto fix = [&](bool to_segments) {
      for (int m = 0; m < messages; ++m)
        for (int k = 1; k < sizes[m]; ++k) fixup_(batch[firsts[m] + k], to_segments ? 0 : uint32_t(k), to_segments ? uint32_t(k) : 0);
    };
    if (fixup_) fix(true);
    // One message (a ping-pong's usual case) costs less through sendmsg,
    // and one contiguous datagram without control messages less again
    // through sendto (no msghdr or iovec to copy in).
    const msghdr& only = messages_[0].msg_hdr;
    const int n = messages > 1 ? ::sendmmsg(fd_, messages_.data(), unsigned(messages), MSG_DONTWAIT)
                  : only.msg_iovlen == 1 && only.msg_controllen == 0
                      ? (::sendto(fd_, only.msg_iov[0].iov_base, only.msg_iov[0].iov_len, MSG_DONTWAIT,
                                  static_cast<const sockaddr*>(only.msg_name), only.msg_namelen) >= 0 ? 1 : -1)
                      : (::sendmsg(fd_, &only, MSG_DONTWAIT) >= 0 ? 1 : -1);
    const int send_errno = errno;
    if (fixup_) fix(false);  // the kernel has copied what it took
    errno = send_errno;
    if (n <= 0 && connected_ && !retried && errno != EAGAIN && errno != EWOULDBLOCK && errno != ENOBUFS) {
      // A connected socket reports an earlier datagram's ICMP error (port
      // or net unreachable, fragmentation needed) on its next send, which
      // then sent nothing. Reported and cleared now: send it again, as an
      // unconnected socket would have sent it. A real failure fails again.
      retried = true;
      continue;
    }
    if (n <= 0) {
      error = errno;
      if (errno == ENETUNREACH || errno == EADDRNOTAVAIL || errno == EINVAL) address_error_ = true;
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == ENOBUFS) return done;
      if (sizes[0] > 1 && (errno == EIO || errno == EINVAL)) {
        gso_ = false;  // the path cannot segment: fall back to one datagram per message
        continue;
      }
      done = firsts[0] + sizes[0];  // drop the offending message; the transport retransmits
      continue;
    }
    done = firsts[n - 1] + sizes[n - 1];
    if (send_only_) note_destination(batch[firsts[n - 1]].peer);
  }
  return done;
}

}  // namespace stellar::host
