#include "dpbalance/log.h"

#include <mutex>

#include "spdlog/sinks/stdout_color_sinks.h"

namespace dpbalance {

std::shared_ptr<spdlog::logger> Logger() {
  static std::once_flag once;
  static std::shared_ptr<spdlog::logger> logger;
  std::call_once(once, [] {
    logger = spdlog::get("dpbalance");
    if (!logger) {
      logger = std::make_shared<spdlog::logger>(
          "dpbalance", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
      logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [dpbalance] [%l] %v");
      logger->set_level(spdlog::level::info);
    }
  });
  return logger;
}

bool SetLogLevel(std::string_view level) {
  const spdlog::level::level_enum l = spdlog::level::from_str(std::string(level));
  if (l == spdlog::level::off && level != "off") return false;
  Logger()->set_level(l);
  return true;
}

}  // namespace dpbalance
