#include "host/daemon_protocol.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <type_traits>

namespace stellar::host::daemon {

namespace off = stellar::offload;

static_assert(std::is_trivially_copyable_v<Reply> && std::is_trivially_copyable_v<AttachRequest> &&
              std::is_trivially_copyable_v<RegisterRequest> && std::is_trivially_copyable_v<OpenRequest>);
static_assert(sizeof(RegisterRequest) <= max_message_bytes && sizeof(Reply) <= max_message_bytes);

bool send_message(int socket, const void* data, size_t length, const int* fds, int fd_count, int flags) {
  iovec iov{const_cast<void*>(data), length};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * max_message_fds)];
  if (fd_count > 0) {
    if (fd_count > max_message_fds) return false;
    m.msg_control = control;
    m.msg_controllen = CMSG_SPACE(sizeof(int) * size_t(fd_count));
    cmsghdr* c = CMSG_FIRSTHDR(&m);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * size_t(fd_count));
    std::memcpy(CMSG_DATA(c), fds, sizeof(int) * size_t(fd_count));
  }
  for (;;) {
    // MSG_NOSIGNAL: a peer that went away is an error here, not SIGPIPE.
    const ssize_t n = ::sendmsg(socket, &m, MSG_NOSIGNAL | flags);
    if (n == ssize_t(length)) return true;
    if (n < 0 && errno == EINTR) continue;
    return false;
  }
}

long receive_message(int socket, void* buffer, size_t capacity, std::vector<int>& fds, int max_fds, int timeout_ms) {
  fds.clear();
  pollfd p{socket, POLLIN, 0};
  for (;;) {
    const int r = ::poll(&p, 1, timeout_ms);
    if (r > 0) break;
    if (r == 0) {
      errno = ETIMEDOUT;
      return -1;
    }
    if (errno != EINTR) return -1;
  }
  iovec iov{buffer, capacity};
  msghdr m{};
  m.msg_iov = &iov;
  m.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * max_message_fds)];
  m.msg_control = control;
  m.msg_controllen = sizeof control;
  ssize_t n;
  do {
    n = ::recvmsg(socket, &m, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  if (n < 0) return -1;
  // Every descriptor that arrived is ours to close, whatever else is wrong.
  for (cmsghdr* c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
      fds.push_back(fd);
    }
  }
  const bool too_many = int(fds.size()) > max_fds;
  if ((m.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || too_many) {
    for (int fd : fds) ::close(fd);
    fds.clear();
    errno = EMSGSIZE;
    return -1;
  }
  return long(n);
}

AttachRequest attach_request(const off::EngineConfig& c) {
  AttachRequest r;
  r.h = {uint32_t(MessageType::attach), sizeof r};
  r.mode = uint8_t(c.mode);
  r.cc = uint8_t(c.cc);
  r.retry_count = c.retry_count;
  r.rnr_retry = c.rnr_retry;
  r.mtu = c.mtu;
  r.max_send_wr = c.max_send_wr;
  r.max_recv_wr = c.max_recv_wr;
  r.pkey = c.pkey;
  r.local_qpn = c.local_qpn;
  r.remote_qpn = c.remote_qpn;
  r.send_psn = c.send_psn;
  r.receive_psn = c.receive_psn;
  r.local_token = c.local_token;
  r.remote_token = c.remote_token;
  r.rto_min_ns = c.rto_min_ns;
  r.rto_max_ns = c.rto_max_ns;
  r.line_rate_bps = c.cc_config.line_rate_bps;
  r.swift_target_delay_ns = c.cc_config.swift_target_delay_ns;
  r.paths = c.paths;
  r.path_policy = uint8_t(c.path_policy);
  r.loopback_unchecked = c.loopback_unchecked ? 1 : 0;
  r.size_path = c.size_path ? 1 : 0;
  return r;
}

bool config_from(const AttachRequest& r, uint32_t session_mtu, off::EngineConfig& c, std::string& error) {
  auto bad = [&](const char* what) {
    error = std::string("attach: ") + what;
    return false;
  };
  // The bounds are the soft provider's own (create_qp, modify to RTR), so
  // that a client can make the daemon allocate no more than an in-process
  // QP could.
  if (r.mode > uint8_t(off::Mode::roce)) return bad("unknown mode");
  if (r.cc > uint8_t(off::CcAlgorithm::swift)) return bad("unknown congestion control");
  if (r.mtu < 256 || r.mtu > session_mtu) return bad("mtu outside [256, the context's mtu]");
  if (r.max_send_wr == 0 || r.max_send_wr > 65536 || r.max_recv_wr == 0 || r.max_recv_wr > 65536)
    return bad("max_send_wr/max_recv_wr outside [1, 65536]");
  if (r.local_qpn < 2 || r.local_qpn > 0xffffff || r.remote_qpn == 0 || r.remote_qpn > 0xffffff)
    return bad("QP number outside [1, 0xffffff]");
  if (r.send_psn > 0xffffff || r.receive_psn > 0xffffff) return bad("PSN above 24 bits");
  // Counts, not sizes (the communicator sets its timeout through them).
  if (r.retry_count > 100'000'000 || r.rnr_retry > 100'000'000) return bad("retry counts above 10^8");
  if (r.rto_min_ns < 1000 || r.rto_max_ns < r.rto_min_ns || r.rto_max_ns > 60'000'000'000ull)
    return bad("retransmission timeouts outside [1 us, 60 s]");
  if (r.line_rate_bps < 1'000'000 || r.line_rate_bps > 10'000'000'000'000ull) return bad("line rate outside [1 Mb/s, 10 Tb/s]");
  if (r.swift_target_delay_ns > 1'000'000'000ull) return bad("congestion target delay above 1 s");
  if (r.mode == uint8_t(off::Mode::stellar) && r.local_token == 0) return bad("stellar mode needs a connection token");
  if (r.paths < 1 || r.paths > off::max_paths) return bad("paths outside [1, 256]");
  if (r.path_policy > uint8_t(off::PathPolicy::bandit)) return bad("unknown path policy");
  if (r.loopback_unchecked > 1) return bad("loopback_unchecked is not 0 or 1");
  if (r.size_path > 1) return bad("size_path is not 0 or 1");
  c = off::EngineConfig{};
  c.mode = off::Mode(r.mode);
  c.cc = off::CcAlgorithm(r.cc);
  c.mtu = r.mtu;
  c.max_send_wr = r.max_send_wr;
  c.max_recv_wr = r.max_recv_wr;
  c.pkey = r.pkey;
  c.local_qpn = r.local_qpn;
  c.remote_qpn = r.remote_qpn;
  c.send_psn = r.send_psn;
  c.receive_psn = r.receive_psn;
  c.local_token = r.local_token;
  c.remote_token = r.remote_token;
  c.rto_min_ns = c.rto_initial_ns = r.rto_min_ns;
  c.rto_max_ns = r.rto_max_ns;
  c.retry_count = r.retry_count;
  c.rnr_retry = r.rnr_retry;
  c.cc_config.line_rate_bps = r.line_rate_bps;
  c.cc_config.swift_target_delay_ns = r.swift_target_delay_ns;
  c.paths = r.paths;
  c.path_policy = off::PathPolicy(r.path_policy);
  c.loopback_unchecked = r.loopback_unchecked == 1;
  c.size_path = r.size_path == 1;
  return true;
}

}  // namespace stellar::host::daemon
