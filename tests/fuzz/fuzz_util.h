// tests/fuzz/fuzz_util.h — helpers shared by the libFuzzer targets (fuzz build only).
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace dpbalance::fuzz {

// The trace and timing readers take a path, not bytes (integration/ is not ours to refactor),
// so each input goes through one scratch file per process, rewritten for every input.
// The file lives in $TMPDIR (or /tmp) and is removed at a normal exit; libFuzzer's _Exit paths
// skip that, so scripts/fuzz.sh and the corpus ctests point TMPDIR at their own folder.
class ScratchFile {
 public:
  explicit ScratchFile(const char* tag) {
    const char* dir = std::getenv("TMPDIR");
    path_ = std::string(dir && *dir ? dir : "/tmp") + "/dpb_fuzz_" + tag + "_" +
            std::to_string(static_cast<long>(getpid()));
  }
  ~ScratchFile() { std::remove(path_.c_str()); }
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;

  // Replaces the file's contents with `size` bytes; aborts if the file cannot be written (a
  // harness failure, not a finding in the code under test).
  const std::string& Write(const uint8_t* data, size_t size) {
    std::FILE* f = std::fopen(path_.c_str(), "wb");
    if (f == nullptr || (size > 0 && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0) {
      std::perror(path_.c_str());
      std::abort();
    }
    return path_;
  }

 private:
  std::string path_;
};

}  // namespace dpbalance::fuzz
