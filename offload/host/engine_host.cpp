#include "host/engine_host.hpp"

#include <arpa/inet.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iterator>

namespace stellar::host {

namespace off = stellar::offload;

uint64_t monotonic_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return uint64_t(t.tv_sec) * 1'000'000'000ull + uint64_t(t.tv_nsec);
}

// Time since `since`, never negative. The daemon stamps posts on its client
// threads with a fresh clock while a shard serves with the `now` it read when
// its round began, so a stamp may lie slightly ahead of `now`: an unsigned
// `now - since` would wrap and expire every timer at once.
uint64_t elapsed(uint64_t now, uint64_t since) { return now > since ? now - since : 0; }

uint64_t arrival_from_stamp(uint64_t stamp, int64_t offset, uint64_t now) {
  if (stamp == 0) return 0;
  const uint64_t at = uint64_t(int64_t(stamp) - offset);
  constexpr uint64_t second = 1'000'000'000;
  const uint64_t distance = at > now ? at - now : now - at;
  return distance < second && at != 0 ? at : 0;
}

void accumulate(off::EngineCounters& sum, const off::EngineCounters& e) {
  // Every field: the host's sum is what ContextCounters and a future
  // daemon's statistics are built from.
  static_assert(sizeof(off::EngineCounters) == 27 * sizeof(uint64_t), "a counter was added: sum it here");
  sum.tx_packets += e.tx_packets, sum.tx_bytes += e.tx_bytes, sum.rx_packets += e.rx_packets, sum.rx_bytes += e.rx_bytes;
  sum.retransmitted_packets += e.retransmitted_packets, sum.timeouts += e.timeouts, sum.fast_retransmits += e.fast_retransmits;
  sum.tail_probes += e.tail_probes, sum.spurious_timeouts += e.spurious_timeouts, sum.spurious_retransmits += e.spurious_retransmits;
  sum.acks_sent += e.acks_sent, sum.naks_sent += e.naks_sent, sum.rnr_naks_sent += e.rnr_naks_sent;
  sum.rnr_naks_received += e.rnr_naks_received, sum.sequence_naks_received += e.sequence_naks_received;
  sum.duplicates += e.duplicates, sum.out_of_window += e.out_of_window, sum.out_of_order += e.out_of_order;
  sum.access_errors += e.access_errors, sum.invalid_requests += e.invalid_requests, sum.decode_errors += e.decode_errors;
  sum.bad_token += e.bad_token, sum.unexpected_packets += e.unexpected_packets;
  sum.requests_dropped_full += e.requests_dropped_full, sum.completions += e.completions;
  sum.paths_retired += e.paths_retired, sum.congestion_marks += e.congestion_marks;
}

struct EngineHost::Engine final : Host::Engine {
  Engine(const off::EngineConfig& config, off::MemoryAccess& memory, off::CompletionSink& sink) : engine(config, memory, sink) {}
  off::QpEngine engine;
  sockaddr_in peer{};
  off::IcrcAddresses rx_addresses{};  // as received: source = the peer
  uint64_t key = 0;                   // pkey << 32 | qpn
  FlowScheduler::Flow flow = 0;       // its place in the flow scheduler
  uint8_t tos = 0;                    // IP TOS byte of its packets (DSCP << 2 | ECN); 0: the socket's
  bool deferred_listed = false;       // in EngineHost::deferred_
  // Path validation of a new peer address (stellar mode): the address its
  // packets now come from, the challenge sent there, and what arrived from
  // it meanwhile (replayed into the engine once the peer echoes the
  // challenge from there, so that the move loses nothing).
  struct Held {
    std::vector<uint8_t> bytes;
    uint64_t arrival = 0;
    bool congestion_mark = false;
  };
  struct Validation {
    bool active = false;
    sockaddr_in candidate{};
    uint64_t challenge = 0;
    uint64_t sent_ns = 0;
    uint32_t sends = 0;
    uint16_t receive_port = 0;  // network order; 0: not seen yet
    sockaddr_in to{};           // where the challenges go
    size_t held_bytes = 0;
    std::vector<Held> held;
  } validation;
  // This host moved: until a packet from the peer reaches the new address
  // (the peer has validated it), an acknowledgement goes out every
  // announce interval, so that one lost announcement, challenge or
  // response does not leave the peer sending to the old address.
  uint64_t validated_challenge = 0;  // the last challenge answered (its repeats' answers are no forgery)
  // The challenge of a validation given up unanswered (max_challenges), and
  // its candidate: a peer descheduled for a few milliseconds answers it
  // late. The next validation of the same candidate asks the same question,
  // so those late answers validate it instead of counting as forgeries.
  // Only for abandoned_lifetime_ns, and cleared once any validation
  // succeeds: a challenge is fresh, unpredictable data, not a standing
  // password that a recorded answer could replay much later.
  sockaddr_in abandoned_candidate{};
  uint64_t abandoned_challenge = 0;
  uint64_t abandoned_ns = 0;
  bool abandoned_fresh(const sockaddr_in& from, uint64_t now) const;
  bool announcing = false;
  uint64_t next_announce = 0;
  uint32_t announcements = 0;
  // Path MTU discovery (docs/wire-format.md, "Path MTU"). The leader (the
  // larger connection token) probes every path index with datagrams padded
  // to each candidate size and an unpadded one, takes the largest size
  // every answering path carried, applies it and sends it to the follower
  // until acknowledged; the follower answers probes and takes the size.
  // Both hold their requests until then.
  struct Sizing {
    enum class Role : uint8_t { none, leader, follower };
    Role role = Role::none;
    bool decided = false;           // leader: the decision is out (awaiting its acknowledgement)
    uint64_t nonce = 0;             // leader: echoed by every answer
    uint32_t sizes[5] = {};         // leader: candidate payload sizes, largest first
    uint32_t size_count = 0;
    std::vector<uint8_t> answered;  // leader, per path index: bit k sizes[k] came back, bit 7 the unpadded probe
    uint32_t rounds = 0;            // leader: rounds sent
    uint32_t rounds_heard = 0;      // leader: rounds since the first answer
    uint64_t round_sent_ns = 0;     // leader: when the latest round left
    uint64_t interval_ns = 0;       // leader: between rounds
    uint64_t next_ns = 0;           // leader: the next round
    uint64_t waiting_since = 0;     // work posted while held: since when (0: none waits)
    uint64_t started_ns = 0;        // when the QP was connected
    bool last_full = false;         // leader: the latest round probed every size (not only the unpadded probe)
  } sizing;
};

namespace {
// Datagrams held per engine while a new peer address is validated: about
// one round trip of a fast sender's packets; the rest the sender resends.
constexpr size_t max_held_datagrams = 128;
constexpr size_t max_held_bytes = 1 << 20;  // and bytes (a GRO receive may be 64 KiB)
// Challenges sent for one candidate before it is given up (its held
// datagrams freed); announcements a moved host sends before it stops.
constexpr uint32_t max_challenges = 8;
constexpr uint32_t max_announcements = 64;
constexpr uint64_t announce_interval_ns = 1'000'000;
// A challenge goes out again, at most this often, while packets keep coming
// from the unvalidated address (the first may have been lost).
constexpr uint64_t min_challenge_interval_ns = 200'000;
constexpr uint64_t abandoned_lifetime_ns = 100'000'000;  // a given-up challenge stays askable this long
// The kernel's address notifications are read at most this often (one
// non-blocking recv), so that busy polling does not pay a syscall per round.
constexpr uint64_t netlink_interval_ns = 250'000;
// Path MTU discovery. Sizes a connection probes, below the MTU both QPs
// agreed on: the payloads of 9000-byte jumbo frames, of a 4200-byte RoCE
// fabric's MTU, of 1500-byte Ethernet and of IPv4's 576-byte minimum.
// A path that answered the unpadded probe but none of these sends 256.
constexpr uint32_t sizing_ladder[] = {8704, 3840, 1280, 256 + 128};
// At or below this agreed size no sizing runs: 1500-byte Ethernet, which
// every IPv4 path in a data centre carries, is assumed.
constexpr uint32_t sizing_floor = 1280;
constexpr uint32_t sizing_rounds_after_heard = 4;  // rounds a size has to come back once the peer answers
constexpr uint64_t sizing_first_interval_ns = 250'000;
constexpr uint64_t sizing_max_interval_ns = 20'000'000;  // a peer not yet up is asked at least this often
constexpr uint64_t sizing_max_heard_interval_ns = 2'000'000;  // once it answers, rounds at least this often
// A peer silent for this long (gone, or never coming) is asked once a second.
constexpr uint64_t sizing_patience_ns = 1'000'000'000;
constexpr uint64_t sizing_slow_interval_ns = 1'000'000'000;
uint64_t sizing_back_off(uint64_t interval, uint64_t started, uint64_t now) {
  return elapsed(now, started) >= sizing_patience_ns ? sizing_slow_interval_ns : std::min(interval * 2, sizing_max_interval_ns);
}
// Work posted while a connection sizes its path waits at most this long
// (for a peer that never answers, or answers and never acknowledges the
// decision); then it fails as a dead peer's does (retry_exceeded).
constexpr uint64_t sizing_timeout_ns = 1'000'000'000;

uint64_t random64() {
  uint64_t v = 0;
  while (::getrandom(&v, sizeof v, 0) != ssize_t(sizeof v)) {
  }
  return v;
}

bool same_address(const sockaddr_in& a, const sockaddr_in& b) { return a.sin_addr.s_addr == b.sin_addr.s_addr; }
}  // namespace

bool EngineHost::Engine::abandoned_fresh(const sockaddr_in& from, uint64_t now) const {
  return abandoned_challenge != 0 && elapsed(now, abandoned_ns) < abandoned_lifetime_ns && same_address(abandoned_candidate, from);
}

EngineHost::EngineHost(std::mutex& lock, HostClient& client) : lock_(lock), client_(client) {}

