#!/usr/bin/env bash
# Compose smoke test: build the image, start model maker + encoder + decoder + gateway with
# `docker compose up -d --wait`, send a real `mmserve generate` with an image from inside the
# decoder container (and one from the host through the published 127.0.0.1 port when this host has
# `mmserve`), one OpenAI chat completion with an image through the gateway, check the stream, the
# usage and `mmserve stats` of both services, then `down -v`.
#
#   tests/compose/smoke.sh            # exit 0: passed, or skipped where no Docker engine runs
#
# Not part of CI. Needs a Docker engine and Compose (v2 `docker compose`, or Debian's docker-compose
# 1.29, where `up --wait` is emulated by polling the healthchecks). Where no image registry is
# reachable: docker/make-base-image.sh and docker/wheelhouse.sh first (docs/docker.md); this script
# then picks the local base image and the offline build by itself.
# Env: MMSERVE_BASE_IMAGE, MMSERVE_OFFLINE (0/1; default 1 when docker/wheelhouse has a torch wheel),
#      MMSERVE_SMOKE_GPU=1 (add docker-compose.gpu.yml), MMSERVE_SMOKE_KEEP=1 (leave the stack up),
#      MMSERVE_SMOKE_COMPOSE=v1 (use docker-compose even where `docker compose` exists),
#      MMSERVE_SMOKE_HOST_CLIENT=0 (skip the request from the host; it is skipped, and says so, where
#      the host has no `mmserve`),
#      MMSERVE_SMOKE_PROJECT [mmserve-smoke], MMSERVE_SMOKE_TIMEOUT seconds for up [900].
#      The published ports default to 15051/15052/19101/19102/18000 here, so a stack on the usual ports
#      is left alone.
set -uo pipefail
cd "$(dirname "$0")/../.."

say() { echo "[smoke $(date -u +%H:%M:%S)] $*"; }
fail() { say "FAIL: $*"; exit 1; }

# --- is there a Docker engine? ----------------------------------------------------------------
if ! command -v docker >/dev/null 2>&1; then
    echo "SKIP: no docker command on this host: the compose smoke test needs a Docker engine"; exit 0
fi
if ! timeout 30 docker info >/dev/null 2>&1; then
    echo "SKIP: no Docker engine answers (docker info failed): the compose smoke test needs one"; exit 0
fi
if [[ "${MMSERVE_SMOKE_COMPOSE:-}" == v1 ]] && command -v docker-compose >/dev/null 2>&1; then
    COMPOSE=(docker-compose); COMPOSE_V2=0
elif docker compose version >/dev/null 2>&1; then
    COMPOSE=(docker compose); COMPOSE_V2=1
elif command -v docker-compose >/dev/null 2>&1; then
    COMPOSE=(docker-compose); COMPOSE_V2=0
else
    echo "SKIP: a Docker engine runs but neither 'docker compose' nor 'docker-compose' is installed"; exit 0
fi
say "engine $(docker version --format '{{.Server.Version}}' 2>/dev/null), compose: $("${COMPOSE[@]}" version --short 2>/dev/null || "${COMPOSE[@]}" version | head -1)"

PROJECT="${MMSERVE_SMOKE_PROJECT:-mmserve-smoke}"
FILES=(-f docker-compose.yml)
[[ "${MMSERVE_SMOKE_GPU:-0}" == 1 ]] && FILES+=(-f docker-compose.gpu.yml)
C=("${COMPOSE[@]}" -p "$PROJECT" "${FILES[@]}")
export MMSERVE_ENCODER_PORT="${MMSERVE_ENCODER_PORT:-15051}" MMSERVE_DECODER_PORT="${MMSERVE_DECODER_PORT:-15052}"
export MMSERVE_ENCODER_METRICS_PORT="${MMSERVE_ENCODER_METRICS_PORT:-19101}"
export MMSERVE_DECODER_METRICS_PORT="${MMSERVE_DECODER_METRICS_PORT:-19102}"
export MMSERVE_GATEWAY_PORT="${MMSERVE_GATEWAY_PORT:-18000}"

