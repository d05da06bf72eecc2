// The checks of `stellar doctor`; docs/doctor.md is the reference for each
// verdict rule. Every path is taken relative to Options::root so the same
// code runs on the live system and on fixture trees.
#include "doctor.hpp"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include <linux/ethtool.h>
#include <linux/sockios.h>
#include <net/if.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

extern char** environ;

namespace stellar::doctor {
namespace fs = std::filesystem;

const char* to_string(Verdict v) {
  switch (v) {
    case Verdict::pass: return "pass";
    case Verdict::warn: return "warn";
    case Verdict::fail: return "fail";
    case Verdict::skip: return "skip";
  }
  return "?";
}

int Report::count(Verdict v) const {
  return static_cast<int>(std::count_if(findings.begin(), findings.end(), [v](const Finding& f) { return f.verdict == v; }));
}

std::vector<Finding> Report::find(const std::string& check, const std::string& subject) const {
  std::vector<Finding> out;
  for (const auto& f : findings)
    if (f.check == check && (subject.empty() || f.subject == subject)) out.push_back(f);
  return out;
}

namespace {

std::string trim(std::string s) {
  const char* space = " \t\r\n";
  s.erase(0, s.find_first_not_of(space));
  s.erase(s.find_last_not_of(space) + 1);
  return s;
}

// sysfs attributes are small; a read error (EINVAL from an empty GID slot,
// EACCES, a missing file) counts as "not present".
std::optional<std::string> read_text(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  std::ostringstream s;
  s << in.rdbuf();
  if (in.bad()) return std::nullopt;
  return trim(s.str());
}

std::vector<std::string> list_names(const fs::path& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) names.push_back(it->path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

bool path_exists(const fs::path& p) {
  std::error_code ec;
  return fs::exists(p, ec);
}

std::optional<long long> parse_integer(const std::string& s) {
  long long v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || s.empty()) return std::nullopt;
  return v;
}

// "16.0 GT/s PCIe" or "8 GT/s" -> 16.0 / 8.0; "Unknown" -> nullopt.
std::optional<double> parse_gts(const std::string& s) {
  try {
    size_t used = 0;
    double v = std::stod(s, &used);
    if (used == 0 || v <= 0) return std::nullopt;
    return v;
  } catch (...) {
    return std::nullopt;
  }
}

std::string join(const std::vector<std::string>& items, const char* sep = ", ") {
  std::string out;
  for (const auto& i : items) out += (out.empty() ? "" : sep) + i;
  return out;
}

std::string uevent_value(const fs::path& uevent, const std::string& key) {
  std::ifstream in(uevent);
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(key + "=", 0) == 0) return trim(line.substr(key.size() + 1));
  return {};
}

// The PCI address of a class device's "device" link. Network devices of
// virtio or auxiliary buses hang one level below their PCI function, so the
// parent is tried too (the kernel resolves ".." after following the link).
std::string pci_slot_of(const fs::path& device) {
  std::string slot = uevent_value(device / "uevent", "PCI_SLOT_NAME");
  if (slot.empty()) slot = uevent_value(device / ".." / "uevent", "PCI_SLOT_NAME");
  return slot;
}

struct RdmaPort {
  std::string number, state, link_layer, rate;
};

struct RdmaDevice {
  std::string name, slot, firmware, hca_type;
  std::vector<std::string> netdevs;
  std::vector<RdmaPort> ports;
};

class Doctor {
 public:
  Doctor(const Options& options, Report& report)
      : options_(options), report_(report), sys_(options.root / "sys"), proc_(options.root / "proc") {
    environment_ = options.environment ? *options.environment : process_environment();
  }

  void run() {
    check_rdma();
    check_pcie();
    check_gpu_memory();
    check_cpu();
    check_pcie_aspm();
    check_nics();
    check_nccl();
  }

 private:
  void add(std::string check, std::string subject, Verdict verdict, std::string message, std::string fix = {}) {
    report_.findings.push_back({std::move(check), std::move(subject), verdict, std::move(message), std::move(fix)});
  }

