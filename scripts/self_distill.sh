#!/usr/bin/env bash
# Self-distillation vs. ShareGPT fine-tune of an existing head, on the same first turns and token budget (issue 14).
#
#   scripts/self_distill.sh HEAD [RECIPE]        # HEAD: the head to start from (native or exported folder)
#
# 1. the target's greedy answers to the recipe's ShareGPT first turns (train.regenerate, resumable);
# 2. the same conversations with their original answers (only those the regeneration kept, so both arms hold the
#    same prompts); both prepared with the same template and mask;
# 3. two fine-tunes from HEAD with identical train settings (online features, same steps and batch tokens);
# 4. tau of HEAD and both fine-tunes with the GPU default tree on all 80 MT-bench first turns (scripts/tau_table.py);
# 5. the same on 80 held-out ShareGPT first turns (after the recipe's conversations).
# Every stage skips what is already done and training resumes from its last checkpoint (re-run after a kill);
# results land in RUN_DIR/tau_table.json and RUN_DIR/tau_table_heldout_sharegpt.json. ARMS=parallel trains the
# two arms side by side, each on half of the cores (logs in RUN_DIR/train-ARM.log), so that a run cut short leaves
# both at about the same step.
set -euo pipefail
HEAD=${1:?usage: scripts/self_distill.sh HEAD [RECIPE]}
RECIPE=${2:-configs/smollm2-135m-selfdistill-cpu.yaml}
PY=${PYTHON:-.venv/bin/python}
RUN=$($PY -c "import sys; from train.recipe import load_recipe; print(load_recipe(sys.argv[1]).run_dir)" "$RECIPE")
TCMALLOC=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
[ -e "$TCMALLOC" ] && export LD_PRELOAD=$TCMALLOC
mkdir -p "$RUN"

$PY -m train.regenerate "$RECIPE"
$PY - "$RECIPE" "$RUN" <<'PY'
import json, sys
from drafthead.utils import atomic_write_text
from train.conversations import read_conversations
from train.recipe import load_recipe
recipe, run = load_recipe(sys.argv[1]), sys.argv[2]
kept = {json.loads(line)["id"] for line in open(f"{run}/regenerated.jsonl")}
convs = read_conversations(recipe.data.conversations, limit=recipe.data.max_conversations,
                           max_assistant_turns=recipe.data.max_assistant_turns)
atomic_write_text(f"{run}/original.jsonl",
                  "".join(json.dumps(c, ensure_ascii=False) + "\n" for c in convs if c["id"] in kept))
print(f"{len(kept)} conversations in both arms")
PY
for arm in self original; do
  data="$RUN/regenerated.jsonl"; [ "$arm" = original ] && data="$RUN/original.jsonl"
  [ -d "$RUN/prepared-$arm" ] || $PY -m train.prepare "$RECIPE" data.conversations="$data" \
      data.prepared_dir="$RUN/prepared-$arm"
done
train_arm() {
  [ -d "$RUN/train-$1/final" ] && return 0  # trained already
  $PY -m train "$RECIPE" head.init_from="$HEAD" data.prepared_dir="$RUN/prepared-$1" train.output_dir="$RUN/train-$1"
}
if [ "${ARMS:-}" = parallel ]; then
  threads=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 ))
  pids=()
  for arm in self original; do
    OMP_NUM_THREADS=$threads train_arm $arm > "$RUN/train-$arm.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done  # (set -e: a failed arm stops the script here)
else
  for arm in self original; do train_arm $arm; done
fi
tau_table() {  # the three heads on 80 prompts, GPU default tree, 8 rows at a time
  $PY scripts/tau_table.py --heads start="$HEAD" self="$RUN/train-self/final" original="$RUN/train-original/final" \
      --tree gpu --num-prompts 80 --max-new-tokens 64 --batch-size 8 "$@"
}
tau_table --out "$RUN/tau_table.json"
# 5. the same on 80 ShareGPT first turns that follow the recipe's conversations: the arms' own distribution,
#    trained on by neither
$PY - "$RECIPE" "$RUN" <<'PY'
import json, sys
from drafthead.utils import atomic_write_text
from train.conversations import read_conversations
from train.recipe import load_recipe
recipe, run = load_recipe(sys.argv[1]), sys.argv[2]
used = recipe.data.max_conversations
if used is None:
    sys.exit("data.max_conversations is unset: every conversation was used, none is left to hold out")
convs = read_conversations(recipe.data.conversations, limit=used + 400, max_assistant_turns=1)
seen = {c["id"] for c in convs[:used]}
rows = []
for c in convs[used:]:
    user = next((m["content"] for m in c["messages"] if m["role"] == "user"), None)
    if c["id"] not in seen and user and 20 < len(user) < 1500:
        rows.append({"id": c["id"], "prompt": user})
atomic_write_text(f"{run}/heldout_sharegpt_prompts.jsonl",
                  "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows[:80]))
print(f"{min(len(rows), 80)} held-out ShareGPT first turns")
PY
tau_table --prompts "$RUN/heldout_sharegpt_prompts.jsonl" --out "$RUN/tau_table_heldout_sharegpt.json"