EngineHost::~EngineHost() {
  stop();
  {
    // A shared scheduler outlives this host: its flows go with it.
    auto held = hold_scheduler();
    for (auto& [key, e] : engines_) sched().remove(e->flow);
  }
  if (kick_fd_ >= 0) ::close(kick_fd_);
  if (netlink_fd_ >= 0) ::close(netlink_fd_);
}

bool EngineHost::LazyMemory::reset(size_t bytes) {
  if (data) ::munmap(data, size);
  data = nullptr;
  size = 0;
  if (bytes == 0) return true;
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return false;
  data = static_cast<uint8_t*>(p);
  size = bytes;
  return true;
}

std::optional<SocketError> EngineHost::open(const HostOptions& options) {
  options_ = options;
  adaptive_wait_.store(options.adaptive_wait);
  if (!shared_scheduler_) {
    auto held = hold_scheduler();
    sched().set_link_rate(options_.tx_rate_bytes_per_s, 0, monotonic_ns());
  }
  std::optional<SocketError> error;
  bool bound = false;
  if (options_.mode == off::Mode::roce && options_.udp_port == 0) {
    error = socket_.open(options_.bind_address, off::roce_udp_port);
    bound = !error;
    if (!bound) socket_.close();
  }
  if (!bound) {
    error = socket_.open(options_.bind_address, options_.udp_port);
    if (error) {
      socket_.close();
      return error;
    }
  }
  // One more socket per extra path, on a port of its own (the kernel's
  // choice), sending only.
  const uint16_t paths = options_.mode == off::Mode::roce ? 1 : std::clamp<uint16_t>(options_.paths, 1, off::max_paths);
  paths_.clear();
  for (uint16_t i = 1; i < paths; ++i) {
    auto s = std::make_unique<UdpSocket>();
    if (auto e = s->open(options_.bind_address, 0)) {
      socket_.close();
      paths_.clear();
      e->message = "path socket " + std::to_string(i) + ": " + e->message;
      return e;
    }
    s->enable_gso(true);
    s->enable_ecn();
    s->send_only();
    paths_.push_back(std::move(s));
  }
  {
    std::lock_guard guard(local_lock_);
    local_ = socket_.local();
  }
  kick_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  const uint32_t capacity = options_.mtu + uint32_t(off::max_header_bytes) + 64;
  // With GRO one receive may carry up to 64 KiB of coalesced datagrams.
  const uint32_t rx_capacity = socket_.gro() ? 65536 : capacity;
  // UDP GSO in both modes: in roce mode each segment's ICRC is fixed for the
  // IP id GSO gives it (segment k: id k), so the bytes on the wire stay
  // valid RoCEv2 for any receiver, and one system call and one skb carry up
  // to 64 KiB instead of one 4 KiB datagram.
  socket_.enable_gso(true);
  if (options_.mode == off::Mode::roce)
    socket_.set_segment_fixup([](Datagram& d, uint32_t from, uint32_t to) {
      uint8_t* end = d.part_count ? static_cast<uint8_t*>(d.parts[d.part_count - 1].iov_base) + d.parts[d.part_count - 1].iov_len : d.data + d.length;
      uint32_t icrc;
      std::memcpy(&icrc, end - 4, 4);
      icrc ^= off::roce_icrc_ip_id_delta(d.length, uint16_t(from)) ^ off::roce_icrc_ip_id_delta(d.length, uint16_t(to));
      std::memcpy(end - 4, &icrc, 4);
    });
  // ECN marks are a path signal in stellar mode (docs/multipath.md); roce
  // mode stays as it was (a RoCE NIC's ECN belongs to DCQCN's CNPs).
  if (options_.mode == off::Mode::stellar) socket_.enable_ecn();
  if (!rx_memory_.reset(size_t(rx_batch) * rx_capacity) || !tx_memory_.reset(size_t(tx_batch) * capacity))
    return SocketError{false, std::string("no memory for the datagram buffers: ") + std::strerror(errno)};
  for (int i = 0; i < rx_batch; ++i) rx_[i] = Datagram{rx_memory_.data + size_t(i) * rx_capacity, rx_capacity, 0, {}, 0};
  for (int i = 0; i < tx_batch; ++i) {
    tx_[i] = off::TxBuffer{tx_memory_.data + size_t(i) * capacity, capacity, 0};
    out_[i] = Datagram{tx_[i].data, capacity, 0, {}, 0};
  }
  filter_ = std::make_unique<FaultFilter>(options_.faults, tx_batch, capacity);
  if (options_.mode == off::Mode::stellar && options_.follow_address) {
    // Address notifications, so that a host whose address changes while it
    // only listens still follows it (a sender notices at its next send).
    netlink_fd_ = ::socket(AF_NETLINK, SOCK_RAW | SOCK_NONBLOCK | SOCK_CLOEXEC, NETLINK_ROUTE);
    if (netlink_fd_ >= 0) {
      sockaddr_nl nl{};
      nl.nl_family = AF_NETLINK;
      nl.nl_groups = RTMGRP_IPV4_IFADDR | RTMGRP_IPV4_ROUTE;  // a new address may become usable only with its route
      if (::bind(netlink_fd_, reinterpret_cast<sockaddr*>(&nl), sizeof nl) != 0) {
        ::close(netlink_fd_);
        netlink_fd_ = -1;
      }
    }
  }
  return std::nullopt;
}

void EngineHost::start() {
  if (!options_.engine_thread || thread_.joinable()) return;
  running_.store(true);
  thread_ = std::thread([this] { engine_thread(); });
}

void EngineHost::stop() {
  running_.store(false);
  if (thread_.joinable()) {
    kick();
    thread_.join();
  }
}

Host::Engine* EngineHost::attach_locked(const off::EngineConfig& config, const sockaddr_in& peer, const QpBinding& binding,
                                        off::MemoryAccess& memory, off::CompletionSink& sink, std::string&) {
  const sockaddr_in& local = socket_.local();
  off::EngineConfig c = config;
  c.tx_addresses = off::IcrcAddresses{local.sin_addr.s_addr, peer.sin_addr.s_addr, ntohs(local.sin_port), ntohs(peer.sin_port)};
  // The acknowledgement a request carries is taken after this side's reply
  // left, not on the way to it (note_deferred, settle_deferred).
  c.defer_piggybacked_acks = true;
  auto e = std::make_unique<Engine>(c, memory, sink);
  e->peer = peer;
  e->rx_addresses = off::IcrcAddresses{peer.sin_addr.s_addr, local.sin_addr.s_addr, ntohs(peer.sin_port), ntohs(local.sin_port)};
  e->key = uint64_t(c.pkey) << 32 | c.local_qpn;
  // The class's DSCP, with the ECN bits the stellar mode's sockets send
  // (ECT(0)); DSCP 0 is the socket's own setting already.
  if (binding.dscp) e->tos = uint8_t(binding.dscp << 2 | (options_.mode == off::Mode::stellar ? 0x02 : 0));
  {
    auto held = hold_scheduler();
    e->flow = sched().add(binding.label, monotonic_ns(), this);
  }
  if (flow_engines_.size() <= e->flow) flow_engines_.resize(e->flow + 1, nullptr);
  flow_engines_[e->flow] = e.get();
  Engine* handle = e.get();
  last_engine_ = nullptr;  // the key may have named an engine that this one replaces
  engines_[handle->key] = std::move(e);
  start_sizing(*handle, monotonic_ns());
  return handle;
}

namespace {
EngineHost::Engine* own(Host::Engine* e) { return static_cast<EngineHost::Engine*>(e); }
const EngineHost::Engine* own(const Host::Engine* e) { return static_cast<const EngineHost::Engine*>(e); }
}  // namespace

void EngineHost::detach_locked(Host::Engine* handle) {
  Engine* e = own(handle);
  // Acknowledge what was delivered here before the QP goes: the peer's last
  // SEND (a "bye") must complete there, not retry into a closed QP.
  const size_t n = e->engine.transmit_final_acknowledgement(tx_, 1, monotonic_ns());
  if (n) send_datagrams(n, e->peer, e->tos);
  accumulate(retired_, e->engine.counters());
  // Its tenant's report keeps what it did.
  auto held = hold_scheduler();
  const FlowLabel& label = sched().label(e->flow);
  FlowReport& r = retired_flows_[label.tenant + '\0' + label.job + '\0' + char('0' + label.traffic_class)];
  r.label = label;
  accumulate(r.counters, e->engine.counters());
  const FlowWaits& w = sched().waits(e->flow);
  r.waits.waits += w.waits, r.waits.wait_ns_total += w.wait_ns_total, r.waits.bytes += w.bytes;
  r.waits.wait_ns_max = std::max(r.waits.wait_ns_max, w.wait_ns_max);
  sched().remove(e->flow);
  flow_engines_[e->flow] = nullptr;
  if (expecting_ == e) expecting_ = nullptr;
  if (e->deferred_listed)
    std::erase_if(deferred_, [e](const Deferred& d) { return d.engine == e; });
  if (e->sizing.role != Engine::Sizing::Role::none) --sizing_engines_;
  last_engine_ = nullptr;
  engines_.erase(e->key);
}

off::PostResult EngineHost::post_send_locked(Host::Engine* handle, const off::SendWork& w, uint64_t now_ns) {
  Engine& e = *own(handle);
  const off::PostResult r = e.engine.post_send(w, now_ns);
  // Held while the path is sized: the time limit runs from the first work that waits.
  if (r == off::PostResult::ok && e.sizing.role != Engine::Sizing::Role::none && e.sizing.waiting_since == 0)
    e.sizing.waiting_since = now_ns ? now_ns : 1;
  return r;
}
off::PostResult EngineHost::post_receive_locked(Host::Engine* e, const off::ReceiveWork& r) { return own(e)->engine.post_receive(r); }
bool EngineHost::set_ready_locked(Host::Engine* e, uint64_t wr_id, uint32_t bytes) { return own(e)->engine.set_ready(wr_id, bytes); }
void EngineHost::enter_error_locked(Host::Engine* e) { own(e)->engine.enter_error(); }
bool EngineHost::in_error_locked(const Host::Engine* e) const { return own(e)->engine.in_error(); }
uint32_t EngineHost::outstanding_sends_locked(const Host::Engine* e) const { return own(e)->engine.outstanding_sends(); }
bool EngineHost::path_info_locked(const Host::Engine* e, uint16_t path, off::PathInfo& out) const {
  return own(e)->engine.path_info(path, out);
}
uint32_t EngineHost::outstanding_receives_locked(const Host::Engine* e) const { return own(e)->engine.outstanding_receives(); }

