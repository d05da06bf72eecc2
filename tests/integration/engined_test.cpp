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

#include "host/daemon_protocol.hpp"
#include "stellar/stellar.hpp"

using namespace stellar;
using namespace std::chrono_literals;
namespace proto = stellar::host::daemon;

namespace {

// A daemon of our own, in the foreground, on a private socket.
class Engined {
 public:
  explicit Engined(std::vector<std::string> extra = {}) {
    char dir[] = "/tmp/stellar-engined-test-XXXXXX";
    dir_ = mkdtemp(dir);
    socket_ = dir_ + "/engined.sock";
    start(std::move(extra));
  }
  ~Engined() {
    stop(SIGTERM);
    ::unlink(log_.c_str());
    ::rmdir(dir_.c_str());
  }
  void start(std::vector<std::string> extra = {}) {
    log_ = dir_ + "/log";
    pid_ = fork();
    if (pid_ == 0) {
      const int fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      dup2(fd, 2);
      std::vector<std::string> args{STELLAR_ENGINED_PATH, "--socket", socket_, "--foreground", "--wait", "adaptive"};
      args.insert(args.end(), extra.begin(), extra.end());
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    // Up once the socket answers.
    for (int i = 0; i < 200; ++i) {
      const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
      sockaddr_un a{};
      a.sun_family = AF_UNIX;
      std::strncpy(a.sun_path, socket_.c_str(), sizeof a.sun_path - 1);
      const bool up = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
      ::close(fd);
      if (up) return;
      std::this_thread::sleep_for(10ms);
    }
    ADD_FAILURE() << "stellar-engined did not come up";
  }
  void stop(int signal) {
    if (pid_ <= 0) return;
    ::kill(pid_, signal);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    // SIGTERM is a clean stop: exit status 0 (the sanitizer build's leak check runs then).
    if (signal == SIGTERM) {
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "stellar-engined status " << status << "; its log:\n" << log();
    }
  }
  bool alive() const { return pid_ > 0 && ::kill(pid_, 0) == 0 && ::waitpid(pid_, nullptr, WNOHANG) == 0; }
  const std::string& socket() const { return socket_; }
  std::string log() const {
    std::ifstream in(log_);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  ContextOptions options(Mode mode = Mode::stellar) const {
    ContextOptions o;
    o.mode = mode;
    o.progress = ProgressMode::daemon;
    o.engined_socket = socket_;
    return o;
  }

 private:
  std::string dir_, socket_, log_;
  pid_t pid_ = -1;
};

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
    if (area_) ::munmap(area_, bytes_);
  }
  bool connected() const { return connected_; }
  int fd() const { return fd_; }

  // A well-formed open: its own rings and eventfds.
  proto::Reply open() {
    bytes_ = proto::area_bytes(capacity, capacity);
    const int memfd = ::memfd_create("raw", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    EXPECT_EQ(::ftruncate(memfd, off_t(bytes_)), 0);
    ::fcntl(memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW);
    area_ = ::mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, memfd, 0);
    shared_ = new (area_) proto::SharedArea{};
    shared_->submit_capacity = shared_->completion_capacity = capacity;
    doorbell_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    const int wake = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    proto::OpenRequest r;
    r.h = {uint32_t(proto::MessageType::open), sizeof r};
    std::strcpy(r.bind_address, "127.0.0.1");
    r.mtu = 4096;
    r.submit_capacity = r.completion_capacity = capacity;
    r.area_bytes = bytes_;
    const int fds[3] = {memfd, doorbell_, wake};
    proto::Reply reply = call(&r, sizeof r, fds, 3);
    ::close(memfd);
    ::close(wake);
    return reply;
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
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t r = ::write(doorbell_, &one, sizeof one);
  }
  void set_tail(uint64_t v) {
    shared_->submit_tail.value.store(v, std::memory_order_release);
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t r = ::write(doorbell_, &one, sizeof one);
  }
  uint64_t consumed() const { return shared_->submit_head.value.load(std::memory_order_acquire); }

  static constexpr uint32_t capacity = 64;

 private:
  int fd_ = -1, doorbell_ = -1;
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
  EXPECT_GT(c.tx_packets, 70u);
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
  while (observer.counters().engines != 0 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(5ms);
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
