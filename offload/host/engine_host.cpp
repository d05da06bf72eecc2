#include "host/engine_host.hpp"

#include <arpa/inet.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>

namespace stellar::host {

namespace off = stellar::offload;

uint64_t monotonic_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return uint64_t(t.tv_sec) * 1'000'000'000ull + uint64_t(t.tv_nsec);
}

void accumulate(off::EngineCounters& sum, const off::EngineCounters& e) {
  // Every field: the host's sum is what ContextCounters and a future
  // daemon's statistics are built from.
  static_assert(sizeof(off::EngineCounters) == 26 * sizeof(uint64_t), "a counter was added: sum it here");
  sum.tx_packets += e.tx_packets, sum.tx_bytes += e.tx_bytes, sum.rx_packets += e.rx_packets, sum.rx_bytes += e.rx_bytes;
  sum.retransmitted_packets += e.retransmitted_packets, sum.timeouts += e.timeouts, sum.fast_retransmits += e.fast_retransmits;
  sum.tail_probes += e.tail_probes, sum.spurious_timeouts += e.spurious_timeouts, sum.spurious_retransmits += e.spurious_retransmits;
  sum.acks_sent += e.acks_sent, sum.naks_sent += e.naks_sent, sum.rnr_naks_sent += e.rnr_naks_sent;
  sum.rnr_naks_received += e.rnr_naks_received, sum.sequence_naks_received += e.sequence_naks_received;
  sum.duplicates += e.duplicates, sum.out_of_window += e.out_of_window, sum.out_of_order += e.out_of_order;
  sum.access_errors += e.access_errors, sum.invalid_requests += e.invalid_requests, sum.decode_errors += e.decode_errors;
  sum.bad_token += e.bad_token, sum.unexpected_packets += e.unexpected_packets;
  sum.requests_dropped_full += e.requests_dropped_full, sum.completions += e.completions;
  sum.paths_retired += e.paths_retired;
}

struct EngineHost::Engine final : Host::Engine {
  Engine(const off::EngineConfig& config, off::MemoryAccess& memory, off::CompletionSink& sink) : engine(config, memory, sink) {}
  off::QpEngine engine;
  sockaddr_in peer{};
  off::IcrcAddresses rx_addresses{};  // as received: source = the peer
  uint64_t key = 0;                   // pkey << 32 | qpn
};

EngineHost::EngineHost(std::mutex& lock, HostClient& client) : lock_(lock), client_(client) {}

EngineHost::~EngineHost() {
  stop();
  if (kick_fd_ >= 0) ::close(kick_fd_);
}

std::optional<SocketError> EngineHost::open(const HostOptions& options) {
  options_ = options;
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
    s->send_only();
    paths_.push_back(std::move(s));
  }
  kick_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  const uint32_t capacity = options_.mtu + uint32_t(off::max_header_bytes) + 64;
  // With GRO one receive may carry up to 64 KiB of coalesced datagrams.
  const uint32_t rx_capacity = socket_.gro() ? 65536 : capacity;
  socket_.enable_gso(options_.mode == off::Mode::stellar);
  rx_memory_.resize(size_t(rx_batch) * rx_capacity);
  tx_memory_.resize(size_t(tx_batch) * capacity);
  for (int i = 0; i < rx_batch; ++i) rx_[i] = Datagram{rx_memory_.data() + size_t(i) * rx_capacity, rx_capacity, 0, {}, 0};
  for (int i = 0; i < tx_batch; ++i) {
    tx_[i] = off::TxBuffer{tx_memory_.data() + size_t(i) * capacity, capacity, 0};
    out_[i] = Datagram{tx_[i].data, capacity, 0, {}, 0};
  }
  filter_ = std::make_unique<FaultFilter>(options_.faults, tx_batch, capacity);
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

