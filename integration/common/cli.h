// integration/common/cli.h — the exit-code convention of the three command-line tools
// (dpbalance-replay, dpbalance-reference-engine, dpbalance-calibrate) and their flag parsing.
//
// Exit codes (docs/flags.md, "The tools' exit codes"):
//   0  success (and --help)
//   1  internal error: the run itself failed (the plugin, the router or a simulation)
//   2  usage error: a bad flag — unknown, unparsable, out of range, or an output path that
//      cannot be written; the message names the flag and the value
//   3  bad data: an input file that is missing, unreadable or holds a bad row or value; the
//      message names the file, the line and the value
// Nothing runs before the flags and the input files are checked, so 2 and 3 leave no output
// files behind.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#include <unistd.h>  // access

namespace dpbalance::cli {

enum ExitCode : int { kOk = 0, kInternalError = 1, kUsageError = 2, kBadData = 3 };

// Prints "<tool>: <message>" on stderr and returns `code`.
inline int Fail(const char* tool, const absl::Status& s, ExitCode code) {
  std::fprintf(stderr, "%s: %s\n", tool, std::string(s.message()).c_str());
  return code;
}

namespace internal {
inline bool g_parsing = false;
inline int g_exit_code_while_parsing = kUsageError;
}  // namespace internal

// absl::ParseCommandLine with the convention above: Abseil exits 1 both after --help and on an
// unknown flag or an unparsable value ("ERROR: Illegal value 'abc' specified for flag 'dp'");
// here --help (and --helpfull, --version, ...) exit 0 and the errors kUsageError. A positional
// argument (none of the tools takes one) is a usage error too. Returns argv[0] and nothing else.
inline std::vector<char*> ParseFlags(const char* tool, int argc, char** argv) {
  bool help = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--") break;
    for (const char* h : {"-help", "-helpfull", "-helpshort", "-helppackage", "-version",
                          "-only_check_args", "-helpon", "-helpmatch"}) {
      if (a == h || a == std::string("-") + h || absl::StartsWith(a, std::string("-") + h + "=") ||
          absl::StartsWith(a, std::string(h) + "=")) {
        help = true;
      }
    }
  }
  internal::g_exit_code_while_parsing = help ? kOk : kUsageError;
  // Abseil leaves through std::exit; this handler replaces its status while parsing lasts.
  static const bool registered = [] {
    std::atexit([] {
      if (!internal::g_parsing) return;
      std::cout.flush();
      std::fflush(nullptr);
      std::_Exit(internal::g_exit_code_while_parsing);
    });
    return true;
  }();
  (void)registered;
  internal::g_parsing = true;
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  internal::g_parsing = false;
  if (rest.size() > 1) {
    std::fprintf(stderr, "%s: unexpected argument '%s' (every input is a --flag; see --help)\n", tool, rest[1]);
    std::exit(kUsageError);
  }
  return rest;
}

// An output flag's path that cannot be written (a directory, a missing directory, no write
// permission): checked before any work, so a long run never ends in "cannot write". Does not
// create the file. OK for an empty path (no output asked for).
inline absl::Status CheckWritable(const std::string& flag, const std::string& path) {
  if (path.empty()) return absl::OkStatus();
  std::error_code ec;
  const std::filesystem::path p(path);
  if (std::filesystem::is_directory(p, ec)) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " = '", path, "' is a directory"));
  }
  const std::filesystem::path dir = p.has_parent_path() ? p.parent_path() : std::filesystem::path(".");
  if (!std::filesystem::is_directory(dir, ec)) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, " = '", path, "': directory '", dir.string(), "' does not exist"));
  }
  if (std::filesystem::exists(p, ec) ? access(path.c_str(), W_OK) != 0 : access(dir.c_str(), W_OK) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(flag, " = '", path, "' is not writable"));
  }
  return absl::OkStatus();
}

}  // namespace dpbalance::cli
