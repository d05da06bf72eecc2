// The `stellar` command-line tool. Subcommands:
//   doctor   check a node against the GPUDirect RDMA deployment lessons (docs/doctor.md)
//   config   every environment variable Stellar reads, with the value in effect (docs/configuration.md)
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <iomanip>
#include <iostream>

#include "core/config.hpp"
#include "doctor.hpp"

namespace {

struct DoctorArguments {
  std::string root = "/";
  bool json = false;
  std::string env_file;
  std::string ethtool_dir;
  std::vector<std::string> min_firmware;
  std::vector<std::string> interfaces;
};

// Exit status: 0 without failures, 1 with at least one failed check, 2 when
// the doctor could not run (bad arguments, unreadable environment file).
int run_doctor(const DoctorArguments& a) {
  stellar::doctor::Options options;
  options.root = a.root;
  options.min_firmware = a.min_firmware;
  options.interfaces = a.interfaces;
  if (!a.env_file.empty()) {
    auto env = stellar::doctor::read_environment_file(a.env_file);
    if (!env) {
      std::cerr << "stellar doctor: " << env.status().message() << "\n";
      return 2;
    }
    options.environment = std::move(*env);
  }
  if (!a.ethtool_dir.empty()) options.ethtool = stellar::doctor::make_fixture_ethtool(a.ethtool_dir);
  const auto report = stellar::doctor::run(options);
  std::cout << (a.json ? stellar::doctor::format_json(report) : stellar::doctor::format_text(report));
  return report.failed() ? 1 : 0;
}

// Prints the table of src/core/config.cpp with what this environment sets.
int run_config(bool json) {
  nlohmann::json out = nlohmann::json::array();
  for (const stellar::config::Variable& v : stellar::config::variables()) {
    auto value = stellar::config::text(v.name);
    // A secret is shown as set, never printed (logs and screens keep it).
    if (value && std::string(v.name) == "STELLAR_TENANT_CREDENTIAL") value = "(set, not shown)";
    if (json) {
      out.push_back({{"name", v.name}, {"value", value ? nlohmann::json(*value) : nlohmann::json()}, {"default", v.default_value},
                     {"unit", v.unit}, {"meaning", v.meaning}, {"read_by", v.reader}});
      continue;
    }
    std::cout << std::left << std::setw(26) << v.name << " "
              << (value ? *value : std::string("(unset") + (*v.default_value ? std::string(", default ") + v.default_value : "") + ")") << "\n"
              << "    " << v.meaning << " [" << v.unit << "]\n";
  }
  if (json) std::cout << out.dump(2) << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Stellar node tools"};
  app.require_subcommand(1);

  DoctorArguments doctor;
  auto* cmd = app.add_subcommand("doctor", "Check RDMA devices, firmware, PCIe links, GPU peer memory, CPU power management, "
                                           "NIC rings/offloads and the NCCL environment; exit 1 if a check fails");
  cmd->add_option("--root", doctor.root, "Read sysfs and procfs below this directory (fixture trees)")->capture_default_str()->check(CLI::ExistingDirectory);
  cmd->add_flag("--json", doctor.json, "Print the findings as JSON");
  cmd->add_option("--env-file", doctor.env_file, "Check NCCL_* variables from this KEY=VALUE file instead of the environment")->check(CLI::ExistingFile);
  cmd->add_option("--ethtool-dir", doctor.ethtool_dir, "Read ring sizes and offloads from fixture files DIR/<ifname>/{rings,features}")
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--min-fw", doctor.min_firmware, "Minimum NIC firmware MAJOR.MINOR.SUB (applies to devices with the same major); repeatable");
  cmd->add_option("--interface", doctor.interfaces, "Also check rings/offloads of this interface; repeatable");

  bool config_json = false;
  auto* config = app.add_subcommand("config", "List every environment variable Stellar reads, with its value here, default and unit");
  config->add_flag("--json", config_json, "Print the list as JSON");

  CLI11_PARSE(app, argc, argv);
  if (cmd->parsed()) return run_doctor(doctor);
  if (config->parsed()) return run_config(config_json);
  return 2;
}
