"""dpbalance's settings in one vLLM engine-core process, checked when the engine starts.

`EngineConfig.resolve` runs in every DP rank's engine-core process, from the scheduler's
constructor: vLLM builds the scheduler before the engine core reports ready, so before the API
server answers `/health`. It checks every DPB_* flag through the plugin itself
(`dpbalanceInspect_v1.check_flags`, dpbalance_inspect_v1.h: the same parser and checks as the
plugin's init, the cost model's file and the metrics file's directory included) and the package's
own DPBALANCE_VLLM_* settings. A bad value is one error line at start-up, naming the value and
where it came from; then

  - DPB_STRICT=1: the engine core raises, so `vllm serve` stops before it serves;
  - otherwise (the default): the rank runs with balancing off, drafts as vLLM would without the
    plugin, and says so in the same line.

What the package sets for the plugin (the `config` string, which wins over the environment):
  - k_max: min(8, num_speculative_tokens), unless DPB_K_MAX is set;
  - default_k, the fallback verify length: vLLM's own draft length, num_speculative_tokens,
    unless DPB_DEFAULT_K is set. "Fallback" in this package's log lines and docs means this
    length, which is what the engine runs without the plugin. (The plugin plans at most 8; with
    more drafts, a fallback step leaves vLLM's drafts as they are, and the plugin's own default
    is 8.) A rank whose settings were refused runs num_speculative_tokens, whatever
    DPB_DEFAULT_K says;
  - draft_us=0 for drafters that run no model (ngram, ngram_gpu, suffix), unless DPB_DRAFT_US is
    set: the plugin's default (1500 us, an MTP draft step on an H200) would price drafts that
    cost nothing;
  - depths=min(8, num_speculative_tokens) for model drafters (draft_model, eagle, eagle3, mtp),
    unless DPB_DEPTHS is set: vLLM's proposer drafts that many every step (vLLM 0.32.0,
    vllm/v1/spec_decode/llm_base_proposer.py), so the instance's draft depth is fixed and the
    plan trims verify lengths under it; a DPB_DEFAULT_K other than that depth is refused;
  - guard_measured=1, unless DPB_GUARD_MEASURED is set: the TPOT guard counts the plugin's own
    measured time per step (its plan call, the exchange over the engine core's gloo DP group
    included: 1-1.7 ms a step on the live CPU runs, which vLLM without the plugin does not pay),
    so a plan's longer steps plus that time stay within the guard (docs/live_vllm.md);
  - the exchange (DPBALANCE_VLLM_EXCHANGE): `ride` (the default) carries the plugin's record
    on vLLM's own per-step DP sync (dp_ride.py), so the package runs no collective of its own
    after init's handshake, and quiet_after=0: there is no collective of ours to skip (a
    nonzero DPB_QUIET_AFTER is refused). `own`: the plugin's all-reduce on the engine core's
    DP group every step, and quiet_after=8 unless DPB_QUIET_AFTER is set: while every decision
    keeps vLLM's draft lengths (8 in a row) the ranks skip it on agreed spans of steps (up to
    DPB_QUIET_MAX, 32) (runtime/include/dpbalance/quiet.h, docs/live_vllm.md).
The start-up line says which of these are in effect, with the cost model.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Optional

log = logging.getLogger("vllm.dpbalance")

# Drafters that run no model: a draft step costs (next to) nothing.
MODEL_FREE_DRAFTERS = ("ngram", "ngram_gpu", "suffix")
# The plugin's limit on any verify length (kMaxDraftLen, dpbalance_plugin_v2.h k_cap).
PLUGIN_K_LIMIT = 8
STATS_EVERY_S_DEFAULT = 30.0
QUIET_AFTER_DEFAULT = 8        # kept-default exchanges before the first quiet span
BUBBLE_WINDOW_DEFAULT = 200


class ConfigError(ValueError):
    """A setting that cannot be used, with the value and where it came from."""


def _env_int(name: str, lo: int, hi: int, default: int) -> int:
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        v = int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}: '{raw}' is not an integer in "
                          f"{lo}..{hi}") from None
    if not lo <= v <= hi:
        raise ConfigError(f"environment variable {name}: {v} is not in {lo}..{hi}")
    return v


def _env_float(name: str, lo: float, hi: float, default: float) -> float:
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        v = float(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}: '{raw}' is not a number in "
                          f"[{lo}, {hi}]") from None
    if not lo <= v <= hi:  # also refuses nan
        raise ConfigError(f"environment variable {name}: {raw} is not in [{lo}, {hi}]")
    return v


def strict() -> bool:
    """DPB_STRICT: 1 refuses to start on a bad setting, 0 (default) runs without balancing.
    A value that is neither counts as 1 (the safe reading), and the error says so."""
    return os.environ.get("DPB_STRICT", "0") != "0"


def check_directory(name: str) -> str:
    """The directory named by environment variable `name`, created if missing and checked
    writable; "" when unset."""
    path = os.environ.get(name, "")
    if not path:
        return ""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"environment variable {name}: '{path}' cannot be created "
                          f"({e.strerror})") from None
    if not os.path.isdir(path):
        raise ConfigError(f"environment variable {name}: '{path}' is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"environment variable {name}: directory '{path}' is not writable")
    return path


@dataclass
class EngineConfig:
    """What one engine-core process runs with. `error` is "" when every setting was usable."""
    dp_size: int
    dp_rank: int
    k_spec: int                      # vLLM's num_speculative_tokens (0: no speculative decoding)
    method: str                      # vLLM's speculative method ("" without one)
    library: Optional[str]           # the plugin library; None: DPB_PLUGIN unset or `none`
    strict: bool = False
    default_k: int = 0               # the fallback verify length (see the module docstring)
    default_k_source: str = ""
    plugin_config: str = ""          # the config string given to the plugin's init
    settings: dict = field(default_factory=dict)  # the plugin's settings in effect
    step_log: str = ""               # DPBALANCE_VLLM_STEP_LOG
    stats_every_s: float = STATS_EVERY_S_DEFAULT
    bubble_window: int = BUBBLE_WINDOW_DEFAULT
    metrics_port: int = 0            # DPBALANCE_VLLM_METRICS_PORT (0: none)
    exchange: str = "ride"           # DPBALANCE_VLLM_EXCHANGE: ride (vLLM's DP sync) or own
    bypass_epoch: int = 0            # DPBALANCE_VLLM_BYPASS_EPOCH (0: none; engine_plan.py)
    error: str = ""

    @property
    def enabled(self) -> bool:
        return self.library is not None

    @property
    def usable(self) -> bool:
        return self.enabled and not self.error

    def fallback_text(self) -> str:
        return f"verify length {self.default_k} ({self.default_k_source})"

    @classmethod
    def resolve(cls, dp_size: int, dp_rank: int, k_spec: int, method: str,
                library: Optional[str], check=None) -> "EngineConfig":
        """Checks every setting (see the module docstring). `check(config, dp_size)`: the
        plugin's flag check, returning (ok, error, settings); the default loads `library`.
        Never raises for a bad setting: the reason is in `error`."""
        c = cls(dp_size=dp_size, dp_rank=dp_rank, k_spec=max(0, int(k_spec)),
                method=method or "", library=library, strict=strict())
        c.default_k = c.k_spec
        c.default_k_source = f"vLLM's num_speculative_tokens={c.k_spec}"
        if not c.enabled:
            return c
        try:
            if os.environ.get("DPB_STRICT", "0") not in ("0", "1"):
                raise ConfigError(f"environment variable DPB_STRICT: "
                                  f"'{os.environ['DPB_STRICT']}' is not 0 or 1 (read as 1)")
            c.step_log = check_directory("DPBALANCE_VLLM_STEP_LOG")
            c.stats_every_s = _env_float("DPBALANCE_VLLM_STATS_EVERY_S", 0.1, 86400.0,
                                         STATS_EVERY_S_DEFAULT)
            c.bubble_window = _env_int("DPBALANCE_VLLM_BUBBLE_WINDOW", 1, 1_000_000,
                                       BUBBLE_WINDOW_DEFAULT)
            c.metrics_port = _env_int("DPBALANCE_VLLM_METRICS_PORT", 0, 65535, 0)
            c.bypass_epoch = _env_int("DPBALANCE_VLLM_BYPASS_EPOCH", 0, 1_000_000, 0)
            if c.bypass_epoch and os.environ.get("DPB_AB_EPOCH", "0") not in ("", "0"):
                raise ConfigError(
                    f"environment variable DPBALANCE_VLLM_BYPASS_EPOCH: {c.bypass_epoch} with "
                    f"DPB_AB_EPOCH={os.environ['DPB_AB_EPOCH']}: one A/B at a time (the bypass "
                    f"A/B's off epochs run without the plugin, DPB_AB_EPOCH's with it)")
            if os.environ.get("DPBALANCE_VLLM_CPU_DP", "0") not in ("0", "1"):
                raise ConfigError(f"environment variable DPBALANCE_VLLM_CPU_DP: "
                                  f"'{os.environ['DPBALANCE_VLLM_CPU_DP']}' is not 0 or 1")
            from . import dp_ride
            c.exchange = dp_ride.mode()
            ride = c.exchange == "ride" and dp_size > 1
            if ride and os.environ.get("DPB_QUIET_AFTER", "0") not in ("", "0"):
                raise ConfigError(
                    f"environment variable DPB_QUIET_AFTER: {os.environ['DPB_QUIET_AFTER']} with "
                    f"{dp_ride.ENV}=ride: quiet mode skips a collective of the plugin's own, and "
                    f"riding vLLM's DP sync runs none (set DPB_QUIET_AFTER=0, or "
                    f"{dp_ride.ENV}=own)")
            parts = []
            if "DPB_K_MAX" not in os.environ:
                parts.append(f"k_max={min(PLUGIN_K_LIMIT, c.k_spec)}")
            if "DPB_DEFAULT_K" not in os.environ:
                parts.append(f"default_k={min(c.k_spec, PLUGIN_K_LIMIT)}")
            if "DPB_DRAFT_US" not in os.environ and c.method in MODEL_FREE_DRAFTERS:
                parts.append("draft_us=0")
            if c.method and c.method not in MODEL_FREE_DRAFTERS and "DPB_DEPTHS" not in os.environ:
                # vLLM's model drafters (draft_model, eagle, eagle3, mtp) draft
                # num_speculative_tokens every step, whatever the scheduler then verifies: the
                # instance's draft depth is that one (the plan trims verify lengths under it).
                depth = min(PLUGIN_K_LIMIT, c.k_spec)
                if "DPB_DEFAULT_K" in os.environ and os.environ["DPB_DEFAULT_K"] != str(depth):
                    raise ConfigError(
                        f"environment variable DPB_DEFAULT_K: {os.environ['DPB_DEFAULT_K']} with "
                        f"the model drafter '{c.method}', which drafts num_speculative_tokens="
                        f"{c.k_spec} every step: the fallback must verify what is drafted (leave "
                        f"DPB_DEFAULT_K unset, or set DPB_DEPTHS)")
                parts.append(f"depths={depth}")
            if "DPB_GUARD_MEASURED" not in os.environ:
                parts.append("guard_measured=1")
            if "DPB_QUIET_AFTER" not in os.environ:
                parts.append(f"quiet_after={0 if ride else QUIET_AFTER_DEFAULT}")
            c.plugin_config = ";".join(parts)
            if check is None:
                check = _plugin_check(library)
            ok, error, settings = check(c.plugin_config, dp_size)
            if not ok:
                if "exceeds 'k_max'" in error and "DPB_K_MAX" not in os.environ:
                    error += f" (k_max is vLLM's num_speculative_tokens={c.k_spec})"
                raise ConfigError(error)
            c.settings = dict(settings)
            if "DPB_DEFAULT_K" in os.environ:
                c.default_k = min(int(settings.get("default_k", c.default_k)), c.k_spec)
                c.default_k_source = f"DPB_DEFAULT_K={os.environ['DPB_DEFAULT_K']}"
        except (ConfigError, ValueError) as e:
            c.error = str(e)
        except Exception as e:  # the library cannot be loaded, or lacks the check
            c.error = f"{type(e).__name__}: {e}"
        return c

    def startup_line(self) -> str:
        """The one line a rank logs when it starts with the plugin on."""
        s = self.settings
        cost = (f"cost model {s.get('cost_model', '?')} (draft {s.get('draft_us', '?')} us/step"
                + (" (no model drafts)" if self.method in MODEL_FREE_DRAFTERS
                   and "DPB_DRAFT_US" not in os.environ else "")
                + f", MoE {s.get('ffn_fixed_us', '?')} us + {s.get('ffn_per_token_us', '?')} "
                f"us/token, overhead {s.get('step_overhead_us', '?')} us, TPOT guard slack "
                f"{s.get('step_slack', '?')} counting {s.get('guard_overhead_us', '?')} us"
                f"{' + its measured own time' if s.get('guard_measured') == '1' else ''}, online refit "
                f"{'on' if s.get('online') == '1' else 'off'}, "
                + ("quiet mode off" if s.get('quiet_after') == '0' else
                   f"quiet after {s.get('quiet_after', '?')} kept-default steps, spans up to "
                   f"{s.get('quiet_max', '?')}") + ")")
        return (f"dpbalance: enabled on DP rank {self.dp_rank}/{self.dp_size}: mode "
                f"{s.get('mode', '?')}, verify lengths 0..{s.get('k_max', '?')} ({self.method or 'no'}"
                f" drafts, num_speculative_tokens={self.k_spec}), {cost}; fallback {self.fallback_text()}; "
                f"library {self.library}; exchange {self.exchange_text()}; "
                f"step log {self.step_log or 'off'}; "
                f"DPB_STRICT={1 if self.strict else 0}")

    def exchange_text(self) -> str:
        if self.dp_size <= 1:
            return "none (DP 1)"
        if self.exchange == "ride":
            return "on vLLM's DP sync (coordinate_batch_across_dp), one step late"
        return "the plugin's own all-reduce on the engine core's DP group"

    def refused_line(self) -> str:
        """The one line a rank logs when a setting is refused."""
        if self.strict:
            return (f"dpbalance: DP rank {self.dp_rank}: bad configuration: {self.error}. "
                    f"DPB_STRICT=1: refusing to start")
        return (f"dpbalance: DP rank {self.dp_rank}: bad configuration: {self.error}. Balancing "
                f"is OFF on this rank; it runs vLLM's own {self.fallback_text()} (set DPB_STRICT=1 "
                f"to refuse to start instead)")


def _plugin_check(library: str):
    from .engine_plan import adapter

    def check(config: str, dp_size: int):
        r = adapter.check_flags(config, dp_size, library=library)
        return r.ok, r.error, r.settings
    return check