void EngineHost::posted_locked(Host::Engine* handle, uint64_t now_ns) {
  if (options_.engine_thread) {
    kick();
    return;
  }
  // Inline: the new work leaves now, in the scheduler's order (the flow
  // waits its turn if others are ahead of it).
  Engine& e = *own(handle);
  if (e.engine.next_wakeup_ns(now_ns) <= now_ns) {
    auto held = hold_scheduler();
    sched().ready(e.flow, now_ns);
  }
  bool more = false;
  serve_locked(now_ns, more);
  // The reply is out: what the last request carried can be taken now.
  if (!deferred_.empty()) settle_deferred(UINT64_MAX);
}

void EngineHost::note_deferred(Engine& e) {
  if (e.deferred_listed || !e.engine.acknowledgement_deferred()) return;
  e.deferred_listed = true;
  deferred_.push_back(Deferred{&e, progress_calls_});
}

void EngineHost::settle_deferred(uint64_t before_call) {
  size_t kept = 0;
  for (const Deferred& d : deferred_) {
    if (d.call >= before_call) {
      deferred_[kept++] = d;
      continue;
    }
    d.engine->deferred_listed = false;
    d.engine->engine.settle_acknowledgement();
  }
  deferred_.resize(kept);
}

size_t EngineHost::flush_engine(Engine& e, uint64_t now_ns) {
  size_t total = 0;
  for (;;) {
    const size_t n = e.engine.transmit(tx_, tx_batch, now_ns);
    if (n == 0) return total;
    send_datagrams(n, e.peer, e.tos);
    total += n;
    if (n < size_t(tx_batch)) return total;
  }
}

bool EngineHost::serve_locked(uint64_t now, bool& more) {
  // Datagrams one round sends at most before it receives again (so that
  // acknowledgements are read while many flows are backlogged).
  constexpr size_t round_cap = 4 * tx_batch;
  const uint64_t mtu = std::max<uint32_t>(options_.mtu, 256);
  size_t sent = 0;
  FlowScheduler::Flow f;
  uint64_t budget;
  auto held = hold_scheduler();
  while (sent < round_cap && sched().next(now, f, budget)) {
    // Shared with other hosts: serve while this host's flow is next; the
    // owner of the next one serves it in its own round.
    if (sched().owner(f) != this) break;
    Engine& e = *flow_engines_[f];
    // budget / mtu, clamped to [1, tx_batch], dividing only for a grant
    // in between (an unshaped flow's is unlimited; a shaped one's small).
    const size_t count = budget >= uint64_t(tx_batch) * mtu ? size_t(tx_batch) : budget < 2 * mtu ? 1 : size_t(budget / mtu);
    const size_t n = e.engine.transmit(tx_, count, now);
    uint64_t bytes = 0;
    for (size_t i = 0; i < n; ++i) bytes += tx_[i].length;
    if (n) send_datagrams(n, e.peer, e.tos);
    sent += n;
    const bool due = n > 0 && e.engine.next_wakeup_ns(now) <= now;
    // A flow that filled its grant may be offered again this round; one
    // that stopped short with more due (roce: a READ response burst) waits
    // for the next round, after the host has received.
    const bool again = due && n == count;
    if (due && !again) more = true;
    sched().served(f, bytes, again, now);
  }
  if (sent >= round_cap) more = true;
  return sent > 0;
}

UdpSocket& EngineHost::path_socket(uint16_t path) {
  const size_t n = paths_.size() + 1;
  const size_t index = path < n ? path : path % n;  // a division only for an out-of-range path
  return index == 0 ? socket_ : *paths_[index - 1];
}

void EngineHost::send_datagrams(size_t n, const sockaddr_in& peer, uint8_t tos) {
  for (size_t i = 0; i < n; ++i) {
    Datagram& d = out_[i];
    d = Datagram{tx_[i].data, tx_[i].capacity, tx_[i].length, peer, 0};
    d.tos = tos;
    if (tx_[i].piece_count) {
      // Zero-copy: headers from the send buffer, payload from registered memory.
      iovec* parts = tx_parts_[i];
      uint32_t k = 0;
      parts[k++] = {tx_[i].data, tx_[i].header_length};
      for (uint32_t j = 0; j < tx_[i].piece_count; ++j)
        parts[k++] = {const_cast<uint8_t*>(tx_[i].pieces[j].data), tx_[i].pieces[j].length};
      parts[k++] = {tx_[i].trailer, tx_[i].trailer_length};
      d.parts = parts;
      d.part_count = k;
    }
  }
  // Runs of datagrams on one path (an engine keeps a path for a burst) go
  // out together from that path's socket, in order.
  for (size_t start = 0; start < n;) {
    UdpSocket& socket = path_socket(tx_[start].path);
    size_t end = start + 1;
    while (end < n && &path_socket(tx_[end].path) == &socket) ++end;
    send_errors_ += filter_->send(socket, out_ + start, int(end - start));
    if (socket.take_address_error()) address_suspect_ = true;
    start = end;
  }
}

bool EngineHost::progress_locked(uint64_t now) {
  // A roce-mode responder sends READ responses in bursts (EngineConfig::
  // max_response_burst) so that re-requests are read between them; rounds
  // continue until the bursts are out, receiving between them, instead of
  // leaving the rest until the next packet or call arrives (an application
  // asleep in epoll would otherwise stall the READ until the peer's RTO).
  bool work = false, more = true;
  ++progress_calls_;
  for (int round = 0; more && round < 64; ++round) {
    more = false;
    work = progress_round_locked(now, more) || work;
  }
  // Acknowledgements put off in an earlier call: the application had its
  // turn to reply (posted_locked takes them sooner when it did). Taking
  // them may complete sends, and the timers they stop ask for no round.
  if (!deferred_.empty()) {
    settle_deferred(progress_calls_);
    work = true;
  }
  return work;
}

// One received datagram (several, coalesced by GRO, of segment_size bytes
// each) from byte `from` on: each to its engine, through the checks every
// datagram passes.
void EngineHost::deliver_datagram(const Datagram& d, uint32_t from_byte, uint64_t now, uint64_t arrival) {
  const uint32_t step = d.segment_size ? d.segment_size : std::max<uint32_t>(d.length - from_byte, 1);
  if (d.segment_size) coalesced_ += (d.length - from_byte + step - 1) / step;
  for (uint32_t at = from_byte; at < d.length || (at == from_byte && d.length == from_byte); at += step) {
    const uint8_t* data = d.data + at;
    const uint32_t length = std::min(step, d.length - at);
    uint16_t pkey;
    uint32_t qpn;
    if (!off::peek_destination(options_.mode, data, length, pkey, qpn)) {
      ++malformed_;
      break;
    }
    // A burst's datagrams are mostly for one QP: the last one found is
    // looked at first (std::unordered_map's find costs a division).
    const uint64_t key = uint64_t(pkey) << 32 | qpn;
    Engine* found = key == last_key_ ? last_engine_ : nullptr;
    if (!found) {
      auto it = engines_.find(key);
      if (it == engines_.end()) {
        ++unknown_qp_;  // no such QP in that tenant
        continue;
      }
      found = it->second.get();
      last_key_ = key;
      last_engine_ = found;
    }
    Engine& e = *found;
    const sockaddr_in& from = d.peer;
    if (options_.mode == off::Mode::stellar) {
      // A stellar-mode peer sprays from many source ports of its
      // address; the engine's token check tells it from a forger. From
      // another address: path validation first (connection IDs, not
      // addresses, name a connection; a new address must prove itself).
      if (off::opcode_is_path_validation(data[2])) {
        on_path_validation(e, from, data, length, now);
        continue;
      }
      if (off::opcode_is_path_sizing(data[2])) {
        on_path_sizing(e, from, data, length, now, arrival);
        continue;
      }
      if (!same_address(e.peer, from)) {
        on_unvalidated(e, from, data, length, now, arrival, d.congestion_mark);
        continue;
      }

    } else if (!same_address(e.peer, from) || e.peer.sin_port != from.sin_port) {
      ++unknown_qp_;  // roce: not from its peer's address and port
      continue;
    }
    heard_from(e, data, arrival);
    if (e.sizing.role == Engine::Sizing::Role::leader && e.sizing.decided) {
      // A leader whose decision's acknowledgement was lost: the follower
      // sends only once it took the size, so a packet of its that the
      // engine takes (the token checked) acknowledges the decision.
      const uint64_t taken = e.engine.counters().rx_packets;
      e.engine.receive(data, length, e.rx_addresses, now, arrival, d.congestion_mark);
      note_deferred(e);
      if (e.engine.counters().rx_packets != taken) finish_sizing(e, now);
      continue;
    }
    e.engine.receive(data, length, e.rx_addresses, now, arrival, d.congestion_mark);
    note_deferred(e);
    if (options_.mode == off::Mode::stellar && off::opcode_is_write(data[2])) note_expectation(e);
  }
}

void EngineHost::heard_from(Engine& e, const uint8_t* data, uint64_t arrival) {
  e.announcing = false;  // the peer reaches us here: it knows where we are
  if (moved_at_ && options_.mode == off::Mode::stellar && (data[3] & 4) != 0) {
    // The first acknowledgement since this host moved: how long the
    // move cost (the peer validated the new address and answered).
    const uint64_t at = arrival ? arrival : monotonic_ns();
    last_move_ns_ = at > moved_at_ ? at - moved_at_ : 0;
    moved_at_ = 0;
  }
}

