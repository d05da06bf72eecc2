// stellar-engined, the daemon placement of the engines, as users and
// attackers meet it: a refused user, a missing daemon, a client killed with
// live QPs, a daemon killed under its clients and restarted, and a client
// that writes garbage into its rings and onto the control socket.
//
// Each test starts its own daemon (the binary built beside this test) on a
// private socket and stops it. The rest of the soft provider's integration
// suite runs in the daemon placement too (ctest: integration_in_daemon).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <iterator>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "engined_process.hpp"
#include "host/daemon_protocol.hpp"
#include "stellar/stellar.hpp"

using namespace stellar;
using namespace std::chrono_literals;
namespace proto = stellar::host::daemon;
using stellar::test::Engined;

namespace {

// Two QPs connected through the connection manager over loopback.
struct Pair {
  std::shared_ptr<Context> a, b;
  std::shared_ptr<ProtectionDomain> pd_a, pd_b;
  std::shared_ptr<CompletionQueue> cq_a, cq_b;
  std::shared_ptr<QueuePair> qp_a, qp_b;
  Status status;

  Pair(const ContextOptions& oa, const ContextOptions& ob, QpTiming timing = {}) {
    auto ca = Context::open(oa);
    auto cb = Context::open(ob);
    if (!ca || !cb) {
      status = !ca ? ca.status() : cb.status();
      return;
    }
    a = *ca, b = *cb;
    pd_a = a->allocate_pd().value();
    pd_b = b->allocate_pd().value();
    cq_a = a->create_cq(256).value();
    cq_b = b->create_cq(256).value();
    QpInitAttributes qa;
    qa.send_cq = qa.recv_cq = cq_a;
    qp_a = pd_a->create_qp(qa).value();
    qa.send_cq = qa.recv_cq = cq_b;
    qp_b = pd_b->create_qp(qa).value();
    auto listener = cm::Listener::listen("127.0.0.1", 0).value();
    Status accepted;
    std::thread acceptor([&] {
      auto request = listener->get_request(10s);
      accepted = request ? (*request)->accept(*qp_b, {}, timing) : request.status();
    });
    cm::ConnectOptions co;
    co.timing = timing;
    co.timeout = 5s;
    auto connected = cm::connect("127.0.0.1", listener->port(), *qp_a, co);
    acceptor.join();
    status = connected ? accepted : connected.status();
  }
};

std::vector<WorkCompletion> collect(CompletionQueue& cq, size_t count, std::chrono::milliseconds limit) {
  std::vector<WorkCompletion> all;
  WorkCompletion wc[16];
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (all.size() < count && std::chrono::steady_clock::now() < deadline) {
    const int n = cq.poll(wc);
    all.insert(all.end(), wc, wc + n);
  }
  return all;
}

// A WRITE of `bytes` from a to b, checked byte for byte.
void write_and_check(Pair& p, size_t bytes) {
  std::vector<uint8_t> source(bytes), target(bytes, 0);
  for (size_t i = 0; i < bytes; ++i) source[i] = uint8_t(i * 7 + 3);
  auto smr = p.pd_a->register_memory(source.data(), bytes, access_local_write).value();
  auto tmr = p.pd_b->register_memory(target.data(), bytes, access_local_write | access_remote_write).value();
  Sge s{reinterpret_cast<uint64_t>(source.data()), uint32_t(bytes), smr->lkey()};
  SendWr wr;
  wr.opcode = WrOpcode::rdma_write;
  wr.sg_list = {&s, 1};
  wr.remote_addr = tmr->addr();
  wr.rkey = tmr->rkey();
  ASSERT_TRUE(p.qp_a->post_send(wr).ok());
  auto done = collect(*p.cq_a, 1, 10s);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].status, WcStatus::success) << to_string(done[0].status);
  EXPECT_EQ(target, source);
}

