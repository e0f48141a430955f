# Shared launch logic, sourced by the launch scripts (examples/qwen_image/*.sh, *.sbatch, examples/tiny/*.sh).
# Not a launch script itself. A script sets its knobs, sources this file and calls `launch "$@"`.
#
# Knobs read here (each script sets defaults at its top):
#   NNODES GPUS_PER_NODE NODE_RANK MASTER_ADDR MASTER_PORT   torchrun rendezvous (static, c10d-free)
#   REWARD_GPUS        comma list of local GPU ids carved out of EVERY node for the reward ("" = none).
#                      Trainer ranks per node = GPUS_PER_NODE - count(REWARD_GPUS), so that torchrun's
#                      --nproc-per-node is the same on every node; world size = NNODES * that. Only node 0
#                      runs the reward server on its carved GPUs (the others leave theirs idle).
#   REWARD_KIND        server (our reward server with REWARD_SCORER, on REWARD_GPUS or on CPU workers)
#                      | vlm (vllm serve JUDGE_MODEL on REWARD_GPUS + our server with the vlm_ocr scorer as its
#                      client) | url (an already running server at REWARD_URL) | none (score inside the trainer)
#   REWARD_SCORER REWARD_HOST REWARD_PORT REWARD_URL REWARD_WORKERS REWARD_DEVICE_KIND JUDGE_MODEL JUDGE_PORT
#   RECIPE PIPELINE_DIR RUN_DIR PYTHON GPU_KIND DRY_RUN HEALTH_TIMEOUT_S MFU_FROM
#   MODEL_BACKEND      the layer spec the 20B recipes read (default te: TransformerEngine). A dry run where
#                      transformer_engine is not importable (a laptop, a CPU login node) plans with local and
#                      says so: the planner's memory and time do not depend on the layer spec.
#   MFU_FROM           a dry run's measured MFU: the JSON tools/gpu_check.sh wrote (default: the assumed 0.35)
# Extra arguments of the script ("$@") go to the entry point (e.g. --set steps=100, --resume auto).

count_list() {  # number of comma-separated entries in $1 ("" -> 0)
    local list="$1"
    if [[ -z "${list// /}" ]]; then echo 0; return; fi
    local IFS=,
    # shellcheck disable=SC2206
    local items=($list)
    echo "${#items[@]}"
}

die() { echo "launch: $*" >&2; exit 2; }

wait_healthy() {  # URL TIMEOUT_S [PID]: poll URL until it answers 200; fail if PID dies or time runs out
    local url="$1" timeout="$2" pid="${3:-}" start=$SECONDS
    until "$PYTHON" - "$url" <<'PY' 2>/dev/null
import sys, urllib.request
with urllib.request.urlopen(sys.argv[1], timeout=2) as r:
    sys.exit(0 if r.status == 200 else 1)
PY
    do
        if [[ -n "$pid" ]] && ! kill -0 "$pid" 2>/dev/null; then
            die "process $pid serving $url exited during start-up (log: ${LOG_DIR}/)"
        fi
        if (( SECONDS - start > timeout )); then
            die "$url not healthy within ${timeout}s (log: ${LOG_DIR}/)"
        fi
        sleep 1
    done
    echo "launch: $url is healthy"
}