// Direct placement. After an engine took a packet of a WRITE that has more
// to come, its next packets are likely the next datagrams on the socket
// (loopback and a single path keep their order; GSO sends a run of them as
// one datagram, which GRO hands over whole): the next receive lays out
// iovecs so that the kernel writes each expected packet's headers and
// trailer into small buffers and its payload straight where the engine
// would have copied it. Safe whatever comes instead: the engine vouches
// (QpEngine::placement) that each place belongs to a packet of that WRITE
// that has not arrived, so nothing there is final until it does, and then
// it is written again with the right bytes.
void EngineHost::note_expectation(Engine& e) {
  if (!options_.rx_placement || options_.mode != off::Mode::stellar) return;
  off::QpEngine::ExpectedWrite w;
  if (e.engine.expected_write(w)) {
    expecting_ = &e;
  } else if (expecting_ == &e) {
    expecting_ = nullptr;
  }
}

// Whether a packet still expected is one receive_into_place would lay out:
// a full-MTU packet. Probing costs a system call or two a message. When a
// WRITE's short piece came last, a message with a single middle packet left
// (a 128 KiB one at loopback's 61440 bytes) measured slower with probes
// than with the copy they save (a two-rank 256 KiB allreduce, 2.92-3.04
// GB/s against 3.14-3.26), so probes waited for two. With the short piece
// first (Requester::packet_span) the one packet left is the whole rest of
// the message: a two-rank allreduce of 64 KiB, 256 KiB and 1 MiB took
// 28.0-29.2 / 79-83 / 278-282 us probing for one, against 29.0-32.5 /
// 80-95 / 274-286 probing for two (four rounds each, interleaved).
// (Where GRO runs are laid out, the last packet is not: there it takes two
// middle packets, as before.)
bool EngineHost::expecting_placeable() const {
  if (!expecting_) return false;
  off::QpEngine::ExpectedWrite w;
  if (!expecting_->engine.expected_write(w)) return false;
  const uint64_t mtu = expecting_->engine.config().mtu;
  return placing_coalesced_ ? w.offset + 2 * mtu < w.message_length : w.offset + mtu <= w.message_length;
}

EngineHost::Placed EngineHost::receive_into_place(uint64_t now, int& taken) {
  taken = 0;
  Engine& e = *expecting_;
  off::QpEngine::ExpectedWrite w;
  const uint32_t mtu = e.engine.config().mtu;
  constexpr uint32_t header = off::stellar_write_header_bytes, trailer = 4;  // stellar PSNs are 32 bits: psn + k wraps as they do
  const uint32_t segment = header + mtu + trailer;  // a middle packet's datagram
  if (!e.engine.expected_write(w) || rx_[0].capacity < segment) {
    expecting_ = nullptr;
    return Placed::gave_up;
  }
  // Two layouts. Where GRO hands a run of packets over as one datagram
  // (seen on the last receive), that datagram's segments one after
  // another; else one packet per datagram, up to max_placed_datagrams of
  // them in one recvmmsg (a system call per packet costs more than the
  // copy it saves on a path of 1280- or 8704-byte packets).
  // Only full-MTU packets: the middle ones (a fixed header) and a last one
  // of a full MTU (a stellar-mode requester puts a WRITE's short piece
  // first, Requester::packet_span), whose header is laid out with an
  // immediate when the QP's previous WRITE ended with one (a wrong guess
  // makes it `other` below: copied, as a short last packet always is). The
  // last one only one datagram a packet: a GRO run's segments share one
  // size. The engine resolves the first place (the message's whole range,
  // once per receive); the later ones are that place plus whole MTUs, each
  // for a packet the engine still awaits.
  const bool coalesced = placing_coalesced_;
  // Not coalesced: batches of any size. At loopback's 61440 bytes they
  // once measured no better than a datagram a call, but that was while
  // the sender put each packet on a path of its own (a system call each)
  // and so set the pace; with its bursts of 4 (EngineConfig::
  // path_burst_packets) a 1 MiB stream went from 7.9 to 9.5 GB/s with them.
  const uint32_t limit = coalesced ? max_placed_segments : place_batch_;
  uint32_t expected = 0;  // packets laid out
  iovec parts[3 * max_placed];
  uint8_t* first = nullptr;
  while (expected < limit && (!coalesced || (expected + 1) * segment <= rx_[0].capacity)) {
    const uint64_t offset = uint64_t(w.offset) + uint64_t(expected) * mtu;
    if (offset + mtu > w.message_length) break;
    const bool last = offset + mtu == w.message_length;
    if (last && coalesced) break;
    if (expected == 0) {
      first = e.engine.placement(w.psn, w.rkey, w.remote_addr, w.message_length, w.offset, mtu);
      if (!first) break;
    } else if (!e.engine.awaiting(w.psn + expected)) {
      break;
    }
    uint8_t* place = first + uint64_t(expected) * mtu;
    placed_at_[expected] = place;
    placed_header_bytes_[expected] = last && w.last_with_imm ? placed_header_room : header;
    parts[3 * expected] = {placed_headers_[expected], placed_header_bytes_[expected]};
    parts[3 * expected + 1] = {place, mtu};
    parts[3 * expected + 2] = {placed_trailers_[expected], trailer};
    ++expected;
  }
  if (expected == 0) {
    expecting_ = nullptr;
    return Placed::gave_up;
  }
  UdpSocket::ScatterLayout layouts[max_placed_datagrams];
  const uint32_t messages = coalesced ? 1 : expected;
  for (uint32_t m = 0; m < messages; ++m)
    layouts[m] = coalesced ? UdpSocket::ScatterLayout{parts, int(3 * expected), expected * segment}
                           : UdpSocket::ScatterLayout{parts + 3 * m, 3, placed_header_bytes_[m] + mtu + trailer};
  const int n = socket_.receive_scattered_batch(rx_, layouts, int(messages));
  if (n == 0) return Placed::none;
  ++receive_calls_;
  taken = n;
  // First, for every datagram that came, where its payload stands:
  //   in_place   what was expected there (every segment the full size, each
  //              one's headers those of the packet expected there, from the
  //              QP's peer);
  //   displaced  a packet of the same WRITE expected in another slot of this
  //              batch (each datagram after an acknowledgement or a
  //              duplicate lands one slot late): the engine copies it from
  //              here to its place, once, as from a receive buffer;
  //   other      anything else (an acknowledgement, another message, another
  //              QP's or tenant's packet, a forgery): put back together in
  //              its d.data and taken from there.
  // All of this before any packet is taken, since taking one writes into
  // its place, which may be another slot of this batch: a displaced packet
  // bound for a later slot whose own payload is displaced too would
  // overwrite it first, so that later slot is put back together instead
  // (and so on along the chain); a datagram with more than its layout
  // (GRO's run, the rest of which lands anywhere) makes every one `other`.
  enum class Fit : uint8_t { in_place, displaced, other };
  Fit fit[max_placed_datagrams];
  uint32_t came[max_placed_datagrams], target[max_placed_datagrams];
  bool runs = false;       // GRO coalesced some datagram
  bool irregular = false;  // some datagram is longer than its layout
  const auto& config = e.engine.config();
  // A packet of the expected WRITE, of the kind laid out in slot i (its
  // header's length, checked by peek_write_placement, goes with its opcode).
  auto same_write = [&](const off::WritePlacement& p, uint32_t i) {
    const bool last = uint64_t(w.offset) + uint64_t(i + 1) * mtu == w.message_length;
    return (last ? p.opcode == off::opcode::write_last || p.opcode == off::opcode::write_last_imm : p.opcode == off::opcode::write_middle) && p.dest_qpn == config.local_qpn &&
           p.pkey == config.pkey && p.rkey == w.rkey && p.remote_addr == w.remote_addr && p.message_length == w.message_length;
  };
  for (int m = 0; m < n; ++m) {
    const Datagram& d = rx_[m];
    const uint32_t base = coalesced ? 0 : uint32_t(m);  // packet index of its first layout segment
    const uint32_t laid = coalesced ? expected : 1;
    const uint32_t step = d.segment_size ? d.segment_size : d.length;
    if (d.segment_size && d.length > d.segment_size) runs = true;
    if (d.length > layouts[m].bytes) irregular = true;
    target[m] = UINT32_MAX;
    came[m] = d.length == 0 ? 0 : std::min(laid, (d.length + step - 1) / step);
    const uint32_t laid_segment = coalesced ? segment : layouts[m].bytes;
    const bool whole = came[m] > 0 && step == laid_segment && came[m] * laid_segment <= d.length && same_address(e.peer, d.peer);
    bool ok = whole;
    off::WritePlacement p;
    for (uint32_t k = 0; ok && k < came[m]; ++k) {
      const uint32_t i = base + k;
      ok = off::peek_write_placement(placed_headers_[i], placed_header_bytes_[i], p) && same_write(p, i) && p.psn == w.psn + i &&
           p.message_offset == w.offset + i * mtu;
    }
    fit[m] = ok ? Fit::in_place : Fit::other;
    // Displaced: only between middle packets' slots (one header length).
    if (ok || coalesced || !whole || d.length != segment || placed_header_bytes_[m] != header ||
        !off::peek_write_placement(placed_headers_[m], header, p) || p.opcode != off::opcode::write_middle || !same_write(p, m))
      continue;
    const uint32_t slot = p.psn - w.psn;  // wraps as PSNs do
    if (slot < expected && slot != uint32_t(m) && placed_header_bytes_[slot] == header && same_write(p, slot) &&
        p.message_offset == w.offset + uint64_t(slot) * mtu) {
      fit[m] = Fit::displaced;
      target[m] = slot;
    }
  }
  for (bool changed = true; changed;) {
    changed = false;
    for (int m = 0; m < n; ++m) {
      if (fit[m] == Fit::displaced && irregular) {
        fit[m] = Fit::other;
        changed = true;
      }
      // (A displaced packet put back together still goes to its target.)
      const bool bound = fit[m] == Fit::displaced || (fit[m] == Fit::other && target[m] < expected);
      if (bound && target[m] > uint32_t(m) && target[m] < uint32_t(n) && fit[target[m]] == Fit::displaced) {
        fit[target[m]] = Fit::other;
        changed = true;
      }
    }
  }
  bool missed = false;
  for (int m = 0; m < n; ++m) {
    if (fit[m] == Fit::in_place) continue;
    missed = true;
    ++placement_misses_;
    if (fit[m] == Fit::displaced) continue;
    // What an `other` left in the places is zeroed: they await their own
    // packets, but another connection's bytes must not stay in this
    // application's memory if those never come. (A truncated datagram
    // reads as length 0 but may have filled them all.)
    const Datagram& d = rx_[m];
    const UdpSocket::ScatterLayout& l = layouts[m];
    uint32_t at = 0;
    for (int j = 0; j < l.count; ++j) {
      const iovec& v = l.parts[j];
      const uint32_t bytes = std::min<uint32_t>(uint32_t(v.iov_len), d.length - at);
      std::memcpy(d.data + at, v.iov_base, bytes);
      if (j % 3 == 1) std::memset(v.iov_base, 0, d.length ? bytes : v.iov_len);
      at += bytes;
    }
  }
  placing_coalesced_ = runs;
  if (!coalesced) {
    if (missed) place_batch_ = 1;
    else if (uint32_t(n) == expected) place_batch_ = std::min(max_placed_datagrams, place_batch_ * 2);
  }
  // Then each datagram in the order it came.
  const int64_t realtime = realtime_offset(now);
  for (int m = 0; m < n; ++m) {
    const Datagram& d = rx_[m];
    const uint64_t arrival = arrival_from_stamp(d.arrival_realtime_ns, realtime, now);
    if (fit[m] == Fit::other) {
      // Batches again from here: the next WRITE packet taken starts the
      // next expectation.
      if (expecting_ == &e) expecting_ = nullptr;
      deliver_datagram(d, 0, now, arrival);
      continue;
    }
    const uint32_t base = coalesced ? 0 : uint32_t(m);
    heard_from(e, placed_headers_[base], arrival);
    if (fit[m] == Fit::displaced) {
      const uint64_t taken_before = e.engine.counters().rx_packets;  // counts packets whose token checked out
      e.engine.receive_placed(placed_headers_[m], header, placed_at_[m], mtu, placed_trailers_[m], e.rx_addresses, now,
                              arrival, d.congestion_mark);
      note_deferred(e);
      // Refused (a bad CRC, a wrong token): not this connection's bytes,
      // zeroed. (Nothing else wrote here yet: a packet bound for this slot
      // from an earlier one would have made this one `other`.) Taken, or a
      // duplicate: the peer's own bytes of this WRITE, overwritten when
      // this slot's packet comes.
      if (e.engine.counters().rx_packets == taken_before) std::memset(placed_at_[m], 0, mtu);
      note_expectation(e);
      continue;
    }
    const uint32_t step = d.segment_size ? d.segment_size : d.length;
    if (d.segment_size) coalesced_ += (d.length + step - 1) / step;
    for (uint32_t k = 0; k < came[m]; ++k) {
      const uint32_t i = base + k;
      e.engine.receive_placed(placed_headers_[i], placed_header_bytes_[i], placed_at_[i], mtu, placed_trailers_[i], e.rx_addresses,
                              now, arrival, d.congestion_mark);
      note_deferred(e);
      // Refused (a bad CRC, a wrong token: not this connection's bytes):
      // still awaited, and zeroed as after a miss.
      if (e.engine.awaiting(w.psn + i)) std::memset(placed_at_[i], 0, mtu);
      else ++placed_;
    }
    note_expectation(e);
    // Segments beyond the laid-out ones (the message's last packet, or more
    // than were laid out) are in d.data past the parts, whole.
    const uint32_t parts_bytes = layouts[m].bytes;
    if (d.length > parts_bytes) {
      if (d.segment_size) coalesced_ -= (d.length - parts_bytes + step - 1) / step;  // counted above already
      deliver_datagram(d, parts_bytes, now, arrival);
    }
  }
  return Placed::some;
}