// Speaks the daemon's protocol directly, as a hostile client would.
class RawClient {
 public:
  explicit RawClient(const std::string& path) {
    fd_ = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::strncpy(a.sun_path, path.c_str(), sizeof a.sun_path - 1);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  }
  ~RawClient() {
    ::close(fd_);
    for (int fd : {doorbell_, daemon_bell_})
      if (fd >= 0) ::close(fd);
    if (area_) ::munmap(area_, bytes_);
  }
  bool connected() const { return connected_; }
  int fd() const { return fd_; }

  // A well-formed open: its own rings and bell socket pair.
  proto::Reply open() {
    bytes_ = proto::area_bytes(capacity, capacity);
    const int memfd = ::memfd_create("raw", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    EXPECT_EQ(::ftruncate(memfd, off_t(bytes_)), 0);
    ::fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW);
    area_ = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    shared_ = new (area_) proto::SharedArea{};
    shared_->submit_capacity = shared_->completion_capacity = capacity;
    int bells[2];
    EXPECT_EQ(::socketpair(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, bells), 0);
    doorbell_ = bells[0];
    const int theirs = bells[1];
    proto::OpenRequest r;
    r.h = {uint32_t(proto::MessageType::open), sizeof r};
    std::strcpy(r.bind_address, "127.0.0.1");
    r.mtu = 4096;
    r.submit_capacity = r.completion_capacity = capacity;
    r.area_bytes = bytes_;
    const int fds[2] = {memfd, theirs};
    proto::Reply reply = call(&r, sizeof r, fds, 2);
    ::close(memfd);
    daemon_bell_ = theirs;  // kept: a hostile client can still reach the daemon's end
    return reply;
  }
  // The daemon's end of the bell pair, as this client still holds it.
  int daemon_bell() const { return daemon_bell_; }
  // Asks the daemon to ring our bell after every batch of completions.
  void want_events() { shared_->client_events.value.store(1); }
  // Attaches a QP (local QPN `qpn`, 16 WRs each way) to a peer that never answers.
  proto::Reply attach(uint32_t qpn) {
    proto::AttachRequest a;
    a.h = {uint32_t(proto::MessageType::attach), sizeof a};
    a.mtu = 4096, a.max_send_wr = a.max_recv_wr = 16, a.local_qpn = qpn, a.remote_qpn = 6, a.local_token = 1;
    a.rto_min_ns = a.rto_max_ns = 1'000'000, a.line_rate_bps = 1'000'000'000;
    a.peer_address = htonl(0x7f000001), a.peer_port = htons(9);
    return call(&a, sizeof a);
  }
  // push(), after waiting (up to `limit`) for room in the ring; false if
  // the daemon stopped consuming.
  bool push_when_room(const proto::SubmitEntry& e, std::chrono::milliseconds limit = 2000ms) {
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (tail_ - consumed() >= capacity) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(100us);
    }
    push(e);
    return true;
  }
  proto::Reply call(const void* data, size_t length, const int* fds = nullptr, int count = 0) {
    proto::Reply reply{};
    if (!proto::send_message(fd_, data, length, fds, count)) return reply;
    std::vector<int> got;
    const long n = proto::receive_message(fd_, &reply, sizeof reply, got, 0, 5000);
    if (n != long(sizeof reply)) reply.ok = -1;  // no (or a malformed) answer
    return reply;
  }
  proto::Reply counters() {
    proto::MessageHeader h{uint32_t(proto::MessageType::counters), sizeof h};
    return call(&h, sizeof h);
  }
  // Writes an entry into the submission ring and rings the doorbell.
  void push(const proto::SubmitEntry& e) {
    proto::SubmitEntry* ring = proto::submit_ring(area_);
    ring[tail_ % capacity] = e;
    ++tail_;
    shared_->submit_tail.value.store(tail_, std::memory_order_release);
    [[maybe_unused]] ssize_t r = ::send(doorbell_, "d", 1, MSG_DONTWAIT);
  }
  void set_tail(uint64_t v) {
    shared_->submit_tail.value.store(v, std::memory_order_release);
    [[maybe_unused]] ssize_t r = ::send(doorbell_, "d", 1, MSG_DONTWAIT);
  }
  uint64_t consumed() const { return shared_->submit_head.value.load(std::memory_order_acquire); }

  static constexpr uint32_t capacity = 64;

 private:
  int fd_ = -1, doorbell_ = -1, daemon_bell_ = -1;
  bool connected_ = false;
  void* area_ = nullptr;
  size_t bytes_ = 0;
  proto::SharedArea* shared_ = nullptr;
  uint64_t tail_ = 0;
};

}  // namespace

