#!/usr/bin/env bash
# `make demo`: a local Prefect server (SQLite), the metrics store, the example queues and jobs,
# one launch agent with two declared GPUs, the queue monitor, and a mix of submitted jobs.
# `make demo DB=postgres` (or DB=postgres scripts/demo.sh): the same, with the Prefect server and the
# metrics store on a private PostgreSQL that this script starts on a loopback port (data in
# .launch/postgres). `make demo AUTH=1` (or AUTH=1 scripts/demo.sh): the gateway in front of the server on
# 127.0.0.1:4280 with an admin, two users (alice, bob; keys printed once) and an agent key; the agent, the
# submissions and the monitor go through it, the workload submitted as both users (the monitor signs
# people in with these users' keys). Ctrl-C stops everything this
# script started.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
BIN="$ROOT/.venv/bin"
STATE="${LAUNCH_DEMO_STATE:-$ROOT/.launch}"  # where the demo keeps its state (default .launch)
mkdir -p "$STATE/logs"

DB="${DB:-sqlite}"
case "$DB" in
  sqlite|postgres) ;;
  *) echo "DB=$DB: use DB=sqlite (default) or DB=postgres" >&2; exit 2 ;;
esac
AUTH="${AUTH:-0}"
PORT="${LAUNCH_PREFECT_PORT:-4200}"
GW_PORT="${LAUNCH_GATEWAY_PORT:-4280}"
DASH_PORT="${LAUNCH_DASHBOARD_PORT:-8501}"
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
if port_busy "$PORT"; then echo "port $PORT is in use; set LAUNCH_PREFECT_PORT=<free port> and retry" >&2; exit 1; fi
if port_busy "$DASH_PORT"; then echo "port $DASH_PORT is in use; set LAUNCH_DASHBOARD_PORT=<free port> and retry" >&2; exit 1; fi
if [ "$AUTH" = 1 ] && port_busy "$GW_PORT"; then echo "port $GW_PORT is in use; set LAUNCH_GATEWAY_PORT=<free port> and retry" >&2; exit 1; fi

export PREFECT_HOME="$STATE/prefect"
export PREFECT_API_URL="http://127.0.0.1:$PORT/api"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export PREFECT_UI_API_URL="$PREFECT_API_URL"
export LAUNCH_CODE_STORAGE="$STATE/storage"
mkdir -p "$PREFECT_HOME"

pids=()
PG_DIR=""
cleanup() {
  trap - INT TERM EXIT
  echo; echo "stopping the demo ..."
  for pid in "${pids[@]}"; do kill -INT -- "-$pid" 2>/dev/null || kill -INT "$pid" 2>/dev/null || true; done
  sleep 3
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  if [ -n "$PG_DIR" ]; then "$BIN/python" -m prefect_launch.local_server postgres stop "$PG_DIR" || true; fi
  echo "stopped. State is kept in $STATE (delete it for a fresh start)."
  exit 0
}
trap cleanup INT TERM EXIT
start() {  # start NAME CMD...: in its own process group, logging to .launch/logs/NAME.log
  local name="$1"; shift
  setsid "$@" >"$STATE/logs/$name.log" 2>&1 &
  pids+=("$!")
}

METRICS_ARGS=()
if [ "$DB" = postgres ]; then
  PG_DIR="$STATE/postgres"
  echo "==> PostgreSQL on 127.0.0.1 (data in $PG_DIR; log $PG_DIR/pg.log)"
  PG_PORT="$("$BIN/python" -m prefect_launch.local_server postgres start "$PG_DIR" ${LAUNCH_PG_PORT:+--port "$LAUNCH_PG_PORT"} \
    --db prefect --db launch_metrics)" || { PG_DIR=""; echo "PostgreSQL did not start (make system-deps installs it)" >&2; exit 1; }
  export PREFECT_SERVER_DATABASE_CONNECTION_URL="postgresql+asyncpg://launch@127.0.0.1:$PG_PORT/prefect"
  METRICS_ARGS=(--metrics-url "postgresql+psycopg://launch@127.0.0.1:$PG_PORT/launch_metrics")
  echo "==> Prefect server on 127.0.0.1:$PORT (PostgreSQL 127.0.0.1:$PG_PORT, database prefect)"
