// The control plane against what an attacker or a dying peer sends: the
// connection manager's listener and client, and the collectives'
// rendezvous, over real TCP on loopback. Each malformed, wrong-typed,
// out-of-range, oversized or idle connection must fail on its own, with a
// reason, and never take the process or the real peer's connection with it.
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <algorithm>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "stellar/cm.hpp"
#include "stellar/coll.hpp"
#include "stellar/stellar.hpp"

using namespace stellar;
using namespace std::chrono_literals;

namespace {

int tcp_connect(uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Sends `bytes` and returns what comes back until the peer closes or `wait` passes.
std::string exchange(uint16_t port, const std::string& bytes, std::chrono::milliseconds wait = 3000ms) {
  const int fd = tcp_connect(port);
  if (fd < 0) return "(no connection)";
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // the server may close on an oversized line before we finish
    sent += size_t(n);
  }
  std::string reply;
  const auto deadline = std::chrono::steady_clock::now() + wait;
  char buffer[4096];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    if (left <= 0) break;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, int(left)) <= 0) break;
    const ssize_t n = recv(fd, buffer, sizeof buffer, 0);
    if (n <= 0) break;
    reply.append(buffer, size_t(n));
  }
  close(fd);
  return reply;
}

// A TCP socket bound to a free loopback port.
int bound_socket(uint16_t& port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  port = ntohs(a.sin_port);
  return fd;
}

uint16_t free_port() {
  uint16_t port = 0;
  close(bound_socket(port));
  return port;
}

struct Side {
  std::shared_ptr<Context> context;
  std::shared_ptr<ProtectionDomain> pd;
  std::shared_ptr<CompletionQueue> cq;
  std::shared_ptr<QueuePair> qp;
};

Side make_side() {
  Side s;
  ContextOptions o;
  o.wait = WaitPolicy::adaptive;
  s.context = Context::open(o).value();
  s.pd = s.context->allocate_pd().value();
  s.cq = s.context->create_cq(64).value();
  QpInitAttributes a;
  a.send_cq = a.recv_cq = s.cq;
  s.qp = s.pd->create_qp(a).value();
  return s;
}

const char* valid_connect =
    R"({"type":"connect","address":"127.0.0.1","udp_port":5000,"qp_num":5,"psn":1,"mtu":4096,"pkey":65535,"mode":"stellar","token":"0123456789abcdef","private_data":""})";

// A connect line with one field replaced by `value` (JSON text).
std::string connect_with(const std::string& field, const std::string& value) {
  std::string s = valid_connect;
  const size_t at = s.find("\"" + field + "\":");
  const size_t start = at + field.size() + 3;
  size_t end = start;
  if (s[end] == '"') end = s.find('"', end + 1) + 1;
  else
    while (s[end] != ',' && s[end] != '}') ++end;
  return s.replace(start, end - start, value) + "\n";
}

// Accepts one real client on `listener` and connects `server.qp` to it.
std::future<Status> serve_one(cm::Listener& listener, Side& server, std::chrono::milliseconds wait = 20000ms) {
  return std::async(std::launch::async, [&listener, &server, wait]() -> Status {
    auto request = listener.get_request(wait);
    if (!request) return request.status();
    return (*request)->accept(*server.qp);
  });
}

// ---------------------------------------------------------------- listener