TEST(EngineDaemon, MovesDataBetweenTwoDaemonContexts) {
  Engined daemon;
  Pair p(daemon.options(), daemon.options());
  ASSERT_TRUE(p.status.ok()) << p.status.to_string();
  for (size_t bytes : {size_t(1), size_t(4096), size_t(300000)}) write_and_check(p, bytes);
  // The counters come from the daemon's engines.
  const ContextCounters c = p.a->counters();
  // 300000 bytes take at least this many packets at the context's (automatic) MTU.
  EXPECT_GE(c.tx_packets, 300000u / p.a->options().mtu);
  EXPECT_GT(p.a->options().mtu, 0u) << "the MTU chosen is reported";
  EXPECT_GT(c.engine_cpu_ns, 0u) << "the daemon reports its CPU time";
}

TEST(EngineDaemon, NoDaemonIsAClearError) {
  ContextOptions o;
  o.progress = ProgressMode::daemon;
  o.engined_socket = "/tmp/stellar-no-such-daemon.sock";
  auto ctx = Context::open(o);
  ASSERT_FALSE(ctx);
  EXPECT_NE(ctx.status().message().find("cannot reach stellar-engined"), std::string::npos) << ctx.status().to_string();
}

TEST(EngineDaemon, ARefusedUserGetsAClearErrorNotAHang) {
  Engined daemon({"--allow-uid", "4242"});  // not us (the tests run as root or a user, never 4242)
  const auto start = std::chrono::steady_clock::now();
  auto ctx = Context::open(daemon.options());
  ASSERT_FALSE(ctx);
  EXPECT_EQ(ctx.status().code(), Errc::permission_denied) << ctx.status().to_string();
  EXPECT_NE(ctx.status().message().find("not allowed"), std::string::npos) << ctx.status().to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
  EXPECT_TRUE(daemon.alive());
}