else
  unset PREFECT_SERVER_DATABASE_CONNECTION_URL PREFECT_API_DATABASE_CONNECTION_URL
  echo "==> Prefect server on 127.0.0.1:$PORT (SQLite under $PREFECT_HOME)"
fi
start server "$BIN/prefect" server start --host 127.0.0.1 --port "$PORT"
for i in $(seq 1 240); do
  curl -fsS "$PREFECT_API_URL/health" >/dev/null 2>&1 && break
  sleep 0.5
  [ "$i" = 240 ] && { echo "server did not start; see $STATE/logs/server.log" >&2; exit 1; }
done

echo "==> metrics store and block types"
"$BIN/prefect-launch" setup "${METRICS_ARGS[@]}"

echo "==> queues (work pools) from deployments/queues.yaml"
"$BIN/prefect-launch" queue apply deployments/queues.yaml

echo "==> jobs (deployments) from prefect.yaml"
"$BIN/prefect" --no-prompt deploy --all --prefect-file prefect.yaml >"$STATE/logs/deploy.log" 2>&1 \
  || { echo "deploy failed; see $STATE/logs/deploy.log" >&2; exit 1; }
"$BIN/prefect-launch" jobs ls

# as_user KEY CMD...: CMD through the gateway with that key (AUTH=1), else straight to the server.
as_user() { local key="$1"; shift; "$@"; }
if [ "$AUTH" = 1 ]; then
  echo "==> users and keys (in the metrics store's database), the gateway on 127.0.0.1:$GW_PORT"
  new_key() {  # new_key NAME [user add options]: a new key for NAME (its old keys revoked if it exists)
    local name="$1"; shift
    { "$BIN/prefect-launch" user add "$name" "$@" --json 2>/dev/null \
      || "$BIN/prefect-launch" user key rotate "$name" --json; } | "$BIN/python" -c 'import json,sys; print(json.load(sys.stdin)["key"])'
  }
  ADMIN_KEY="$(new_key admin --admin)"
  ALICE_KEY="$(new_key alice --project vision)"
  BOB_KEY="$(new_key bob --project nlp)"
  AGENT_KEY="$(new_key demo-agent --agent)"
  MONITOR_KEY="$(new_key monitor)"  # the monitor's own key, for its reads; people sign in to it as themselves
  start gateway "$BIN/prefect-launch" gateway --host 127.0.0.1 --port "$GW_PORT" --upstream "$PREFECT_API_URL"
  GW_API="http://127.0.0.1:$GW_PORT/api"
  for i in $(seq 1 120); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "$GW_API/health")" = 401 ] && break
    sleep 0.5
    [ "$i" = 120 ] && { echo "the gateway did not start; see $STATE/logs/gateway.log" >&2; exit 1; }
  done
  as_user() { local key="$1"; shift; PREFECT_API_URL="$GW_API" PREFECT_API_KEY="$key" "$@"; }
fi

echo "==> one launch agent serving gpu-box and cpu-pool (declared capacity: 2 GPUs)"
if [ "$AUTH" = 1 ]; then  # the agent's own key, through the gateway; the jobs it starts inherit it
  PREFECT_API_URL="$GW_API" PREFECT_API_AUTH_STRING="demo-agent:$AGENT_KEY" start agent "$BIN/prefect-launch" agent \
    --queue gpu-box --queue cpu-pool --capacity "cpu=2,memory=8Gi,gpu=2" --name demo-agent
else
  start agent "$BIN/prefect-launch" agent --queue gpu-box --queue cpu-pool \
    --capacity "cpu=2,memory=8Gi,gpu=2" --name demo-agent
