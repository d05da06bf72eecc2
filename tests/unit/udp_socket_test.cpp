// The engine host's UDP socket (offload/host/udp_socket.hpp) on loopback:
// what a busy-polling receive (`fresh`, the lean recvfrom path) may and may
// not lose against the full recvmsg path. Real sockets on 127.0.0.1.
#include "host/udp_socket.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <sys/uio.h>

#include <cstring>
#include <vector>

using stellar::host::Datagram;
using stellar::host::UdpSocket;

namespace {

// A plain sender whose datagrams carry `tos` (3: ECN CE, as a marking queue leaves them).
struct Sender {
  int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
  explicit Sender(int tos = 0) {
    if (tos) ::setsockopt(fd, IPPROTO_IP, IP_TOS, &tos, sizeof tos);
  }
  ~Sender() { ::close(fd); }
  void send(const UdpSocket& to, size_t bytes, uint8_t fill = 0x5a) {
    std::vector<uint8_t> b(bytes, fill);
    const sockaddr_in& a = to.local();
    ASSERT_EQ(::sendto(fd, b.data(), b.size(), 0, reinterpret_cast<const sockaddr*>(&a), sizeof a), ssize_t(bytes));
  }
};

struct Receiver {
  UdpSocket socket;
  std::vector<uint8_t> memory;
  std::vector<Datagram> batch;
  explicit Receiver(uint32_t capacity = 2048) : memory(size_t(capacity) * 32), batch(32) {
    EXPECT_FALSE(socket.open("127.0.0.1", 0).has_value());
    for (size_t i = 0; i < batch.size(); ++i) batch[i] = Datagram{memory.data() + i * capacity, capacity, 0, {}, 0};
  }
  // Polls as a busy loop does until a datagram comes (loopback delivers at
  // once; the bound only keeps a broken socket from hanging the test).
  int receive(bool fresh) {
    for (int i = 0; i < 100000; ++i)
      if (int n = socket.receive_batch(batch.data(), int(batch.size()), fresh); n > 0) return n;
    return 0;
  }
};

TEST(UdpSocket, LeanReceiveDeliversTheDatagramAndItsSender) {
  Receiver r;
  Sender s;
  // The first call after a datagram looks for a batch (recvmmsg); an empty
  // poll makes the socket sparse, where the lean path applies.
  EXPECT_EQ(r.socket.receive_batch(r.batch.data(), 32, true), 0);
  s.send(r.socket, 100, 0x11);
  ASSERT_EQ(r.receive(true), 1);
  EXPECT_EQ(r.batch[0].length, 100u);
  EXPECT_EQ(r.batch[0].data[99], 0x11);
  EXPECT_EQ(r.batch[0].segment_size, 0u);
  EXPECT_EQ(r.batch[0].peer.sin_addr.s_addr, htonl(INADDR_LOOPBACK));
}

TEST(UdpSocket, OversizedDatagramIsReportedTruncatedOnBothPaths) {
  for (bool fresh : {true, false}) {
    Receiver r(512);
    Sender s;
    EXPECT_EQ(r.socket.receive_batch(r.batch.data(), 32, fresh), 0);
    s.send(r.socket, 1500);
    ASSERT_EQ(r.receive(fresh), 1) << "fresh " << fresh;
    EXPECT_EQ(r.batch[0].length, 0u) << "a datagram larger than the buffer must read as truncated (fresh " << fresh << ")";
  }
}

TEST(UdpSocket, CongestionMarksGetThroughBusyPolling) {
  Receiver r;
  r.socket.enable_ecn();
  Sender marked(0x03);  // CE
  int seen = 0, first = -1;
  // One datagram at a time, each polled for as a ping-pong does: at most
  // ecn_sample_calls lean calls pass before one reads control messages, and
  // from the first mark on every datagram reports its mark.
  for (int i = 0; i < 64; ++i) {
    EXPECT_EQ(r.socket.receive_batch(r.batch.data(), 32, true), 0);
    marked.send(r.socket, 64);
    ASSERT_EQ(r.receive(true), 1);
    if (r.batch[0].congestion_mark) {
      ++seen;
      if (first < 0) first = i;
    } else {
      EXPECT_LT(first, 0) << "datagram " << i << " lost its mark after marks were seen";
    }
  }
  ASSERT_GE(first, 0) << "no CE mark was reported in 64 marked datagrams";
  EXPECT_LT(first, int(UdpSocket::ecn_sample_calls) * 2);
  EXPECT_EQ(seen, 64 - first);
}

TEST(UdpSocket, StaleReceiveKeepsTheArrivalStamp) {
  Receiver r;
  Sender s;
  EXPECT_EQ(r.socket.receive_batch(r.batch.data(), 32, false), 0);
  s.send(r.socket, 64);
  ASSERT_EQ(r.receive(false), 1);
  EXPECT_NE(r.batch[0].arrival_realtime_ns, 0u) << "a poll that is not busy-polling must read the kernel's arrival stamp";
}

}  // namespace

