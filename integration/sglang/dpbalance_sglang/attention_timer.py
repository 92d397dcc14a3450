"""The rank's attention time per step, measured where it runs: around each attention layer of the
target model (SGLang's `RadixAttention.forward`, sglang/srt/layers/radix_attention.py, 0.5.23)
during the forward of a planned batch (patch/attention.py), summed over the layers.

On a GPU each layer is bracketed by CUDA events on the current stream, read when the batch is
reported (its results are on the host by then, so the events have completed); on a CPU the
forward is synchronous and `time.perf_counter` brackets it. Only the target's layers count
(`bind` collects them from the scheduler's model runner): draft models have their own modules,
and their attention is not the verify's. Under CUDA-graph replay no Python runs inside the
forward, so no layer is seen: the step's attention is then unknown and reported as 0, which the
plugin's online refit skips (docs/engines.md "SGLang" says what that leaves open).
"""
from __future__ import annotations

import logging
import time
from typing import Optional

log = logging.getLogger("sglang.srt.plugins.dpbalance")


class AttentionTimer:
    def __init__(self):
        self._layers: set = set()      # id() of the target model's attention modules
        self._active = False           # a planned batch's forward is running
        self._cpu_us = 0.0
        self._events: list = []
        self._cuda = False

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def bind(self, model_runner) -> None:
        """Collects the target's attention layers (none for a model runner without a model)."""
        model = getattr(model_runner, "model", None)
        if model is None or not hasattr(model, "modules"):
            return
        from sglang.srt.layers.radix_attention import RadixAttention

        self._layers = {id(m) for m in model.modules() if isinstance(m, RadixAttention)}
        device = str(getattr(model_runner, "device", "cpu"))
        self._cuda = device.startswith("cuda")

    def begin(self, active: bool) -> None:
        """A forward starts; only a planned batch's (`active`) is timed."""
        self._active, self._cpu_us, self._events = active, 0.0, []

    def end(self) -> Optional[tuple]:
        """The forward ended: its timing (for elapsed_us, when the batch is reported), or None
        when it was not timed."""
        timing = (self._cpu_us, self._events) if self._active else None
        self._active = False
        return timing

    def around_layer(self, original, layer, *args, **kwargs):
        if not self._active or id(layer) not in self._layers:
            return original(layer, *args, **kwargs)
        if self._cuda:
            import torch

            try:
                if torch.cuda.is_current_stream_capturing():
                    return original(layer, *args, **kwargs)
                start, stop = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
            except Exception:  # noqa: BLE001 - timing must never stop the forward
                log.exception("dpbalance_sglang: attention timing failed; it stays off")
                self._layers = set()
                return original(layer, *args, **kwargs)
            out = original(layer, *args, **kwargs)
            stop.record()
            self._events.append((start, stop))
            return out
        t0 = time.perf_counter()
        out = original(layer, *args, **kwargs)
        self._cpu_us += (time.perf_counter() - t0) * 1e6
        return out

    @staticmethod
    def elapsed_us(timing: Optional[tuple]) -> float:
        """The attention microseconds of a forward's timing (end()'s; 0: none was timed)."""
        cpu_us, events = timing if timing is not None else (0.0, [])
        if not events:
            return cpu_us
        try:
            events[-1][1].synchronize()
            return sum(a.elapsed_time(b) for a, b in events) * 1e3
        except Exception:  # noqa: BLE001 - an unreadable event: this step's attention is unknown
            log.exception("dpbalance_sglang: attention events unreadable; reported as unknown")
            return 0.0
