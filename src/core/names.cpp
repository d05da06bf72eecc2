// Names of the API's enums and their parsing: no dependencies beyond the
// public headers, so the control plane's fuzz target can link them alone.
#include "stellar/verbs.hpp"

namespace stellar {

const char* to_string(Errc e) {
  switch (e) {
    case Errc::ok: return "ok";
    case Errc::invalid_argument: return "invalid argument";
    case Errc::wrong_state: return "wrong state";
    case Errc::queue_full: return "queue full";
    case Errc::not_found: return "not found";
    case Errc::no_device: return "no device";
    case Errc::permission_denied: return "permission denied";
    case Errc::resource_exhausted: return "resource exhausted";
    case Errc::io_error: return "I/O error";
    case Errc::timeout: return "timeout";
    case Errc::connection_refused: return "connection refused";
    case Errc::protocol_error: return "protocol error";
    case Errc::unsupported: return "unsupported";
  }
  return "?";
}

std::string Status::to_string() const {
  return ok() ? "ok" : std::string(stellar::to_string(code_)) + ": " + message_;
}

const char* to_string(Provider p) { return p == Provider::verbs ? "verbs" : "soft"; }
const char* to_string(Mode m) { return m == Mode::roce ? "roce" : "stellar"; }
const char* to_string(ProgressMode p) {
  switch (p) {
    case ProgressMode::inline_poll: return "inline";
    case ProgressMode::thread: return "thread";
    case ProgressMode::daemon: return "daemon";
  }
  return "?";
}

Result<Provider> parse_provider(const std::string& s) {
  if (s == "soft") return Provider::soft;
  if (s == "verbs") return Provider::verbs;
  return Status(Errc::invalid_argument, "unknown provider '" + s + "' (expected soft or verbs)");
}

Result<Mode> parse_mode(const std::string& s) {
  if (s == "stellar") return Mode::stellar;
  if (s == "roce") return Mode::roce;
  return Status(Errc::invalid_argument, "unknown mode '" + s + "' (expected stellar or roce)");
}

const char* to_string(PathPolicy p) {
  switch (p) {
    case PathPolicy::oblivious: return "oblivious";
    case PathPolicy::reps: return "reps";
    case PathPolicy::two_choices: return "two-choices";
    case PathPolicy::bandit: return "bandit";
  }
  return "?";
}

Result<PathPolicy> parse_path_policy(const std::string& s) {
  for (PathPolicy p : {PathPolicy::oblivious, PathPolicy::reps, PathPolicy::two_choices, PathPolicy::bandit})
    if (s == to_string(p)) return p;
  return Status(Errc::invalid_argument, "unknown path policy '" + s + "' (expected oblivious, reps, two-choices or bandit)");
}

const char* to_string(WcOpcode o) {
  switch (o) {
    case WcOpcode::send: return "send";
    case WcOpcode::rdma_write: return "rdma_write";
    case WcOpcode::rdma_read: return "rdma_read";
    case WcOpcode::compare_swap: return "compare_swap";
    case WcOpcode::fetch_add: return "fetch_add";
    case WcOpcode::recv: return "recv";
    case WcOpcode::recv_rdma_with_imm: return "recv_rdma_with_imm";
  }
  return "?";
}

const char* to_string(QpState s) {
  switch (s) {
    case QpState::reset: return "RESET";
    case QpState::init: return "INIT";
    case QpState::rtr: return "RTR";
    case QpState::rts: return "RTS";
    case QpState::error: return "ERROR";
  }
  return "?";
}

}  // namespace stellar