fi
for i in $(seq 1 60); do
  "$BIN/prefect-launch" agent ls --json 2>/dev/null | grep -q '"online": true' && break
  sleep 1
done

echo "==> queue monitor on 127.0.0.1:$DASH_PORT"
MON_ENV=()  # AUTH=1: through the gateway with its own key, which turns on the sign-in with users and keys
if [ "$AUTH" = 1 ]; then MON_ENV=(env PREFECT_API_URL="$GW_API" PREFECT_API_AUTH_STRING="monitor:$MONITOR_KEY"); fi
start dashboard "${MON_ENV[@]}" "$BIN/python" -m prefect_launch.dashboard.serve --server.address 127.0.0.1 --server.port "$DASH_PORT" \
  --server.headless true --browser.gatherUsageStats false

echo "==> submitting a mix of jobs"
S="$BIN/prefect-launch submit"
A=(); B=()  # AUTH=1: the first user's and the second user's submissions, through the gateway
if [ "$AUTH" = 1 ]; then A=(as_user "$ALICE_KEY"); B=(as_user "$BOB_KEY"); fi
"${A[@]}" $S train/train-code --queue gpu-box --preset gpu-2 --param epochs=300 --param hold_seconds=20 --name big-train
"${B[@]}" $S train/train-code --queue gpu-box --preset gpu-1 --param hold_seconds=10 --count 2 --name small-train
"${A[@]}" $S train/train-code --queue gpu-box --preset gpu-1 --priority high --param hold_seconds=5 --name urgent-train
"${B[@]}" $S evaluate/evaluate-code --queue cpu-pool --count 3 --name eval
"${A[@]}" $S evaluate/evaluate-code --queue cpu-pool --preset large --name eval-large
"${B[@]}" $S versioned/versioned-git --queue cpu-pool --name git-job || true

cat <<MSG

prefect-launch demo is running.
  Prefect UI          http://127.0.0.1:$PORT
  Queue monitor       http://127.0.0.1:$DASH_PORT
  Queues              PREFECT_API_URL=$PREFECT_API_URL .venv/bin/prefect-launch queue ls
  Runs                PREFECT_API_URL=$PREFECT_API_URL .venv/bin/prefect-launch runs ls
  Logs                $STATE/logs/
Press Ctrl-C to stop everything.
MSG
if [ "$AUTH" = 1 ]; then
  cat <<MSG
Gateway (every request needs a key)   http://127.0.0.1:$GW_PORT/api  (the UI: http://127.0.0.1:$GW_PORT, log in as user:key)
API keys, shown once (the database keeps only their hashes):
  admin       $ADMIN_KEY
  alice       $ALICE_KEY   (project vision)
  bob         $BOB_KEY   (project nlp)
  demo-agent  $AGENT_KEY   (the agent's)
  e.g.  PREFECT_API_URL=http://127.0.0.1:$GW_PORT/api PREFECT_API_KEY=<alice's key> .venv/bin/prefect-launch runs ls
The jobs above were submitted as alice and bob through the gateway. The monitor reads through it with its
own key (user monitor); sign in to it as alice or bob (user name and key above) to launch, rename or
terminate sessions as them, or as admin to change queue links.
MSG
fi
# Keep traffic coming so the queues and the monitor have something to show: every 45 s a wave of
# jobs of mixed sizes, some of which must wait for GPUs held by others.
wave=0
while true; do
  sleep 45
  wave=$((wave + 1))
  {
    "${A[@]}" $S train/train-code --queue gpu-box --preset gpu-2 --param hold_seconds=30 --name "wave$wave-big"
    "${B[@]}" $S train/train-code --queue gpu-box --preset gpu-1 --param hold_seconds=15 --count 2 --name "wave$wave-small"
    "${A[@]}" $S evaluate/evaluate-code --queue cpu-pool --count 2 --name "wave$wave-eval"
  } >>"$STATE/logs/traffic.log" 2>&1 || echo "a demo submission failed; see $STATE/logs/traffic.log"
done
