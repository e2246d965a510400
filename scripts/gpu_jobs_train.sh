#!/usr/bin/env bash
# Training at GPU scale and an 8B-shaped target in the decoding engine: the jobs of one lent GPU machine
# (H100/H200), staged without a head or ShareGPT (the training data here is synthetic tokens):
#
#   SHAREGPT=0 scripts/gpu_stage.sh -j scripts/gpu_jobs_train.sh      # here: the carry folders and their calls
#
# Device calls and time plan (15 minutes of device time in all; the machine's start counts):
#   calls 1 .. N-1  carry .gpu-stage/K, `bash .gpu-stage/K/run.sh`  (~2 min: the start, then ~15 s a call;
#                   N = 3 with a ~20 MiB tree)                                              brings back: nothing
#   call N          carry .gpu-stage/N, `bash .gpu-stage/N/run.sh`, timeout_s 600: setup (~40 s), starts these
#                   jobs, waits up to 420 s                                  brings back: the JSON written so far
#   call N+1        `bash /root/stage/poll.sh 200`, timeout_s 300             brings back: every JSON, logs.tgz
# The jobs share BUDGET_S (default 600 s), each cut at its limit, each JSON written when its job (or, for the
# decoding curve, each size) ends; jobs_status.json says how each job ended. Nothing is downloaded: the 8B-shaped
# target is made on the machine from its config (random weights, bf16). In order:
#   1. train_135m      <= 150 s  the GPU recipe's trainer for SmolLM2-135M, online (target in the loop), bf16,
#                                16 x 1,024-token micro-batches, STEPS_135M (20) steps of synthetic tokens: tokens/s,
#                                each step's time (slow steps), peak GPU memory, the share of a step in the target's
#                                forward (features_fraction) and in the head         -> train_135m_online.json
#   2. make_8b         <= 120 s  Llama-3.1-8B's shape, random bf16 weights made on the GPU, saved to $S/target-8b
#                                                                                      -> make_8b.log
#   3. train_8b_zero2  <= 210 s  the same trainer on the 8B-shaped target through `accelerate launch` with
#                                configs/accelerate/gpu_zero2.yaml on one GPU, STEPS_8B (10) steps: tokens/s,
#                                peak memory, target-forward vs head shares        -> train_8b_zero2.json
#   4. train_8b_zero3  <= 210 s  the same with gpu_zero3.yaml                      -> train_8b_zero3.json
#   5. decode_8b       the rest  the 8B-shaped target on the engine's static runner, batch 1, CONTEXT (1024)
#                                tokens of KV, each size compiled to a CUDA graph: one token first (the graphed
#                                plain step), then the verify cost of QUERIES (64, 16, 4, 32, 8) tokens; the
#                                weight-streaming limit (weights read per step / copy bandwidth measured there)
#                                                                                      -> decode_8b.json
# Expected ~90 + 40 + 120 + 130 s for 1-4, which leaves 5 about 200 s: the graphed plain step and 3-4 sizes of the
# curve at ~40 s of compile each (an H100's figure for the 135M target's steps). A later session can run the rest
# with `ONLY=make_8b,decode_8b QUERIES=... bash .gpu-stage/N/run.sh` (a fresh machine holds no 8B target: every
# 8B job needs make_8b in the same run).
#
# CPU rehearsal (CUDA off, the `tiny` shape of the same architecture, a few steps; a few minutes):
#   REHEARSAL=1 STAGE=/tmp/rehearsal REPO=$PWD PY=.venv/bin/python bash scripts/gpu_jobs_train.sh
set -uo pipefail
if [ "${REHEARSAL:-0}" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=
  DEVICE=cpu ACCEL=cpu SHAPE=tiny PRECISION=fp32 COMPILE=off STEPS_135M=${STEPS_135M:-3} STEPS_8B=${STEPS_8B:-3}
  SEQUENCES=${SEQUENCES:-8} SEQ_LEN=${SEQ_LEN:-128} MICRO=${MICRO:-2} CONTEXT=${CONTEXT:-256} ROUNDS=${ROUNDS:-3}
  QUERIES=${QUERIES:-16,4} BUDGET_S=${BUDGET_S:-1800} CAP_SCALE=${CAP_SCALE:-4}
  # a shorter unroll and no compiled loss: the rehearsal checks that every job runs through, not its speed
  TRAIN_SET=${TRAIN_SET:-dtype=float32 train.ttt_steps=2 train.compile_loss=false}
fi
DEVICE=${DEVICE:-cuda} ACCEL=${ACCEL:-gpu} SHAPE=${SHAPE:-llama-3.1-8b} PRECISION=${PRECISION:-bf16}
COMPILE=${COMPILE:-on} STEPS_135M=${STEPS_135M:-20} STEPS_8B=${STEPS_8B:-10} SEQUENCES=${SEQUENCES:-64}
SEQ_LEN=${SEQ_LEN:-1024} MICRO=${MICRO:-16} CONTEXT=${CONTEXT:-1024} ROUNDS=${ROUNDS:-20}
QUERIES=${QUERIES:-64,16,4,32,8} BUDGET_S=${BUDGET_S:-600} TRAIN_SET=${TRAIN_SET:-}
# shellcheck source=scripts/gpu_jobs_common.sh
source "${REPO:-${STAGE:-/root/stage}/repo}/scripts/gpu_jobs_common.sh"
BIG=$S/target-8b
# shellcheck disable=SC2086  # TRAIN_SET: several KEY=VALUE words
TRAIN=(scripts/bench_train.py --device "$DEVICE" --online --recipe configs/smollm2-135m-eagle3-gpu.yaml
       --processes 1 --sequences "$SEQUENCES" --seq-len "$SEQ_LEN" --precision "$PRECISION"
       --set "train.batch_size=$MICRO" $TRAIN_SET)

job train_135m 150 60 "$PY" "${TRAIN[@]}" --steps "$STEPS_135M" --out "$O/train_135m_online.json"
job make_8b 120 30 "$PY" scripts/make_target.py --shape "$SHAPE" --out "$BIG" --device "$DEVICE"
for stage in 2 3; do
  job "train_8b_zero$stage" 210 90 "$PY" "${TRAIN[@]}" --target "$BIG" --steps "$STEPS_8B" \
      --accelerate "configs/accelerate/${ACCEL}_zero$stage.yaml" --out "$O/train_8b_zero$stage.json"
done
job decode_8b 600 60 "$PY" scripts/verify_cost.py --target "$BIG" --device "$DEVICE" --dtype bfloat16 \
    --compile "$COMPILE" --batch-size 1 --context "$CONTEXT" --queries "1,$QUERIES" --sequential --limit \
    --rounds "$ROUNDS" --out "$O/decode_8b.json"
