// dpbalance-flags: the plugin's DPB_* flags, in two tiers (what a deployment sets, then the
// research and tuning flags), and a check of the ones this shell sets, parsed exactly as the
// plugin's init parses them.
//
//   dpbalance-flags --help              the flags, by tier and topic (docs/flags.md has the rest)
//   dpbalance-flags --check [CONFIG]    parse DPB_* of the environment and CONFIG ("k=v;..."):
//                                       exit 0 and the settings, or 2 and the error naming the flag
#include <cstdio>
#include <string>

#include "flags.h"

int main(int argc, char** argv) {
  const std::string arg = argc > 1 ? argv[1] : "--help";
  if (arg == "--help" || arg == "-h") {
    std::fputs("Usage: dpbalance-flags [--help | --check [CONFIG]]\n", stdout);
    std::fputs(dpbalance::plugin::FlagHelp().c_str(), stdout);
    return 0;
  }
  if (arg == "--check" && argc <= 3) {
    const std::string config = argc == 3 ? argv[2] : "";
    const auto f = dpbalance::plugin::ParseFlags(dpbalance::plugin::DpbEnvironment(), config);
    if (!f.ok()) {
      std::fprintf(stderr, "dpbalance-flags: %s\n", std::string(f.status().message()).c_str());
      return 2;
    }
    const auto& p = f->balancer.planner;
    std::printf("ok: k_max=%d default_k=%d learn_step_terms=%d ffn_fixed_us=%g ffn_per_token_us=%g "
                "draft_us=%g step_overhead_us=%g tpot_slo_ms=%g\n",
                p.k_max, p.default_k, f->balancer.learn_step_terms ? 1 : 0, p.global.ffn_fixed_us,
                p.global.ffn_per_token_us, p.global.draft_per_step_us, p.global.step_overhead_us,
                f->balancer.tpot_slo_us / 1000);
    return 0;
  }
  std::fprintf(stderr, "dpbalance-flags: unknown argument '%s' (see --help)\n", arg.c_str());
  return 2;
}
