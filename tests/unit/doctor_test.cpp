// `stellar doctor` on the fixture trees of tests/fixtures/doctor/: every
// verdict each scenario must produce (make-fixtures.sh builds the trees).
#include "doctor.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace fs = std::filesystem;
using namespace stellar::doctor;

namespace {

const fs::path fixtures = STELLAR_DOCTOR_FIXTURES;

Report run_scenario(const std::string& scenario, std::vector<std::string> min_firmware = {}, const std::string& env_scenario = {}) {
  Options options;
  options.root = fixtures / scenario;
  auto env = read_environment_file(fixtures / (env_scenario.empty() ? scenario : env_scenario) / "env");
  EXPECT_TRUE(env.ok()) << env.status().message();
  if (env) options.environment = *env;
  options.min_firmware = std::move(min_firmware);
  return run(options);
}

Report run_healthy_with(std::map<std::string, std::string> environment) {
  Options options;
  options.root = fixtures / "healthy";
  options.environment = std::move(environment);
  return run(options);
}

// The single finding of a check (and subject); fails the test if there is not exactly one.
Finding one(const Report& report, const std::string& check, const std::string& subject = {}) {
  auto found = report.find(check, subject);
  EXPECT_EQ(found.size(), 1u) << check << " " << subject << "\n" << format_text(report);
  return found.empty() ? Finding{check, subject, Verdict::skip, "<missing>", ""} : found.front();
}

Verdict verdict(const Report& report, const std::string& check, const std::string& subject = {}) { return one(report, check, subject).verdict; }

bool contains(const std::string& haystack, const std::string& needle) { return haystack.find(needle) != std::string::npos; }

}  // namespace

TEST(Doctor, HealthyNodePassesEveryCheck) {
  const Report r = run_scenario("healthy", {"20.31.1014"});
  EXPECT_EQ(r.count(Verdict::warn), 0) << format_text(r);
  EXPECT_EQ(r.count(Verdict::fail), 0) << format_text(r);
  EXPECT_EQ(r.count(Verdict::skip), 0) << format_text(r);
  EXPECT_FALSE(r.failed());
  EXPECT_TRUE(contains(one(r, "rdma.devices").message, "mlx5_0, mlx5_1"));
  EXPECT_EQ(verdict(r, "rdma.firmware", "mlx5_0"), Verdict::pass);
  EXPECT_EQ(verdict(r, "rdma.port", "mlx5_1/1"), Verdict::pass);
  EXPECT_EQ(verdict(r, "rdma.cm"), Verdict::pass);
  EXPECT_EQ(verdict(r, "pcie.link", "mlx5_0 (0000:3b:00.0)"), Verdict::pass);
  EXPECT_EQ(verdict(r, "pcie.link", "mlx5_1 (0000:86:00.0)"), Verdict::pass);
  EXPECT_EQ(verdict(r, "pcie.link", "GPU 0000:3d:00.0"), Verdict::pass);
  EXPECT_EQ(r.find("pcie.link").size(), 3u);  // the NICs' netdevs are the same PCI functions; the ISA bridge is no GPU
  EXPECT_TRUE(contains(one(r, "gpu.driver").message, "535.104.05 (open kernel modules)"));
  EXPECT_TRUE(contains(one(r, "gpu.peer_memory").message, "nvidia_peermem loaded"));
  EXPECT_EQ(verdict(r, "cpu.governor"), Verdict::pass);
  EXPECT_EQ(verdict(r, "cpu.idle"), Verdict::pass);  // C6 exists but is disabled
  EXPECT_EQ(verdict(r, "pcie.aspm"), Verdict::pass);
  EXPECT_EQ(verdict(r, "nic.rings", "ens1f0"), Verdict::pass);
  EXPECT_EQ(verdict(r, "nic.offloads", "ens2f0"), Verdict::pass);
  EXPECT_TRUE(r.find("nic.rings", "docker0").empty());  // not a NIC of an RDMA device
  for (const char* check : {"nccl.ib_disable", "nccl.ib_hca", "nccl.socket_ifname", "nccl.gid_index", "nccl.gdr_level", "nccl.ib_timeout",
                            "nccl.ib_retry_cnt", "nccl.ib_tc"})
    EXPECT_EQ(verdict(r, check), Verdict::pass) << check;
}