TEST(ControlPlane, WrongTypedAndOutOfRangeFieldsAreRefusedWithAReason) {
  auto listener = cm::Listener::listen("127.0.0.1", 0).value();
  Side server = make_side();
  auto served = serve_one(*listener, server);
  const std::pair<std::string, std::string> cases[] = {
      {"private_data", "5"},        {"private_data", "null"},      {"private_data", "\"zz\""},  {"udp_port", "70000"},
      {"udp_port", "\"4791\""},     {"pkey", "131071"},            {"qp_num", "1099511627783"}, {"mtu", "0"},
      {"mtu", "-5"},                {"mtu", "1e300"},              {"psn", "null"},             {"mode", "\"tcp\""},
      {"address", "\"0.0.0.0\""},   {"address", "\"255.255.255.255\""}, {"address", "\"224.0.0.1\""}, {"address", "5"},
      {"token", "\"0123\""},        {"type", "5"},
  };
  for (const auto& [field, value] : cases) {
    const std::string reply = exchange(listener->port(), connect_with(field, value));
    EXPECT_NE(reply.find("\"type\":\"reject\""), std::string::npos) << field << "=" << value << ": " << reply;
    EXPECT_NE(reply.find("reason"), std::string::npos) << field << "=" << value;
  }
  static const char with_nul[] = "{\"type\":\"connect\"\0}\n";
  const std::string nul_inside(with_nul, sizeof with_nul - 1);
  const std::vector<std::string> junk_lines = {"[1,2,3]\n", "\"connect\"\n", "{}\n", "not json at all\n", nul_inside};
  for (const std::string& junk : junk_lines)
    EXPECT_NE(exchange(listener->port(), junk).find("reject"), std::string::npos) << junk;
  // The listener survived all of it and still serves a real client.
  Side client = make_side();
  cm::ConnectOptions options;
  options.timeout = 10s;
  auto connected = cm::connect("127.0.0.1", listener->port(), *client.qp, options);
  ASSERT_TRUE(connected) << connected.status().to_string();
  EXPECT_TRUE(served.get().ok());
  EXPECT_EQ(client.qp->state(), QpState::rts);
}

TEST(ControlPlane, AnOversizedLineIsRefusedWithoutBufferingIt) {
  auto listener = cm::Listener::listen("127.0.0.1", 0).value();
  Side server = make_side();
  auto served = serve_one(*listener, server);
  const std::string reply = exchange(listener->port(), std::string(4 << 20, 'x'));  // 4 MiB, no newline
  EXPECT_NE(reply.find("longer than"), std::string::npos) << reply;
  Side client = make_side();
  ASSERT_TRUE(cm::connect("127.0.0.1", listener->port(), *client.qp));
  EXPECT_TRUE(served.get().ok());
}

TEST(ControlPlane, IdleSocketsDoNotKeepTheRealClientOut) {
  auto listener = cm::Listener::listen("127.0.0.1", 0).value();
  Side server = make_side();
  auto served = serve_one(*listener, server);
  std::vector<int> idle;
  for (int i = 0; i < 64; ++i) idle.push_back(tcp_connect(listener->port()));
  // Idle connections get 5 s each to speak; the real client must not wait
  // for them: it connects within a timeout shorter than one of theirs.
  Side client = make_side();
  cm::ConnectOptions options;
  options.timeout = 3s;
  auto connected = cm::connect("127.0.0.1", listener->port(), *client.qp, options);
  EXPECT_TRUE(connected) << connected.status().to_string();
  EXPECT_TRUE(served.get().ok());
  for (int fd : idle) close(fd);
}

TEST(ControlPlane, DeeplyNestedJsonIsRefusedBeforeItIsParsed) {
  // Parsing is iterative, but copying and dumping a JSON value recurse: a
  // line of 30,000 '[' would overflow the stack after a successful parse.
  auto listener = cm::Listener::listen("127.0.0.1", 0).value();
  Side server = make_side();
  auto served = serve_one(*listener, server);
  const std::string deep = R"({"type":"connect","private_data":)" + std::string(30000, '[') + std::string(30000, ']') + "}\n";
  EXPECT_NE(exchange(listener->port(), deep).find("nested deeper"), std::string::npos);
  Side client = make_side();
  ASSERT_TRUE(cm::connect("127.0.0.1", listener->port(), *client.qp));
  EXPECT_TRUE(served.get().ok());
}

TEST(ControlPlane, MoreIdleSocketsThanPendingSlotsStillLetTheClientIn) {
  // 300 silent connections: past the 256 pending slots the oldest silent one
  // is dropped for each newcomer, so the real client's request is read.
  auto listener = cm::Listener::listen("127.0.0.1", 0).value();
  Side server = make_side();
  auto served = serve_one(*listener, server);
  std::vector<int> idle;
  for (int i = 0; i < 300; ++i) idle.push_back(tcp_connect(listener->port()));
  Side client = make_side();
  cm::ConnectOptions options;
  options.timeout = 3s;
  auto connected = cm::connect("127.0.0.1", listener->port(), *client.qp, options);
  EXPECT_TRUE(connected) << connected.status().to_string();
  EXPECT_TRUE(served.get().ok());
  for (int fd : idle) close(fd);
}

