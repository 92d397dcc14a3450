// Fuzzes the plugin's flag parser (plugin/src/flags.h): ParseFlags on an arbitrary DPB_*
// environment and config string. Input: lines up to the first line "--" are environment entries
// NAME=VALUE (a line without '=' is the name DPB_<line>); everything after it is the config
// string. A parse that succeeds must give a planner config that Planner::Create accepts.
//
// '/' is mapped to '_' so that `cost_model=<path>` never names a file outside the working
// directory (e.g. /dev/zero or /dev/stdin, which would block the reader: the file read is the
// cost-model loader's business, not the flag parser's).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>

#include "absl/strings/str_split.h"
#include "dpbalance/planner.h"
#include "flags.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string text(reinterpret_cast<const char*>(data), size);
  std::replace(text.begin(), text.end(), '/', '_');
  std::map<std::string, std::string> env;
  std::string config;
  const size_t sep = text.find("\n--\n");
  if (sep != std::string::npos) {
    for (absl::string_view line : absl::StrSplit(absl::string_view(text).substr(0, sep), '\n')) {
      const size_t eq = line.find('=');
      if (eq == absl::string_view::npos) {
        env[std::string("DPB_") + std::string(line)] = "";
      } else {
        env[std::string(line.substr(0, eq))] = std::string(line.substr(eq + 1));
      }
    }
    config = text.substr(sep + 4);
  } else {
    config = text;
  }
  absl::StatusOr<dpbalance::plugin::PluginFlags> f = dpbalance::plugin::ParseFlags(env, config);
  if (!f.ok()) return 0;
  // Every value the parser accepts is in range: the planner must take it.
  absl::StatusOr<dpbalance::Planner> p =
      dpbalance::Planner::Create(f->balancer.planner, f->balancer.model);
  if (!p.ok()) {
    std::fprintf(stderr, "ParseFlags accepted flags that Planner::Create rejects: %s\n",
                 std::string(p.status().message()).c_str());
    std::abort();
  }
  return 0;
}
