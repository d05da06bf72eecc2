#include "core/log.hpp"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdlib>

namespace stellar {

spdlog::logger& log() {
  static const std::shared_ptr<spdlog::logger> logger = [] {
    auto l = spdlog::stderr_color_mt("stellar");
    const char* level = std::getenv("STELLAR_LOG_LEVEL");
    l->set_level(level ? spdlog::level::from_str(level) : spdlog::level::warn);
    l->set_pattern("[%H:%M:%S.%e] [stellar] [%l] %v");
    return l;
  }();
  return *logger;
}

}  // namespace stellar
