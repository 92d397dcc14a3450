"""dpbalance for SGLang: speculative verify lengths and depths balanced across attention-DP ranks.

Installed with pip (`pip install integration/sglang` builds and bundles libdpbalance.so), the
package registers `register` under SGLang's `sglang.srt.plugins` entry point. SGLang's
`load_plugins()` (sglang/srt/plugins/__init__.py) calls it in the engine entry point (before the
server arguments are resolved), the DP controller and every scheduler, then applies the hooks it
registered (`HookRegistry.apply_hooks`). One switch turns dpbalance on: `DPB_PLUGIN=dpbalance`
(the bundled library; or a path, or a name on the loader's path; `none` joins the exchange with
an empty record, so that every rank runs SGLang's own lengths). Unset, nothing is registered and
SGLang runs as shipped. `SGLANG_PLUGINS`, when set, must name `dpbalance`. The DPB_* flags are
the plugin's (docs/flags.md); unset ones that SGLang's configuration decides come from it
(spec_config.py).

What the hooks do (every one in patch/, listed with its target in patch/README.md):
  - our 512-byte record rides SGLang's per-step DP sync as 64 extra int64 columns of the
    MLPSyncBatchInfo row; the iteration's prefill probe stays as shipped (engine_step.py);
  - the plan survives SGLang's batch copies (the overlap loop, PD decode) and is reported with
    the accepted drafts and the attention time measured around the target's attention layers;
  - DSpark (SGLANG_RAGGED_VERIFY_MODE=compact): each request's verify length and the agreed
    verify tier come from the plan, with or without an SPS table;
  - EAGLE / EAGLE3 / MTP with --speculative-adaptive: SGLang's refusal under attention DP is
    lifted and every rank runs the plan's agreed depth (patch/eagle.py).

`activate_cpu_platform` is the `sglang.srt.platforms` entry point: with DPBALANCE_SGLANG_CPU=1 a
CPU platform whose process groups run on gloo (cpu_platform.py), for SGLang's DP sync on a
machine without a GPU. Without it the hook returns None and SGLang picks its platform as usual.
"""
from __future__ import annotations

import logging
import os
from typing import Optional

__version__ = "0.1.0"

# The SGLang release every hook in patch/ was read at (its source, file by file: patch/README.md);
# patch.SUPPORTED is the range the package accepts (each hooked signature checked at import).
READ_AT_SGLANG = "0.5.23"
CPU_PLATFORM = "dpbalance_sglang.cpu_platform.DpbCpuPlatform"

log = logging.getLogger("sglang.srt.plugins.dpbalance")
REGISTERED = False


def register() -> None:
    """SGLang's general-plugin hook. Checks the SGLang version and the hooked functions'
    signatures, then registers the hooks by their dotted targets (patch/__init__.py); on a
    mismatch it says so in one error line and registers nothing (SGLang runs as shipped)."""
    global REGISTERED
    if REGISTERED:
        return
    REGISTERED = True
    if not os.environ.get("DPB_PLUGIN"):
        log.debug("dpbalance_sglang: DPB_PLUGIN unset; SGLang runs as shipped")
        return
    from . import patch

    patch.register_all()


def activate_cpu_platform() -> Optional[str]:
    """SGLang's platform-plugin hook: the CPU platform's qualified name with
    DPBALANCE_SGLANG_CPU=1, else None (stay out of SGLang's choice)."""
    if os.environ.get("DPBALANCE_SGLANG_CPU", "0") != "1":
        return None
    return CPU_PLATFORM