  // ---- RDMA devices, firmware, ports ----
  void check_rdma() {
    const fs::path ib = sys_ / "class/infiniband";
    for (const auto& name : list_names(ib)) {
      RdmaDevice d;
      d.name = name;
      d.slot = pci_slot_of(ib / name / "device");
      d.firmware = read_text(ib / name / "fw_ver").value_or("");
      d.hca_type = read_text(ib / name / "hca_type").value_or("");
      d.netdevs = list_names(ib / name / "device/net");
      for (const auto& port : list_names(ib / name / "ports")) {
        const fs::path p = ib / name / "ports" / port;
        d.ports.push_back({port, read_text(p / "state").value_or("unknown"), read_text(p / "link_layer").value_or("unknown"),
                           read_text(p / "rate").value_or("")});
      }
      devices_.push_back(std::move(d));
    }
    if (devices_.empty()) {
      add("rdma.devices", "", Verdict::fail, "no RDMA device under /sys/class/infiniband",
          "load the NIC's RDMA driver (e.g. modprobe mlx5_ib) and install rdma-core; on hosts without an RDMA NIC "
          "use the soft provider (--provider soft)");
      return;
    }
    std::vector<std::string> names;
    for (const auto& d : devices_) names.push_back(d.name);
    add("rdma.devices", "", Verdict::pass, std::to_string(devices_.size()) + " RDMA device(s): " + join(names));

    for (const auto& d : devices_) check_firmware(d);
    check_firmware_consistency();
    // librdmacm needs the rdma_ucm module's character device (a misc device
    // named rdma_cm) for cm::Method::rdma_cm / --cm rdma_cm.
    if (path_exists(sys_ / "class/misc/rdma_cm"))
      add("rdma.cm", "", Verdict::pass, "rdma_ucm loaded (rdma_cm device registered): --cm rdma_cm can work where /dev/infiniband/rdma_cm is accessible");
    else
      add("rdma.cm", "", Verdict::warn, "rdma_ucm not loaded: the rdma_cm connection method (--cm rdma_cm) is unavailable; the tcp method works",
          "modprobe rdma_ucm (rdma-core's rdma-load-modules@rdma.service loads it at boot)");
    for (const auto& d : devices_)
      for (const auto& p : d.ports) {
        const std::string subject = d.name + "/" + p.number;
        std::string what = p.state + ", " + p.link_layer + (p.rate.empty() ? "" : ", " + p.rate);
        if (p.state.find("ACTIVE") != std::string::npos)
          add("rdma.port", subject, Verdict::pass, what);
        else
          add("rdma.port", subject, Verdict::fail, "port is not ACTIVE: " + what,
              "check the cable, the switch port and the link (ibv_devinfo -d " + d.name + ", ip link show" +
                  (d.netdevs.empty() ? std::string() : " " + d.netdevs.front()) + ")");
      }
  }

  void check_firmware(const RdmaDevice& d) {
    if (d.firmware.empty()) {
      add("rdma.firmware", d.name, Verdict::warn, "fw_ver not readable", "check the driver with ibv_devinfo -d " + d.name);
      return;
    }
    const std::string major = d.firmware.substr(0, d.firmware.find('.'));
    for (const auto& minimum : options_.min_firmware) {
      if (minimum.substr(0, minimum.find('.')) != major) continue;
      if (compare_versions(d.firmware, minimum) < 0) {
        add("rdma.firmware", d.name, Verdict::fail, "firmware " + d.firmware + " is older than the minimum " + minimum,
            "update the NIC firmware to " + minimum + " or newer (mlxup, or mstflint -d " + (d.slot.empty() ? d.name : d.slot) + ")");
      } else {
        add("rdma.firmware", d.name, Verdict::pass, "firmware " + d.firmware + " (minimum " + minimum + ")");
      }
      return;
    }
    add("rdma.firmware", d.name, Verdict::pass,
        "firmware " + d.firmware + (options_.min_firmware.empty() ? " (no minimum given: --min-fw)" : " (no minimum given for this family)"));
  }

  // GPUDirect RDMA across nodes broke on mixed firmware: devices of one family
  // (same hca_type and firmware major) should all run the same version.
  void check_firmware_consistency() {
    std::map<std::string, std::map<std::string, std::vector<std::string>>> families;  // family -> version -> devices
    for (const auto& d : devices_) {
      if (d.firmware.empty()) continue;
      families[d.hca_type + "/" + d.firmware.substr(0, d.firmware.find('.'))][d.firmware].push_back(d.name);
    }
    for (const auto& [family, versions] : families) {
      if (versions.size() < 2) continue;
      std::vector<std::string> parts, all;
      for (const auto& [version, names] : versions) {
        parts.push_back(join(names, "+") + " " + version);
        all.insert(all.end(), names.begin(), names.end());
      }
      add("rdma.firmware", join(all, ","), Verdict::warn, "devices of one model run different firmware: " + join(parts),
          "flash every NIC of a model with the same (newest) firmware");
    }
  }

  // ---- PCIe links of NICs and GPUs ----
  void check_pcie() {
    std::set<std::string> seen;
    for (const auto& d : devices_)
      if (!d.slot.empty() && seen.insert(d.slot).second) check_link(d.name + " (" + d.slot + ")", d.slot, false);
    const fs::path net = sys_ / "class/net";
    for (const auto& ifname : list_names(net)) {
      if (!path_exists(net / ifname / "device")) continue;  // virtual interfaces (lo, bridges, veth) have no device
      std::string slot = pci_slot_of(net / ifname / "device");
      if (!slot.empty() && seen.insert(slot).second) check_link(ifname + " (" + slot + ")", slot, false);
    }
    const fs::path pci = sys_ / "bus/pci/devices";
    for (const auto& slot : list_names(pci)) {
      const std::string vendor = read_text(pci / slot / "vendor").value_or("");
      const std::string klass = read_text(pci / slot / "class").value_or("");
      if (vendor != "0x10de" || (klass.rfind("0x0300", 0) != 0 && klass.rfind("0x0302", 0) != 0)) continue;
      gpus_.push_back(slot);
      if (seen.insert(slot).second) check_link("GPU " + slot, slot, true);
    }
  }