bool EngineHost::progress_round_locked(uint64_t now, bool& more) {
  bool work = false;
  client_.on_progress_locked(now);
  for (int round = 0; round < 4; ++round) {
    // Kernel arrival stamps are CLOCK_REALTIME; the engine runs on MONOTONIC.
    // A CLOCK_REALTIME step smaller than the 1 s arrival_from_stamp notices
    // skews the estimates until the next refresh of the offset.
    if (expecting_) {
      // A WRITE streams in: straight into place, a receive at a time,
      // until something else comes or the message ends.
      Placed r = Placed::some;
      int taken = 0, got = 0;
      while (expecting_ && taken < rx_batch && (r = receive_into_place(now, got)) == Placed::some) taken += got;
      if (taken) work = true;
      if (r == Placed::none) break;  // the socket is empty
      if (expecting_) continue;      // more of the stream: another round
    }
    const bool fresh = now - last_poll_ns_ < fresh_poll_ns;
    last_poll_ns_ = now;
    // A batch takes whatever is queued, so a WRITE whose packets were all
    // waiting (the peer sent its window while this side was busy sending
    // its own) went through receive buffers and was copied. After such a
    // batch the next receives take one datagram at a time until one starts
    // a WRITE, whose rest then goes straight into place (probes_left_).
    const bool probe = probes_left_ > 0;
    const int n = probe ? socket_.receive_first(rx_) : socket_.receive_batch(rx_, rx_batch, fresh);
    if (n == 0) break;
    work = true;
    ++receive_calls_;
    const int64_t offset = realtime_offset(now);
    uint32_t copied = 0;  // datagrams that came while a full-MTU packet was expected: they could have been placed
    for (int i = 0; i < n; ++i) {
      if (expecting_placeable()) ++copied;
      deliver_datagram(rx_[i], 0, now, arrival_from_stamp(rx_[i].arrival_realtime_ns, offset, now));
    }
    if (probe) {
      ++probes_;
      if (expecting_placeable()) probes_left_ = probe_budget;  // a WRITE starts: into place next round
      else --probes_left_;
      continue;
    }
    if (copied) probes_left_ = probe_budget;
    if (n < rx_batch) break;
  }
  // Engines with datagrams due join the scheduler's queue; it decides the
  // order they leave in (docs/scheduler.md).
  {
    auto held = hold_scheduler();
    for (auto& [key, e] : engines_) {
      if (!sched().is_ready(e->flow)) {
        if (e->engine.next_wakeup_ns(now) <= now) sched().ready(e->flow, now);
      } else if (sched().eligible_at(e->flow, now) > now) {
      // Held back by a token bucket: its acknowledgements of what the peer
      // sent still go now (a few bytes), so that the peer's timers and
      // delay signals do not pay for this side's rate limit.
        const size_t n = e->engine.transmit_final_acknowledgement(tx_, 1, now);
        if (n) send_datagrams(n, e->peer, e->tos);
      }
    }
  }
  if (serve_locked(now, more)) work = true;
  // A datagram held back for reordering goes out now if nothing overtook it.
  send_errors_ += filter_->release_held();
  if (options_.mode == off::Mode::stellar) {
    if (netlink_fd_ >= 0 && address_changes(now)) address_suspect_ = true;
    if (address_suspect_) follow_address_locked(now);
    if (timers_due_ <= now) {
      address_timers_locked(now);
      timers_due_ = now + min_challenge_interval_ns / 2;
    }
    if (sizing_engines_ && sizing_due_ <= now) sizing_timers_locked(now);
  }
  return work;
}

// ---- address change ----

void EngineHost::send_validation(const Engine& e, const sockaddr_in& to, uint8_t opcode, uint64_t challenge) {
  const off::EngineConfig& c = e.engine.config();
  off::Header h;
  h.opcode = opcode;
  h.pkey = c.pkey;
  h.dest_qpn = c.remote_qpn;
  h.token = c.remote_token;  // the peer's token: the challenge is as authentic as any packet of ours
  h.challenge = challenge;
  uint8_t buffer[off::max_header_bytes];
  const size_t n = off::encode(off::Mode::stellar, h, buffer, sizeof buffer, {});
  Datagram d{buffer, uint32_t(sizeof buffer), uint32_t(n), to, 0};
  int error = 0;
  // From the receiving socket: its address and port are where the peer
  // sends to once it has validated us.
  if (n == 0 || socket_.send_batch(&d, 1, error) != 1) ++send_errors_;
  if (socket_.take_address_error()) address_suspect_ = true;
}

void EngineHost::on_path_validation(Engine& e, const sockaddr_in& from, const uint8_t* data, uint32_t length,
                                    uint64_t now) {
  off::Header h;
  // As received: from `from` to our address (an unchecked packet is taken only between loopback addresses).
  off::IcrcAddresses as_received = e.rx_addresses;
  as_received.source_ip = from.sin_addr.s_addr;
  as_received.source_port = ntohs(from.sin_port);
  if (off::decode(off::Mode::stellar, data, length, as_received, h) != off::DecodeError::none) {
    ++malformed_;
    return;
  }
  if (h.token != e.engine.config().local_token) {
    ++unknown_qp_;  // not from the connection's peer
    return;
  }
  if (h.opcode == off::opcode::path_challenge) {
    // Answer from here, to wherever it came from (the peer may itself have
    // moved): the same size as the challenge, so no amplification.
    send_validation(e, from, off::opcode::path_response, h.challenge);
    return;
  }
  Engine::Validation& v = e.validation;
  // A late answer to a challenge sent again, after the first answer
  // validated the address: a duplicate, not a forgery.
  if (!v.active && e.validated_challenge != 0 && h.challenge == e.validated_challenge && same_address(e.peer, from)) return;
  // A late answer to a validation given up: stale, not forged (the next
  // packet from there starts one with the same challenge).
  if (!v.active && e.abandoned_fresh(from, now) && h.challenge == e.abandoned_challenge) return;
  if (!v.active || !same_address(v.candidate, from) || h.challenge != v.challenge) {
    ++migrations_rejected_;  // answers no challenge of ours: forged, or stale
    return;
  }
  // Validated: the peer is at `from` now (the port it receives on).
  e.peer = from;
  e.rx_addresses.source_ip = from.sin_addr.s_addr;
  e.rx_addresses.source_port = ntohs(from.sin_port);
  off::IcrcAddresses tx = e.engine.config().tx_addresses;
  tx.destination_ip = from.sin_addr.s_addr;
  tx.destination_port = ntohs(from.sin_port);
  e.engine.set_tx_addresses(tx);
  std::vector<Engine::Held> held = std::move(v.held);
  e.validated_challenge = v.challenge;
  e.abandoned_challenge = 0;
  v = Engine::Validation{};
  ++migrations_;
  for (const Engine::Held& d : held)
    e.engine.receive(d.bytes.data(), d.bytes.size(), e.rx_addresses, now, d.arrival, d.congestion_mark);
  e.engine.addresses_changed(now);
  flush_engine(e, now);
}

