#!/usr/bin/env bash
# The benchmark head for SmolLM2-135M-Instruct: `make demo`'s pipeline (scripts/demo.py) with bigger sizes, then
# the bench on all 80 MT-bench first turns. Every stage resumes or skips when re-run, so a killed run is continued
# by running this script again. Outputs: runs/bench-head/. Any DEMO_* variable overrides a size, e.g. on a GPU:
#   DEMO_DEVICE=cuda DEMO_ACCELERATE_CONFIG=configs/accelerate/gpu_zero2.yaml DEMO_STEPS=5000 scripts/bench_head.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
[ -e "$TCMALLOC" ] && export LD_PRELOAD="$TCMALLOC"
export RUN_DIR="${RUN_DIR:-runs/bench-head}"
export DEMO_CONVERSATIONS="${DEMO_CONVERSATIONS:-2000}" DEMO_MAX_LENGTH="${DEMO_MAX_LENGTH:-1024}"
export DEMO_VALIDATION_FRACTION="${DEMO_VALIDATION_FRACTION:-0.03}" DEMO_STEPS="${DEMO_STEPS:-120}"
export DEMO_SAVE_EVERY="${DEMO_SAVE_EVERY:-25}" DEMO_EVAL_EVERY="${DEMO_EVAL_EVERY:-25}"
export DEMO_EVAL_BATCHES="${DEMO_EVAL_BATCHES:-8}" DEMO_WARMUP="${DEMO_WARMUP:-20}" DEMO_LR="${DEMO_LR:-8e-4}"
export DEMO_BATCH_TOKENS="${DEMO_BATCH_TOKENS:-4096}" DEMO_TTT_STEPS="${DEMO_TTT_STEPS:-4}"
export DEMO_DRAFT_VOCAB="${DEMO_DRAFT_VOCAB:-8192}" DEMO_PRECISION="${DEMO_PRECISION:-bf16}"
export DEMO_PROMPTS="${DEMO_PROMPTS:-80}" DEMO_NEW_TOKENS="${DEMO_NEW_TOKENS:-96}"
export DEMO_CALIBRATION_PROMPTS="${DEMO_CALIBRATION_PROMPTS:-3}" DEMO_CALIBRATION_TOKENS="${DEMO_CALIBRATION_TOKENS:-96}"
exec .venv/bin/python scripts/demo.py