  void check_link(const std::string& subject, const std::string& slot, bool gpu) {
    const fs::path dev = sys_ / "bus/pci/devices" / slot;
    auto width = parse_integer(read_text(dev / "current_link_width").value_or(""));
    auto max_width = parse_integer(read_text(dev / "max_link_width").value_or(""));
    const std::string speed_text = read_text(dev / "current_link_speed").value_or("");
    const std::string max_speed_text = read_text(dev / "max_link_speed").value_or("");
    auto speed = parse_gts(speed_text), max_speed = parse_gts(max_speed_text);
    if (!width || !max_width || !speed || !max_speed) {
      add("pcie.link", subject, Verdict::skip, "no PCIe link attributes (virtual or non-PCIe-express device)");
      return;
    }
    std::ostringstream what;
    what << "x" << *width << " at " << speed_text << " (max x" << *max_width << ", " << max_speed_text << ")";
    const std::string lspci = "lspci -vv -s " + slot + " shows LnkCap/LnkSta";
    if (*width < *max_width) {
      add("pcie.link", subject, Verdict::fail, "degraded link: " + what.str(),
          "reseat the card in a full-width slot and check risers and BIOS bifurcation; " + lspci);
    } else if (*speed + 0.01 < *max_speed) {
      add("pcie.link", subject, Verdict::warn, "link below its maximum speed: " + what.str(),
          gpu ? "GPUs lower the link speed when idle: re-check under load (nvidia-smi -q -d PCIE); if it stays low, check the slot generation and BIOS PCIe settings"
              : "check the slot generation and the BIOS PCIe speed setting; " + lspci);
    } else if (*max_width < 16) {
      add("pcie.link", subject, Verdict::warn, "device is not x16: " + what.str(),
          "GPUDirect RDMA wants x16 links for NICs and GPUs; use an x16 card/slot");
    } else {
      add("pcie.link", subject, Verdict::pass, what.str());
    }
  }

  // ---- GPU memory for RDMA: nvidia-peermem or dma-buf ----
  void check_gpu_memory() {
    if (gpus_.empty()) {
      add("gpu.peer_memory", "", Verdict::skip, "no NVIDIA GPU (PCI class 0x0300/0x0302, vendor 0x10de)");
      return;
    }
    const auto version_line = read_text(proc_ / "driver/nvidia/version");
    std::string driver, kind;
    bool open_modules = false;
    if (!version_line) {
      add("gpu.driver", "", Verdict::fail, std::to_string(gpus_.size()) + " NVIDIA GPU(s) but no /proc/driver/nvidia/version",
          "install and load the NVIDIA driver (modprobe nvidia)");
    } else {
      open_modules = version_line->find("Open Kernel Module") != std::string::npos;
      // The version follows "Kernel Module" ("... Kernel Module  535.104.05  ...").
      size_t at = version_line->find("Kernel Module");
      std::istringstream rest(version_line->substr(at == std::string::npos ? 0 : at + 13));
      std::string token;
      while (rest >> token)
        if (!token.empty() && std::isdigit(static_cast<unsigned char>(token[0])) && token.find('.') != std::string::npos) {
          driver = token;
          break;
        }
      kind = open_modules ? "open kernel modules" : "proprietary kernel modules";
      add("gpu.driver", "", Verdict::pass, std::to_string(gpus_.size()) + " GPU(s), driver " + (driver.empty() ? "?" : driver) + " (" + kind + ")");
    }

    const auto modules = read_text(proc_ / "modules").value_or("");
    auto loaded = [&](const std::string& module) {
      return path_exists(sys_ / "module" / module) || modules.rfind(module + " ", 0) == 0 || modules.find("\n" + module + " ") != std::string::npos;
    };
    const bool peermem = loaded("nvidia_peermem"), legacy = loaded("nv_peer_mem");

    // dma-buf GPU memory needs the kernel's RDMA dma-buf import (5.12) and
    // NVIDIA's export, which only the open kernel modules of R515+ provide.
    const std::string kernel = read_text(proc_ / "sys/kernel/osrelease").value_or("");
    const bool kernel_ok = !kernel.empty() && compare_versions(kernel.substr(0, kernel.find_first_not_of("0123456789.")), "5.12") >= 0;
    const bool driver_ok = open_modules && !driver.empty() && compare_versions(driver, "515") >= 0;
    const std::string dmabuf = "dma-buf: kernel " + (kernel.empty() ? std::string("?") : kernel) + (kernel_ok ? " >= 5.12" : " < 5.12") +
                               ", driver " + (driver.empty() ? std::string("?") : driver) + " " +
                               (driver_ok ? "open modules >= 515" : "needs open kernel modules >= 515");
    if (peermem || legacy) {
      add("gpu.peer_memory", "", Verdict::pass, std::string(peermem ? "nvidia_peermem" : "nv_peer_mem") + " loaded; " + dmabuf);
    } else if (kernel_ok && driver_ok) {
      add("gpu.peer_memory", "", Verdict::pass, "nvidia_peermem not loaded, the dma-buf path is available (" + dmabuf + ")");
    } else {
      add("gpu.peer_memory", "", Verdict::fail, "no GPUDirect RDMA path: nvidia_peermem not loaded and no " + dmabuf,
          "modprobe nvidia-peermem (ships with the NVIDIA driver), or use the open kernel modules (driver >= 515) on a kernel >= 5.12");
    }
  }