// Receiving into place takes several datagrams in one call, each into its
// own layout: datagram k's first bytes into its parts, the rest after
// layouts[k].bytes in its own buffer; one longer than its buffer still
// reads as truncated.
TEST(UdpSocket, ScatteredBatchLaysEachDatagramOutOnItsOwn) {
  Receiver r(256);
  Sender s;
  s.send(r.socket, 100, 0x21);
  s.send(r.socket, 40, 0x22);   // shorter than its layout
  s.send(r.socket, 1000, 0x23); // longer than its buffer
  s.send(r.socket, 70, 0x24);   // not laid out for: stays queued
  uint8_t head[3][16], body[3][64];
  iovec parts[6];
  UdpSocket::ScatterLayout layouts[3];
  for (int k = 0; k < 3; ++k) {
    parts[2 * k] = {head[k], sizeof head[k]};
    parts[2 * k + 1] = {body[k], sizeof body[k]};
    layouts[k] = {parts + 2 * k, 2, 80};
  }
  int n = 0;
  for (int i = 0; i < 100000 && n == 0; ++i) n = r.socket.receive_scattered_batch(r.batch.data(), layouts, 3);
  ASSERT_EQ(n, 3);
  EXPECT_EQ(r.batch[0].length, 100u);
  EXPECT_EQ(head[0][15], 0x21);
  EXPECT_EQ(body[0][63], 0x21);
  EXPECT_EQ(r.batch[0].data[80], 0x21);  // byte 80 on: its own buffer, past the layout
  EXPECT_EQ(r.batch[0].data[99], 0x21);
  EXPECT_EQ(r.batch[1].length, 40u);
  EXPECT_EQ(body[1][23], 0x22);
  EXPECT_EQ(r.batch[2].length, 0u) << "a datagram longer than layout and buffer must read as truncated";
  EXPECT_EQ(r.batch[0].peer.sin_addr.s_addr, htonl(INADDR_LOOPBACK));
  ASSERT_EQ(r.receive(false), 1);
  EXPECT_EQ(r.batch[0].length, 70u);
  EXPECT_EQ(r.batch[0].data[0], 0x24);
  // Nothing waiting: none, without blocking.
  EXPECT_EQ(r.socket.receive_scattered_batch(r.batch.data(), layouts, 3), 0);
}

// A send-only socket (a multipath host's extra source port) connects itself
// to the peer it keeps sending to, so that the kernel keeps the route; its
// datagrams to that peer and to any other still arrive, and a dead peer's
// ICMP error, which a connected socket reports on its next send, costs no
// datagram to anyone else.
TEST(UdpSocket, ASendOnlySocketConnectsToItsPeerAndStillReachesOthers) {
  Receiver a, b;
  UdpSocket sender;
  ASSERT_FALSE(sender.open("127.0.0.1", 0).has_value());
  sender.send_only();
  uint8_t payload[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  auto send_to = [&](const UdpSocket& to, uint8_t tag) {
    payload[0] = tag;
    Datagram d{payload, sizeof payload, sizeof payload, to.local(), 0};
    int error = 0;
    return sender.send_batch(&d, 1, error);
  };
  auto drain = [](Receiver& r) {
    int got = 0;
    for (int n; (n = r.socket.receive_batch(r.batch.data(), int(r.batch.size()))) > 0;) got += n;
    return got;
  };
  for (uint32_t i = 0; i + 1 < UdpSocket::connect_after_sends; ++i) ASSERT_EQ(send_to(a.socket, 1), 1);
  EXPECT_FALSE(sender.connected());
  ASSERT_EQ(send_to(a.socket, 1), 1);
  EXPECT_TRUE(sender.connected());
  ASSERT_EQ(send_to(a.socket, 2), 1);  // unaddressed now
  ASSERT_EQ(send_to(b.socket, 3), 1);  // addressed, to another peer
  EXPECT_EQ(drain(a), int(UdpSocket::connect_after_sends) + 1);
  ASSERT_EQ(b.receive(false), 1);
  EXPECT_EQ(b.batch[0].data[0], 3);
  EXPECT_EQ(b.batch[0].peer.sin_port, sender.local().sin_port);
  // The connected peer goes away: its port answers with ICMP, which the
  // kernel hands to the next send, whatever its destination.
  const sockaddr_in gone = a.socket.local();
  a.socket.close();
  Datagram d{payload, sizeof payload, sizeof payload, gone, 0};
  int error = 0;
  sender.send_batch(&d, 1, error);
  ::usleep(1000);
  ASSERT_EQ(send_to(b.socket, 4), 1);
  ASSERT_EQ(b.receive(false), 1);
  EXPECT_EQ(b.batch[0].data[0], 4);
}