TEST(ControlPlane, ABrokenAttemptLeavesTheListenerWaitingForTheNext) {
  auto listener = cm::Listener::listen("127.0.0.1", 0).value();
  // Connect and close at once, then a half line and close.
  close(tcp_connect(listener->port()));
  EXPECT_EQ(exchange(listener->port(), "{\"type\":\"conn", 200ms), "");
  auto nothing = listener->get_request(300ms);
  ASSERT_FALSE(nothing);
  EXPECT_EQ(nothing.status().code(), Errc::timeout);
  Side server = make_side(), client = make_side();
  auto served = serve_one(*listener, server);
  ASSERT_TRUE(cm::connect("127.0.0.1", listener->port(), *client.qp));
  EXPECT_TRUE(served.get().ok());
}

// A zero timeout polls (the NCCL plugin's accept must not block): it never
// waits, and calling it again and again takes a connector in.
TEST(ControlPlane, AZeroTimeoutPollsAndStillMakesProgress) {
  auto listener = cm::Listener::listen("127.0.0.1", 0).value();
  const auto t0 = std::chrono::steady_clock::now();
  auto nothing = listener->get_request(0ms);
  ASSERT_FALSE(nothing);
  EXPECT_EQ(nothing.status().code(), Errc::timeout);
  Side server = make_side(), client = make_side();
  auto connected = std::async(std::launch::async, [&] { return cm::connect("127.0.0.1", listener->port(), *client.qp).status(); });
  std::unique_ptr<cm::ConnectionRequest> request;
  long polls = 0;
  while (!request && std::chrono::steady_clock::now() - t0 < 20s) {
    auto r = listener->get_request(0ms);
    ++polls;
    if (r) request = std::move(*r);
    else ASSERT_EQ(r.status().code(), Errc::timeout) << r.status().to_string();
  }
  ASSERT_TRUE(request) << "no request after " << polls << " polls";
  ASSERT_TRUE(request->accept(*server.qp).ok());
  EXPECT_TRUE(connected.get().ok());
}

// ---------------------------------------------------------------- client

// A fake listener: answers the first connection with `reply`.
std::thread fake_listener(int& listen_fd, uint16_t& port, std::string reply) {
  listen_fd = bound_socket(port);
  listen(listen_fd, 4);
  return std::thread([fd = listen_fd, reply] {
    const int c = accept(fd, nullptr, nullptr);
    if (c < 0) return;
    char buffer[65536];
    (void)recv(c, buffer, sizeof buffer, 0);
    (void)send(c, reply.data(), reply.size(), MSG_NOSIGNAL);
    std::this_thread::sleep_for(200ms);
    close(c);
  });
}

TEST(ControlPlane, TheClientSurvivesAHostileListener) {
  const std::pair<std::string, Errc> replies[] = {
      {"{\"type\":\"reject\",\"reason\":5}\n", Errc::connection_refused},
      {"{\"type\":\"reject\",\"reason\":[\"x\"]}\n", Errc::connection_refused},
      {"{\"type\":\"accept\",\"address\":\"127.0.0.1\"}\n", Errc::protocol_error},
      {connect_with("udp_port", "0").replace(9, 7, "accept"), Errc::protocol_error},
      {"{\"type\":null}\n", Errc::protocol_error},
      {"[]\n", Errc::protocol_error},
      {std::string(200000, 'y'), Errc::protocol_error},
  };
  for (const auto& [reply, code] : replies) {
    int fd = -1;
    uint16_t port = 0;
    std::thread peer = fake_listener(fd, port, reply);
    Side client = make_side();
    cm::ConnectOptions options;
    options.timeout = 3s;
    auto connected = cm::connect("127.0.0.1", port, *client.qp, options);
    peer.join();
    close(fd);
    ASSERT_FALSE(connected) << reply.substr(0, 80);
    EXPECT_EQ(connected.status().code(), code) << reply.substr(0, 80) << " -> " << connected.status().to_string();
    EXPECT_NE(client.qp->state(), QpState::rts) << reply.substr(0, 80);
  }
}