  // ---- CPU power management ----
  void check_cpu() {
    const fs::path cpu = sys_ / "devices/system/cpu";
    std::vector<std::string> cpus;
    for (const auto& n : list_names(cpu))
      if (n.size() > 3 && n.rfind("cpu", 0) == 0 && parse_integer(n.substr(3))) cpus.push_back(n);

    std::map<std::string, int> governors;
    int with_governor = 0;
    for (const auto& c : cpus)
      if (auto g = read_text(cpu / c / "cpufreq/scaling_governor")) {
        ++governors[*g];
        ++with_governor;
      }
    if (with_governor == 0) {
      add("cpu.governor", "", Verdict::skip, "no cpufreq governor (frequency managed by firmware or the hypervisor)");
    } else if (governors.size() == 1 && governors.count("performance")) {
      add("cpu.governor", "", Verdict::pass, "all " + std::to_string(with_governor) + " CPUs use the performance governor");
    } else {
      std::vector<std::string> parts;
      for (const auto& [g, n] : governors) parts.push_back(std::to_string(n) + " " + g);
      add("cpu.governor", "", Verdict::warn, "CPU frequency governors: " + join(parts) + " (of " + std::to_string(with_governor) + ")",
          "cpupower frequency-set -g performance, and set the BIOS power profile to maximum performance");
    }

    // Deep C-states add tens to hundreds of microseconds of wake-up latency to
    // a polling or interrupt-driven receive; 10 us separates C1/C1E from C3+.
    constexpr long long deep_latency_us = 10;
    std::map<std::string, long long> deep;  // state name -> exit latency
    int cpus_with_deep = 0, cpus_with_idle = 0;
    for (const auto& c : cpus) {
      const auto states = list_names(cpu / c / "cpuidle");
      if (!states.empty()) ++cpus_with_idle;
      bool any = false;
      for (const auto& s : states) {
        const fs::path st = cpu / c / "cpuidle" / s;
        auto latency = parse_integer(read_text(st / "latency").value_or(""));
        if (!latency || *latency <= deep_latency_us || read_text(st / "disable").value_or("0") != "0") continue;
        deep[read_text(st / "name").value_or(s)] = *latency;
        any = true;
      }
      cpus_with_deep += any;
    }
    if (cpus_with_idle == 0) {
      add("cpu.idle", "", Verdict::skip, "no cpuidle states exposed");
    } else if (deep.empty()) {
      add("cpu.idle", "", Verdict::pass, "no idle state deeper than " + std::to_string(deep_latency_us) + " us exit latency is enabled");
    } else {
      std::vector<std::string> parts;
      for (const auto& [name, latency] : deep) parts.push_back(name + " (" + std::to_string(latency) + " us)");
      add("cpu.idle", "", Verdict::warn, "deep C-states enabled on " + std::to_string(cpus_with_deep) + " CPUs: " + join(parts),
          "cpupower idle-set -D " + std::to_string(deep_latency_us) +
              ", or boot with intel_idle.max_cstate=1 processor.max_cstate=1, or disable C-states in the BIOS");
    }
  }

  void check_pcie_aspm() {
    const auto policy_line = read_text(sys_ / "module/pcie_aspm/parameters/policy");
    if (!policy_line) {
      add("pcie.aspm", "", Verdict::skip, "no PCIe ASPM policy exposed");
      return;
    }
    const size_t open = policy_line->find('['), close = policy_line->find(']');
    const std::string policy = open != std::string::npos && close > open ? policy_line->substr(open + 1, close - open - 1) : *policy_line;
    if (policy == "powersave" || policy == "powersupersave")
      add("pcie.aspm", "", Verdict::warn, "ASPM policy " + policy + ": links enter low-power states and wake up slowly",
          "echo performance > /sys/module/pcie_aspm/parameters/policy, or boot with pcie_aspm=off");
    else
      add("pcie.aspm", "", Verdict::pass, "ASPM policy " + policy + (policy == "default" ? " (as the BIOS configured it)" : ""));
  }