TEST(Doctor, DegradedPcieLinkFirmwareAndPort) {
  const Report r = run_scenario("degraded_pcie", {"20.30.0"});
  const Finding nic = one(r, "pcie.link", "mlx5_0 (0000:3b:00.0)");
  EXPECT_EQ(nic.verdict, Verdict::fail);
  EXPECT_TRUE(contains(nic.message, "x8 at 16.0 GT/s PCIe (max x16"));
  EXPECT_TRUE(contains(nic.fix, "lspci -vv -s 0000:3b:00.0"));
  EXPECT_EQ(verdict(r, "pcie.link", "mlx5_1 (0000:86:00.0)"), Verdict::pass);
  const Finding gpu = one(r, "pcie.link", "GPU 0000:3d:00.0");
  EXPECT_EQ(gpu.verdict, Verdict::warn);  // speed only: GPUs downshift when idle
  EXPECT_TRUE(contains(gpu.fix, "under load"));

  const Finding old = one(r, "rdma.firmware", "mlx5_1");
  EXPECT_EQ(old.verdict, Verdict::fail);
  EXPECT_TRUE(contains(old.message, "20.28.1002 is older than the minimum 20.30.0"));
  EXPECT_EQ(verdict(r, "rdma.firmware", "mlx5_0"), Verdict::pass);
  const Finding mismatch = one(r, "rdma.firmware", "mlx5_1,mlx5_0");
  EXPECT_EQ(mismatch.verdict, Verdict::warn);
  EXPECT_TRUE(contains(mismatch.message, "different firmware"));

  EXPECT_EQ(verdict(r, "rdma.port", "mlx5_0/1"), Verdict::pass);
  EXPECT_EQ(verdict(r, "rdma.port", "mlx5_1/1"), Verdict::fail);
  const Finding cm = one(r, "rdma.cm");
  EXPECT_EQ(cm.verdict, Verdict::warn);
  EXPECT_TRUE(contains(cm.fix, "modprobe rdma_ucm"));
  EXPECT_TRUE(r.failed());
  EXPECT_EQ(r.count(Verdict::fail), 3);
  EXPECT_EQ(r.count(Verdict::warn), 3);
}

TEST(Doctor, FirmwareMinimumAppliesOnlyToItsFamily) {
  // 16.x is ConnectX-5 firmware; it says nothing about 20.x devices.
  const Report r = run_scenario("degraded_pcie", {"16.35.1012"});
  EXPECT_EQ(verdict(r, "rdma.firmware", "mlx5_1"), Verdict::pass);
  EXPECT_TRUE(contains(one(r, "rdma.firmware", "mlx5_1").message, "no minimum given for this family"));
  EXPECT_EQ(verdict(r, "rdma.firmware", "mlx5_1,mlx5_0"), Verdict::warn);  // the mismatch stays
}

TEST(Doctor, NoRdmaDeviceVirtualMachine) {
  const Report r = run_scenario("no_rdma");
  const Finding devices = one(r, "rdma.devices");
  EXPECT_EQ(devices.verdict, Verdict::fail);
  EXPECT_TRUE(contains(devices.fix, "--provider soft"));
  EXPECT_TRUE(r.find("rdma.port").empty());
  EXPECT_TRUE(r.find("rdma.firmware").empty());
  EXPECT_TRUE(r.find("rdma.cm").empty());  // said by rdma.devices already
  EXPECT_EQ(verdict(r, "pcie.link", "eth0 (0000:00:03.0)"), Verdict::skip);  // virtio: PCI slot found through the parent
  EXPECT_EQ(verdict(r, "gpu.peer_memory"), Verdict::skip);
  EXPECT_TRUE(r.find("gpu.driver").empty());
  EXPECT_EQ(verdict(r, "cpu.governor"), Verdict::skip);
  const Finding idle = one(r, "cpu.idle");
  EXPECT_EQ(idle.verdict, Verdict::warn);
  EXPECT_TRUE(contains(idle.message, "C6 (133 us)"));
  EXPECT_EQ(verdict(r, "pcie.aspm"), Verdict::pass);
  const Finding rings = one(r, "nic.rings", "eth0");
  EXPECT_EQ(rings.verdict, Verdict::warn);
  EXPECT_EQ(rings.fix, "ethtool -G eth0 rx 1024 tx 1024");  // 4096 capped by the driver's maximum
  EXPECT_EQ(verdict(r, "nic.offloads", "eth0"), Verdict::pass);  // GRO on is fine off the RDMA path
  EXPECT_TRUE(r.find("nic.rings", "lo").empty());
  EXPECT_EQ(verdict(r, "nccl.gid_index"), Verdict::skip);
  EXPECT_EQ(verdict(r, "nccl.socket_ifname"), Verdict::warn);
  EXPECT_EQ(verdict(r, "nccl.ib_timeout"), Verdict::warn);
  EXPECT_EQ(r.count(Verdict::fail), 1);
}

