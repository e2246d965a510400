#!/usr/bin/env bash
# The benchmark head for SmolLM2-135M-Instruct, stage by stage, then the full MT-bench benchmark.
# Every stage resumes or skips when re-run (collection at the first missing shard, training at the latest
# checkpoint), so a killed run is continued by running this script again. Outputs: runs/bench-head/.
#   scripts/bench_head.sh                # all stages
#   STAGES="train export" scripts/bench_head.sh
#   DEVICE=cuda ACCELERATE_CONFIG=configs/accelerate/gpu_zero2.yaml CONVERSATIONS=null STEPS=5000 scripts/bench_head.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export DRAFTHEAD_CACHE="${DRAFTHEAD_CACHE:-$HOME/.cache/drafthead}"
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
[ -e "$TCMALLOC" ] && export LD_PRELOAD="$TCMALLOC"
PY=.venv/bin/python
R=configs/smollm2-135m-eagle3.yaml
O="device=${DEVICE:-cpu} run_dir=runs/bench-head data.max_conversations=${CONVERSATIONS:-2000} data.max_length=1024
 data.validation_fraction=0.03 train.output_dir=runs/bench-head/head train.max_steps=${STEPS:-120}
 train.save_every=25 train.eval_every=25 train.eval_batches=8 train.warmup_steps=20 train.lr=8e-4
 train.batch_tokens=4096 train.grad_accum=1 train.max_length=1024 train.ttt_steps=4 train.mixed_precision=bf16
 head.draft_vocab_size=8192"
STAGES="${STAGES:-fetch prepare collect train export bench}"
for stage in $STAGES; do
  echo "== $stage"
  case $stage in
    fetch)   $PY scripts/fetch_assets.py ;;
    prepare) [ -d runs/bench-head/prepared ] || $PY -m train.prepare $R $O ;;
    collect) $PY -m train.collect $R $O ;;
    train)   .venv/bin/accelerate launch --config_file "${ACCELERATE_CONFIG:-configs/accelerate/cpu_zero2.yaml}" \
               --num_processes "${PROCESSES:-1}" -m train $R $O ;;
    export)  $PY -m drafthead.export runs/bench-head/head/final runs/bench-head/export --format eagle3 --force ;;
    bench)   $PY -m inference.bench --target "$DRAFTHEAD_CACHE/models/SmolLM2-135M-Instruct" \
               --draft runs/bench-head/export --prompts mt_bench --num-prompts 80 --max-new-tokens 96 \
               --tree auto --compare-tree gpu --dtype auto --device "${DEVICE:-cpu}" \
               --out runs/bench-head/bench.json ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
