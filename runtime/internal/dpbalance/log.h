// dpbalance/log.h — the library's logger: spdlog, named "dpbalance", to stderr only (never
// stdout, which belongs to the engine). Thread-safe.
#pragma once

#include <memory>
#include <string_view>

#include "spdlog/spdlog.h"

namespace dpbalance {

std::shared_ptr<spdlog::logger> Logger();
// "trace", "debug", "info", "warn", "error", "off"; returns false for an unknown name.
bool SetLogLevel(std::string_view level);

}  // namespace dpbalance
