// Stands in for spdlog/spdlog.h: an installed dpbalance header must not need it.
#error "an installed dpbalance header includes spdlog/spdlog.h"