void EngineHost::on_unvalidated(Engine& e, const sockaddr_in& from, const uint8_t* data, uint32_t length,
                                uint64_t now, uint64_t arrival, bool congestion_mark) {
  off::Header h;
  // As received: from `from` to our address (an unchecked packet is taken only between loopback addresses).
  off::IcrcAddresses as_received = e.rx_addresses;
  as_received.source_ip = from.sin_addr.s_addr;
  as_received.source_port = ntohs(from.sin_port);
  if (off::decode(off::Mode::stellar, data, length, as_received, h) != off::DecodeError::none) {
    ++malformed_;
    return;
  }
  if (h.token != e.engine.config().local_token) {
    ++unknown_qp_;  // not from the connection's peer: changes nothing, costs no challenge
    return;
  }
  Engine::Validation& v = e.validation;
  const uint64_t interval = std::max(min_challenge_interval_ns, 2 * e.engine.smoothed_rtt_ns());
  if (!v.active || !same_address(v.candidate, from)) {
    // A new candidate replaces one being validated only once that one had
    // its time: a token holder cycling source addresses gets at most one
    // challenge per interval out of us.
    if (v.active && elapsed(now, v.sent_ns) < interval) {
      ++migration_dropped_;
      return;
    }
    v = Engine::Validation{};
    v.active = true;
    v.candidate = from;
    v.challenge = e.abandoned_fresh(from, now) ? e.abandoned_challenge : random64();
  }
  // Where the challenge goes: the peer's receiving socket at the new
  // address. Packets of path 0 leave from it; until one arrives, the port
  // the peer received on before (a moving host keeps it when it is free).
  // Other paths leave from send-only sockets that nobody reads. Learnt
  // once per candidate, so that varying ports buys no extra challenges.
  bool port_learned = false;
  if (h.path == 0 && v.receive_port == 0) {
    v.receive_port = from.sin_port;
    port_learned = v.sends > 0 && v.to.sin_port != from.sin_port;
  }
  v.to = from;
  v.to.sin_port = v.receive_port ? v.receive_port : e.peer.sin_port;
  if (v.held.size() < max_held_datagrams && v.held_bytes + length <= max_held_bytes) {
    v.held.push_back(Engine::Held{std::vector<uint8_t>(data, data + length), arrival, congestion_mark});
    v.held_bytes += length;
  } else {
    ++migration_dropped_;  // the sender resends it once the address is validated
  }
  if (v.sends == 0 || port_learned) send_challenge(e, now);
}

void EngineHost::send_challenge(Engine& e, uint64_t now) {
  Engine::Validation& v = e.validation;
  send_validation(e, v.to, off::opcode::path_challenge, v.challenge);
  v.sent_ns = now;
  ++v.sends;
  ++path_challenges_;
}

void EngineHost::address_timers_locked(uint64_t now) {
  for (auto& [key, ep] : engines_) {
    Engine& e = *ep;
    Engine::Validation& v = e.validation;
    if (v.active && elapsed(now, v.sent_ns) >= std::max(min_challenge_interval_ns, 2 * e.engine.smoothed_rtt_ns())) {
      if (v.sends >= max_challenges) {
        migration_dropped_ += v.held.size();  // never answered: forget it and what it held
        e.abandoned_candidate = v.candidate;
        e.abandoned_challenge = v.challenge;
        e.abandoned_ns = now;
        v = Engine::Validation{};
      } else {
        send_challenge(e, now);  // the challenge or its response may have been lost
      }
    }
    if (e.announcing && now >= e.next_announce) {
      if (++e.announcements > max_announcements) {
        e.announcing = false;
      } else {
        e.engine.addresses_changed(now);
        flush_engine(e, now);
        e.next_announce = now + announce_interval_ns;
      }
    }
  }
}

// ---- path MTU discovery ----

void EngineHost::start_sizing(Engine& e, uint64_t now) {
  const off::EngineConfig& c = e.engine.config();
  // Between loopback addresses the datagram never meets a link: the bound
  // interface's MTU is the path's. Equal tokens (never drawn in practice)
  // would make both sides leaders: both keep the agreed size, as before.
  if (options_.mode != off::Mode::stellar || !c.size_path || c.mtu <= sizing_floor || off::is_loopback(c.tx_addresses) ||
      c.local_token == c.remote_token)
    return;
  Engine::Sizing& z = e.sizing;
  z.role = c.local_token > c.remote_token ? Engine::Sizing::Role::leader : Engine::Sizing::Role::follower;
  z.started_ns = now;
  e.engine.hold_requests(true);
  ++sizing_engines_;
  if (z.role == Engine::Sizing::Role::follower) {
    // The follower answers, and says once it is up: a leader connected
    // earlier backs off while nobody answers, and starts its next round at
    // once on this (again every sizing_max_interval_ns, should it be lost).
    send_sizing(e, 0, off::opcode::path_size, 0, 0, false, 0);
    z.interval_ns = sizing_max_interval_ns;
    z.next_ns = now + z.interval_ns;
    sizing_due_ = std::min(sizing_due_, z.next_ns);
    return;
  }
  z.nonce = random64();
  z.sizes[z.size_count++] = c.mtu;
  for (uint32_t s : sizing_ladder)
    if (s < c.mtu && z.size_count < std::size(z.sizes)) z.sizes[z.size_count++] = s;
  z.answered.assign(c.paths, 0);
  z.interval_ns = sizing_first_interval_ns;
  if (sizing_buffer_.size() < size_t(c.mtu) + off::max_header_bytes) sizing_buffer_.assign(size_t(c.mtu) + off::max_header_bytes, 0);
  sizing_round(e, now);
}

void EngineHost::send_sizing(const Engine& e, uint16_t path, uint8_t opcode, uint64_t nonce, uint32_t size, bool set,
                             uint32_t datagram_bytes) {
  const off::EngineConfig& c = e.engine.config();
  off::Header h;
  h.opcode = opcode;
  h.pkey = c.pkey;
  h.dest_qpn = c.remote_qpn;
  h.token = c.remote_token;  // as authentic as any packet of ours
  h.path = path;
  h.challenge = nonce;
  h.size_bytes = size;
  h.size_set = set;
  const size_t header = off::encoded_header_bytes(off::Mode::stellar, h);
  // Padded to what a data packet of `size` payload bytes and the largest
  // headers would be: what the path has to carry. The padding is zeros.
  h.payload_length = datagram_bytes > header ? uint32_t(datagram_bytes - header) : 0;
  if (sizing_buffer_.size() < header + h.payload_length) sizing_buffer_.assign(header + h.payload_length, 0);
  std::memset(sizing_buffer_.data() + off::payload_offset(off::Mode::stellar, h), 0, h.payload_length);
  const size_t n = off::encode(off::Mode::stellar, h, sizing_buffer_.data(), sizing_buffer_.size(), c.tx_addresses);
  // To the peer's receiving socket, from the socket this path's data leaves
  // from: the probe crosses the route (ECMP hash) the data will take, and
  // so does the answer, which leaves from the peer's socket of that path.
  Datagram d{sizing_buffer_.data(), uint32_t(sizing_buffer_.size()), uint32_t(n), e.peer, 0};
  d.tos = e.tos;
  int error = 0;
  UdpSocket& socket = path_socket(path);
  if (n == 0 || socket.send_batch(&d, 1, error) != 1) ++send_errors_;
  if (socket.take_address_error()) address_suspect_ = true;
  ++mtu_probes_;
}

void EngineHost::sizing_round(Engine& e, uint64_t now) {
  Engine::Sizing& z = e.sizing;
  if (z.decided) {
    send_sizing(e, 0, off::opcode::path_size, z.nonce, e.engine.config().mtu, true, 0);
  } else if (z.rounds > 0 && z.rounds_heard == 0) {
    // Nobody answered the first full round: the peer is not up yet (or
    // gone). Only the unpadded probe until it answers, not tens of padded
    // ones a round toward nobody.
    send_sizing(e, 0, off::opcode::path_size, z.nonce, 0, false, 0);
    z.last_full = false;
  } else {
    z.last_full = true;
    const uint16_t paths = uint16_t(z.answered.size());
    for (uint16_t p = 0; p < paths; ++p) {
      if (!(z.answered[p] & 0x80)) send_sizing(e, p, off::opcode::path_size, z.nonce, 0, false, 0);
      for (uint32_t k = 0; k < z.size_count; ++k)
        if (!(z.answered[p] & (1u << k)))
          send_sizing(e, p, off::opcode::path_size, z.nonce, z.sizes[k], false, z.sizes[k] + uint32_t(off::max_header_bytes));
    }
    if (z.rounds_heard > 0) ++z.rounds_heard;
  }
  ++z.rounds;
  z.round_sent_ns = now;
  // Until the peer answers (it may not be up yet), and while a decision
  // goes unacknowledged, the rounds slow down; between, they come every
  // two round trips.
  if (z.rounds_heard == 0 || z.decided) z.interval_ns = sizing_back_off(z.interval_ns, z.started_ns, now);
  z.next_ns = now + z.interval_ns;
  sizing_due_ = std::min(sizing_due_, z.next_ns);
}

