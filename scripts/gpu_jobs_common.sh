# Sourced by the device jobs scripts (scripts/gpu_jobs_*.sh): where things are, and `job`, which runs one job of
# a run inside a shared time budget and records its outcome in $O/jobs_status.json as soon as it ends.
#   STAGE (default /root/stage, the staged machine's folder), REPO (default $STAGE/repo), RESULTS (default
#   $STAGE/out), PY (default python3), BUDGET_S (seconds for all the jobs, counted from the first), CAP_SCALE
#   (default 1: every job's own limit times this; a CPU rehearsal on a shared machine runs slower than the GPU),
#   ONLY (a comma list of job names: run those alone, e.g. in a later session for the jobs an earlier one did not
#   reach; set it on the device call that starts the jobs: `ONLY=a,b bash .gpu-stage/N/run.sh`).
S=${STAGE:-/root/stage}
REPO=${REPO:-$S/repo}
O=${RESULTS:-$S/out}
PY=${PY:-python3}
mkdir -p "$O"
cd "$REPO" || exit 1
JOBS_START=$SECONDS
JOBS_STATUS=()

# job NAME CAP_S NEED_S COMMAND...: run COMMAND (output in $O/NAME.log) for at most CAP_S seconds, fewer when the
# budget ends sooner; skipped when fewer than NEED_S seconds are left. Never stops the jobs after it.
job() {
  local name=$1 cap=$2 need=$3
  shift 3
  local left=$((BUDGET_S - (SECONDS - JOBS_START)))
  cap=$((cap * ${CAP_SCALE:-1}))
  local limit=$((cap < left ? cap : left))
  local t0=$SECONDS outcome
  if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then
    outcome="skipped: not in ONLY"
  elif [ "$limit" -lt "$need" ]; then
    outcome="skipped: ${left} s of the budget left, needs ${need}"
  else
    echo "[jobs] $(date -u +%H:%M:%S) $name (at most $limit s): $*"
    timeout -k 15 "$limit" "$@" > "$O/$name.log" 2>&1
    local rc=$?
    case $rc in
      0) outcome=ok ;;
      124 | 137) outcome="cut at its limit of $limit s" ;;
      *) outcome="failed (exit $rc): see $name.log" ;;
    esac
  fi
  echo "[jobs] $name: $outcome ($((SECONDS - t0)) s)"
  JOBS_STATUS+=("{\"job\": \"$name\", \"outcome\": \"$outcome\", \"seconds\": $((SECONDS - t0)), \"limit_s\": $limit}")
  (IFS=,; printf '{"budget_s": %s, "elapsed_s": %s, "jobs": [%s]}\n' "$BUDGET_S" "$((SECONDS - JOBS_START))" \
      "${JOBS_STATUS[*]}") > "$O/jobs_status.json"
}
