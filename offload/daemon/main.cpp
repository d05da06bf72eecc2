// stellar-engined: hosts the offload engines of every application on this
// host that selects the daemon placement (STELLAR_ENGINE=daemon, or
// ContextOptions::progress = ProgressMode::daemon). docs/engine-daemon.md.
//
//   stellar-engined --socket /run/stellar/engined.sock [--cores N] [--tenants FILE] [--tx-rate B/s] [--foreground]
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>

#include "daemon/daemon.hpp"

namespace {
stellar::engined::Daemon* running = nullptr;
void on_signal(int) {
  if (running) running->stop();
}
}  // namespace

int main(int argc, char** argv) {
  stellar::engined::DaemonOptions o;
  o.socket_path = "/run/stellar/engined.sock";
  bool foreground = false;
  std::string wait = "poll";
  CLI::App app{"stellar-engined: the Stellar offload engine daemon (the SmartNIC placement of the engine)"};
  app.add_option("--socket", o.socket_path, "Unix socket applications attach to")->capture_default_str();
  app.add_option("--cores", o.cores, "engine threads (shards); each owns a set of contexts")->check(CLI::Range(1, 256))->capture_default_str();
  app.add_option("--wait", wait, "shard threads: poll (spin, the default: a SmartNIC core does nothing else) or adaptive (spin, then sleep)")
      ->check(CLI::IsMember({"poll", "adaptive"}))
      ->capture_default_str();
  uint64_t spin_us = 50;
  app.add_option("--spin-us", spin_us, "adaptive: spin this long without work before sleeping")->capture_default_str();
  app.add_option("--allow-uid", o.allow_uids, "users whose applications may attach (default: this daemon's user and root)");
  app.add_option("--allow-gid", o.allow_gids, "groups whose applications may attach");
  app.add_option("--max-clients", o.max_clients, "application contexts served at once")->check(CLI::Range(1u, 1u << 20))->capture_default_str();
  app.add_option("--max-qps", o.max_qps_per_client, "QPs one context may attach")->check(CLI::Range(1u, 1u << 24))->capture_default_str();
  app.add_option("--max-regions", o.max_regions_per_client, "memory regions one context may register")
      ->check(CLI::Range(1u, 1u << 24))
      ->capture_default_str();
  app.add_option("--tenants", o.tenants_file,
                 "tenants file (JSON, docs/scheduler.md): serve only its tenants, each with its credential, quotas, weight and rate limit")
      ->check(CLI::ExistingFile);
  app.add_option("--tx-rate", o.tx_rate_bytes_per_s, "bytes/s the daemon's packets leave at, split over the shards (0: no limit)")
      ->check(CLI::Range(uint64_t(0), uint64_t(1) << 48))
      ->capture_default_str();
  app.add_flag("--foreground", foreground, "stay in the foreground, log to stderr (containers, tests, systemd)");
  CLI11_PARSE(app, argc, argv);
  o.busy_poll = wait == "poll";
  // Absolute: daemon() changes to /, and the socket is removed at exit.
  std::error_code ec;
  if (auto absolute = std::filesystem::absolute(o.socket_path, ec); !ec) o.socket_path = absolute.string();
  // Every client holds a few descriptors here (its socket, bell, UDP
  // socket, /proc/PID/mem, pidfd): take all the kernel allows.
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) == 0 && files.rlim_cur < files.rlim_max) {
    files.rlim_cur = files.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &files);
  }
  o.spin_ns = spin_us * 1000;

  stellar::engined::Daemon daemon(o);
  if (auto error = daemon.start()) {
    std::fprintf(stderr, "stellar-engined: %s\n", error->c_str());
    return 1;
  }
  if (!foreground && ::daemon(0, 0) != 0) {
    std::perror("stellar-engined: daemon()");
    return 1;
  }
  running = &daemon;
  struct sigaction sa{};
  sa.sa_handler = on_signal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
  daemon.run();
  running = nullptr;
  return 0;
}
