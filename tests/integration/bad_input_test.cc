// Bad input at the file boundary: the trace readers (integration/replay/trace.cc) and the timing-row
// readers (integration/calibrate/timing_rows.cc) refuse every out-of-range, non-integer or
// non-finite number before any arithmetic, with a message naming the file, the line and the value.
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "timing_rows.h"
#include "trace.h"

namespace dpbalance {
namespace {

using ::testing::HasSubstr;

std::string WriteTemp(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + "/bad_input_" + name;
  std::ofstream(path) << text;
  return path;
}

constexpr char kGoodMooncake[] = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5}\n";

// The error of a Mooncake trace whose second line has `input_length` = `value` (JSON text).
absl::Status MooncakeInputLength(const std::string& name, const std::string& value) {
  const std::string path = WriteTemp(name, std::string(kGoodMooncake) + "{\"timestamp\": 1, \"input_length\": " +
                                               value + ", \"output_length\": 5}\n");
  return replay::LoadTrace(path, replay::TraceFormat::kAuto, 1).status();
}

TEST(BadTrace, MooncakeLengthsOutOfRangeNameLineAndValue) {
  for (const auto& [name, value, why] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"int64max.jsonl", "9223372036854775807", "exceeds 16777216 tokens"},
           {"uint64max.jsonl", "18446744073709551615", "exceeds 16777216 tokens"},
           {"huge_float.jsonl", "1e30", "exceeds 16777216 tokens"},
           {"two31.jsonl", "2147483648", "exceeds 16777216 tokens"},
           {"fraction.jsonl", "12.5", "is not an integer"},
           {"negative.jsonl", "-3", "is negative"},
           {"negative_float.jsonl", "-3.0", "is negative"},
           {"string.jsonl", "\"12\"", "non-numeric 'input_length'"}}) {
    const absl::Status s = MooncakeInputLength(name, value);
    EXPECT_FALSE(s.ok()) << name;
    EXPECT_THAT(s.message(), HasSubstr(name + ":2:")) << s;
    EXPECT_THAT(s.message(), HasSubstr(why)) << s;
    if (value[0] != '"') {
      EXPECT_THAT(s.message(), HasSubstr(value == "1e30" ? "1e+30" : value)) << s;
    }
  }
}

TEST(BadTrace, MooncakeAcceptsIntegralFloatsAndTheBound) {
  absl::StatusOr<std::vector<replay::TraceRequest>> t = replay::LoadTrace(
      WriteTemp("integral.jsonl", std::string(kGoodMooncake) +
                                      "{\"timestamp\": 1, \"input_length\": 16777216.0, \"output_length\": 7}\n"),
      replay::TraceFormat::kAuto, 1);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)[1].input_tokens, replay::kMaxRequestTokens);
}

TEST(BadTrace, MooncakeTimestampMustBeFiniteAndNonNegative) {
  for (const std::string ts : {"-1", "1e300"}) {
    const absl::Status s = replay::LoadTrace(
        WriteTemp("ts.jsonl", "{\"timestamp\": " + ts + ", \"input_length\": 1, \"output_length\": 5}\n"),
        replay::TraceFormat::kAuto, 1).status();
    EXPECT_FALSE(s.ok()) << ts;
    EXPECT_THAT(s.message(), HasSubstr("ts.jsonl:1: timestamp")) << s;
  }
}

TEST(BadTrace, AzureRowsNameLineAndValue) {
  const std::string header = "TIMESTAMP,ContextTokens,GeneratedTokens\n";
  const std::string good = "2023-11-16 18:15:46.6805900,374,44\n";
  for (const auto& [row, want] : std::vector<std::pair<std::string, std::string>>{
           {"2023-99-99 99:99:99,10,5", "TIMESTAMP '2023-99-99 99:99:99' is not a calendar time"},
           {"2023-02-29 10:00:00,10,5", "TIMESTAMP '2023-02-29 10:00:00'"},
           {"2023-11-16 18:15:46junk,10,5", "TIMESTAMP '2023-11-16 18:15:46junk'"},
           {"2023-11-16 18:15:nan,10,5", "TIMESTAMP"},
           {"2023-11-16 18:15:47,12.5,5", "ContextTokens '12.5' is not an integer number of tokens"},
           {"2023-11-16 18:15:47,9223372036854775807,5", "ContextTokens 9223372036854775807 exceeds 16777216"},
           {"2023-11-16 18:15:47,1e30,5", "ContextTokens 1e30 exceeds"},
           {"2023-11-16 18:15:47,10,abc", "GeneratedTokens 'abc' is not an integer"},
           {"2023-11-16 18:15:47,10,0", "output length 0"},
           {"2023-11-16 18:15:47,10", "2 fields, expected 3"}}) {
    const absl::Status s =
        replay::LoadTrace(WriteTemp("az.csv", header + good + row + "\n"), replay::TraceFormat::kAuto, 1).status();
    EXPECT_FALSE(s.ok()) << row;
    EXPECT_THAT(s.message(), HasSubstr("az.csv:3: ")) << s;
    EXPECT_THAT(s.message(), HasSubstr(want)) << s;
  }
}