// A client killed with live QPs and registered memory: the daemon frees
// them (its session count goes back), and the peer's sends to it fail with
// an error completion, not a hang.
TEST(EngineDaemon, AKilledClientLeavesNothingBehind) {
  Engined daemon;
  auto parent = Context::open(ContextOptions{}).value();  // the peer: inline, in this process
  auto pd = parent->allocate_pd().value();
  auto cq = parent->create_cq(64).value();
  QpInitAttributes qa;
  qa.send_cq = qa.recv_cq = cq;
  auto qp = pd->create_qp(qa).value();
  auto listener = cm::Listener::listen("127.0.0.1", 0).value();
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = fork();
  if (child == 0) {
    // The victim: a daemon context with a QP, memory and receives, then it waits to be killed.
    auto ctx = Context::open(daemon.options());
    if (!ctx) _exit(10);
    auto cpd = (*ctx)->allocate_pd().value();
    auto ccq = (*ctx)->create_cq(64).value();
    QpInitAttributes ca;
    ca.send_cq = ca.recv_cq = ccq;
    auto cqp = cpd->create_qp(ca).value();
    std::vector<uint8_t> buffer(1 << 20);
    auto mr = cpd->register_memory(buffer.data(), buffer.size(), access_local_write | access_remote_write).value();
    QpModify init;
    init.state = QpState::init;
    if (!cqp->modify(init).ok()) _exit(11);
    Sge s{reinterpret_cast<uint64_t>(buffer.data()), 4096, mr->lkey()};
    for (uint64_t i = 0; i < 8; ++i)
      if (!cqp->post_recv(RecvWr{i, {&s, 1}}).ok()) _exit(12);
    if (!cm::connect("127.0.0.1", listener->port(), *cqp)) _exit(13);
    const char one = 1;
    if (::write(ready[1], &one, 1) != 1) _exit(14);
    for (;;) pause();
  }
  QpTiming timing;
  timing.rto_min = 1ms;
  timing.rto_max = 4ms;
  timing.retry_count = 3;
  auto request = listener->get_request(10s);
  ASSERT_TRUE(request) << request.status().to_string();
  ASSERT_TRUE((*request)->accept(*qp, {}, timing).ok());
  char byte;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1);
  {
    RawClient observer(daemon.socket());
    ASSERT_TRUE(observer.open().ok);
    EXPECT_EQ(observer.counters().sessions, 2u);  // the victim and the observer
    EXPECT_EQ(observer.counters().engines, 1u);
  }
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  // Within a bounded time the daemon has freed everything of the victim's.
  RawClient observer(daemon.socket());
  ASSERT_TRUE(observer.open().ok);
  const auto deadline = std::chrono::steady_clock::now() + 2s;
  // (Sessions: the victim's and the first observer's, whose close the
  // daemon may see a little after this observer's open.)
  auto settled = [&] {
    const proto::Reply c = observer.counters();
    return c.engines == 0 && c.sessions == 1;
  };
  while (!settled() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
  const proto::Reply after = observer.counters();
  EXPECT_EQ(after.engines, 0u);
  EXPECT_EQ(after.sessions, 1u);
  // The peer's send to the dead QP completes with an error.
  SendWr wr;
  wr.wr_id = 77;
  wr.opcode = WrOpcode::send;
  ASSERT_TRUE(qp->post_send(wr).ok());
  auto done = collect(*cq, 1, 5s);
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].wr_id, 77u);
  EXPECT_EQ(done[0].status, WcStatus::retry_exceeded) << to_string(done[0].status);
  EXPECT_TRUE(daemon.alive());
}

// The daemon dies under a client: its outstanding work completes as
// flushed, its later calls fail clearly, nothing hangs; a restarted daemon
// serves new contexts.
TEST(EngineDaemon, ADeadDaemonBecomesErrorsAndARestartedOneServes) {
  Engined daemon;
  Pair p(daemon.options(), ContextOptions{});
  ASSERT_TRUE(p.status.ok()) << p.status.to_string();
  std::vector<uint8_t> buffer(4096);
  auto mr = p.pd_a->register_memory(buffer.data(), buffer.size(), access_local_write).value();
  Sge s{reinterpret_cast<uint64_t>(buffer.data()), 4096, mr->lkey()};
  for (uint64_t i = 0; i < 3; ++i) ASSERT_TRUE(p.qp_a->post_recv(RecvWr{i, {&s, 1}}).ok());
  daemon.stop(SIGKILL);
  const auto start = std::chrono::steady_clock::now();
  auto flushed = collect(*p.cq_a, 3, 5s);
  ASSERT_EQ(flushed.size(), 3u);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  for (uint64_t i = 0; i < 3; ++i) {
    EXPECT_EQ(flushed[i].wr_id, i);
    EXPECT_EQ(flushed[i].status, WcStatus::work_request_flushed);
  }
  EXPECT_EQ(p.qp_a->state(), QpState::error);
  // Later work completes flushed at once; a new context is refused clearly.
  SendWr wr;
  wr.wr_id = 9;
  wr.opcode = WrOpcode::send;
  EXPECT_TRUE(p.qp_a->post_send(wr).ok());
  auto later = collect(*p.cq_a, 1, 2s);
  ASSERT_EQ(later.size(), 1u);
  EXPECT_EQ(later[0].status, WcStatus::work_request_flushed);
  auto refused = Context::open(daemon.options());
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.status().message().find("stellar-engined"), std::string::npos);
  // Restarted on the same socket, it serves new contexts.
  daemon.start();
  Pair again(daemon.options(), daemon.options());
  ASSERT_TRUE(again.status.ok()) << again.status.to_string();
  write_and_check(again, 100000);
}