Host::Engine* EngineHost::attach_locked(const off::EngineConfig& config, const sockaddr_in& peer, const QpBinding&,
                                        off::MemoryAccess& memory, off::CompletionSink& sink, std::string&) {
  const sockaddr_in& local = socket_.local();
  off::EngineConfig c = config;
  c.tx_addresses = off::IcrcAddresses{local.sin_addr.s_addr, peer.sin_addr.s_addr, ntohs(local.sin_port), ntohs(peer.sin_port)};
  auto e = std::make_unique<Engine>(c, memory, sink);
  e->peer = peer;
  e->rx_addresses = off::IcrcAddresses{peer.sin_addr.s_addr, local.sin_addr.s_addr, ntohs(peer.sin_port), ntohs(local.sin_port)};
  e->key = uint64_t(c.pkey) << 32 | c.local_qpn;
  Engine* handle = e.get();
  engines_[handle->key] = std::move(e);
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
  if (n) send_datagrams(n, e->peer);
  accumulate(retired_, e->engine.counters());
  engines_.erase(e->key);
}

off::PostResult EngineHost::post_send_locked(Host::Engine* e, const off::SendWork& w, uint64_t now_ns) {
  return own(e)->engine.post_send(w, now_ns);
}
off::PostResult EngineHost::post_receive_locked(Host::Engine* e, const off::ReceiveWork& r) { return own(e)->engine.post_receive(r); }
bool EngineHost::set_ready_locked(Host::Engine* e, uint64_t wr_id, uint32_t bytes) { return own(e)->engine.set_ready(wr_id, bytes); }
void EngineHost::enter_error_locked(Host::Engine* e) { own(e)->engine.enter_error(); }
bool EngineHost::in_error_locked(const Host::Engine* e) const { return own(e)->engine.in_error(); }
uint32_t EngineHost::outstanding_sends_locked(const Host::Engine* e) const { return own(e)->engine.outstanding_sends(); }
uint32_t EngineHost::outstanding_receives_locked(const Host::Engine* e) const { return own(e)->engine.outstanding_receives(); }

void EngineHost::posted_locked(Host::Engine* e, uint64_t now_ns) {
  if (options_.engine_thread) kick();
  else flush_engine(*own(e), now_ns);
}

size_t EngineHost::flush_engine(Engine& e, uint64_t now_ns) {
  size_t total = 0;
  for (;;) {
    const size_t n = e.engine.transmit(tx_, tx_batch, now_ns);
    if (n == 0) return total;
    send_datagrams(n, e.peer);
    total += n;
    if (n < size_t(tx_batch)) return total;
  }
}

UdpSocket& EngineHost::path_socket(uint16_t path) {
  const size_t index = path % (paths_.size() + 1);
  return index == 0 ? socket_ : *paths_[index - 1];
}