  // ---- NIC rings and receive offloads ----
  void check_nics() {
    std::map<std::string, bool> interfaces;  // name -> carries RDMA (the lessons' rules apply fully)
    for (const auto& d : devices_)
      for (const auto& n : d.netdevs) interfaces[n] = true;
    for (const auto& n : options_.interfaces) interfaces[n] = true;
    if (interfaces.empty()) {
      const fs::path net = sys_ / "class/net";
      for (const auto& n : list_names(net))
        if (path_exists(net / n / "device")) interfaces[n] = false;
    }
    if (interfaces.empty()) {
      add("nic.rings", "", Verdict::skip, "no physical network interface");
      return;
    }
    std::shared_ptr<EthtoolSource> source = options_.ethtool;
    if (!source && path_exists(options_.root / "ethtool")) source = make_fixture_ethtool(options_.root / "ethtool");
    std::error_code ec;
    if (!source && fs::equivalent(options_.root, "/", ec)) source = make_ioctl_ethtool();
    if (!source) {
      add("nic.rings", "", Verdict::skip, "no ethtool source for root " + options_.root.string() + " (no ethtool/ folder)");
      return;
    }
    for (const auto& [ifname, rdma] : interfaces) {
      if (auto rings = source->rings(ifname); !rings) {
        add("nic.rings", ifname, Verdict::skip, "ring sizes not available: " + rings.status().message());
      } else {
        const RingSizes& r = *rings;
        const uint32_t want_rx = r.rx_max ? std::min<uint32_t>(4096, r.rx_max) : 4096;
        const uint32_t want_tx = r.tx_max ? std::min<uint32_t>(4096, r.tx_max) : 4096;
        std::ostringstream what;
        what << "rx " << r.rx << " tx " << r.tx << " (max " << r.rx_max << "/" << r.tx_max << ")";
        if (r.rx < want_rx || r.tx < want_tx)
          add("nic.rings", ifname, Verdict::warn, "small rings: " + what.str() + "; the deployment used 4096/4096",
              "ethtool -G " + ifname + " rx " + std::to_string(want_rx) + " tx " + std::to_string(want_tx));
        else
          add("nic.rings", ifname, Verdict::pass, what.str());
      }
      if (auto off = source->offloads(ifname); !off) {
        add("nic.offloads", ifname, Verdict::skip, "offloads not available: " + off.status().message());
      } else {
        auto state = [](const std::optional<bool>& b) { return b ? (*b ? "on" : "off") : "n/a"; };
        const std::string what = std::string("GRO ") + state(off->gro) + ", LRO " + state(off->lro);
        std::vector<std::string> fixes;
        if (off->gro.value_or(false) && rdma) fixes.push_back("gro off");
        if (off->lro.value_or(false)) fixes.push_back("lro off");
        if (!fixes.empty())
          add("nic.offloads", ifname, Verdict::warn, what + "; the deployment turned GRO and LRO off on RDMA NICs",
              "ethtool -K " + ifname + " " + join(fixes, " "));
        else
          add("nic.offloads", ifname, Verdict::pass,
              what + (!rdma && off->gro.value_or(false) ? " (not an RDMA NIC: GRO batches the soft provider's UDP receive)" : ""));
      }
    }
  }

  // ---- NCCL environment ----
  std::optional<std::string> env(const std::string& name) const {
    auto it = environment_.find(name);
    if (it == environment_.end()) return std::nullopt;
    return it->second;
  }

  // NCCL's list syntax for NCCL_IB_HCA and NCCL_SOCKET_IFNAME: "^" excludes,
  // "=" asks for exact names, otherwise each entry is a prefix; IB entries may
  // carry ":port".
  struct NameList {
    bool exclude = false, exact = false;
    std::vector<std::pair<std::string, std::string>> entries;  // name, port ("" = any)
  };
  static NameList parse_name_list(std::string value) {
    NameList list;
    if (!value.empty() && value[0] == '^') list.exclude = true, value.erase(0, 1);
    if (!value.empty() && value[0] == '=') list.exact = true, value.erase(0, 1);
    std::istringstream in(value);
    std::string item;
    while (std::getline(in, item, ',')) {
      item = trim(item);
      if (item.empty()) continue;
      const size_t colon = item.find(':');
      list.entries.emplace_back(item.substr(0, colon), colon == std::string::npos ? "" : item.substr(colon + 1));
    }
    return list;
  }
  static bool name_matches(const NameList& list, const std::string& entry, const std::string& name) {
    return list.exact ? name == entry : name.rfind(entry, 0) == 0;
  }

  void check_nccl() {
    if (auto v = env("NCCL_IB_DISABLE"); v && *v == "1")
      add("nccl.ib_disable", "", Verdict::fail, "NCCL_IB_DISABLE=1: NCCL uses TCP sockets, not RDMA", "unset NCCL_IB_DISABLE");
    else
      add("nccl.ib_disable", "", Verdict::pass, v ? "NCCL_IB_DISABLE=" + *v : "unset (IB/RoCE transport enabled)");

    check_nccl_hca();
    check_nccl_socket_ifname();
    check_nccl_gid_index();

    if (auto v = env("NCCL_NET_GDR_LEVEL")) {
      static const std::set<std::string> valid = {"LOC", "PIX", "PXB", "PHB", "SYS", "0", "1", "2", "3", "4", "5"};
      if (!valid.count(*v))
        add("nccl.gdr_level", "", Verdict::fail, "NCCL_NET_GDR_LEVEL=" + *v + " is not LOC, PIX, PXB, PHB or SYS",
            "unset NCCL_NET_GDR_LEVEL or set PXB");
      else if (*v == "LOC" || *v == "0")
        add("nccl.gdr_level", "", Verdict::warn, "NCCL_NET_GDR_LEVEL=" + *v + " disables GPUDirect RDMA",
            "unset NCCL_NET_GDR_LEVEL (NCCL decides from the PCIe topology) or set PXB");
      else
        add("nccl.gdr_level", "", Verdict::pass, "NCCL_NET_GDR_LEVEL=" + *v);
    } else {
      add("nccl.gdr_level", "", Verdict::pass, "unset (NCCL decides from the PCIe topology)");
    }

    // The deployment's tuned values; the ranges are those of the IB fields
    // they end up in (5-bit timeout exponent, 3-bit retry count, 8-bit traffic class).
    check_nccl_tuning("NCCL_IB_TIMEOUT", 22, 1, 31);
    check_nccl_tuning("NCCL_IB_RETRY_CNT", 7, 0, 7);
    check_nccl_tuning("NCCL_IB_TC", 41, 0, 255);
  }

