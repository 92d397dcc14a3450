"""Hook on sglang/srt/layers/radix_attention.py (SGLang 0.5.23): the rank's attention time.

  RadixAttention.forward   AROUND: times the target model's attention layers during a planned
                           batch's forward (attention_timer.py; draft layers are not timed)
"""
from __future__ import annotations

from .. import engine_step

TARGET = "sglang.srt.layers.radix_attention.RadixAttention.forward"

SIGNATURES = {TARGET: ("self", "q", "k", "v", "forward_batch", "save_kv_cache",
                       "key_value_num_tokens", "kwargs")}


def around_forward(original, self, *args, **kwargs):
    return engine_step.state().timer.around_layer(original, self, *args, **kwargs)


HOOKS = ((TARGET, around_forward, "AROUND"),)