// ---------------------------------------------------------------- rendezvous

// Runs a `world`-rank job of forked ranks that create a communicator and do
// one allreduce; `attack(port)` runs in the parent meanwhile. Returns each
// rank's exit code (0 ok, 1 wrong result, 100 + Errc when create failed, 50
// when it failed with a message that contains every one of `expect_in_error`).
std::vector<int> job_under_attack(int world, std::chrono::seconds timeout, const std::function<void(uint16_t)>& attack,
                                  std::vector<int> absent = {}, std::vector<std::string> expect_in_error = {}) {
  const uint16_t port = free_port();
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    if (std::find(absent.begin(), absent.end(), r) != absent.end()) continue;
    const pid_t pid = fork();
    if (pid == 0) {
      if (r > 0) std::this_thread::sleep_for(1500ms);  // let the attacker reach rank 0 first
      coll::CommunicatorOptions o;
      o.rank = r;
      o.world_size = world;
      o.master_port = port;
      o.timeout = timeout;
      o.context.wait = WaitPolicy::adaptive;
      auto comm = coll::Communicator::create(o);
      if (!comm) {
        const std::string message = comm.status().to_string();
        std::fprintf(stderr, "rank %d: %s\n", r, message.c_str());
        bool all = !expect_in_error.empty();
        for (const std::string& part : expect_in_error) all = all && message.find(part) != std::string::npos;
        _exit(all ? 50 : 100 + int(comm.status().code()));
      }
      std::vector<float> v(1000, float(r + 1));
      Status s = (*comm)->allreduce(v.data(), v.data(), v.size(), coll::DataType::float32, coll::ReduceOp::sum);
      const float expected = float(world * (world + 1) / 2);
      const int rc = s.ok() && v[0] == expected && v[999] == expected ? 0 : 1;
      comm->reset();
      _exit(rc);
    }
    pids.push_back(pid);
  }
  std::this_thread::sleep_for(300ms);  // rank 0 is listening
  attack(port);
  std::vector<int> codes;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    codes.push_back(WIFEXITED(status) ? WEXITSTATUS(status) : -WTERMSIG(status));
  }
  return codes;
}

TEST(Rendezvous, MalformedHellosAndIdleSocketsDoNotStopTheJob) {
  std::vector<int> idle;
  std::vector<std::string> replies;
  const auto codes = job_under_attack(3, 20s, [&](uint16_t port) {
    for (int i = 0; i < 16; ++i) idle.push_back(tcp_connect(port));
    replies.push_back(exchange(port, R"({"type":"hello","version":4,"rank":1,"host":"h","world_size":3,"endpoints":{}})" "\n"));
    replies.push_back(exchange(port, R"({"type":"hello","rank":"one"})" "\n"));
    replies.push_back(exchange(port, R"({"type":"hello","rank":7})" "\n"));
    const std::string oversized(size_t(2) << 20, '{');
    replies.push_back(exchange(port, oversized));
  });
  for (int fd : idle) close(fd);
  EXPECT_EQ(codes, (std::vector<int>{0, 0, 0}));
  for (const std::string& r : replies) EXPECT_NE(r.find("\"type\":\"error\""), std::string::npos) << r;
}

TEST(Rendezvous, AMissingRankFailsAtTheTimeoutNamingItAndWhatWasRefused) {
  const auto start = std::chrono::steady_clock::now();
  // Rank 2 never starts; a stranger sends a malformed hello meanwhile.
  const auto codes = job_under_attack(3, 4s, [&](uint16_t port) { exchange(port, "{\"type\":\"hello\"}\n"); }, {2},
                                      {"timeout", "never arrived: rank(s) 2", "refused 1 connection", "rank' is missing"});
  const auto took = std::chrono::steady_clock::now() - start;
  ASSERT_EQ(codes.size(), 2u);
  EXPECT_EQ(codes[0], 50) << "rank 0 must fail with a timeout naming rank 2 and the refused hello (see its stderr)";
  EXPECT_NE(codes[1], 0);
  EXPECT_LT(took, 30s);  // bounded: the job's timeout, not forever
}

}  // namespace