TEST(Doctor, PeermemMissingWithProprietaryDriverFails) {
  const Report r = run_scenario("peermem_missing");
  const Finding driver = one(r, "gpu.driver");
  EXPECT_EQ(driver.verdict, Verdict::pass);
  EXPECT_TRUE(contains(driver.message, "535.104.05 (proprietary kernel modules)"));
  const Finding peer = one(r, "gpu.peer_memory");
  EXPECT_EQ(peer.verdict, Verdict::fail);
  EXPECT_TRUE(contains(peer.message, "nvidia_peermem not loaded"));
  EXPECT_TRUE(contains(peer.fix, "modprobe nvidia-peermem"));
  EXPECT_EQ(r.count(Verdict::fail), 1);
}

TEST(Doctor, DmabufPathWithoutPeermemPasses) {
  const Report r = run_scenario("dmabuf_only");
  const Finding peer = one(r, "gpu.peer_memory");
  EXPECT_EQ(peer.verdict, Verdict::pass);
  EXPECT_TRUE(contains(peer.message, "dma-buf path is available"));
  EXPECT_FALSE(r.failed());
}

TEST(Doctor, PowerManagementWarns) {
  const Report r = run_scenario("powersave");
  const Finding governor = one(r, "cpu.governor");
  EXPECT_EQ(governor.verdict, Verdict::warn);
  EXPECT_TRUE(contains(governor.message, "1 performance, 1 powersave"));
  EXPECT_TRUE(contains(governor.fix, "cpupower frequency-set -g performance"));
  const Finding idle = one(r, "cpu.idle");
  EXPECT_EQ(idle.verdict, Verdict::warn);
  EXPECT_TRUE(contains(idle.message, "on 2 CPUs: C6 (133 us)"));
  EXPECT_EQ(verdict(r, "pcie.aspm"), Verdict::warn);
  EXPECT_EQ(r.count(Verdict::warn), 3);
  EXPECT_FALSE(r.failed());
}

TEST(Doctor, NicRingsAndOffloadsWarn) {
  const Report r = run_scenario("nic_tuning");
  const Finding rings = one(r, "nic.rings", "ens1f0");
  EXPECT_EQ(rings.verdict, Verdict::warn);
  EXPECT_EQ(rings.fix, "ethtool -G ens1f0 rx 4096 tx 4096");
  const Finding offloads = one(r, "nic.offloads", "ens1f0");
  EXPECT_EQ(offloads.verdict, Verdict::warn);
  EXPECT_EQ(offloads.fix, "ethtool -K ens1f0 gro off lro off");
  EXPECT_EQ(verdict(r, "nic.rings", "ens2f0"), Verdict::pass);
  EXPECT_EQ(r.count(Verdict::warn), 2);
}

TEST(Doctor, NcclMisconfigured) {
  const Report r = run_scenario("nccl_misconfigured");
  EXPECT_EQ(verdict(r, "nccl.ib_disable"), Verdict::fail);
  const Finding hca = one(r, "nccl.ib_hca");
  EXPECT_EQ(hca.verdict, Verdict::warn);  // "=mlx5_0,mlx5_9": one exists, one does not
  EXPECT_TRUE(contains(hca.message, "mlx5_9"));
  EXPECT_EQ(verdict(r, "nccl.socket_ifname"), Verdict::fail);  // no interface starts with "ib"
  const Finding gid = one(r, "nccl.gid_index");
  EXPECT_EQ(gid.verdict, Verdict::warn);  // index 2 is RoCE v1
  EXPECT_EQ(gid.fix, "export NCCL_IB_GID_INDEX=3");
  EXPECT_EQ(verdict(r, "nccl.gdr_level"), Verdict::warn);
  EXPECT_EQ(verdict(r, "nccl.ib_timeout"), Verdict::fail);  // 40 does not fit the 5-bit field
  EXPECT_EQ(verdict(r, "nccl.ib_retry_cnt"), Verdict::warn);
  EXPECT_EQ(verdict(r, "nccl.ib_tc"), Verdict::warn);
}