// Garbage in the rings: forged handles (including another client's),
// unknown kinds and opcodes, oversized counts, keys that are not the
// client's. Each is refused and counted; the daemon and other clients go on.
TEST(EngineDaemon, MalformedRingEntriesAreRefusedAndCounted) {
  Engined daemon;
  Pair victim(daemon.options(), daemon.options());  // another client, with attached QPs (handles 1)
  ASSERT_TRUE(victim.status.ok()) << victim.status.to_string();
  RawClient raw(daemon.socket());
  ASSERT_TRUE(raw.open().ok);
  proto::SubmitEntry e;
  e.kind = uint32_t(proto::EntryKind::post_send);
  e.handle = 1;  // the victim's first QP's handle, in the victim's session: not ours
  raw.push(e);
  e.handle = 0xdeadbeef;
  raw.push(e);
  e.kind = 77;
  raw.push(e);
  const auto deadline = std::chrono::steady_clock::now() + 2s;
  while (raw.consumed() < 3 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(raw.consumed(), 3u);
  EXPECT_EQ(raw.counters().counters.refused_entries, 3u);
  // An index no producer could write ends that session, and only it.
  raw.set_tail(raw.consumed() + 1'000'000);
  pollfd pf{raw.fd(), POLLIN, 0};
  EXPECT_EQ(::poll(&pf, 1, 2000), 1) << "the daemon closes a session whose ring index is corrupt";
  EXPECT_TRUE(daemon.alive());
  write_and_check(victim, 65536);
}

// Garbage on the control socket: short and oversized messages, unknown
// types, requests before open, a second open, descriptors where none
// belong, configurations no QP could have, an idle connection. Each gets an
// error reply (or the connection closes); the daemon serves others meanwhile.
TEST(EngineDaemon, MalformedControlMessagesGetErrorsNotCrashes) {
  Engined daemon;
  RawClient idle(daemon.socket());  // connects and never says anything
  ASSERT_TRUE(idle.connected());
  RawClient raw(daemon.socket());
  proto::MessageHeader h{uint32_t(proto::MessageType::counters), sizeof h};
  EXPECT_EQ(raw.call(&h, sizeof h).ok, 0) << "requests before open are refused";
  uint8_t tiny[3] = {1, 2, 3};
  EXPECT_EQ(raw.call(tiny, sizeof tiny).ok, 0);
  h.type = 9999;
  EXPECT_EQ(raw.call(&h, sizeof h).ok, 0);
  ASSERT_EQ(raw.open().ok, 1);
  EXPECT_EQ(raw.open().ok, 0) << "a second open on one connection";
  proto::AttachRequest a;
  a.h = {uint32_t(proto::MessageType::attach), sizeof a};
  EXPECT_EQ(raw.call(&a, sizeof a).ok, 0) << "an all-zero configuration";
  a.mtu = 4096, a.max_send_wr = a.max_recv_wr = 16, a.local_qpn = 5, a.remote_qpn = 6, a.local_token = 1;
  a.rto_min_ns = a.rto_max_ns = 1'000'000, a.line_rate_bps = 1'000'000'000, a.peer_port = htons(1);
  a.peer_address = htonl(0xe0000001);  // multicast
  proto::Reply r = raw.call(&a, sizeof a);
  EXPECT_EQ(r.ok, 0);
  EXPECT_NE(std::string(r.message).find("unicast"), std::string::npos) << r.message;
  a.peer_address = htonl(0x7f000001);
  a.max_send_wr = 1u << 30;  // a daemon-side allocation bomb
  EXPECT_EQ(raw.call(&a, sizeof a).ok, 0);
  proto::RegisterRequest reg;
  reg.h = {uint32_t(proto::MessageType::register_memory), sizeof reg};
  reg.lkey = reg.rkey = 5;
  reg.address = 0x1000, reg.length = 4096;  // keys equal, and not our memory anyway
  EXPECT_EQ(raw.call(&reg, sizeof reg).ok, 0);
  reg.rkey = 6;
  r = raw.call(&reg, sizeof reg);  // nothing mapped at 0x1000 in this process
  EXPECT_EQ(r.ok, 0);
  EXPECT_NE(std::string(r.message).find("cannot read"), std::string::npos) << r.message;
  const int devnull = ::open("/dev/null", O_RDONLY);
  proto::KeyRequest dereg;
  dereg.h = {uint32_t(proto::MessageType::deregister_memory), sizeof dereg};
  dereg.lkey = 12345;
  EXPECT_EQ(raw.call(&dereg, sizeof dereg, &devnull, 1).ok, 0) << "descriptors on a request that takes none, an unknown key";
  ::close(devnull);
  std::vector<uint8_t> huge(proto::max_message_bytes * 4, 0xab);
  EXPECT_NE(raw.call(huge.data(), huge.size()).ok, 1);
  // Still serving, with the idle connection open.
  EXPECT_TRUE(daemon.alive());
  Pair p(daemon.options(), daemon.options());
  ASSERT_TRUE(p.status.ok()) << p.status.to_string();
  write_and_check(p, 10000);
}

// A client that turns the daemon's end of its bells blocking (O_NONBLOCK
// lives in the descriptor both hold), floods the doorbell, makes the daemon
// produce completions it never consumes, and sends requests whose replies
// it never reads. None of it may stall a daemon thread: another client's
// data moves meanwhile, and the hostile session is ended.
TEST(EngineDaemon, AClientThatStopsReadingCannotStallTheDaemon) {
  Engined daemon;
  Pair victim(daemon.options(), daemon.options());
  ASSERT_TRUE(victim.status.ok()) << victim.status.to_string();
  RawClient raw(daemon.socket());
  ASSERT_EQ(raw.open().ok, 1);
  const int flags = ::fcntl(raw.daemon_bell(), F_GETFL);
  ASSERT_EQ(::fcntl(raw.daemon_bell(), F_SETFL, flags & ~O_NONBLOCK), 0);
  raw.want_events();
  const proto::Reply attached = raw.attach(7);
  ASSERT_EQ(attached.ok, 1) << attached.message;
  // Receives with a key that is not ours: each one completes in error
  // (local protection), and we never take a completion out of the ring.
  proto::SubmitEntry e;
  e.kind = uint32_t(proto::EntryKind::post_receive);
  e.handle = attached.handle;
  e.count = 1;
  e.segments[0] = proto::WireSegment{0x1000, 64, 999};
  size_t pushed = 0;
  while (pushed < 4000 && raw.push_when_room(e, 1000ms)) ++pushed;
  // Doorbells by the thousand, on a bell we made blocking (we never read ours).
  for (int i = 0; i < 5000; ++i) [[maybe_unused]] ssize_t r = ::send(raw.daemon_bell(), "d", 1, MSG_DONTWAIT);
  // Requests whose replies we never read.
  proto::MessageHeader h{uint32_t(proto::MessageType::counters), sizeof h};
  for (int i = 0; i < 100000; ++i)
    if (!proto::send_message(raw.fd(), &h, sizeof h, nullptr, 0, MSG_DONTWAIT)) break;
  write_and_check(victim, 100000);
  EXPECT_TRUE(daemon.alive());
  // The hostile session ends (unconsumed completions past any honest
  // client's, or replies it does not read): the daemon hangs up on it.
  pollfd pf{raw.fd(), POLLRDHUP, 0};
  const auto deadline = std::chrono::steady_clock::now() + 3s;
  while (!(pf.revents & (POLLHUP | POLLRDHUP)) && std::chrono::steady_clock::now() < deadline) ::poll(&pf, 1, 100);
  EXPECT_TRUE(pf.revents & (POLLHUP | POLLRDHUP)) << "the daemon still serves a client that does not read";
  RawClient observer(daemon.socket());
  ASSERT_EQ(observer.open().ok, 1);
  const auto gone = std::chrono::steady_clock::now() + 3s;
  while (observer.counters().sessions != 3 && std::chrono::steady_clock::now() < gone) std::this_thread::sleep_for(10ms);
  EXPECT_EQ(observer.counters().sessions, 3u) << "the victim's two contexts and the observer";
  EXPECT_GT(observer.counters().engines, 0u);
}

// The daemon's quotas: clients at once, QPs and regions per client. Each
// refusal is an error that names the limit; what was within it works.
TEST(EngineDaemon, QuotasRefuseWithAMessage) {
  Engined daemon({"--max-clients", "2", "--max-qps", "1", "--max-regions", "1"});
  RawClient one(daemon.socket()), two(daemon.socket());
  ASSERT_EQ(one.open().ok, 1);
  ASSERT_EQ(two.open().ok, 1);
  auto third = Context::open(daemon.options());
  ASSERT_FALSE(third);
  EXPECT_NE(third.status().message().find("--max-clients"), std::string::npos) << third.status().to_string();
  ASSERT_EQ(one.attach(7).ok, 1);
  proto::Reply r = one.attach(8);
  EXPECT_EQ(r.ok, 0);
  EXPECT_NE(std::string(r.message).find("--max-qps"), std::string::npos) << r.message;
  static uint8_t region[2][4096];
  proto::RegisterRequest reg;
  reg.h = {uint32_t(proto::MessageType::register_memory), sizeof reg};
  reg.lkey = 5, reg.rkey = 6, reg.access = 1;
  reg.address = reinterpret_cast<uint64_t>(region[0]), reg.length = sizeof region[0];
  r = one.call(&reg, sizeof reg);
  ASSERT_EQ(r.ok, 1) << r.message;
  reg.lkey = 7, reg.rkey = 8, reg.address = reinterpret_cast<uint64_t>(region[1]);
  r = one.call(&reg, sizeof reg);
  EXPECT_EQ(r.ok, 0);
  EXPECT_NE(std::string(r.message).find("--max-regions"), std::string::npos) << r.message;
  EXPECT_TRUE(daemon.alive());
}

// Entering ERROR right after an unsignaled WR (which completes nothing)
// frees every slot at once: the whole send queue can be posted again (and
// is flushed), none is still counted as outstanding.
TEST(EngineDaemon, EnterErrorAfterAnUnsignaledWriteFreesTheQueue) {
  Engined daemon;
  Pair p(daemon.options(), daemon.options());
  ASSERT_TRUE(p.status.ok()) << p.status.to_string();
  write_and_check(p, 4096);
  std::vector<uint8_t> source(64, 1), target(64, 0);
  auto smr = p.pd_a->register_memory(source.data(), source.size(), access_local_write).value();
  auto tmr = p.pd_b->register_memory(target.data(), target.size(), access_local_write | access_remote_write).value();
  Sge s{reinterpret_cast<uint64_t>(source.data()), 64, smr->lkey()};
  SendWr wr;
  wr.opcode = WrOpcode::rdma_write;
  wr.sg_list = {&s, 1};
  wr.remote_addr = tmr->addr();
  wr.rkey = tmr->rkey();
  wr.flags = 0;  // unsignaled
  ASSERT_TRUE(p.qp_a->post_send(wr).ok());
  const auto landed = std::chrono::steady_clock::now() + 5s;
  while (target[63] != 1 && std::chrono::steady_clock::now() < landed) std::this_thread::sleep_for(1ms);
  ASSERT_EQ(target[63], 1) << "the unsignaled WRITE landed";
  QpModify m;
  m.state = QpState::error;
  ASSERT_TRUE(p.qp_a->modify(m).ok());
  wr.flags = send_signaled;
  const uint32_t depth = QpCapabilities{}.max_send_wr;
  for (uint32_t i = 0; i < depth; ++i) {
    wr.wr_id = 1000 + i;
    Status posted = p.qp_a->post_send(wr);
    ASSERT_TRUE(posted.ok()) << "post " << i << " of " << depth << ": " << posted.to_string();
  }
  auto flushed = collect(*p.cq_a, depth, 10s);
  ASSERT_EQ(flushed.size(), depth);
  for (auto& c : flushed) EXPECT_EQ(c.status, WcStatus::work_request_flushed);
}
