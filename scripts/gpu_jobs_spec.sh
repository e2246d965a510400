#!/usr/bin/env bash
# Speculation on a GPU against the engine's own graphed plain decoding, batch 1 and continuous batches: the jobs of
# one lent GPU machine (H100/H200), staged with the benchmark head:
#
#   PART_MIB=41 scripts/gpu_stage.sh -j scripts/gpu_jobs_spec.sh HEAD_FOLDER     # here: carry folders, their calls
#
# Device calls (15 minutes of device time in all; the machine's start counts):
#   calls 1 .. N-1  carry .gpu-stage/K, `bash .gpu-stage/K/run.sh`: the start (36 s on an H200, up to ~2 min),
#                   then ~5 s a call (N = 5 with the head, no ShareGPT and a 28 MiB tree; SHAREGPT=0 when no batch
#                   job runs)                                                               brings back: nothing
#   call N          carry .gpu-stage/N, `WAIT_S=420 bash .gpu-stage/N/run.sh`, timeout_s 600: setup (~40 s), starts
#                   the jobs, waits up to WAIT_S                                brings back: the JSON so far
#   call N+1        `bash /root/stage/poll.sh 240 tests`, timeout_s 300: waits for the jobs and the CUDA tests after
#                   them (never poll with `pgrep -f NAME`: it matches its own command)
#                                                                               brings back: every JSON, logs.tgz
# That leaves the jobs BUDGET_S = 600 s. Each is cut at its limit; a bench rewrites its JSON after every prompt
# (batch 1) or cell (batches), so a job cut short keeps what it measured; jobs_status.json says how each ended.
# Every compiled shape costs 26-40 s on a fresh machine (H200 / H100: each verify bucket a drafter can use, each
# drafting graph, per batch size), more than the decoding itself, so one session holds the CUDA tests and batch 1
# (an H200 ran spec_b1_gpu in 272 s):
#   1. cuda_tests     <= 120 s  the CUDA tests (graph capture of every verify bucket and drafting depth, the
#                               compiled loss), first: the figures after them are read knowing whether a step
#                               skipped its graph                                 -> cuda_tests.log (in logs.tgz)
#   2. spec_b1_gpu    <= 480 s  batch 1, PROMPTS (20) MT-bench first turns x TOKENS (128), bf16, static runner in
#                               CUDA graphs: transformers generate (~75 s), the engine's graphed plain decoding and
#                               the head with the GPU tree (6/10/60; ~7 buckets + its drafting graph to compile);
#                               per-step draft and verify ms in methods.*.ms_per_step  -> spec_b1_gpu_tree.json
#   3. spec_batch     <= 560 s  continuous batching of REQUESTS (64) requests through BATCH_SIZES (8, 32) rows:
#                               plain batched decoding vs head trees (BATCH_TREE 4/4/16), CONTEXT-token ShareGPT
#                               prompts (the batch bench reads no MT-bench); ~7 shapes per batch size
#                                                                                 -> spec_batch.json
#   4. spec_b1_auto   the rest  batch 1 as in 2 with --tree auto (tuned on this GPU: CALIB_PROMPTS x CALIB_TOKENS
#                               calibration, no lookup trial; the tuner compiles its own trial trees) and the GPU
#                               tree in the same run; its batch-1 buckets come from 2's compile cache if run after it
#                                                                                 -> spec_b1_auto.json
# Sessions: the first runs 1 and 2 (3 and 4 start only if time is left); a second `ONLY=spec_batch bash
# .gpu-stage/N/run.sh`; a third `ONLY=spec_b1_auto` (a whole batch-1 run by itself: generate, plain, auto and GPU
# trees). ONLY and BUDGET_S go on the call that starts the jobs; the CUDA tests then run after the figures.
#
# CPU rehearsal (CUDA off, eager steps, 2 prompts x 16 tokens, batches 2 and 4 of 4 requests):
#   REHEARSAL=1 STAGE=/tmp/rehearsal REPO=$PWD PY=.venv/bin/python HEAD=HEAD_FOLDER bash scripts/gpu_jobs_spec.sh
set -uo pipefail
if [ "${REHEARSAL:-0}" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=
  DEVICE=cpu DTYPE=${DTYPE:-float32} COMPILE=off PROMPTS=${PROMPTS:-2} TOKENS=${TOKENS:-16}
  BATCH_SIZES=${BATCH_SIZES:-2,4} REQUESTS=${REQUESTS:-4} CONTEXT=${CONTEXT:-128}
  CALIB_PROMPTS=${CALIB_PROMPTS:-1} CALIB_TOKENS=${CALIB_TOKENS:-16}
  BUDGET_S=${BUDGET_S:-1800} CAP_SCALE=${CAP_SCALE:-4}
fi
DEVICE=${DEVICE:-cuda} DTYPE=${DTYPE:-bfloat16} COMPILE=${COMPILE:-on} PROMPTS=${PROMPTS:-20} TOKENS=${TOKENS:-128}
BATCH_SIZES=${BATCH_SIZES:-8,32} REQUESTS=${REQUESTS:-64} CONTEXT=${CONTEXT:-256}
# 16 tokens a row: the GPU preset's 60 would make a 32-row verification 1,920 tokens, past where a step is cheap
BATCH_TREE=${BATCH_TREE:-4,4,16}
CALIB_PROMPTS=${CALIB_PROMPTS:-2} CALIB_TOKENS=${CALIB_TOKENS:-64} BUDGET_S=${BUDGET_S:-600}
# shellcheck source=scripts/gpu_jobs_common.sh
source "${REPO:-${STAGE:-/root/stage}/repo}/scripts/gpu_jobs_common.sh"
HEAD=${HEAD:-$S/head}
TARGET=${TARGET:-${DRAFTHEAD_CACHE:?set DRAFTHEAD_CACHE (the staged asset cache)}/models/SmolLM2-135M-Instruct}
B1=(--target "$TARGET" --draft "$HEAD" --prompts mt_bench --num-prompts "$PROMPTS" --max-new-tokens "$TOKENS"
    --device "$DEVICE" --dtype "$DTYPE" --runner static --compile "$COMPILE" --no-pld --warmup 1)

job cuda_tests 120 30 "$PY" -m pytest -q -p no:cacheprovider -p no:randomly tests/test_static_runner.py \
    tests/test_soft_ce.py -k cuda -rs
job spec_b1_gpu 480 240 "$PY" -m inference.bench "${B1[@]}" --methods plain,engine_plain,speculative --tree gpu \
    --compare-tree --out "$O/spec_b1_gpu_tree.json"
job spec_batch 560 300 "$PY" -m inference.bench --target "$TARGET" --draft "$HEAD" --grid --contexts "$CONTEXT" \
    --batch-sizes "$BATCH_SIZES" --continuous --prompts-per-cell "$REQUESTS" --max-new-tokens "$TOKENS" \
    --batch-methods plain,head --tree "$BATCH_TREE" --device "$DEVICE" --dtype "$DTYPE" --compile "$COMPILE" \
    --out "$O/spec_batch.json"
job spec_b1_auto 600 300 "$PY" -m inference.bench "${B1[@]}" --methods plain,engine_plain,speculative,compare \
    --tree auto --compare-tree gpu --no-auto-lookup --calibration-prompts "$CALIB_PROMPTS" \
    --calibration-tokens "$CALIB_TOKENS" --out "$O/spec_b1_auto.json"