  void check_nccl_hca() {
    const auto v = env("NCCL_IB_HCA");
    if (!v || v->empty()) {
      add("nccl.ib_hca", "", Verdict::pass, "unset (NCCL uses every RDMA device)");
      return;
    }
    const NameList list = parse_name_list(*v);
    std::vector<std::string> used, unknown;
    for (const auto& d : devices_) {
      bool listed = false;
      for (const auto& [entry, port] : list.entries)
        if (name_matches(list, entry, d.name)) listed = true;
      if (listed != list.exclude) used.push_back(d.name);
    }
    if (!list.exclude)
      for (const auto& [entry, port] : list.entries) {
        const RdmaDevice* match = nullptr;
        for (const auto& d : devices_)
          if (name_matches(list, entry, d.name)) match = &d;
        bool port_ok = port.empty() || (match && std::any_of(match->ports.begin(), match->ports.end(), [&](const RdmaPort& p) { return p.number == port; }));
        if (!match || !port_ok) unknown.push_back(entry + (port.empty() ? "" : ":" + port));
      }
    std::vector<std::string> have;
    for (const auto& d : devices_) have.push_back(d.name);
    const std::string present = have.empty() ? "no RDMA device" : "devices: " + join(have);
    if (used.empty())
      add("nccl.ib_hca", "", Verdict::fail, "NCCL_IB_HCA=" + *v + " selects no RDMA device (" + present + ")",
          "set NCCL_IB_HCA to existing devices (ibv_devices lists them) or unset it");
    else if (!unknown.empty())
      add("nccl.ib_hca", "", Verdict::warn, "NCCL_IB_HCA=" + *v + ": no such device/port: " + join(unknown) + " (" + present + ")",
          "remove the entries that do not exist");
    else
      add("nccl.ib_hca", "", Verdict::pass, "NCCL_IB_HCA=" + *v + " selects " + join(used));
  }

  void check_nccl_socket_ifname() {
    const auto v = env("NCCL_SOCKET_IFNAME");
    const auto interfaces = list_names(sys_ / "class/net");
    std::string suggestion = "<data-network interface>";
    for (const auto& d : devices_)
      if (!d.netdevs.empty()) {
        suggestion = d.netdevs.front();
        break;
      }
    if (!v || v->empty()) {
      add("nccl.socket_ifname", "", Verdict::warn,
          "unset: NCCL picks its bootstrap interface itself and may pick docker0 or a management port",
          "export NCCL_SOCKET_IFNAME=" + suggestion);
      return;
    }
    const NameList list = parse_name_list(*v);
    std::vector<std::string> used;
    for (const auto& n : interfaces) {
      if (n == "lo" && list.exclude) continue;  // NCCL skips loopback unless asked for it
      bool listed = false;
      for (const auto& [entry, port] : list.entries)
        if (name_matches(list, entry + (port.empty() ? "" : ":" + port), n)) listed = true;
      if (listed != list.exclude) used.push_back(n);
    }
    if (used.empty())
      add("nccl.socket_ifname", "", Verdict::fail,
          "NCCL_SOCKET_IFNAME=" + *v + " matches no interface (have " + join(interfaces) + ")", "export NCCL_SOCKET_IFNAME=" + suggestion);
    else
      add("nccl.socket_ifname", "", Verdict::pass, "NCCL_SOCKET_IFNAME=" + *v + " matches " + join(used));
  }