void EngineHost::send_datagrams(size_t n, const sockaddr_in& peer) {
  for (size_t i = 0; i < n; ++i) {
    Datagram& d = out_[i];
    d = Datagram{tx_[i].data, tx_[i].capacity, tx_[i].length, peer, 0};
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
  for (int round = 0; more && round < 64; ++round) {
    more = false;
    work = progress_round_locked(now, more) || work;
  }
  return work;
}

bool EngineHost::progress_round_locked(uint64_t now, bool& more) {
  bool work = false;
  client_.on_progress_locked(now);
  for (int round = 0; round < 4; ++round) {
    const int n = socket_.receive_batch(rx_, rx_batch);
    if (n == 0) break;
    work = true;
    ++receive_calls_;
    // Kernel arrival stamps are CLOCK_REALTIME; the engine runs on MONOTONIC.
    timespec real;
    clock_gettime(CLOCK_REALTIME, &real);
    const uint64_t realtime_now = uint64_t(real.tv_sec) * 1'000'000'000ull + uint64_t(real.tv_nsec);
    const uint64_t monotonic_now = monotonic_ns();
    for (int i = 0; i < n; ++i) {
      const uint64_t stamp = rx_[i].arrival_realtime_ns;
      // A stamp more than 1 s old means CLOCK_REALTIME stepped: no host-delay estimate then.
      const uint64_t age = stamp && stamp <= realtime_now ? realtime_now - stamp : UINT64_MAX;
      const uint64_t arrival = age < 1'000'000'000 && age < monotonic_now ? monotonic_now - age : 0;
      const uint32_t step = rx_[i].segment_size ? rx_[i].segment_size : std::max<uint32_t>(rx_[i].length, 1);
      if (rx_[i].segment_size) coalesced_ += (rx_[i].length + step - 1) / step;
      for (uint32_t at = 0; at < rx_[i].length || (at == 0 && rx_[i].length == 0); at += step) {
        const uint8_t* data = rx_[i].data + at;
        const uint32_t length = std::min(step, rx_[i].length - at);
        uint16_t pkey;
        uint32_t qpn;
        if (!off::peek_destination(options_.mode, data, length, pkey, qpn)) {
          ++malformed_;
          break;
        }
        auto it = engines_.find(uint64_t(pkey) << 32 | qpn);
        // From the peer: its address, and (roce, one path) its port. A
        // stellar-mode peer sprays from many source ports; the engine's
        // token check is what tells it from a forger.
        if (it == engines_.end() || it->second->peer.sin_addr.s_addr != rx_[i].peer.sin_addr.s_addr ||
            (options_.mode == off::Mode::roce && it->second->peer.sin_port != rx_[i].peer.sin_port)) {
          ++unknown_qp_;  // no such QP in that tenant, or not from its peer
          continue;
        }
        it->second->engine.receive(data, length, it->second->rx_addresses, now, arrival);
      }
    }
    if (n < rx_batch) break;
  }
  for (auto& [key, e] : engines_) {
    off::QpEngine& engine = e->engine;
    if (engine.next_wakeup_ns(now) <= now && flush_engine(*e, now) > 0) {
      work = true;
      if (engine.next_wakeup_ns(now) <= now) more = true;
    }
  }
  // A datagram held back for reordering goes out now if nothing overtook it.
  send_errors_ += filter_->release_held();
  return work;
}

void EngineHost::flush_acknowledgements_locked(uint64_t now) {
  for (auto& [key, e] : engines_) {
    e->engine.acknowledge_now(now);
    flush_engine(*e, now);
  }
}

uint64_t EngineHost::next_wakeup_locked(uint64_t now) {
  uint64_t t = client_.next_wakeup_locked(now);
  for (auto& [key, e] : engines_) t = std::min(t, e->engine.next_wakeup_ns(now));
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
  if (filter_) c.faults = filter_->counters();
  // The engine thread's own CPU clock (it runs nothing else).
  clockid_t clock;
  timespec t;
  if (thread_.joinable() && pthread_getcpuclockid(const_cast<std::thread&>(thread_).native_handle(), &clock) == 0 &&
      clock_gettime(clock, &t) == 0)
    c.engine_cpu_ns = uint64_t(t.tv_sec) * 1'000'000'000ull + uint64_t(t.tv_nsec);
  return c;
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
  pollfd fds[3] = {{socket_.fd(), POLLIN, 0}, {kick_fd_, POLLIN, 0}, {extra_fd, POLLIN, 0}};
  // ppoll, not poll: engine timers (a delayed ACK is due 10 us out) need
  // better than poll's whole milliseconds, or every such ACK waits 1 ms.
  const uint64_t sleep_ns = std::min<uint64_t>(until - now, 1'000'000'000);
  const timespec timeout{time_t(sleep_ns / 1'000'000'000), long(sleep_ns % 1'000'000'000)};
  ::ppoll(fds, extra_fd >= 0 ? 3 : 2, &timeout, nullptr);
  if (fds[1].revents & POLLIN) {
    uint64_t v;
    [[maybe_unused]] ssize_t r = ::read(kick_fd_, &v, sizeof v);
  }
}

void EngineHost::engine_thread() {
  uint64_t idle_since = monotonic_ns();
  while (running_.load(std::memory_order_relaxed)) {
    bool work;
    {
      std::lock_guard lock(lock_);
      work = progress_locked(monotonic_ns());
    }
    const uint64_t now = monotonic_ns();
    if (work) {
      idle_since = now;
    } else if (options_.adaptive_wait && now - idle_since >= options_.spin_ns) {
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
    }
  }
}

}  // namespace stellar::host