TEST(Doctor, NcclVariableRules) {
  const std::map<std::string, std::string> tuned = {{"NCCL_IB_TIMEOUT", "22"}, {"NCCL_IB_RETRY_CNT", "7"}, {"NCCL_IB_TC", "41"}};
  auto with = [&](std::map<std::string, std::string> extra) {
    extra.insert(tuned.begin(), tuned.end());
    return run_healthy_with(extra);
  };
  EXPECT_EQ(verdict(with({{"NCCL_IB_GID_INDEX", "4"}}), "nccl.gid_index"), Verdict::fail);  // empty GID slot
  EXPECT_EQ(verdict(with({{"NCCL_IB_GID_INDEX", "x"}}), "nccl.gid_index"), Verdict::fail);
  const Finding unset = one(with({}), "nccl.gid_index");
  EXPECT_EQ(unset.verdict, Verdict::warn);
  EXPECT_EQ(unset.fix, "export NCCL_IB_GID_INDEX=3");
  EXPECT_EQ(verdict(with({{"NCCL_IB_HCA", "^mlx5_0"}}), "nccl.ib_hca"), Verdict::pass);
  EXPECT_EQ(verdict(with({{"NCCL_IB_HCA", "^mlx5"}}), "nccl.ib_hca"), Verdict::fail);
  EXPECT_EQ(verdict(with({{"NCCL_IB_HCA", "mlx5_1:1"}}), "nccl.ib_hca"), Verdict::pass);
  EXPECT_EQ(verdict(with({{"NCCL_IB_HCA", "mlx5_1:2,mlx5_0"}}), "nccl.ib_hca"), Verdict::warn);  // no port 2
  EXPECT_EQ(verdict(with({{"NCCL_IB_HCA", "=mlx5"}}), "nccl.ib_hca"), Verdict::fail);          // exact: no device "mlx5"
  EXPECT_EQ(verdict(with({{"NCCL_SOCKET_IFNAME", "^docker,lo"}}), "nccl.socket_ifname"), Verdict::pass);
  EXPECT_EQ(verdict(with({{"NCCL_SOCKET_IFNAME", "=ens"}}), "nccl.socket_ifname"), Verdict::fail);
  EXPECT_EQ(verdict(with({{"NCCL_NET_GDR_LEVEL", "bogus"}}), "nccl.gdr_level"), Verdict::fail);
  EXPECT_EQ(verdict(with({{"NCCL_NET_GDR_LEVEL", "SYS"}}), "nccl.gdr_level"), Verdict::pass);
  EXPECT_EQ(verdict(with({{"NCCL_IB_DISABLE", "0"}}), "nccl.ib_disable"), Verdict::pass);
  EXPECT_EQ(verdict(with({{"NCCL_IB_RETRY_CNT", "8"}}), "nccl.ib_retry_cnt"), Verdict::fail);
  EXPECT_EQ(verdict(with({{"NCCL_IB_TC", "106"}}), "nccl.ib_tc"), Verdict::warn);
}

namespace {
class FailingEthtool final : public EthtoolSource {
 public:
  stellar::Result<RingSizes> rings(const std::string& i) override { return stellar::Status(stellar::Errc::io_error, "ETHTOOL_GRINGPARAM on " + i + ": EOPNOTSUPP"); }
  stellar::Result<Offloads> offloads(const std::string& i) override { return stellar::Status(stellar::Errc::unsupported, i + ": nothing"); }
};
}  // namespace

TEST(Doctor, EthtoolSourceIsPluggable) {
  Options options;
  options.root = fixtures / "healthy";
  options.environment = std::map<std::string, std::string>{};
  options.ethtool = std::make_shared<FailingEthtool>();
  options.interfaces = {"ens9"};  // asked for explicitly, though no RDMA device owns it
  const Report r = run(options);
  EXPECT_EQ(r.find("nic.rings").size(), 3u);
  const Finding rings = one(r, "nic.rings", "ens9");
  EXPECT_EQ(rings.verdict, Verdict::skip);
  EXPECT_TRUE(contains(rings.message, "EOPNOTSUPP"));
  EXPECT_EQ(verdict(r, "nic.offloads", "ens1f0"), Verdict::skip);
}

