#include "core/log.hpp"

#include <spdlog/sinks/stdout_color_sinks.h>

#include <cstdio>

#include "core/config.hpp"

namespace stellar {

spdlog::logger& log() {
  static const std::shared_ptr<spdlog::logger> logger = [] {
    auto l = spdlog::stderr_color_mt("stellar");
    // spdlog takes an unknown name for "off": say so instead of going quiet.
    spdlog::level::level_enum level = spdlog::level::warn;
    if (auto name = config::text("STELLAR_LOG_LEVEL")) {
      level = spdlog::level::from_str(*name);
      if (level == spdlog::level::off && *name != "off") {
        std::fprintf(stderr, "stellar: STELLAR_LOG_LEVEL='%s' is not a level (trace, debug, info, warn, error, critical, off); using warn\n",
                     name->c_str());
        level = spdlog::level::warn;
      }
    }
    l->set_level(level);
    l->set_pattern("[%H:%M:%S.%e] [stellar] [%l] %v");
    return l;
  }();
  return *logger;
}

}  // namespace stellar
