"""How the trainer should share the CPU with the rollout engine: threads and cores, measured.

    .venv/bin/python bench/cores.py [--steps 4]

One rollout engine (vLLM, SmolLM2, the stacked LoRA path) runs in this process; its worker
binds its OpenMP thread to a core (`VLLM_CPU_OMP_THREADS_BIND=auto`). Beside it, in a child
process, the trainer times `train_step` on the arithmetic demo job's batch shape (in the
trainer's precision on this machine, bench/machine.py; shared prompts) for each split:
torch's default threads on every core, one thread on any core, one thread pinned to the core
the engine leaves free. Each split is timed twice: while the engine
is idle, and while it generates without pause (64 requests in flight, 8 adapters), whose
tokens/s over the same window is recorded too. Every figure is a ratio to the default split
measured in the same phase of the same run.

Writes `bench/results/cores-<date>-<machine>.json`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from machine import engine_dtype, machine_fields, result_path, trainer_dtype  # bench/machine.py

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SPLITS: dict[str, dict[str, Any]] = {
    "default": {"threads": 0, "cores": None},  # torch's default: one thread per core
    "one_thread": {"threads": 1, "cores": None},
    "one_thread_free_core": {"threads": 1, "cores": "free"},
    # What the embedded stack runs: one thread pinned to the free core, plus one on the
    # engine's core for each pass while the engine leaves it idle (trainer_svc/compute.py).
    "borrow_engine_core": {"threads": 1, "cores": "free", "lent": "engine"},
}


def trainer_child(config: dict[str, Any]) -> dict[str, Any]:
    import torch
    from trainer import LORA, RL, batch, timed  # bench/trainer.py

    from common.files.models import resolve_base_model
    from trainer_svc.compute import ComputeThread
    from trainer_svc.policy import MultiAdapterPolicy

    if config["cores"] is not None:
        os.sched_setaffinity(0, set(config["cores"]))
    own, lent = set(config["cores"] or ()), set(config.get("lent") or ())
    compute = ComputeThread(own, lent, config["threads"])  # 0: one thread per own core
    policy = compute.call(
        MultiAdapterPolicy,
        resolve_base_model(config["model"]),
        compute_dtype=config["dtype"],
        torch_threads=config["threads"],
        adjust_threads=compute.adjust if lent else None,
    )
    policy.add_job("job", LORA, RL)
    trajectories = batch(policy.base_model.config.vocab_size, seed=0)
    advantages = [t.reward - 0.5 for t in trajectories]
    step_s = compute.call(
        timed,
        lambda: policy.train_step("job", trajectories, advantages),
        config["steps"],
        policy.device,
    )
    threads = compute.call(torch.get_num_threads)
    compute.shutdown()
    return {
        "step_s": step_s,
        "threads": threads,
        "borrowed_calls": compute.borrowed_calls,
        "calls": compute.calls,
    }


def run_trainer(config: dict[str, Any]) -> dict[str, Any]:
    completed = subprocess.run(
        [sys.executable, __file__, "--trainer-child", json.dumps(config)],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    )
    return json.loads(completed.stdout.strip().splitlines()[-1])


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    from multilora import prompts, write_adapter  # bench/multilora.py

    from common.files.models import resolve_base_model
    from common.wire.adapters import AdapterRef
    from common.wire.messages import GenerationRequest, SamplingSettings
    from rollout_svc.engine import RolloutEngine
    from rollout_svc.engine_settings import EngineSettings

    model_dir = resolve_base_model(args.model)
    work = Path(tempfile.mkdtemp(prefix="marlaas-cores-"))
    adapters = [
        AdapterRef(f"job{i}", 1, str(write_adapter(model_dir, work / f"a{i}", i))) for i in range(8)
    ]
    engine = RolloutEngine(EngineSettings(model_dir, max_loras=8, max_lora_rank=8, max_num_seqs=64))
    context = prompts(model_dir, 64)
    sampling = SamplingSettings(max_new_tokens=32)
    all_cores = sorted(os.sched_getaffinity(0))
    await engine.start()
    busy = asyncio.Event()

    async def generate_forever(slot: int) -> None:
        index = 0
        while True:
            await busy.wait()
            request = GenerationRequest(
                request_id=f"r{slot}-{index}",
                job_id="bench",
                episode_id=f"e{slot}",
                group_id="g",
                sample_index=0,
                turn=0,
                context_token_ids=context[slot],
                sampling=sampling,
            )
            await engine.generate(request, adapters[slot % len(adapters)])
            index += 1

    workers = [asyncio.create_task(generate_forever(slot)) for slot in range(64)]
    engine_core = _engine_core()
    free = [c for c in all_cores if c != engine_core] or all_cores
    results: dict[str, dict[str, Any]] = {}
    try:
        for phase in ("idle", "busy"):
            if phase == "busy":
                busy.set()
                await asyncio.sleep(5)  # let the batch fill
            for name, split in SPLITS.items():
                cores = free if split["cores"] == "free" else split["cores"]
                lent = [engine_core] if split.get("lent") and engine_core is not None else []
                config = {
                    "model": args.model,
                    "steps": args.steps,
                    "threads": split["threads"],
                    "cores": cores,
                    "lent": lent,
                    "dtype": trainer_dtype(),
                }
                tokens_before, started = engine.generated_tokens, time.perf_counter()
                trainer = await asyncio.to_thread(run_trainer, config)
                elapsed = time.perf_counter() - started
                results.setdefault(phase, {})[name] = {
                    **trainer,
                    "cores": cores or all_cores,
                    "engine_tokens_per_s": (engine.generated_tokens - tokens_before) / elapsed,
                }
                tokens_per_s = results[phase][name]["engine_tokens_per_s"]
                print(
                    f"{phase:>5} {name:>22}: {trainer['step_s']:.2f} s/step, "
                    f"engine {tokens_per_s:.1f} tok/s",
                    flush=True,
                )
            busy.clear()
    finally:
        for worker in workers:
            worker.cancel()
        await engine.stop()
    for splits in results.values():
        base = splits["default"]
        for split in splits.values():
            split["step_ratio_to_default"] = split["step_s"] / base["step_s"]
            if base["engine_tokens_per_s"]:
                split["engine_ratio_to_default"] = (
                    split["engine_tokens_per_s"] / base["engine_tokens_per_s"]
                )
    return {"engine_core": engine_core, "cores": all_cores, "phases": results}


def _engine_core() -> int | None:
    """The core vLLM's worker bound its OpenMP thread to, read from its process' affinity."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith("VLLM::Worker"):
            for task in os.listdir(f"/proc/{pid}/task"):
                affinity = os.sched_getaffinity(int(task))
                if len(affinity) == 1:
                    return next(iter(affinity))
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--trainer-child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trainer_child:
        print(json.dumps(trainer_child(json.loads(args.trainer_child))))
        return
    machine = machine_fields(trainer=trainer_dtype(), engine=engine_dtype())
    result = {"bench": "cores", "model": args.model, "machine": machine}
    result |= asyncio.run(measure(args))
    out = args.out or result_path("cores")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