TEST(Doctor, EmptyRootDoesNotCrash) {
  const fs::path root = fs::temp_directory_path() / ("stellar-doctor-empty-" + std::to_string(::getpid()));
  fs::create_directories(root);
  Options options;
  options.root = root;
  options.environment = std::map<std::string, std::string>{};
  const Report r = run(options);
  fs::remove_all(root);
  EXPECT_EQ(verdict(r, "rdma.devices"), Verdict::fail);
  EXPECT_EQ(verdict(r, "nic.rings"), Verdict::skip);
  EXPECT_EQ(verdict(r, "cpu.idle"), Verdict::skip);
  EXPECT_EQ(verdict(r, "pcie.aspm"), Verdict::skip);
  EXPECT_EQ(r.count(Verdict::fail), 1);
}

// This machine, whatever it has: the doctor must finish and give a clear
// verdict on RDMA devices (fail with the soft-provider hint when there are none).
TEST(Doctor, RunsOnThisMachine) {
  Options options;  // root "/", the process environment, the ioctl ethtool source
  const Report r = run(options);
  const Finding devices = one(r, "rdma.devices");
  if (!fs::exists("/sys/class/infiniband") || fs::is_empty("/sys/class/infiniband"))
    EXPECT_EQ(devices.verdict, Verdict::fail);
  else
    EXPECT_EQ(devices.verdict, Verdict::pass);
  EXPECT_FALSE(r.find("cpu.idle").empty());
  EXPECT_FALSE(r.find("nccl.ib_disable").empty());
}

TEST(Doctor, JsonAndTextOutput) {
  const Report r = run_scenario("degraded_pcie", {"20.30.0"});
  const auto doc = nlohmann::json::parse(format_json(r));
  ASSERT_EQ(doc["findings"].size(), r.findings.size());
  EXPECT_EQ(doc["summary"]["fail"], 3);
  EXPECT_EQ(doc["summary"]["warn"], 3);
  bool saw = false;
  for (const auto& f : doc["findings"])
    if (f["check"] == "pcie.link" && f["verdict"] == "fail") saw = f["subject"] == "mlx5_0 (0000:3b:00.0)" && !f["fix"].get<std::string>().empty();
  EXPECT_TRUE(saw);

  const std::string text = format_text(r);
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), static_cast<long>(r.findings.size()) + 1);
  EXPECT_TRUE(contains(text, "FAIL  pcie.link           mlx5_0 (0000:3b:00.0): degraded link"));
  EXPECT_TRUE(contains(text, "doctor: 21 pass, 3 warn, 3 fail, 0 skip"));
}

TEST(Doctor, EnvironmentFileParsing) {
  auto env = read_environment_file(fixtures / "nccl_misconfigured" / "env");
  ASSERT_TRUE(env.ok());
  EXPECT_EQ(env->at("NCCL_IB_DISABLE"), "1");             // "export " removed
  EXPECT_EQ(env->at("NCCL_IB_HCA"), "=mlx5_0,mlx5_9");    // quotes removed
  EXPECT_EQ(env->count("NCCL_IB_TC"), 0u);
  EXPECT_EQ(read_environment_file(fixtures / "missing.env").status().code(), stellar::Errc::not_found);
  EXPECT_FALSE(read_environment_file(fixtures / "make-fixtures.sh").ok());  // not KEY=VALUE lines
}

TEST(Doctor, CompareVersions) {
  EXPECT_LT(compare_versions("20.28.1002", "20.31.1014"), 0);
  EXPECT_EQ(compare_versions("20.31.1014", "20.31.1014"), 0);
  EXPECT_GT(compare_versions("20.31.2006", "20.31.1014"), 0);
  EXPECT_EQ(compare_versions("5.12", "5.12.0"), 0);
  EXPECT_GT(compare_versions("6.1.0", "5.12"), 0);
  EXPECT_LT(compare_versions("5.4", "5.12"), 0);  // numeric, not lexical
  EXPECT_GT(compare_versions("535.104.05", "515"), 0);
}
