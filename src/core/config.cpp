#include "core/config.hpp"

#include <cctype>
#include <charconv>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace stellar::config {

namespace {

// The table docs/configuration.md mirrors. Launcher variables (RANK, ...)
// belong to torchrun and mpirun: Stellar reads them, it does not own them.
constexpr Variable table[] = {
    {"STELLAR_LOG_LEVEL", "warn", "trace|debug|info|warn|error|critical|off",
     "control-plane log level on stderr (the data path never logs, it counts)", "src/core/log.cpp"},
    {"STELLAR_FAULT_DROP", "0", "probability", "soft provider: drop each sent datagram with this probability", "Context::open"},
    {"STELLAR_FAULT_DUP", "0", "probability", "soft provider: send each datagram twice with this probability", "Context::open"},
    {"STELLAR_FAULT_REORDER", "0", "probability", "soft provider: hold a datagram back behind the next one with this probability",
     "Context::open"},
    {"STELLAR_FAULT_SEED", "", "integer", "seed of the fault injector's generator (unset: a random seed)", "Context::open"},
    {"STELLAR_ENGINE", "", "inline|thread|daemon",
     "soft provider: where the engines run, overriding ContextOptions::progress (daemon: stellar-engined)", "Context::open"},
    {"STELLAR_ENGINED_SOCKET", "/run/stellar/engined.sock", "path", "the engine daemon's Unix socket (ContextOptions::engined_socket)",
     "Context::open"},
    {"STELLAR_MTU", "auto", "auto or integer 256-61440",
     "payload bytes per packet (ContextOptions::mtu); auto: the largest payload the bound interface's MTU carries (soft: a multiple of 256 up to 61440 in stellar mode, a RoCE MTU up to 4096 in roce mode)",
     "Context::open"},
    {"STELLAR_PATHS", "16", "integer 1-256",
     "soft provider, stellar mode: paths (UDP source ports) each connection sprays over (ContextOptions::paths)", "Context::open"},
    {"STELLAR_PATH_POLICY", "two-choices", "oblivious|reps|two-choices|bandit",
     "soft provider, stellar mode: how a connection chooses its paths (ContextOptions::path_policy)", "Context::open"},
    {"STELLAR_LOOPBACK_CRC", "0", "0 or 1",
     "soft provider, stellar mode: 1 keeps the CRC-32C trailer on packets between loopback addresses (ContextOptions::loopback_crc); 0: left out where the peer agrees",
     "Context::open"},
    {"STELLAR_RX_PLACEMENT", "1", "0 or 1",
     "soft provider, stellar mode: 1 receives a streaming WRITE's payload straight into its registered memory (ContextOptions::rx_placement); 0: through a receive buffer",
     "Context::open"},
    {"STELLAR_FOLLOW_ADDRESS", "1", "0 or 1",
     "soft provider, stellar mode: move to the new local address when the bound one disappears (ContextOptions::follow_address)",
     "Context::open"},
    {"STELLAR_PATH_MTU_DISCOVERY", "1", "0 or 1",
     "soft provider, stellar mode: probe each connection's path before its first packet and send no larger packets than it carries (ContextOptions::path_mtu_discovery)",
     "Context::open"},
    {"STELLAR_TENANT", "", "name", "the tenant a context opens as (ContextOptions::tenant)", "Context::open"},
    {"STELLAR_TENANT_CREDENTIAL", "", "text", "the credential of STELLAR_TENANT (ContextOptions::credential)", "Context::open"},
    {"STELLAR_TENANTS", "", "path", "the tenants file: JSON, docs/scheduler.md (ContextOptions::tenants_file)", "Context::open"},
    {"STELLAR_JOB_HINTS", "", "job=NAME,kind=KIND,priority=P,...",
     "the job hints of QPs created without their own (ContextOptions::hints, JobHints::parse)", "Context::open"},
    {"STELLAR_TRAFFIC_CLASS_DSCP", "0,8,16,24,32,40,46,48", "8 integers 0-63",
     "DSCP of traffic classes 0-7 (ContextOptions::class_dscp)", "Context::open"},
    {"STELLAR_TX_RATE", "0", "bytes/s", "soft provider: the rate the flow scheduler shapes transmissions to; 0: none",
     "Context::open"},
    {"STELLAR_VERBS_TC", "0", "integer 0-255", "verbs provider: GRH traffic class (DSCP << 2 | ECN) of every QP, as NCCL_IB_TC",
     "verbs provider open"},
    {"STELLAR_CUDA_LIBRARY", "libcuda.so.1", "path", "the CUDA driver library to dlopen (tests point it at a fake)",
     "src/gpu/cuda_driver.cpp"},
    {"STELLAR_COLL_TIMEOUT_MS", "30000", "ms", "collectives: bootstrap and per-operation timeout", "CommunicatorOptions::from_environment"},
    {"STELLAR_COLL_QPS_PER_PEER", "1", "integer 1-16", "collectives: QPs striped per peer (large messages spread over them)",
     "CommunicatorOptions::from_environment"},
    {"STELLAR_COLL_WAIT", "auto", "auto, busy or adaptive",
     "collectives: auto waits adaptively when more ranks share the host than there are CPUs; busy or adaptive force one",
     "CommunicatorOptions::from_environment"},
    {"STELLAR_COLL_SHM", "1", "0 or 1",
     "collectives: ranks on one host exchange data through shared memory (/dev/shm); 0 sends it over the network",
     "CommunicatorOptions::from_environment, stellar_allreduce"},
    {"STELLAR_COLL_DIRECT", "1", "0 or 1",
     "collectives: a ring's gather steps write straight into the next rank's output buffer; 0 goes through landing slots and a copy",
     "CommunicatorOptions::from_environment, stellar_allreduce"},
    {"STELLAR_NCCL_ADDRESS", "", "IPv4 addresses, comma-separated",
     "NCCL plugin: one device per address; unset: the first non-loopback IPv4 address that is up, else 127.0.0.1",
     "libnccl-net-stellar.so (plugins/nccl)"},
    {"STELLAR_NCCL_SPEED_MBPS", "25000", "Mbps 1-10000000",
     "NCCL plugin: the most speed a device reports (the link's speed below it wins)", "libnccl-net-stellar.so (plugins/nccl)"},
    {"STELLAR_NCCL_CONNECT_TIMEOUT_MS", "20000", "ms", "NCCL plugin: how long a connect may take before it fails",
     "libnccl-net-stellar.so (plugins/nccl)"},
    {"STELLAR_NCCL_GDR", "1", "0 or 1", "NCCL plugin: 0 reports host memory only, even where a GPU is found",
     "libnccl-net-stellar.so (plugins/nccl)"},
    {"RANK", "", "integer", "this process's rank (torchrun); with WORLD_SIZE", "CommunicatorOptions::from_environment"},
    {"WORLD_SIZE", "", "integer 1-65536", "number of ranks (torchrun)", "CommunicatorOptions::from_environment"},
    {"OMPI_COMM_WORLD_RANK", "", "integer", "rank under mpirun, when RANK/WORLD_SIZE are unset", "CommunicatorOptions::from_environment"},
    {"OMPI_COMM_WORLD_SIZE", "", "integer", "world size under mpirun", "CommunicatorOptions::from_environment"},
    {"MASTER_ADDR", "127.0.0.1", "IPv4 address", "rank 0's address for the bootstrap (torchrun)", "CommunicatorOptions::from_environment"},
    {"MASTER_PORT", "29500", "TCP port", "rank 0's bootstrap port (torchrun)", "CommunicatorOptions::from_environment"},
};

const Variable& declared(const char* name) {
  for (const Variable& v : table)
    if (std::strcmp(v.name, name) == 0) return v;
  std::fprintf(stderr, "stellar: environment variable %s is read but not declared in src/core/config.cpp\n", name);
  std::abort();
}

Status malformed(const char* name, const std::string& value, const std::string& wanted) {
  return Status(Errc::invalid_argument, std::string(name) + "='" + value + "' is not " + wanted);
}

// Digits only, decimal or 0x hexadecimal (never octal: a leading 0 is
// decimal), after an optional '-' where `negative_ok`. No whitespace: strto*
// would skip it in front and refuse it behind.
bool integer_text(const std::string& v, bool negative_ok, int& base) {
  size_t i = 0;
  if (negative_ok && !v.empty() && v[0] == '-') i = 1;
  base = 10;
  if (v.size() > i + 2 && v[i] == '0' && (v[i + 1] == 'x' || v[i + 1] == 'X')) {
    base = 16;
    i += 2;
  }
  if (i >= v.size()) return false;
  for (; i < v.size(); ++i)
    if (!(base == 16 ? std::isxdigit(static_cast<unsigned char>(v[i])) : std::isdigit(static_cast<unsigned char>(v[i])))) return false;
  return true;
}

}  // namespace