TEST(BadTrace, MissingAndEmptyFiles) {
  EXPECT_TRUE(absl::IsNotFound(replay::LoadTrace("/nonexistent/t.jsonl", replay::TraceFormat::kAuto, 1).status()));
  const absl::Status empty = replay::LoadTrace(WriteTemp("empty.jsonl", ""), replay::TraceFormat::kAuto, 1).status();
  EXPECT_THAT(empty.message(), HasSubstr("empty trace"));
  const absl::Status blank =
      replay::LoadTrace(WriteTemp("blank.jsonl", "\n\n"), replay::TraceFormat::kMooncakeJsonl, 1).status();
  EXPECT_THAT(blank.message(), HasSubstr("no requests"));
}

// The error of a timing file whose second row is `row`.
absl::Status TimingRow(const std::string& row) {
  const std::string path =
      WriteTemp("rows.jsonl", std::string("{\"ctx\": [100], \"q\": [2], \"attn_ms\": 0.5}\n") + row + "\n");
  return calibrate::LoadTimingRows(path, calibrate::Target::kAttention).status();
}

TEST(BadTimingRows, NumbersOutOfRangeNameLineAndValue) {
  for (const auto& [row, want] : std::vector<std::pair<std::string, std::string>>{
           {R"({"ctx": [100], "q": [1099511627777], "attn_ms": 0.5})", "q[0] = 1099511627777 exceeds 16777216"},
           {R"({"ctx": [9223372036854775807], "q": [1], "attn_ms": 0.5})", "ctx[0] = 9223372036854775807 exceeds"},
           {R"({"ctx": [18446744073709551615], "q": [1], "attn_ms": 0.5})", "ctx[0] = 18446744073709551615 exceeds"},
           {R"({"ctx": [-1], "q": [1], "attn_ms": 0.5})", "ctx[0] = -1 must be >= 0"},
           {R"({"ctx": [100], "q": [0], "attn_ms": 0.5})", "q[0] = 0 must be >= 1"},
           {R"({"ctx": [100.5], "q": [1], "attn_ms": 0.5})", "ctx[0] = 100.5 is not an integer"},
           {R"({"ctx": [100], "q": [1], "attn_ms": 1e300})", "attn_ms = 1e+300 must be > 0 and <= 10000 ms"},
           {R"({"ctx": [100], "q": [1], "attn_ms": -0.5})", "attn_ms = -0.5 must be > 0"},
           {R"({"ctx": [100], "q": [1], "attn_ms": "x"})", "missing number 'attn_ms'"},
           {R"({"ctx": [100, 3], "q": [1], "attn_ms": 0.5})", "'ctx' has 2 entries and 'q' 1"},
           {R"({"ctx": [100], "q": [1], "attn_ms": 0.5)", "not a JSON object"},
           // A fuzz finding (tests/fuzz/timing_rows_fuzz.cc, K3): this used to throw.
           {R"({"ctx": [1], "q": [1], "attn_ms": 1, "variant": 5})", "'variant' is not a string"},
           {R"({"ctx": [1], "q": [1], "attn_ms": 1, "mode": []})", "'mode' is not a string"}}) {
    const absl::Status s = TimingRow(row);
    EXPECT_FALSE(s.ok()) << row;
    EXPECT_THAT(s.message(), HasSubstr("rows.jsonl:2: ")) << s;
    EXPECT_THAT(s.message(), HasSubstr(want)) << s;
  }
}

TEST(BadTimingRows, GemmSweepNumbers) {
  for (const auto& [row, want] : std::vector<std::pair<std::string, std::string>>{
           {R"({"ntok": 4294967296, "ms": 0.1})", "ntok = 4294967296 exceeds"},
           {R"({"ntok": 0, "ms": 0.1})", "ntok = 0 must be >= 1"},
           {R"({"ntok": 8, "ms": 1e300})", "ms = 1e+300 must be > 0 and <= 10000"}}) {
    const absl::Status s =
        calibrate::LoadGemmSweep(WriteTemp("sweep.jsonl", std::string("{\"ntok\": 1, \"ms\": 0.1}\n") + row + "\n"))
            .status();
    EXPECT_FALSE(s.ok()) << row;
    EXPECT_THAT(s.message(), HasSubstr("sweep.jsonl:2: ")) << s;
    EXPECT_THAT(s.message(), HasSubstr(want)) << s;
  }
}

}  // namespace
}  // namespace dpbalance