# --- base image and build mode ------------------------------------------------------------------
if [[ -z "${MMSERVE_BASE_IMAGE:-}" && "${MMSERVE_SMOKE_GPU:-0}" != 1 ]]; then
    if docker image inspect python:3.11-slim >/dev/null 2>&1; then
        MMSERVE_BASE_IMAGE=python:3.11-slim
    elif docker image inspect mmserve-base:bookworm >/dev/null 2>&1; then
        MMSERVE_BASE_IMAGE=mmserve-base:bookworm
    elif timeout 120 docker pull -q python:3.11-slim >/dev/null 2>&1; then
        MMSERVE_BASE_IMAGE=python:3.11-slim
    else
        fail "no base image: python:3.11-slim is not here and cannot be pulled; run docker/make-base-image.sh"
    fi
    export MMSERVE_BASE_IMAGE
fi
if [[ -z "${MMSERVE_OFFLINE:-}" ]]; then
    if compgen -G "docker/wheelhouse/torch-*.whl" >/dev/null; then MMSERVE_OFFLINE=1; else MMSERVE_OFFLINE=0; fi
    export MMSERVE_OFFLINE
fi
say "project $PROJECT, base image ${MMSERVE_BASE_IMAGE:-(gpu default)}, offline build: $MMSERVE_OFFLINE"

dump_and_down() {
    local rc=$?
    if [[ $rc != 0 ]]; then
        say "--- ps ---"; "${C[@]}" ps -a 2>/dev/null || "${C[@]}" ps
        say "--- logs (last 60 lines each) ---"; "${C[@]}" logs --no-color --tail 60 2>&1 | sed "s/\x1b\[[0-9;]*[A-Za-z]//g" | tail -200
    fi
    if [[ "${MMSERVE_SMOKE_KEEP:-0}" == 1 ]]; then
        say "MMSERVE_SMOKE_KEEP=1: left up; stop with: ${C[*]} down -v"
    else
        say "down -v"; "${C[@]}" down -v --remove-orphans >/dev/null 2>&1 || say "down -v failed"
    fi
    if [[ $rc == 0 ]]; then say "PASS"; else say "FAIL (exit $rc)"; fi
    exit $rc
}
trap dump_and_down EXIT
trap 'exit 130' INT TERM

"${C[@]}" config -q || fail "compose config is invalid"
"${C[@]}" down -v --remove-orphans >/dev/null 2>&1 || true   # leftovers of an interrupted run

# --- build ----------------------------------------------------------------------------------------
t0=$SECONDS
# The classic builder unless buildx is installed (Debian's docker.io has none): Compose v1 builds only
# that way, and it works with v2 as well (v2 can also build through the engine's BuildKit without
# buildx). The Dockerfile works with both.
if [[ -z "${DOCKER_BUILDKIT:-}" ]] && ! docker buildx version >/dev/null 2>&1; then export DOCKER_BUILDKIT=0; fi
say "build (DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-default})"
"${C[@]}" build > /tmp/mmserve-smoke-build.log 2>&1 || { tail -40 /tmp/mmserve-smoke-build.log; fail "build failed (log: /tmp/mmserve-smoke-build.log)"; }
BUILD_S=$((SECONDS - t0))
IMAGE="$("${C[@]}" config 2>/dev/null | sed -n 's/^ *image: *//p' | head -1 | tr -d "'\"")"
say "build done in ${BUILD_S}s; image $IMAGE: $(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')"

