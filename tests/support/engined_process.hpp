// A stellar-engined of a test's own: started in the foreground on a
// private socket with the given extra options, stopped (SIGTERM, clean exit
// checked) when it goes. Tests that use it define STELLAR_ENGINED_PATH (the
// daemon built beside them).
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <vector>

#include "stellar/stellar.hpp"

namespace stellar::test {

// A daemon of our own, in the foreground, on a private socket.
class Engined {
 public:
  explicit Engined(std::vector<std::string> extra = {}) {
    char dir[] = "/tmp/stellar-engined-test-XXXXXX";
    dir_ = mkdtemp(dir);
    socket_ = dir_ + "/engined.sock";
    start(std::move(extra));
  }
  ~Engined() {
    stop(SIGTERM);
    ::unlink(log_.c_str());
    ::unlink(socket_.c_str());  // left behind by a daemon a test killed with SIGKILL
    ::rmdir(dir_.c_str());
  }
  void start(std::vector<std::string> extra = {}) {
    log_ = dir_ + "/log";
    pid_ = fork();
    if (pid_ == 0) {
      const int fd = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      dup2(fd, 2);
      std::vector<std::string> args{STELLAR_ENGINED_PATH, "--socket", socket_, "--foreground", "--wait", "adaptive"};
      args.insert(args.end(), extra.begin(), extra.end());
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      _exit(127);
    }
    // Up once the socket answers.
    for (int i = 0; i < 200; ++i) {
      const int fd = ::socket(AF_UNIX, SOCK_SEQPACKET, 0);
      sockaddr_un a{};
      a.sun_family = AF_UNIX;
      std::strncpy(a.sun_path, socket_.c_str(), sizeof a.sun_path - 1);
      const bool up = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
      ::close(fd);
      if (up) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ADD_FAILURE() << "stellar-engined did not come up";
  }
  void stop(int signal) {
    if (pid_ <= 0) return;
    ::kill(pid_, signal);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    // SIGTERM is a clean stop: exit status 0 (the sanitizer build's leak check runs then).
    if (signal == SIGTERM) {
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "stellar-engined status " << status << "; its log:\n" << log();
    }
  }
  bool alive() const { return pid_ > 0 && ::kill(pid_, 0) == 0 && ::waitpid(pid_, nullptr, WNOHANG) == 0; }
  const std::string& socket() const { return socket_; }
  std::string log() const {
    std::ifstream in(log_);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  ContextOptions options(Mode mode = Mode::stellar) const {
    ContextOptions o;
    o.mode = mode;
    o.progress = ProgressMode::daemon;
    o.engined_socket = socket_;
    return o;
  }

 private:
  std::string dir_, socket_, log_;
  pid_t pid_ = -1;
};

}  // namespace stellar::test
