"""The engine's compute time: what "busy" means for utilisation.

An engine with a request in it is not necessarily computing much: one request decoding alone
keeps it "busy" as long as sixty-four would. So besides the wall time with a request in the
engine (`RolloutEngine.busy_seconds`) a replica reports the CPU time its engine computed
(`EngineCompute.seconds`) against the cores it may use (`slots`), and the mean batch it ran
(request-seconds over busy seconds): the compute busy share is `Δseconds / (Δwall x slots)`.

vLLM computes in its engine-core process, a child of the replica's process (with
`VLLM_ENABLE_V1_MULTIPROCESSING=0`, in the replica's own process): the children's CPU time is
counted (the process's own when in-process). A child that exits keeps the time
it was last seen with, so the count never goes down while the replica runs. On a GPU the CPU
time says nothing of the device's work: `seconds` is None there and no share is reported.
"""

from __future__ import annotations

import os

import psutil


class EngineCompute:
    """CPU seconds of this process's engine: its child processes, or this process itself
    when vLLM runs its core in-process (`in_process`; default: as vLLM's own switch says)."""

    def __init__(
        self,
        process: psutil.Process | None = None,
        *,
        in_process: bool | None = None,
        on_gpu: bool | None = None,
    ) -> None:
        self._process = process or psutil.Process()
        if in_process is None:
            in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
        self._in_process = in_process
        self._on_gpu = on_gpu
        """None: decided at the first read, once the engine has started (torch sees a GPU)."""
        self._seen: dict[int, float] = {}
        """CPU seconds of each engine process when last read, by pid."""

    @property
    def slots(self) -> int:
        """Cores the engine may compute on: this process's affinity, which its children
        inherit (vLLM binds its threads within it)."""
        return len(os.sched_getaffinity(self._process.pid))

    def seconds(self) -> float | None:
        """CPU seconds the engine has computed so far (None on a GPU)."""
        if self._on_gpu is None:
            import torch  # the engine's own dependency, imported by then

            self._on_gpu = torch.cuda.is_available()
        if self._on_gpu:
            return None
        for process in self._engine_processes():
            try:
                times = process.cpu_times()
            except psutil.Error:  # exited between listing and reading: keep what was seen
                continue
            self._seen[process.pid] = times.user + times.system
        return sum(self._seen.values())

    def _engine_processes(self) -> list[psutil.Process]:
        if self._in_process:
            return [self._process]
        try:
            return self._process.children(recursive=True)
        except psutil.Error:
            return []