# --- up --wait --------------------------------------------------------------------------------------
t0=$SECONDS
UP_TIMEOUT="${MMSERVE_SMOKE_TIMEOUT:-900}"
cid() {  # container id of a service, running or not (works with Compose v1 and v2)
    docker ps -aq --filter "label=com.docker.compose.project=$PROJECT" \
        --filter "label=com.docker.compose.service=$1" | head -1
}
if [[ $COMPOSE_V2 == 1 ]]; then
    say "up -d --wait"
    timeout "$UP_TIMEOUT" "${C[@]}" up -d --wait || fail "docker compose up -d --wait failed"
else
    say "up -d (docker-compose v1: waiting on the healthchecks by polling)"
    "${C[@]}" up -d || fail "docker-compose up -d failed"
    deadline=$((SECONDS + UP_TIMEOUT))
    for svc in encoder decoder gateway; do
        while :; do
            st="$(docker inspect -f '{{.State.Status}}/{{if .State.Health}}{{.State.Health.Status}}{{end}}' "$(cid "$svc")" 2>/dev/null)"
            [[ "$st" == running/healthy ]] && break
            [[ "$st" == */unhealthy || "$st" == exited/* || "$st" == dead/* || "$st" == restarting/* ]] && fail "$svc is $st"
            (( SECONDS > deadline )) && fail "$svc not healthy after ${UP_TIMEOUT}s ($st)"
            sleep 2
        done
    done
fi
UP_S=$((SECONDS - t0))
say "up in ${UP_S}s"
model_exit="$(docker inspect -f '{{.State.ExitCode}}' "$(cid model)")"
[[ "$model_exit" == 0 ]] || fail "model maker exited $model_exit"
say "model maker: $("${C[@]}" logs --no-color model 2>&1 | grep -o 'model: .*' | tail -1)"
"${C[@]}" ps
for svc in encoder decoder gateway; do
    say "$svc health: $(docker inspect -f '{{.State.Health.Status}}' "$(cid "$svc")")"
done
# Published ports must be bound to the loopback interface only.
for svc in encoder decoder gateway; do
    while read -r line; do
        [[ -z "$line" ]] && continue
        say "$svc port $line"
        [[ "$line" == *"-> 127.0.0.1:"* ]] || fail "$svc publishes a port beyond 127.0.0.1: $line"
    done <<<"$(docker port "$(cid "$svc")")"
done

# --- a real generation with an image, from inside the decoder container ---------------------------
X=("${C[@]}" exec -T decoder)
"${X[@]}" python -c "
from PIL import Image
im = Image.new('RGB', (96, 64))
im.putdata([(x * 2 % 256, y * 4 % 256, (x + y) % 256) for y in range(64) for x in range(96)])
im.save('/tmp/smoke.png')" || fail "could not write a test image in the decoder container"
PROMPT=$'USER: <image>\nWhat is this? ASSISTANT:'
gen() {  # gen LABEL ARGS...: one streamed generation; sets OUT, USAGE
    local label=$1; shift
    local t=$SECONDS
    "$@" mmserve generate --addr 127.0.0.1:50052 --prompt "$PROMPT" --image /tmp/smoke.png \
        --max-tokens 16 --ignore-eos --usage > /tmp/mmserve-smoke-gen.out 2> /tmp/mmserve-smoke-gen.err \
        || { cat /tmp/mmserve-smoke-gen.err; fail "$label: mmserve generate failed"; }
    OUT="$(cat /tmp/mmserve-smoke-gen.out)"; USAGE="$(grep '^{' /tmp/mmserve-smoke-gen.err | tail -1)"
    say "$label ($((SECONDS - t))s): text: $(printf '%q' "$OUT")"
    say "$label: $USAGE"
    [[ -n "${OUT//[[:space:]]/}" ]] || fail "$label: the stream carried no text"
    python3 - "$USAGE" <<'PY' || fail "$label: bad usage"
import json, sys
u = json.loads(sys.argv[1])
assert u["finish_reason"].lower() in ("length", "finish_reason_length"), u
assert int(u["usage"]["completion_tokens"]) == 16, u
assert int(u["usage"]["images"]) == 1, u
assert int(u["usage"]["prompt_tokens"]) > 1, u
PY
}
gen "generate #1 (in decoder container)" "${X[@]}"
gen "generate #2 (same image again)" "${X[@]}"
# The second request must not run the vision tower again: its KV prefix or the encoder cache covers it.
python3 - "$USAGE" <<'PY' || fail "the repeated image was encoded again"
import json, sys
u = json.loads(sys.argv[1])["usage"]
assert int(u["images_encoder_cache_hits"]) + int(u["images_skipped_by_kv_reuse"]) >= 1, u
PY

# From the host through the published port, where this host has the CLI.
if command -v mmserve >/dev/null 2>&1 && [[ "${MMSERVE_SMOKE_HOST_CLIENT:-1}" == 1 ]]; then
    "${X[@]}" cat /tmp/smoke.png > /tmp/mmserve-smoke.png
    t=$SECONDS
    mmserve generate --addr "127.0.0.1:$MMSERVE_DECODER_PORT" --prompt "$PROMPT" --image /tmp/mmserve-smoke.png \
        --max-tokens 8 --ignore-eos > /tmp/mmserve-smoke-host.out 2>&1 || { cat /tmp/mmserve-smoke-host.out; fail "host generate failed"; }
    say "generate #3 (host -> 127.0.0.1:$MMSERVE_DECODER_PORT, $((SECONDS - t))s): $(printf '%q' "$(cat /tmp/mmserve-smoke-host.out)")"
    mmserve health "127.0.0.1:$MMSERVE_ENCODER_PORT" >/dev/null || fail "host: encoder health on 127.0.0.1:$MMSERVE_ENCODER_PORT"
elif [[ "${MMSERVE_SMOKE_HOST_CLIENT:-1}" != 1 ]]; then
    say "skipped: the request from the host through 127.0.0.1:$MMSERVE_DECODER_PORT (MMSERVE_SMOKE_HOST_CLIENT=${MMSERVE_SMOKE_HOST_CLIENT})"
else
    say "skipped: the request from the host through 127.0.0.1:$MMSERVE_DECODER_PORT (no mmserve command on this host; pip install -e . to include it)"
fi

# --- one OpenAI chat completion with an image through the gateway -------------------------------------
GW_REPLY="$("${C[@]}" exec -T gateway python - <<'PY' 2>/tmp/mmserve-smoke-gw.err
import base64, io, json, os, urllib.request
from PIL import Image
im = Image.new("RGB", (96, 64))
im.putdata([(x * 2 % 256, y * 4 % 256, (x + y) % 256) for y in range(64) for x in range(96)])
buf = io.BytesIO(); im.save(buf, "PNG")
body = {"model": os.path.basename(os.environ["MMSERVE_MODEL_DIR"]), "max_tokens": 8, "temperature": 0,
        "ignore_eos": True, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}},
            {"type": "text", "text": "What is this?"}]}]}
headers = {"Content-Type": "application/json"}
if os.environ.get("MMSERVE_API_KEY"):
    headers["Authorization"] = "Bearer " + os.environ["MMSERVE_API_KEY"]
req = urllib.request.Request("http://127.0.0.1:8000/v1/chat/completions", json.dumps(body).encode(), headers)
print(urllib.request.urlopen(req, timeout=120).read().decode())
PY
)" || { cat /tmp/mmserve-smoke-gw.err; fail "chat completion through the gateway failed"; }
say "gateway chat completion: $GW_REPLY"
python3 - "$GW_REPLY" <<'PY' || fail "bad chat completion from the gateway"
import json, sys
r = json.loads(sys.argv[1])
assert r["object"] == "chat.completion" and r["choices"][0]["message"]["role"] == "assistant", r
assert r["usage"]["completion_tokens"] == 8 and r["choices"][0]["finish_reason"] == "length", r
assert r["usage"]["prompt_tokens"] > 1 and "cached_tokens" in r["usage"]["prompt_tokens_details"], r
PY
python3 -c "import urllib.request, sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:$MMSERVE_GATEWAY_PORT/health', timeout=10).status != 200)" \
    || fail "host: gateway health on 127.0.0.1:$MMSERVE_GATEWAY_PORT"

# --- stats --------------------------------------------------------------------------------------------
DSTATS="$("${X[@]}" mmserve stats 127.0.0.1:50052 2>/tmp/mmserve-smoke-stats.err)" \
    || { tail -5 /tmp/mmserve-smoke-stats.err; fail "mmserve stats (decoder) failed"; }
ESTATS="$("${X[@]}" mmserve stats encoder:50051 2>/tmp/mmserve-smoke-stats.err)" \
    || { tail -5 /tmp/mmserve-smoke-stats.err; fail "mmserve stats (encoder) failed"; }
say "decoder stats: $(python3 -c 'import json,sys; print(json.dumps(json.loads(sys.argv[1])))' "$DSTATS")"
say "encoder stats: $(python3 -c 'import json,sys; print(json.dumps(json.loads(sys.argv[1])))' "$ESTATS")"
python3 - "$DSTATS" "$ESTATS" <<'PY' || fail "stats do not show the requests"
import json, sys
d, e = json.loads(sys.argv[1]), json.loads(sys.argv[2])
assert d["service"] == "decoder" and e["service"] == "encoder", (d, e)
assert int(d["requests_finished"]) >= 2, d
assert int(d["images_encoded"]) >= 1, d
assert int(e["encodes"]) >= 1, e
PY
# Which transport carried the embeddings (decoder stats), where the decoder reports it.
TRANSPORTS="$(python3 -c 'import json, sys; print(json.dumps(json.loads(sys.argv[1]).get("embedding_transports")))' "$DSTATS")"
say "decoder embedding_transports: $TRANSPORTS"

# --- how the embedding crossed the container boundary ---------------------------------------------
# With `ipc: host` the decoder maps the encoder's /dev/shm arena; without it, inline bytes.
if [[ "${MMSERVE_SMOKE_GPU:-0}" != 1 ]]; then
    seg="$("${X[@]}" sh -c 'cat /proc/[0-9]*/maps 2>/dev/null' | grep -o '/dev/shm/mmserve-enc-[^ ]*' | sort -u | head -1)"
    enc=0
    [[ -n "$seg" ]] && enc="$("${C[@]}" exec -T encoder sh -c 'cat /proc/[0-9]*/maps 2>/dev/null' | grep -cF "$seg")"
    shm_n="$(python3 -c 'import json, sys; t = json.loads(sys.argv[1]) or {}; print(int(t.get("shm", -1)))' "$TRANSPORTS")"
    [[ "$shm_n" == 0 ]] && fail "the decoder received no embedding by shm (embedding_transports: $TRANSPORTS); check ipc: host"
    if [[ -n "$seg" && "$enc" -gt 0 ]]; then
        say "embedding handoff: shared memory (the decoder maps the encoder's $seg)"
    else
        fail "embedding handoff: the decoder maps no shm arena of the encoder ('$seg'): inline fallback; check ipc: host"
    fi
fi
if [[ "${MMSERVE_SMOKE_GPU:-0}" == 1 ]]; then
    ipc_n="$(python3 -c 'import json, sys; t = json.loads(sys.argv[1]) or {}; print(int(t.get("cuda_ipc", -1)))' "$TRANSPORTS")"
    [[ "$ipc_n" == 0 ]] && fail "the decoder received no embedding by CUDA IPC (embedding_transports: $TRANSPORTS); check pid: host, ipc: host and MMSERVE_GPU"
    say "embedding handoff: CUDA IPC ($TRANSPORTS)"
fi
say "timings: build ${BUILD_S}s, up ${UP_S}s"