CHILD_PIDS=()
cleanup() {  # stop what this script started (reward server, vLLM judge), in reverse order
    local pid
    for (( i=${#CHILD_PIDS[@]}-1; i>=0; i-- )); do
        pid="${CHILD_PIDS[$i]}"
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
            kill -KILL "$pid" 2>/dev/null || true
        fi
    done
}

start_reward() {  # node 0: start the reward side on REWARD_GPUS; every node: wait for it and set REWARD_URL
    if [[ "$REWARD_KIND" == none ]]; then return; fi
    REWARD_URL="${REWARD_URL:-http://${MASTER_ADDR}:${REWARD_PORT}}"
    if [[ "$REWARD_KIND" != url && "$NODE_RANK" == 0 ]]; then
        mkdir -p "$LOG_DIR"
        local n_gpu devices=() i
        n_gpu=$(count_list "$REWARD_GPUS")
        for (( i=0; i<n_gpu; i++ )); do devices+=("${REWARD_DEVICE_KIND}:$i"); done
        local server=("$PYTHON" -m megatron_omni.reward.server --host "$REWARD_HOST" --port "$REWARD_PORT"
                      --max-queue "$REWARD_MAX_QUEUE" --timeout "$REWARD_TIMEOUT_S")
        if [[ "$REWARD_KIND" == vlm ]]; then
            CUDA_VISIBLE_DEVICES="$REWARD_GPUS" vllm serve "$JUDGE_MODEL" --host 127.0.0.1 --port "$JUDGE_PORT" \
                --tensor-parallel-size "$n_gpu" >"$LOG_DIR/vllm_judge.log" 2>&1 &
            CHILD_PIDS+=($!)
            wait_healthy "http://127.0.0.1:${JUDGE_PORT}/health" "$HEALTH_TIMEOUT_S" "$!"
            server+=(--scorer vlm_ocr --workers "$REWARD_WORKERS" --scorer-kwargs
                     "{\"base_url\": \"http://127.0.0.1:${JUDGE_PORT}/v1\", \"model\": \"${JUDGE_MODEL}\"}")
            CUDA_VISIBLE_DEVICES="" "${server[@]}" >"$LOG_DIR/reward_server.log" 2>&1 &
        elif (( n_gpu > 0 )); then
            server+=(--scorer "$REWARD_SCORER" --devices "$(IFS=,; echo "${devices[*]}")")
            CUDA_VISIBLE_DEVICES="$REWARD_GPUS" "${server[@]}" >"$LOG_DIR/reward_server.log" 2>&1 &
        else
            server+=(--scorer "${REWARD_SCORER}" --workers "$REWARD_WORKERS")
            CUDA_VISIBLE_DEVICES="" "${server[@]}" >"$LOG_DIR/reward_server.log" 2>&1 &
        fi
        CHILD_PIDS+=($!)
        echo "launch: reward server (pid $!) -> $LOG_DIR/reward_server.log"
        wait_healthy "${REWARD_URL}/health" "$HEALTH_TIMEOUT_S" "$!"
    else
        wait_healthy "${REWARD_URL}/health" "$HEALTH_TIMEOUT_S"
    fi
    ENTRY_ARGS+=(--set "reward.url=${REWARD_URL}")
    # The saved config names the scorer that actually scores.
    if [[ "$REWARD_KIND" == vlm ]]; then ENTRY_ARGS+=(--set reward.scorer=vlm_ocr); fi
    if [[ "$REWARD_KIND" == server ]]; then ENTRY_ARGS+=(--set "reward.scorer=${REWARD_SCORER}"); fi
}

launch() {  # the one call of the entry point: a dry run (DRY_RUN=1) or torchrun on this node
    set -euo pipefail
    PYTHON="${PYTHON:-python}"
    REWARD_HOST="${REWARD_HOST:-0.0.0.0}"
    REWARD_PORT="${REWARD_PORT:-8000}"
    REWARD_URL="${REWARD_URL:-}"
    REWARD_KIND="${REWARD_KIND:-server}"
    REWARD_SCORER="${REWARD_SCORER:-ocr}"
    REWARD_WORKERS="${REWARD_WORKERS:-4}"
    REWARD_DEVICE_KIND="${REWARD_DEVICE_KIND:-cuda}"
    REWARD_MAX_QUEUE="${REWARD_MAX_QUEUE:-1024}"
    REWARD_TIMEOUT_S="${REWARD_TIMEOUT_S:-600}"
    JUDGE_MODEL="${JUDGE_MODEL:-Qwen/Qwen2.5-VL-7B-Instruct}"
    JUDGE_PORT="${JUDGE_PORT:-8001}"
    HEALTH_TIMEOUT_S="${HEALTH_TIMEOUT_S:-600}"
    GPU_KIND="${GPU_KIND:-H200}"
    DRY_RUN="${DRY_RUN:-0}"
    LOG_DIR="${LOG_DIR:-${RUN_DIR}/logs}"
    export PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"

    local n_reward
    n_reward=$(count_list "$REWARD_GPUS")
    NPROC_PER_NODE="${NPROC_PER_NODE:-$(( GPUS_PER_NODE - n_reward ))}"
    (( NPROC_PER_NODE >= 1 )) || die "no trainer GPUs left: GPUS_PER_NODE=$GPUS_PER_NODE, REWARD_GPUS=$REWARD_GPUS"
    (( NODE_RANK >= 0 && NODE_RANK < NNODES )) || die "NODE_RANK=$NODE_RANK is not in [0, NNODES=$NNODES)"
    local world=$(( NNODES * NPROC_PER_NODE ))
    case "$REWARD_KIND" in  # checked before a dry run too: a bad knob fails before the job is queued
        server|url|none) ;;
        vlm) (( n_reward > 0 )) || die "REWARD_KIND=vlm needs REWARD_GPUS for vllm serve" ;;
        *) die "REWARD_KIND=$REWARD_KIND: expected server, vlm, url or none" ;;
    esac
    if [[ "$REWARD_KIND" == url && -z "$REWARD_URL" ]]; then die "REWARD_KIND=url needs REWARD_URL"; fi
    ENTRY_ARGS=(--recipe "$RECIPE" --set "run_dir=${RUN_DIR}")
    if [[ -n "${PIPELINE_DIR:-}" ]]; then ENTRY_ARGS+=(--set "model.pipeline=${PIPELINE_DIR}"); fi
    echo "launch: $NNODES node(s) x $NPROC_PER_NODE trainer ranks = world size $world" \
         "(+ $n_reward reward GPU(s) per node: '${REWARD_GPUS}'), node rank $NODE_RANK, recipe $RECIPE"

    if [[ "$DRY_RUN" == 1 ]]; then
        # Nothing is started: the planner validates the layout for this world size and prints the plan.
        if [[ -z "${MODEL_BACKEND:-}" ]] && ! "$PYTHON" -c \
                'import importlib.util, sys; sys.exit(importlib.util.find_spec("transformer_engine") is None)'; then
            echo "launch: transformer_engine is not importable here: the dry run plans with MODEL_BACKEND=local" \
                 "(same memory and time model; the cluster run uses te)"
            export MODEL_BACKEND=local
        fi
        local dry=(--dry-run --gpu "$GPU_KIND" --gpus-per-node "$GPUS_PER_NODE" --reward-gpus "$(( NNODES * n_reward ))")
        if [[ -n "${MFU_FROM:-}" ]]; then dry+=(--mfu-from "$MFU_FROM"); fi
        WORLD_SIZE="$world" exec "$PYTHON" -m megatron_omni.train "${dry[@]}" "${ENTRY_ARGS[@]}" "$@"
    fi

    trap cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    start_reward
    if [[ -n "$REWARD_GPUS" ]]; then
        # Trainer ranks see only the GPUs not carved out for the reward (LOCAL_RANK indexes into this list).
        CUDA_VISIBLE_DEVICES="$(
            "$PYTHON" -c 'import sys; r=set(sys.argv[2].split(",")); print(",".join(str(i) for i in range(int(sys.argv[1])) if str(i) not in r))' \
                "$GPUS_PER_NODE" "$REWARD_GPUS")"
        export CUDA_VISIBLE_DEVICES
    fi
    "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE" \
        --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
        -m megatron_omni.train "${ENTRY_ARGS[@]}" "$@"
}