std::span<const Variable> variables() { return table; }

std::optional<std::string> text(const char* name) {
  (void)declared(name);
  const char* value = std::getenv(name);
  if (!value || !*value) return std::nullopt;
  return std::string(value);
}

Result<std::optional<double>> probability(const char* name) {
  auto value = text(name);
  if (!value) return std::optional<double>();
  // from_chars: "0.01" whatever locale the application set (strtod would
  // want "0,01" under a comma-decimal one).
  double v = -1;
  const char* end = value->data() + value->size();
  const auto [stop, error] = std::from_chars(value->data(), end, v);
  if (error != std::errc() || stop != end || !(v >= 0.0 && v <= 1.0)) return malformed(name, *value, "a probability in [0, 1]");
  return std::optional<double>(v);
}

Result<std::optional<int64_t>> integer(const char* name, int64_t min, int64_t max) {
  auto value = text(name);
  if (!value) return std::optional<int64_t>();
  // Decimal, or hexadecimal with 0x (traffic classes are often written so);
  // never octal: a rank of "010" is 10.
  int base = 10;
  const bool digits = integer_text(*value, min < 0, base);
  errno = 0;
  const long long v = digits ? std::strtoll(value->c_str(), nullptr, base) : 0;
  if (!digits || errno == ERANGE || v < min || v > max)
    return malformed(name, *value, "an integer in [" + std::to_string(min) + ", " + std::to_string(max) + "]");
  return std::optional<int64_t>(v);
}

Result<std::optional<uint64_t>> unsigned64(const char* name) {
  auto value = text(name);
  if (!value) return std::optional<uint64_t>();
  int base = 10;
  const bool digits = integer_text(*value, false, base);
  errno = 0;
  const unsigned long long v = digits ? std::strtoull(value->c_str(), nullptr, base) : 0;
  if (!digits || errno == ERANGE) return malformed(name, *value, "an unsigned 64-bit integer (decimal or 0x hexadecimal)");
  return std::optional<uint64_t>(v);
}

}  // namespace stellar::config