void EngineHost::decide_size(Engine& e, uint32_t size, uint64_t now) {
  Engine::Sizing& z = e.sizing;
  const uint32_t agreed = e.engine.config().mtu;
  e.engine.set_mtu(size);
  if (size < agreed) ++mtu_lowered_;
  z.decided = true;
  z.nonce = random64();  // the decision's own: an answer to a probe cannot acknowledge it
  sizing_round(e, now);
}

void EngineHost::finish_sizing(Engine& e, uint64_t now) {
  // What the sizing cost the application: how long its first work waited.
  if (e.sizing.waiting_since) mtu_last_ns_ = elapsed(now, e.sizing.waiting_since);
  e.sizing = Engine::Sizing{};
  --sizing_engines_;
  e.engine.hold_requests(false);
  if (e.engine.next_wakeup_ns(now) <= now) {
    auto held = hold_scheduler();
    sched().ready(e.flow, now);
  }
}

void EngineHost::on_path_sizing(Engine& e, const sockaddr_in& from, const uint8_t* data, uint32_t length, uint64_t now,
                                uint64_t arrival) {
  off::Header h;
  if (off::decode(off::Mode::stellar, data, length, e.rx_addresses, h) != off::DecodeError::none) {
    ++malformed_;
    return;
  }
  if (h.token != e.engine.config().local_token || !same_address(e.peer, from)) {
    ++unknown_qp_;  // not from the connection's peer
    return;
  }
  Engine::Sizing& z = e.sizing;
  const off::EngineConfig& c = e.engine.config();
  if (h.opcode == off::opcode::path_size) {
    if (h.size_set) {
      // The leader's decision: at most what both QPs agreed on. Taken once
      // (set_mtu refuses after the first request), acknowledged each time.
      if (h.size_bytes < 256 || h.size_bytes > c.mtu) {
        ++malformed_;
        return;
      }
      if (z.role == Engine::Sizing::Role::follower) {
        const uint32_t agreed = c.mtu;
        if (e.engine.set_mtu(h.size_bytes) && h.size_bytes < agreed) ++mtu_lowered_;
        finish_sizing(e, now);
      }
      if (e.engine.config().mtu == h.size_bytes) send_sizing(e, 0, off::opcode::path_size_ack, h.challenge, h.size_bytes, true, 0);
      return;
    }
    // A probe: answered from this path's socket, as large as it came (no
    // amplification), whatever the state: a late probe costs one answer.
    send_sizing(e, h.path, off::opcode::path_size_ack, h.challenge, h.size_bytes, false, length);
    // A leader still waiting for its peer: the peer is up now (the
    // follower's hello), so a full round goes at once, not after the back-off.
    if (z.role == Engine::Sizing::Role::leader && !z.decided && z.rounds_heard == 0 &&
        elapsed(now, z.round_sent_ns) >= sizing_first_interval_ns / 4) {
      z.rounds = 0;  // a full round
      z.interval_ns = sizing_first_interval_ns;
      sizing_round(e, now);
    }
    return;
  }
  // An answer: only the leader asked (the follower's hello is answered too,
  // and that answer needs nothing).
  if (z.role != Engine::Sizing::Role::leader) return;
  if (h.challenge != z.nonce) {
    ++unknown_qp_;  // stale or forged: answers no question of ours
    return;
  }
  if (h.size_set) {
    if (z.decided && h.size_bytes == c.mtu) finish_sizing(e, now);
    return;
  }
  if (z.decided || h.path >= z.answered.size()) return;
  uint8_t& bits = z.answered[h.path];
  if (h.size_bytes == 0) {
    bits |= 0x80;
  } else {
    for (uint32_t k = 0; k < z.size_count; ++k)
      if (z.sizes[k] == h.size_bytes && length >= h.size_bytes + off::max_header_bytes) bits |= uint8_t(0x80 | 1u << k);
  }
  if (z.rounds_heard == 0) {
    // The first answer: the peer is up. Rounds from now on every two round
    // trips (as the kernel stamped the answer's arrival: an application
    // that polls late must not stretch them).
    z.rounds_heard = 1;
    const uint64_t at = arrival && arrival >= z.round_sent_ns ? arrival : now;
    z.interval_ns = std::clamp<uint64_t>(2 * elapsed(at, z.round_sent_ns), sizing_first_interval_ns, sizing_max_heard_interval_ns);
    // Woken by the unpadded probe alone: the padded ones go now.
    z.next_ns = z.last_full ? now + z.interval_ns : now;
    sizing_due_ = std::min(sizing_due_, z.next_ns);
  }
  // Every path carried the largest size: no need to wait for the rest.
  bool all = true;
  for (uint8_t b : z.answered) all = all && (b & 1);
  if (all) decide_size(e, z.sizes[0], now);
}

void EngineHost::sizing_timers_locked(uint64_t now) {
  uint64_t due = UINT64_MAX;
  for (auto& [key, ep] : engines_) {
    Engine& e = *ep;
    Engine::Sizing& z = e.sizing;
    if (z.role == Engine::Sizing::Role::none) continue;
    if (z.waiting_since && elapsed(now, z.waiting_since) >= sizing_timeout_ns) {
      // Work has waited for a peer that does not settle the size: it fails
      // as a dead peer's would, and the QP enters the error state.
      ++mtu_failed_;
      std::fprintf(stderr,
                   "stellar: QP %u: path MTU discovery with %s did not settle within %llu ms (%s); its work fails "
                   "(STELLAR_PATH_MTU_DISCOVERY=0 on both sides turns the sizing off)\n",
                   unsigned(e.engine.config().local_qpn), format_ipv4(e.peer).c_str(),
                   (unsigned long long)(sizing_timeout_ns / 1'000'000),
                   z.role == Engine::Sizing::Role::leader ? (z.rounds_heard ? "the peer never acknowledged the size"
                                                                             : "the peer never answered a probe")
                                                          : "the peer never sent a size");
      e.sizing = Engine::Sizing{};
      --sizing_engines_;
      e.engine.fail_requests(off::CompletionStatus::retry_exceeded);
      continue;
    }
    if (z.role == Engine::Sizing::Role::leader && now >= z.next_ns) {
      if (!z.decided && z.rounds_heard > sizing_rounds_after_heard) {
        // The largest size every path that answered at all carried (a path
        // silent even to the unpadded probe is down, not small: its loss
        // is multipath's to handle).
        uint32_t carried = 0xff;
        for (uint8_t b : z.answered)
          if (b & 0x80) carried &= b;
        uint32_t size = 256;
        for (uint32_t k = 0; k < z.size_count; ++k)
          if (carried & (1u << k)) {
            size = z.sizes[k];
            break;
          }
        decide_size(e, size, now);
      } else {
        sizing_round(e, now);
      }
    }
    if (z.role == Engine::Sizing::Role::follower && now >= z.next_ns) {
      send_sizing(e, 0, off::opcode::path_size, 0, 0, false, 0);  // the hello again
      z.interval_ns = sizing_back_off(z.interval_ns, z.started_ns, now);
      z.next_ns = now + z.interval_ns;
    }
    if (z.role == Engine::Sizing::Role::leader) due = std::min(due, z.next_ns);
    // The follower and every waiting post need the clock for the limit.
    if (z.waiting_since) due = std::min(due, z.waiting_since + sizing_timeout_ns);
    if (z.role == Engine::Sizing::Role::follower) due = std::min(due, z.next_ns);
  }
  sizing_due_ = due;
}

int64_t EngineHost::realtime_offset(uint64_t now) {
  if (realtime_offset_at_ == 0 || now - realtime_offset_at_ >= realtime_refresh_ns) {
    timespec real;
    clock_gettime(CLOCK_REALTIME, &real);
    const uint64_t monotonic = monotonic_ns();
    realtime_offset_ = int64_t(uint64_t(real.tv_sec) * 1'000'000'000ull + uint64_t(real.tv_nsec)) - int64_t(monotonic);
    realtime_offset_at_ = now ? now : 1;
  }
  return realtime_offset_;
}

bool EngineHost::address_changes(uint64_t now) {
  if (now - netlink_checked_ < netlink_interval_ns) return false;
  netlink_checked_ = now;
  bool any = false;
  char buffer[8192];
  for (;;) {
    const ssize_t n = ::recv(netlink_fd_, buffer, sizeof buffer, MSG_DONTWAIT);
    if (n > 0) {
      any = true;
    } else {
      // ENOBUFS: notifications were lost in an overflow; one may have been ours.
      if (n < 0 && errno == ENOBUFS) any = true;
      if (n < 0 && errno == EINTR) continue;
      break;
    }
  }
  return any;
}

namespace {
// Whether `address` is still one of this host's: a socket can bind to it.
bool address_is_local(const sockaddr_in& address) {
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return true;  // cannot tell: assume nothing changed
  sockaddr_in a = address;
  a.sin_port = 0;
  const bool local = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 || errno != EADDRNOTAVAIL;
  ::close(fd);
  return local;
}

// The source address the kernel picks toward `peer` now; nullopt if none.
std::optional<sockaddr_in> source_toward(const sockaddr_in& peer) {
  const int fd = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::nullopt;
  sockaddr_in local{};
  socklen_t length = sizeof local;
  const bool ok = ::connect(fd, reinterpret_cast<const sockaddr*>(&peer), sizeof peer) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &length) == 0 && local.sin_addr.s_addr != 0;
  ::close(fd);
  if (!ok) return std::nullopt;
  return local;
}
}  // namespace