  // RoCE needs a RoCE v2 GID (UDP/IP routable). NCCL before 2.21 uses index 0
  // unless told otherwise, which is the RoCE v1 link-local GID on most setups.
  void check_nccl_gid_index() {
    struct EthernetPort {
      std::string device, port;
    };
    std::vector<EthernetPort> roce;
    for (const auto& d : devices_)
      for (const auto& p : d.ports)
        if (p.link_layer == "Ethernet") roce.push_back({d.name, p.number});
    const auto v = env("NCCL_IB_GID_INDEX");
    if (roce.empty()) {
      add("nccl.gid_index", "", Verdict::skip,
          std::string(v ? "NCCL_IB_GID_INDEX=" + *v + "; " : "") + "no RoCE (Ethernet link layer) port to check against");
      return;
    }
    auto gid_path = [&](const EthernetPort& e, const char* what, long long index) {
      return sys_ / "class/infiniband" / e.device / "ports" / e.port / what / std::to_string(index);
    };
    auto is_empty_gid = [](const std::string& gid) { return gid.find_first_not_of("0:") == std::string::npos; };
    // First RoCE v2 GID carrying an IPv4 address (::ffff:a.b.c.d), the usual choice.
    auto suggest = [&](const EthernetPort& e) -> std::optional<long long> {
      for (long long i = 0; i < 256; ++i) {
        const auto gid = read_text(gid_path(e, "gids", i));
        if (!gid) break;
        if (is_empty_gid(*gid) || read_text(gid_path(e, "gid_attrs/types", i)).value_or("") != "RoCE v2") continue;
        if (gid->rfind("0000:0000:0000:0000:0000:ffff:", 0) == 0) return i;
      }
      return std::nullopt;
    };
    if (!v) {
      std::optional<long long> s;
      for (const auto& e : roce)
        if ((s = suggest(e))) break;
      if (s && *s == 0)
        add("nccl.gid_index", "", Verdict::pass, "unset; GID index 0 is RoCE v2 with an IPv4 address");
      else
        add("nccl.gid_index", "", Verdict::warn,
            "unset: NCCL < 2.21 uses GID index 0, which is not a RoCE v2 IPv4 GID here",
            s ? "export NCCL_IB_GID_INDEX=" + std::to_string(*s) : "assign an IPv4 address to the RoCE interface, then set NCCL_IB_GID_INDEX");
      return;
    }
    auto index = parse_integer(*v);
    if (!index || *index < 0 || *index > 255) {
      add("nccl.gid_index", "", Verdict::fail, "NCCL_IB_GID_INDEX=" + *v + " is not an index 0..255",
          "set NCCL_IB_GID_INDEX to a RoCE v2 GID index (show_gids lists them)");
      return;
    }
    std::vector<std::string> empty, not_v2, good;
    std::optional<long long> s;
    for (const auto& e : roce) {
      const std::string name = e.device + "/" + e.port;
      const auto gid = read_text(gid_path(e, "gids", *index));
      const auto type = read_text(gid_path(e, "gid_attrs/types", *index)).value_or("");
      if (!gid || is_empty_gid(*gid))
        empty.push_back(name);
      else if (type != "RoCE v2")
        not_v2.push_back(name + " (" + (type.empty() ? "unknown type" : type) + ")");
      else
        good.push_back(name);
      if (!s) s = suggest(e);
    }
    const std::string fix = s ? "export NCCL_IB_GID_INDEX=" + std::to_string(*s) : "set NCCL_IB_GID_INDEX to a RoCE v2 GID index (show_gids lists them)";
    if (!empty.empty())
      add("nccl.gid_index", "", Verdict::fail, "NCCL_IB_GID_INDEX=" + *v + " is an empty GID on " + join(empty), fix);
    else if (!not_v2.empty())
      add("nccl.gid_index", "", Verdict::warn, "NCCL_IB_GID_INDEX=" + *v + " is not RoCE v2 on " + join(not_v2), fix);
    else
      add("nccl.gid_index", "", Verdict::pass, "NCCL_IB_GID_INDEX=" + *v + " is RoCE v2 on " + join(good));
  }

  void check_nccl_tuning(const std::string& name, long long want, long long low, long long high) {
    const std::string check = "nccl." + [&] {
      std::string s = name.substr(5);
      std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
      return s;
    }();
    const std::string fix = "export " + name + "=" + std::to_string(want);
    const auto v = env(name);
    if (!v) {
      add(check, "", Verdict::warn, "unset; the deployment used " + std::to_string(want), fix);
      return;
    }
    auto value = parse_integer(*v);
    if (!value || *value < low || *value > high)
      add(check, "", Verdict::fail, name + "=" + *v + " is outside " + std::to_string(low) + ".." + std::to_string(high), fix);
    else if (*value != want)
      add(check, "", Verdict::warn, name + "=" + *v + "; the deployment used " + std::to_string(want), fix);
    else
      add(check, "", Verdict::pass, name + "=" + *v);
  }

  const Options& options_;
  Report& report_;
  fs::path sys_, proc_;
  std::map<std::string, std::string> environment_;
  std::vector<RdmaDevice> devices_;
  std::vector<std::string> gpus_;
};

// ---- ethtool sources ----

class IoctlEthtool final : public EthtoolSource {
 public:
  IoctlEthtool() : fd_(::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0)) {}
  ~IoctlEthtool() override {
    if (fd_ >= 0) ::close(fd_);
  }
  Result<RingSizes> rings(const std::string& interface) override {
    ethtool_ringparam rp{};
    rp.cmd = ETHTOOL_GRINGPARAM;
    if (Status s = call(interface, &rp, "ETHTOOL_GRINGPARAM"); !s) return s;
    return RingSizes{rp.rx_pending, rp.tx_pending, rp.rx_max_pending, rp.tx_max_pending};
  }
  // ETHTOOL_GGRO and ETHTOOL_GFLAGS are the legacy single-feature requests;
  // the kernel still maps them onto the feature bits (NETIF_F_GRO,
  // NETIF_F_LRO), which spares looking bits up by name via ETHTOOL_GSTRINGS.
  Result<Offloads> offloads(const std::string& interface) override {
    Offloads out;
    ethtool_value gro{};
    gro.cmd = ETHTOOL_GGRO;
    if (call(interface, &gro, "ETHTOOL_GGRO")) out.gro = gro.data != 0;
    ethtool_value flags{};
    flags.cmd = ETHTOOL_GFLAGS;
    if (call(interface, &flags, "ETHTOOL_GFLAGS")) out.lro = (flags.data & ETH_FLAG_LRO) != 0;
    if (!out.gro && !out.lro) return Status(Errc::unsupported, interface + ": the driver reports neither GRO nor LRO");
    return out;
  }

 private:
  Status call(const std::string& interface, void* data, const char* what) {
    if (fd_ < 0) return Status(Errc::io_error, std::string("socket: ") + std::strerror(errno));
    if (interface.size() >= IFNAMSIZ) return Status(Errc::invalid_argument, "interface name too long: " + interface);
    ifreq ifr{};
    std::memcpy(ifr.ifr_name, interface.c_str(), interface.size());
    ifr.ifr_data = static_cast<char*>(data);
    if (::ioctl(fd_, SIOCETHTOOL, &ifr) != 0) return Status(Errc::io_error, std::string(what) + " on " + interface + ": " + std::strerror(errno));
    return Status::success();
  }
  int fd_;
};

