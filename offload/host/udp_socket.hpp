// Batched UDP I/O for the engine host: non-blocking IPv4 socket,
// recvmmsg/sendmmsg batches into caller-owned preallocated buffers (no
// allocation or locking per datagram). Not thread-safe: one driver thread.
// Part of the engine host (offload/host): no dependency on src/.
#pragma once

#include <netinet/in.h>
#include <sys/uio.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace stellar::host {

struct Datagram {
  uint8_t* data = nullptr;
  uint32_t capacity = 0;
  uint32_t length = 0;
  sockaddr_in peer{};
  // Received with UDP GRO: `length` bytes hold several datagrams of
  // `segment_size` bytes each (the last may be shorter). 0: one datagram.
  uint32_t segment_size = 0;
  // Receiving: when the kernel took the datagram in (CLOCK_REALTIME ns,
  // SO_TIMESTAMPNS); 0 when the kernel gave no timestamp.
  uint64_t arrival_realtime_ns = 0;
  // Receiving, with enable_ecn(): the IP header said congestion experienced
  // (ECN CE): a queue on the way marked it.
  bool congestion_mark = false;
  // Sending only: the IP TOS byte (DSCP << 2 | ECN) of this datagram, sent
  // as an IP_TOS control message; 0: the socket's own (enable_ecn's ECT(0)).
  uint8_t tos = 0;
  // Sending only: when part_count > 0 the datagram is these pieces in order
  // (zero-copy gather of headers, payload in place, trailer); length is their total.
  const struct iovec* parts = nullptr;
  uint32_t part_count = 0;
};

// Why open failed: `invalid_address` when the address is not IPv4 text,
// else a system call failed (`message` names it and the errno text).
struct SocketError {
  bool invalid_address = false;
  std::string message;
  bool permission_denied = false;  // the engine daemon refused the application's credentials
};

class UdpSocket {
 public:
  // Datagrams one receive_batch() call fills at most, and messages one
  // sendmmsg carries (send_batch() loops for more). The host's batches are
  // sized against it (static_assert in engine_host.hpp).
  static constexpr int max_batch = 64;

  UdpSocket() = default;
  ~UdpSocket();
  UdpSocket(const UdpSocket&) = delete;
  UdpSocket& operator=(const UdpSocket&) = delete;

  // Binds address:port (port 0: any). Large socket buffers, DF set, UDP GRO
  // on where the kernel has it. nullopt on success.
  std::optional<SocketError> open(const std::string& address, uint16_t port);
  // For a socket that only sends (a multipath host's extra source ports):
  // the smallest receive buffer, so that stray datagrams to its port, which
  // nobody reads, hold next to no memory. Such a socket also connects
  // itself to a peer it has sent `connect_after_sends` messages in a row to:
  // the kernel then keeps the route instead of looking it up on every send
  // (~70 ns of an 8-byte sendto on loopback). Datagrams to other peers still
  // go out, addressed; a connected UDP socket only filters what it
  // receives, which a send-only one never reads. The one other difference,
  // an ICMP error for an earlier datagram failing the next send, is undone
  // there: send_batch sends that message again.
  void send_only();
  static constexpr uint32_t connect_after_sends = 64;
  bool connected() const { return connected_; }
  // Closes the socket (open may be called again).
  void close();
  // Binds to address:port (port 0: any) in place of the current binding,
  // keeping the file descriptor number (a new socket dup2'ed over it, so
  // that whoever polls fd() keeps polling the right socket; an epoll set
  // must add it again). GSO and send-only settings carry over. On failure
  // the socket is unchanged.
  std::optional<SocketError> rebind(const std::string& address, uint16_t port);
  // The second half of rebind: `fresh` (opened elsewhere) takes this
  // socket's place under this socket's descriptor number (close-on-exec
  // kept); `fresh` is left closed. For hosts that open every new socket
  // before swapping any, so that a failure leaves all of them as they were.
  std::optional<SocketError> adopt(UdpSocket& fresh);
  // True once since the last call if a send failed the way sends fail when
  // the bound address is gone (ENETUNREACH, EADDRNOTAVAIL, EINVAL): the
  // host then looks for its new address (EngineHost, address change).
  bool take_address_error() {
    const bool e = address_error_;
    address_error_ = false;
    return e;
  }
  // Send runs of equal-sized datagrams to one peer as one UDP GSO message
  // (one syscall entry and one skb per up to 64 KiB). Off by default. The
  // kernel numbers the segments' IP ids, which the RoCEv2 ICRC covers: roce
  // mode turns it on together with set_segment_fixup.
  void enable_gso(bool on) {
    gso_wanted_ = on;
    gso_ = on && gso_supported_;
  }
  // For a protocol whose checksum covers the IPv4 id (RoCEv2's ICRC): GSO
  // gives segment k of a message id k (a lone datagram has 0). With a fixup,
  // send_batch calls it for every datagram it sends as segment k > 0 just
  // before the system call (from 0 to k) and again after it (k to 0), so the
  // datagrams keep their id-0 form; datagrams that share their last bytes
  // (a fault filter's duplicate) never share a system call.
  using SegmentFixup = void (*)(Datagram&, uint32_t from_position, uint32_t to_position);
  void set_segment_fixup(SegmentFixup f) { fixup_ = f; }
  bool gso() const { return gso_; }
  // ECN: every datagram sent carries ECT(0) (DSCP 0), so that queues which
  // mark instead of dropping mark it; received ones report CE
  // (Datagram::congestion_mark). Kept across rebind().
  void enable_ecn();
  bool gro() const { return gro_supported_; }  // available (it is switched on under bulk traffic)
  int fd() const { return fd_; }
  const sockaddr_in& local() const { return local_; }

