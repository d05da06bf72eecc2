// `stellar doctor`: checks a node against the deployment lessons of GPUDirect
// RDMA clusters (system-brief.md, part 7): RDMA devices and their firmware,
// PCIe links of NICs and GPUs, GPU peer-memory support (nvidia-peermem or
// dma-buf), CPU power management, NIC ring sizes and GRO/LRO, and the NCCL
// environment. docs/doctor.md lists every check and its verdict rules.
//
// Everything is read below `Options::root` (sysfs, procfs), so tests point the
// checks at fixture trees (tests/fixtures/doctor/<scenario>/). The ethtool
// values that sysfs does not offer come from a pluggable EthtoolSource.
//
// Thread-safety: run() keeps no global state; the objects are plain values.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "stellar/status.hpp"

namespace stellar::doctor {

enum class Verdict {
  pass,  // as the deployment lessons want it
  warn,  // works, but costs performance or is likely to break under load
  fail,  // GPUDirect RDMA / the verbs provider will not work (or not as configured)
  skip,  // not applicable here (e.g. GPU checks without a GPU) or not readable
};
const char* to_string(Verdict);

struct Finding {
  std::string check;    // stable identifier, e.g. "pcie.link" (docs/doctor.md)
  std::string subject;  // what was checked: a device, interface, variable; may be empty
  Verdict verdict = Verdict::pass;
  std::string message;  // what was found, one line
  std::string fix;      // what to do about it; empty for pass and skip
};

// NIC ring sizes in descriptors (ETHTOOL_GRINGPARAM). A maximum of 0 means the
// driver did not report one.
struct RingSizes {
  uint32_t rx = 0, tx = 0, rx_max = 0, tx_max = 0;
};

// Receive offloads; nullopt when the driver does not report the feature.
struct Offloads {
  std::optional<bool> gro;
  std::optional<bool> lro;
};

// Where ring sizes and offloads come from. Implementations must be callable
// from the thread that runs the doctor; they need not be thread-safe.
class EthtoolSource {
 public:
  virtual ~EthtoolSource() = default;
  virtual Result<RingSizes> rings(const std::string& interface) = 0;
  virtual Result<Offloads> offloads(const std::string& interface) = 0;
};

// The running kernel, through the SIOCETHTOOL ioctl on an AF_INET socket
// (ETHTOOL_GRINGPARAM, ETHTOOL_GGRO, ETHTOOL_GFLAGS). Interfaces are those of
// the caller's network namespace.
std::unique_ptr<EthtoolSource> make_ioctl_ethtool();

// Fixture files: <directory>/<interface>/rings holds "rx N", "tx N",
// "rx_max N", "tx_max N" lines; <directory>/<interface>/features holds
// "gro on|off" and "lro on|off" lines. A missing file is Errc::not_found.
std::unique_ptr<EthtoolSource> make_fixture_ethtool(std::filesystem::path directory);

struct Options {
  // sysfs and procfs are read at root/sys and root/proc.
  std::filesystem::path root = "/";
  // The environment whose NCCL_* variables are checked; nullopt: this process's.
  std::optional<std::map<std::string, std::string>> environment;
  // Minimum NIC firmware versions, "MAJOR.MINOR.SUBMINOR". A minimum applies to
  // the devices whose firmware has the same major number (Mellanox/NVIDIA
  // firmware encodes the device family there: 16 = ConnectX-5, 20 = ConnectX-6 Dx, ...).
  std::vector<std::string> min_firmware;
  // Interfaces whose rings and offloads are checked besides the RDMA devices' own.
  std::vector<std::string> interfaces;
  // nullptr: root/ethtool when that folder exists (fixtures), else the ioctl
  // source when root is "/", else these checks are skipped.
  std::shared_ptr<EthtoolSource> ethtool;
};

struct Report {
  std::vector<Finding> findings;
  int count(Verdict) const;
  bool failed() const { return count(Verdict::fail) > 0; }
  // Findings of one check (and subject, when given), for tests and callers.
  std::vector<Finding> find(const std::string& check, const std::string& subject = {}) const;
};

Report run(const Options&);

// One line per finding: "FAIL  pcie.link  mlx5_0 (0000:3b:00.0): x8 of x16 ... | fix: ...",
// then a summary line.
std::string format_text(const Report&);
// {"findings": [{"check", "subject", "verdict", "message", "fix"}...],
//  "summary": {"pass": n, "warn": n, "fail": n, "skip": n}}
std::string format_json(const Report&);

// KEY=VALUE lines; blank lines and lines starting with '#' are ignored, an
// optional "export " prefix and surrounding quotes are removed.
Result<std::map<std::string, std::string>> read_environment_file(const std::filesystem::path&);
std::map<std::string, std::string> process_environment();

// Dotted version comparison ("20.31.1014" < "20.31.2006"); numeric per field,
// a missing field counts as 0. Returns <0, 0, >0.
int compare_versions(const std::string& a, const std::string& b);

}  // namespace stellar::doctor