class FixtureEthtool final : public EthtoolSource {
 public:
  explicit FixtureEthtool(fs::path dir) : dir_(std::move(dir)) {}
  Result<RingSizes> rings(const std::string& interface) override {
    auto values = read(interface, "rings");
    if (!values) return values.status();
    auto get = [&](const char* key) -> uint32_t {
      auto it = values->find(key);
      return it == values->end() ? 0 : static_cast<uint32_t>(parse_integer(it->second).value_or(0));
    };
    return RingSizes{get("rx"), get("tx"), get("rx_max"), get("tx_max")};
  }
  Result<Offloads> offloads(const std::string& interface) override {
    auto values = read(interface, "features");
    if (!values) return values.status();
    auto get = [&](const char* key) -> std::optional<bool> {
      auto it = values->find(key);
      if (it == values->end()) return std::nullopt;
      return it->second == "on";
    };
    return Offloads{get("gro"), get("lro")};
  }

 private:
  Result<std::map<std::string, std::string>> read(const std::string& interface, const char* file) {
    std::ifstream in(dir_ / interface / file);
    if (!in) return Status(Errc::not_found, "no fixture " + (dir_ / interface / file).string());
    std::map<std::string, std::string> values;
    std::string key, value;
    while (in >> key >> value) values[key] = value;
    return values;
  }
  fs::path dir_;
};

}  // namespace

std::unique_ptr<EthtoolSource> make_ioctl_ethtool() { return std::make_unique<IoctlEthtool>(); }
std::unique_ptr<EthtoolSource> make_fixture_ethtool(fs::path directory) { return std::make_unique<FixtureEthtool>(std::move(directory)); }

Report run(const Options& options) {
  Report report;
  Doctor(options, report).run();
  return report;
}

int compare_versions(const std::string& a, const std::string& b) {
  std::istringstream x(a), y(b);
  std::string p, q;
  while (true) {
    const bool more_a = static_cast<bool>(std::getline(x, p, '.'));
    const bool more_b = static_cast<bool>(std::getline(y, q, '.'));
    if (!more_a && !more_b) return 0;
    const long long u = more_a ? parse_integer(p).value_or(0) : 0, v = more_b ? parse_integer(q).value_or(0) : 0;
    if (u != v) return u < v ? -1 : 1;
  }
}

std::string format_text(const Report& report) {
  std::ostringstream out;
  for (const auto& f : report.findings) {
    std::string verdict = to_string(f.verdict);
    std::transform(verdict.begin(), verdict.end(), verdict.begin(), [](unsigned char c) { return std::toupper(c); });
    out << verdict << "  " << f.check << std::string(f.check.size() < 20 ? 20 - f.check.size() : 1, ' ')
        << (f.subject.empty() ? "" : f.subject + ": ") << f.message;
    if (!f.fix.empty()) out << " | fix: " << f.fix;
    out << "\n";
  }
  out << "doctor: " << report.count(Verdict::pass) << " pass, " << report.count(Verdict::warn) << " warn, " << report.count(Verdict::fail)
      << " fail, " << report.count(Verdict::skip) << " skip\n";
  return out.str();
}

std::string format_json(const Report& report) {
  nlohmann::json findings = nlohmann::json::array();
  for (const auto& f : report.findings)
    findings.push_back({{"check", f.check}, {"subject", f.subject}, {"verdict", to_string(f.verdict)}, {"message", f.message}, {"fix", f.fix}});
  nlohmann::json doc = {{"findings", findings},
                        {"summary",
                         {{"pass", report.count(Verdict::pass)},
                          {"warn", report.count(Verdict::warn)},
                          {"fail", report.count(Verdict::fail)},
                          {"skip", report.count(Verdict::skip)}}}};
  return doc.dump(2) + "\n";
}

Result<std::map<std::string, std::string>> read_environment_file(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return Status(Errc::not_found, "cannot read environment file " + path.string());
  std::map<std::string, std::string> env;
  std::string line;
  while (std::getline(in, line)) {
    line = trim(line);
    if (line.empty() || line[0] == '#') continue;
    if (line.rfind("export ", 0) == 0) line = trim(line.substr(7));
    const size_t eq = line.find('=');
    if (eq == std::string::npos || eq == 0) return Status(Errc::invalid_argument, path.string() + ": not KEY=VALUE: " + line);
    std::string value = trim(line.substr(eq + 1));
    if (value.size() >= 2 && (value.front() == '"' || value.front() == '\'') && value.back() == value.front())
      value = value.substr(1, value.size() - 2);
    env[trim(line.substr(0, eq))] = value;
  }
  return env;
}

std::map<std::string, std::string> process_environment() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e && *e; ++e) {
    const std::string entry = *e;
    const size_t eq = entry.find('=');
    if (eq != std::string::npos) env[entry.substr(0, eq)] = entry.substr(eq + 1);
  }
  return env;
}

}  // namespace stellar::doctor