void EngineHost::follow_address_locked(uint64_t now) {
  // At most every 100 us: while the address is gone every send fails.
  if (now - follow_checked_ < 100'000) return;
  follow_checked_ = now;
  address_suspect_ = false;
  if (!options_.follow_address || options_.mode != off::Mode::stellar) return;
  if (address_is_local(socket_.local())) return;
  for (auto& [key, e] : engines_) {
    const auto source = source_toward(e->peer);
    if (!source) continue;
    const std::string address = format_ipv4(*source);
    if (auto error = rebind_locked(address, now)) {
      // Once per second at most: while it keeps failing, every send asks again.
      if (now - follow_logged_ >= 1'000'000'000) {
        follow_logged_ = now;
        std::fprintf(stderr, "stellar: our address %s is gone; rebinding to %s failed: %s\n",
                     format_ipv4(socket_.local()).c_str(), address.c_str(), error->c_str());
      }
    }
    return;
  }
}

std::optional<std::string> EngineHost::rebind_locked(const std::string& address, uint64_t now) {
  if (options_.mode != off::Mode::stellar)
    return std::string("roce mode names a connection by its addresses and ports: it cannot change address");
  const auto target = parse_ipv4(address, 0);
  if (!target) return "not an IPv4 address: '" + address + "'";
  // Already there: nothing to do (rebinding would only change the port,
  // which a peer that sees no new address would never learn).
  if (target->sin_addr.s_addr == socket_.local().sin_addr.s_addr) return std::nullopt;
  // Every new socket first, so that a failure changes nothing: the same
  // port if it is free there, so that only the address changes.
  UdpSocket main;
  if (auto e = main.open(address, ntohs(socket_.local().sin_port))) {
    if (e->invalid_address) return e->message;
    main.close();
    if (auto again = main.open(address, 0)) return again->message;
  }
  std::vector<UdpSocket> fresh(paths_.size());
  for (size_t i = 0; i < paths_.size(); ++i)
    if (auto e = fresh[i].open(address, 0)) return "path socket: " + e->message;
  if (auto e = socket_.adopt(main)) return e->message;
  for (size_t i = 0; i < paths_.size(); ++i)
    if (auto e = paths_[i]->adopt(fresh[i])) return "path socket: " + e->message;  // dup3 failing: EMFILE-like
  options_.bind_address = address;
  ++rebinds_;
  moved_at_ = monotonic_ns();
  const sockaddr_in local = socket_.local();
  {
    std::lock_guard guard(local_lock_);
    local_ = local;
  }
  for (auto& [key, e] : engines_) {
    e->rx_addresses.destination_ip = local.sin_addr.s_addr;
    e->rx_addresses.destination_port = ntohs(local.sin_port);
    off::IcrcAddresses tx = e->engine.config().tx_addresses;
    tx.source_ip = local.sin_addr.s_addr;
    tx.source_port = ntohs(local.sin_port);
    e->engine.set_tx_addresses(tx);
    // Tell every peer at once (an ACK from the new address starts its
    // validation) and probe for what the move lost; again every
    // announce interval until the peer is heard at the new address.
    e->engine.addresses_changed(now);
    flush_engine(*e, now);
    e->announcing = true;
    e->announcements = 0;
    e->next_announce = now + announce_interval_ns;
  }
  // A thread asleep in ppoll waits on the old socket: wake it.
  kick();
  return std::nullopt;
}

void EngineHost::flush_acknowledgements_locked(uint64_t now) {
  settle_deferred(UINT64_MAX);  // ours: the sends they complete
  // Acknowledgements only, at once (they are the peer's, and tiny); data
  // that is due leaves in the scheduler's order and within its buckets.
  for (auto& [key, e] : engines_) {
    const size_t n = e->engine.transmit_final_acknowledgement(tx_, 1, now);
    if (n) send_datagrams(n, e->peer, e->tos);
  }
  {
    auto held = hold_scheduler();
    for (auto& [key, e] : engines_)
      if (!sched().is_ready(e->flow) && e->engine.next_wakeup_ns(now) <= now) sched().ready(e->flow, now);
  }
  bool more = false;
  serve_locked(now, more);
}

uint64_t EngineHost::next_wakeup_locked(uint64_t now) {
  if (!deferred_.empty()) return now;  // never asleep on a deferred acknowledgement: the next progress call takes it
  uint64_t t = client_.next_wakeup_locked(now);
  auto held = hold_scheduler();
  for (auto& [key, e] : engines_) {
    uint64_t w = e->engine.next_wakeup_ns(now);
    // Due, but its token bucket (or the link's) holds it back: when it refills.
    if (w <= now && sched().is_ready(e->flow)) w = sched().eligible_at(e->flow, now);
    t = std::min(t, w);
    if (e->validation.active || e->announcing) t = std::min(t, timers_due_);
  }
  if (sizing_engines_) t = std::min(t, sizing_due_);
  return t;
}

HostCounters EngineHost::counters_locked() const {
  HostCounters c;
  c.engines = retired_;
  for (auto& [key, e] : engines_) accumulate(c.engines, e->engine.counters());
  c.malformed = malformed_;
  c.unknown_qp = unknown_qp_;
  c.send_errors = send_errors_;
  c.receive_calls = receive_calls_;
  c.coalesced = coalesced_;
  c.placed = placed_, c.placement_misses = placement_misses_;
  c.migrations = migrations_, c.path_challenges = path_challenges_, c.migrations_rejected = migrations_rejected_;
  c.migration_dropped = migration_dropped_, c.rebinds = rebinds_, c.last_move_ns = last_move_ns_;
  c.path_mtu_probes = mtu_probes_, c.path_mtu_lowered = mtu_lowered_, c.path_mtu_failed = mtu_failed_;
  c.path_mtu_last_ns = mtu_last_ns_;
  if (filter_) c.faults = filter_->counters();
  // The engine thread's own CPU clock (it runs nothing else).
  clockid_t clock;
  timespec t;
  if (thread_.joinable() && pthread_getcpuclockid(const_cast<std::thread&>(thread_).native_handle(), &clock) == 0 &&
      clock_gettime(clock, &t) == 0)
    c.engine_cpu_ns = uint64_t(t.tv_sec) * 1'000'000'000ull + uint64_t(t.tv_nsec);
  return c;
}

bool EngineHost::set_tenant_share_locked(const std::string& tenant, const TenantShare& share) {
  if (shared_scheduler_) return false;  // the sharer's to set
  auto held = hold_scheduler();
  sched().set_tenant(tenant, share, monotonic_ns());
  return true;
}

void EngineHost::withdraw_locked(uint64_t now) {
  auto held = hold_scheduler();
  for (auto& [key, e] : engines_)
    if (sched().is_ready(e->flow)) sched().served(e->flow, 0, false, now);
}

void EngineHost::use_scheduler_locked(std::shared_ptr<SharedScheduler> shared) {
  // Flows live in one scheduler: only a host without engines may move.
  if (!engines_.empty() || !shared) return;
  scheduling_ = std::move(shared);
  shared_scheduler_ = true;
}

std::vector<FlowReport> EngineHost::flow_report_locked() const {
  std::unordered_map<std::string, FlowReport> by = retired_flows_;
  auto held = hold_scheduler();
  for (auto& [key, e] : engines_) {
    const FlowLabel& label = sched().label(e->flow);
    FlowReport& r = by[label.tenant + '\0' + label.job + '\0' + char('0' + label.traffic_class)];
    r.label = label;
    ++r.engines;
    accumulate(r.counters, e->engine.counters());
    const FlowWaits& w = sched().waits(e->flow);
    r.waits.waits += w.waits, r.waits.wait_ns_total += w.wait_ns_total, r.waits.bytes += w.bytes;
    r.waits.wait_ns_max = std::max(r.waits.wait_ns_max, w.wait_ns_max);
  }
  std::vector<FlowReport> out;
  out.reserve(by.size());
  for (auto& [key, r] : by) out.push_back(r);
  return out;
}

void EngineHost::kick() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t r = ::write(kick_fd_, &one, sizeof one);
}

void EngineHost::sleep_until_work(uint64_t limit_ns, int extra_fd) {
  uint64_t wake;
  {
    std::lock_guard lock(lock_);
    wake = next_wakeup_locked(monotonic_ns());
  }
  const uint64_t now = monotonic_ns();
  const uint64_t until = std::min(limit_ns, wake);
  if (until <= now) return;
  // The address notifications too: a sleeping host that moves is woken.
  pollfd fds[4] = {{socket_.fd(), POLLIN, 0}, {kick_fd_, POLLIN, 0}, {netlink_fd_, POLLIN, 0}, {extra_fd, POLLIN, 0}};
  // ppoll, not poll: engine timers (a delayed ACK is due 10 us out) need
  // better than poll's whole milliseconds, or every such ACK waits 1 ms.
  const uint64_t sleep_ns = std::min<uint64_t>(until - now, 1'000'000'000);
  const timespec timeout{time_t(sleep_ns / 1'000'000'000), long(sleep_ns % 1'000'000'000)};
  ::ppoll(fds, extra_fd >= 0 ? 4 : 3, &timeout, nullptr);  // a negative fd is ignored
  if (fds[1].revents & POLLIN) {
    uint64_t v;
    [[maybe_unused]] ssize_t r = ::read(kick_fd_, &v, sizeof v);
  }
}

void EngineHost::engine_thread() {
  uint64_t idle_since = monotonic_ns();
  // Oversubscription. A busy engine thread beside a busy application thread
  // is two spinning threads a process: two such processes on two CPUs spun
  // through each other's time slices, and a ping-pong round trip took 4-8
  // ms (a scheduler slice or two) instead of microseconds. Once this thread
  // finds itself preempted (ContentionDetector), an idle round gives the
  // core away (as Open MPI's yield_when_idle), and so does an empty CQ poll
  // of the application's (SoftCq::poll, through contended()).
  while (running_.load(std::memory_order_relaxed)) {
    bool work;
    {
      std::lock_guard lock(lock_);
      work = progress_locked(monotonic_ns());
    }
    const uint64_t now = monotonic_ns();
    if (work) {
      idle_since = now;
    } else if (adaptive_wait_.load(std::memory_order_relaxed) && now - idle_since >= options_.spin_ns) {
      uint64_t next;
      {
        std::lock_guard lock(lock_);
        next = next_wakeup_locked(now);
      }
      // A timer due within the spin time is cheaper to spin for than to sleep
      // for (the kernel's timer slack alone is 50 us).
      if (next > now + options_.spin_ns) {
        sleep_until_work(now + 10'000'000, -1);
        idle_since = monotonic_ns();
      }
    } else if (contention_.check(now)) {
      contention_yields_.fetch_add(1, std::memory_order_relaxed);
      sched_yield();
    }
  }
}

}  // namespace stellar::host
