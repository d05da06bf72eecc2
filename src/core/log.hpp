// Control-plane logging (spdlog). The data path never logs: it counts
// (ContextCounters). Level from STELLAR_LOG_LEVEL (trace, debug, info, warn,
// error, off; default warn); output to stderr. Thread-safe.
#pragma once

#include <spdlog/spdlog.h>

namespace stellar {

spdlog::logger& log();

}  // namespace stellar
