#!/usr/bin/env bash
# The benches on a lent GPU machine, in one short run (under 10 minutes on an H200):
#
#   bench/gpu.sh            # PYTHON=... to pick the interpreter; results under $OUT or bench/results
#
# Needs an environment with a CUDA torch, transformers, peft and vLLM's GPU build (the
# `rollout-gpu` extra); it installs nothing, since the lent machine reaches no registry.
# Writes the same JSON as on the CPU, machine-tagged `gpu-<name>`:
#   trainer-<date>-gpu-*.json    one job, 8 jobs in turn, 8 jobs batched, vs the GPU's matmul peak
#   multilora-<date>-gpu-*.json  the engine's tokens/s with 0, 1, 8 and 32 adapters (vLLM's
#                                own GPU LoRA kernels: the stacked CPU path is for CPUs only)
#   precision-choice-<date>-gpu-*.json  what `auto` precision picks there (bf16 on a bf16 GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
RESULTS=${OUT:-bench/results}
mkdir -p "$RESULTS"
"$PYTHON" - <<'PY'
import importlib, sys
import torch
if not torch.cuda.is_available():
    sys.exit("bench/gpu.sh: torch sees no CUDA device")
missing = [m for m in ("transformers", "peft", "vllm") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"bench/gpu.sh: missing {missing}; install the 'trainer' and 'rollout-gpu' extras")
PY
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -cs 'A-Za-z0-9' '-' | sed 's/-$//')
MACHINE="gpu-${GPU}"
DATE=$(date -u +%Y%m%d)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" - > "$RESULTS/precision-choice-$DATE-$MACHINE.json" <<'PY'
import json
from common.hardware import detect, engine_precision, trainer_precision
hardware = detect()
print(json.dumps({
    "machine": hardware.record(),
    "engine": engine_precision("auto", hardware).describe(),
    "trainer": trainer_precision("auto", "auto", hardware).describe(),
}, indent=2))
PY
cat "$RESULTS/precision-choice-$DATE-$MACHINE.json"
timeout 240 "$PYTHON" bench/trainer.py --device cuda --jobs 8 --repeats 3 \
  --out "$RESULTS/trainer-$DATE-$MACHINE.json"
timeout 300 "$PYTHON" bench/multilora.py --paths vllm --requests 64 --new-tokens 64 \
  --out "$RESULTS/multilora-$DATE-$MACHINE.json"