  // Receives up to count datagrams without blocking; returns how many (0 when
  // none). Fills length and peer of each.
  //
  // `fresh`: the caller polled this socket moments ago (busy-polling), so a
  // datagram found now arrived at most that long ago. A lone datagram may
  // then come through recvfrom, which costs about 120 ns less than recvmsg
  // on this path (no msghdr or iovec to copy in) but brings no control
  // messages: no arrival stamp (the engine takes "now", off by less than
  // the poll interval) and no ECN mark. Marks still get through: with ECN
  // on, one call in ecn_sample_calls uses recvmsg, and once a mark was
  // seen every call does for a while (ecn_watch_calls). Never while GRO is
  // on or draining (a coalesced datagram needs its segment size).
  int receive_batch(Datagram* batch, int count, bool fresh = false);
  // Receives at most one datagram into batch[0] (recvmsg, with its control
  // messages), leaving the heuristics above as they were: a probe that
  // lets the caller look at the first datagram before deciding where the
  // next ones go (EngineHost's direct placement). 1 if one came, else 0.
  int receive_first(Datagram* batch);
  // 32: one sparse datagram in 32 pays recvmsg's extra ~0.5 us on this
  // path (at 8 it was one in 8, a visible share of a ping-pong's median);
  // a marking queue is still noticed within ~32 polls, tens of microseconds.
  static constexpr uint32_t ecn_sample_calls = 32;
  static constexpr uint32_t ecn_watch_calls = 1u << 20;  // about half a second of busy-polling
  // Receives up to `count` (at most max_scattered_batch) datagrams without
  // blocking, in one system call; datagram k's first bytes go into
  // layouts[k]'s iovecs (the caller's layout, e.g. headers into a buffer
  // and payloads into their place) and whatever is longer into
  // batch[k].data + layouts[k].bytes, so that copying the parts to
  // data[0, bytes) makes it one contiguous datagram again. Returns how many
  // came (0 when none was waiting), each filled as receive_batch fills it
  // (length: the whole datagram's). All the layouts together have at most
  // max_scatter iovecs.
  static constexpr int max_scatter = 192;
  struct ScatterLayout {
    const struct iovec* parts = nullptr;
    int count = 0;       // iovecs
    uint32_t bytes = 0;  // their total, at most the datagram's capacity
  };
  static constexpr int max_scattered_batch = 16;
  int receive_scattered_batch(Datagram* batch, const ScatterLayout* layouts, int count);
  // Sends count datagrams (each to its peer); returns how many the kernel
  // took. Failures other than "would block" are counted by the caller.
  int send_batch(Datagram* batch, int count, int& error);

 private:
  int fd_ = -1;
  sockaddr_in local_{};
  bool gso_ = false, gso_supported_ = false, gro_ = false;  // gro_: currently on (see receive_batch)
  std::vector<struct mmsghdr> messages_;
  std::vector<struct iovec> iovecs_;
  std::vector<char> controls_;  // one cmsg buffer per message
  std::vector<struct mmsghdr> rx_messages_;  // receive side: built once, see receive_batch
  std::vector<struct iovec> rx_iovecs_;
  std::vector<char> rx_controls_;
  void prepare_receive(Datagram* batch, int count);
  const Datagram* prepared_ = nullptr;  // batch the receive headers were built for
  int prepared_count_ = 0;
  bool sparse_ = false;  // the last receive found at most one datagram
  bool send_only_ = false, address_error_ = false;
  // send_only(): the peer connected to (connected_), and the peer of the
  // last messages with how many went there in a row.
  bool connected_ = false;
  sockaddr_in connected_peer_{}, last_peer_{};
  uint32_t same_peer_sends_ = 0;
  void note_destination(const sockaddr_in& peer);
  bool gso_wanted_ = false;
  SegmentFixup fixup_ = nullptr;
  bool ecn_ = false;  // enable_gso's wish: a rebind starts from it, not from a fallback
  bool gro_supported_ = false;
  uint32_t quiet_receives_ = 0;  // lone datagrams in a row while GRO is on
  // receive_batch's lean path (see there): calls counted for the ECN sample,
  // calls left that must read control messages after a CE mark, and whether
  // datagrams coalesced before GRO went off may still be queued.
  uint32_t lean_calls_ = 0, metadata_calls_ = 0;
  bool gro_draining_ = false;
  void set_gro(bool on);
  // Length, GRO segment size, arrival stamp and ECN mark of a received message.
  static void finish_received(const struct msghdr& h, unsigned length, Datagram& d);
};

// nullopt when `address` is not a dotted-quad IPv4 address.
std::optional<sockaddr_in> parse_ipv4(const std::string& address, uint16_t port);
std::string format_ipv4(const sockaddr_in&);

}  // namespace stellar::host
