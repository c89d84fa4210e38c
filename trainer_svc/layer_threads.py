"""Threads per decoder layer: a hook asks, before each layer's forward and backward, how many
threads what follows runs on (trainer_svc/compute.py lends idle cores this way), and counts
threads x seconds so a step can report the threads it ran on."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


class LayerThreads:
    """Calls `adjust` at each decoder layer's forward and backward; counts thread-seconds."""

    def __init__(self, adjust: Callable[[], int], threads: int) -> None:
        """`adjust`: returns the threads what follows runs on. `threads`: those now."""
        self.adjust = adjust
        self._threads = threads
        """Threads since `_threads_since` (the last call of `adjust`)."""
        self._threads_since = 0.0
        self.thread_s = 0.0
        """Threads x seconds since `begin`."""

    def hook(self, layers: Any) -> None:
        """Install the hooks on each decoder layer."""
        for layer in layers:
            layer.register_forward_pre_hook(self._before_layer)
            layer.register_forward_hook(self._after_layer)

    def begin(self, started: float) -> None:
        """Count thread-seconds from `started` (a step's `time.monotonic()`) on."""
        self.thread_s, self._threads_since = 0.0, started

    def step(self) -> None:
        """Let `adjust` set the threads of what runs next; count the time at the last."""
        now = time.monotonic()
        self.thread_s += (now - self._threads_since) * self._threads
        self._threads_since = now
        self._threads = self.adjust()

    def _before_layer(self, module: torch.nn.Module, args: Any) -> None:
        self.step()

    def _after_layer(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        """The layer's backward begins when its output's gradient is in: adjust there too."""
        import torch

        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            hidden.register_hook(self._before_layer_backward)

    def _before_layer_backward(self, grad: torch.Tensor) -> None:
        self.step()
