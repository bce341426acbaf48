#!/usr/bin/env bash
# Every benchmark on one GPU with the llava-1.5-7b preset in bf16, in about 8 minutes.
#
#   OUT=/some/dir bash bench/run_gpu.sh          (from the repository root)
#
# Env: OUT (required): where results go: results.json (all benchmarks merged, headline table),
#      serve_cdf.png (latency CDFs of the serve run), run_gpu.log (console output, service log tails).
#      MODEL_DIR (default /tmp/llava7b): made with make-model when missing. PYTHON (default python3).
#      DEVICE / DTYPE / PRESET (default cuda / bfloat16 / llava-1.5-7b): change only to smoke-test the
#      script itself, e.g. DEVICE=cpu DTYPE=float32 PRESET=tiny MODEL_DIR=/tmp/tiny on a CPU host.
#      SECTIONS (default llava): llava (the sections below), qwen (Qwen2.5-VL-7B shapes: bench/qwen_gpu.py,
#      the model made in QWEN_MODEL_DIR, default /tmp/qwen7b), qwen3 (Qwen3-VL-8B shapes: bench/qwen_gpu.py
#      then bench/qwen_serve.py, results qwen3_gpu and qwen3_serve; the model made in QWEN3_MODEL_DIR,
#      default /tmp/qwen3_8b, from QWEN3_PRESET, default qwen3-vl-8b; QWEN3_GPU_ARGS / QWEN3_SERVE_ARGS add
#      options, e.g. smaller figures for a CPU smoke test), fp8 (bf16 vs FP8 decode in-process and
#      through gRPC, FP8 accuracy; FP8_BATCHES default 1,32), video (bench/video_serve.py, result qwen_video
#      or qwen3_video: 30 s 448x448 30 fps clips sampled at the model's 2 fps, TTFT cold / warm through one
#      decoder beside HF's vision + prefill, lookahead on/off over 16 video requests one every 0.5 s; on
#      Qwen2.5-VL-7B shapes in QWEN_MODEL_DIR as the qwen section makes them, or Qwen3-VL-8B shapes in
#      QWEN3_MODEL_DIR from QWEN3_PRESET with VIDEO_FAMILY=qwen3; VIDEO_HF=0 skips HF; VIDEO_ARGS adds
#      options, e.g. tiny clips for a CPU smoke test; its step may take 480 s and making the model up to
#      300 s more: give it BUDGET_S=900 or so), tp (two GPUs: TP=2 parity test, decode at TP=1 and TP=2,
#      image rows to the workers, a Qwen2.5-VL-72B-shaped TP=2 decoder under 64 image requests against
#      its roofline; the 72B tower made in QWEN72_MODEL_DIR, default /tmp/qwen72b, from QWEN72_PRESET;
#      TP_KV_BYTES per rank, default 30 GB; a CPU smoke test: QWEN72_PRESET=qwen2.5-vl-tiny
#      TP_KV_BYTES=50000000 with DEVICE=cpu and friends; BUDGET_S=1500 or so),
#      ttft (bench/ttft.py: time to first token with its split, per preset; see its block below),
#      decode (bench/decode_gemv.py, then decode tok/s per preset with the fused one-row products off and
#      on; see its block below),
#      gemma (Gemma 3's real shapes: TTFT, decode, Encode, each with HF; see its block below),
#      phi4mm (Phi-4-multimodal's real shapes: TTFT, decode with and without the vision adapter, Encode,
#      each with HF, and profiles of the tower and of steps; see its block below),
#      soak (bench/soak.py on SOAK_PRESET, default qwen2.5-vl-7b: 96 clients, hostile inputs, cancels,
#      video; SOAK_ARGS, default "--clients 96 --seconds 240"; the services' logs are copied to
#      $OUT/soak-logs; see its block below),
#      nixl (the NIXL transport beside CUDA IPC, shared memory and bytes: GPU tests, the handoff of one
#      Qwen2.5-VL-7B 1024² embedding, cold/warm TTFT with each; see its block below),
#      vision_attention (issue 64: the Triton varlen attention kernel at head dims 72/80 beside torch's SDPA
#      kernels, alone and in the Qwen3-VL-8B / Qwen2.5-VL-7B towers with HF's beside; see its block below),
#      moe (issue 69: the fused MoE GPU tests, then bench/moe_decode.py on Qwen3-VL-30B-A3B shapes, the tower
#      made in MOE_MODEL_DIR, default /tmp/moe30b, from MOE_PRESET, default qwen3-vl-30b-a3b, the language
#      weights drawn on the device: bf16 and FP8 experts, b1 and 32 streams, HF beside; MOE_ARGS adds
#      options; see its block below),
#      deterministic (issue 66: tests/gpu/test_deterministic*_gpu.py and test_invariant_matmul_gpu.py, then
#      bench/deterministic_cost.py on the tower made in QWEN3_MODEL_DIR from QWEN3_PRESET with the language
#      weights drawn on the device: decode b1 / 32 streams, Encode at 64 clients, cold TTFT, the reference
#      before and after the load, the mode off and on; DET_ARGS adds options; see its block below),
#      qwen3_5 (issue 68: the Gated DeltaNet layers' fla kernels against the torch reference on the GPU,
#      then decode on qwen3.5-9b shapes with fla and with the reference; see its block below),
#      or a list such as llava,qwen,qwen3.
#      MPS=1: the script's processes share the GPU through NVIDIA's Multi-Process Service (a daemon of this
#      run, in its own pipe directory, stopped at the end; the GPU's compute mode is left as it is): the
#      encoder's and the decoder's kernels then run side by side instead of in time slices (issue 65's
#      burst, where the tower took 3x its time alone beside the prefills).
#      BUDGET_S (default 500): seconds for the whole script, model making included; each step's timeout
#      is cut to what is left, so a slow step cannot push the script past the budget (later steps are
#      skipped instead; the merge still runs).
# The project need not be pip-installed: PYTHONPATH is set to the repository root.
set -u
OUT=${OUT:?set OUT to the results directory}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
MODEL=${MODEL_DIR:-/tmp/llava7b}
RES=$(mktemp -d /tmp/mmserve-bench.XXXXXX)
LOG="$OUT/run_gpu.log"
DEVICE=${DEVICE:-cuda}
DT=(--device "$DEVICE" --dtype "${DTYPE:-bfloat16}")
ENC_PORT=50061
DEC_PORT=50062
PIDS=()
START=$SECONDS
BUDGET=${BUDGET_S:-500}
exec > >(tee -a "$LOG") 2>&1

cleanup() {
  for pid in ${PIDS[@]+"${PIDS[@]}"}; do kill "$pid" 2>/dev/null; done
  for pid in ${PIDS[@]+"${PIDS[@]}"}; do wait "$pid" 2>/dev/null; done
}
stop_mps() {
  if [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then echo quit | nvidia-cuda-mps-control >/dev/null 2>&1; fi
}
trap 'cleanup; stop_mps' EXIT

# The wheels a bare device image lacks (grpc health and reflection, blake3, fla-core, ...) come from .whl:
# installed once into /tmp/site when the services' or fla's imports fail there (on a GPU run only).
if [ "${DEVICE:-cuda}" = cuda ] && ls .whl/*.whl >/dev/null 2>&1 && ! "$PY" -c "import grpc_health, blake3, fla.ops.gated_delta_rule" \
    >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -3
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null)"
if [ "${MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY="$RES/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$RES/mps-log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d 2>&1; then
    echo "== MPS: daemon started (pipe $CUDA_MPS_PIPE_DIRECTORY)"
  else
    echo "== MPS: the daemon did not start; the run goes on without it"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
fi
SECTIONS=${SECTIONS:-llava}
if [[ ",$SECTIONS," != *,llava,* ]]; then MODEL=/nonexistent-skip; fi
if [[ ",$SECTIONS," == *,llava,* ]] && [ ! -f "$MODEL/mmserve_model.json" ]; then
  echo "== make-model ${PRESET:-llava-1.5-7b} -> $MODEL"
  timeout 200 "$PY" -m common.cli make-model --preset "${PRESET:-llava-1.5-7b}" --out "$MODEL" "${DT[@]}" \
    2>&1 | tail -3
fi

# step NAME LIMIT_S CMD...: run with a timeout of min(LIMIT_S, what is left of the budget).
step() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - (SECONDS - START)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then echo "== $name: skipped (budget spent)"; return; fi
  echo "== $name (timeout ${limit}s, t=$((SECONDS - START))s)"
  timeout --kill-after=10 "$limit" "$@" --out "$RES/$name.json" > "$RES/$name.log" 2>&1
  echo "   rc=$? after $((SECONDS - START))s"
  grep -v -e "it/s]" -e "req/s]" "$RES/$name.log" | tail -40
}

# make_once DIR PRESET [ARGS...]: make-model PRESET into DIR unless a model is there; its timeout is
# min(300 s, what is left of the budget). ARGS go to make-model (e.g. --weights vision).
make_once() {
  local dir=$1 preset=$2; shift 2
  [ -f "$dir/mmserve_model.json" ] && return
  local left=$((BUDGET - (SECONDS - START)))
  [ "$left" -gt 300 ] && left=300
  echo "== make-model $preset $* -> $dir (timeout ${left}s)"
  [ "$left" -gt 5 ] || return
  timeout --kill-after=10 "$left" "$PY" -m common.cli make-model --preset "$preset" --out "$dir" "${DT[@]}" \
    "$@" 2>&1 | tail -3
}

# wait_healthy PORT TIMEOUT_S [PID]: until SERVING; fails early when PID has exited.
wait_healthy() {
  local deadline=$((SECONDS + $2))
  until "$PY" -m common.cli health "127.0.0.1:$1" >/dev/null 2>&1; do
    [ $SECONDS -ge $deadline ] && return 1
    [ -n "${3:-}" ] && ! kill -0 "$3" 2>/dev/null && return 1
    sleep 2
  done
}

run_llava() {
# 1. In-process: decode tokens/s (engine vs HF vs bandwidth bound). No services running yet.
step decode_tput 150 "$PY" -m bench.decode_tput --model "$MODEL" "${DT[@]}" --batch-sizes 1,8,32 \
  --prompt-len 64 --output-len 32

# 2. Handoff: spawns its own encoders (cupy CUDA arena and /dev/shm arena).
step handoff 90 "$PY" -m bench.handoff --model "$MODEL" "${DT[@]}" --iters 30 --image-size 336 \
  --logs "$RES/logs-handoff"

# 3. The shared pair for the serving benchmarks.
echo "== starting encoder :$ENC_PORT and decoder :$DEC_PORT (t=$((SECONDS - START))s)"
start_encoder() {
  "$PY" -m common.cli encoder --model "$MODEL" "${DT[@]}" --port $ENC_PORT --cache-bytes 4000000000 "$@" \
    >> "$RES/encoder.log" 2>&1 &
  ENC_PID=$!
  PIDS+=($ENC_PID)
}
start_encoder
"$PY" -m common.cli decoder --model "$MODEL" "${DT[@]}" --port $DEC_PORT --encoder 127.0.0.1:$ENC_PORT \
  --kv-cache-bytes 24000000000 --max-num-seqs 64 > "$RES/decoder.log" 2>&1 &
DEC_PID=$!
PIDS+=($DEC_PID)
if ! wait_healthy $ENC_PORT 150 "$ENC_PID"; then
  echo "   encoder (arena auto) did not start; retrying with --arena private (inline handoff only)"
  kill "$ENC_PID" 2>/dev/null
  start_encoder --arena private
fi
if wait_healthy $ENC_PORT 150 "$ENC_PID" && wait_healthy $DEC_PORT 150 "$DEC_PID"; then
  echo "   pair ready after $((SECONDS - START))s"
  SVC=(--addr 127.0.0.1:$DEC_PORT --encoder 127.0.0.1:$ENC_PORT --model "$MODEL" "${DT[@]}")
  step encode_cache 60 "$PY" -m bench.encode_cache --encoder 127.0.0.1:$ENC_PORT --model "$MODEL" \
    "${DT[@]}" --iters 16 --image-size 336
  step ttft_prefix 75 "$PY" -m bench.ttft_prefix "${SVC[@]}" --rounds 5 --prompt-len 600
  step serve 90 "$PY" -m bench.serve "${SVC[@]}" --num-requests 48 --concurrency 16 --repeat-ratio 0.5 \
    --image-size 336 --prompt-len 64 --output-len 64 --warmup 2 --plot "$OUT/serve_cdf.png" --no-progress
  step serve_tput 150 "$PY" -m bench.serve_tput "${SVC[@]}" --num-requests 64 --concurrency 64 \
    --repeat-ratio 0.5 --output-len 32 --hf-batch 64 --no-progress
  # 4. Lookahead: two more decoders (max-ahead 4 and 0, 8 running each) on the shared encoder.
  step lookahead 150 "$PY" -m bench.lookahead --encoder 127.0.0.1:$ENC_PORT --model "$MODEL" "${DT[@]}" \
    --decoder-args "--kv-cache-bytes 8000000000" --max-num-seqs 8 --num-requests 32 --concurrency 32 \
    --output-len 16 --logs "$RES/logs-lookahead" --no-progress
else
  echo "   the pair did not become healthy"
fi
cleanup
PIDS=()
}
[[ ",$SECTIONS," == *,llava,* ]] && run_llava

# Qwen2.5-VL-7B shapes (random weights made here): tower, cold TTFT, batch-1 decode and bf16 agreement,
# each beside HF transformers on the same weights.
if [[ ",$SECTIONS," == *,qwen,* ]]; then
  QMODEL=${QWEN_MODEL_DIR:-/tmp/qwen7b}
  make_once "$QMODEL" qwen2.5-vl-7b
  step qwen_gpu 300 "$PY" -m bench.qwen_gpu --model "$QMODEL" "${DT[@]}"
  step qwen_serve 300 "$PY" -m bench.qwen_serve --model "$QMODEL" "${DT[@]}" --logs "$RES/logs-qwen" \
    --requests 32 --max-num-seqs 4 --output-len 64
fi

# Qwen3-VL-8B shapes (random weights made here): the same figures as the qwen section (the tower with its
# DeepStack outputs on both sides), then the services (Encode img/s, lookahead on/off).
# The 8B checkpoint is ~17 GB: made on the GPU in a minute or two; its timeout is cut to the budget too.
if [[ ",$SECTIONS," == *,qwen3,* ]]; then
  Q3MODEL=${QWEN3_MODEL_DIR:-/tmp/qwen3_8b}
  Q3PRESET=${QWEN3_PRESET:-qwen3-vl-8b}
  read -r -a Q3GPU <<< "${QWEN3_GPU_ARGS:-}"
  read -r -a Q3SERVE <<< "${QWEN3_SERVE_ARGS:-}"
  make_once "$Q3MODEL" "$Q3PRESET"
  if [ -f "$Q3MODEL/mmserve_model.json" ]; then
    step qwen3_gpu 300 "$PY" -m bench.qwen_gpu --model "$Q3MODEL" "${DT[@]}" ${Q3GPU[@]+"${Q3GPU[@]}"}
    step qwen3_serve 300 "$PY" -m bench.qwen_serve --model "$Q3MODEL" "${DT[@]}" --logs "$RES/logs-qwen3" \
      --requests 32 --max-num-seqs 4 --output-len 64 ${Q3SERVE[@]+"${Q3SERVE[@]}"}
  else
    echo "== qwen3: no model in $Q3MODEL (make-model failed or the budget was spent); skipped"
  fi
fi

# Videos through the services (bench/video_serve.py): Qwen2.5-VL-7B shapes (the qwen section's model) or,
# with VIDEO_FAMILY=qwen3, Qwen3-VL-8B shapes (the qwen3 section's). The clips are made on the host first
# (8 x 30 s of 448x448 at 30 fps, libx264), then one encoder and two decoders (lookahead 4 and 0, 2 running
# each) start; HF's model is loaded in the benchmark's process after they stop (VIDEO_HF=0: not at all).
if [[ ",$SECTIONS," == *,video,* ]]; then
  if [ "${VIDEO_FAMILY:-qwen}" = qwen3 ]; then
    VMODEL=${QWEN3_MODEL_DIR:-/tmp/qwen3_8b}
    VPRESET=${QWEN3_PRESET:-qwen3-vl-8b}
  else
    VMODEL=${QWEN_MODEL_DIR:-/tmp/qwen7b}
    VPRESET=qwen2.5-vl-7b
  fi
  read -r -a VARGS <<< "${VIDEO_ARGS:-}"
  VHF=()
  [ "${VIDEO_HF:-1}" = 0 ] || VHF=(--hf)
  make_once "$VMODEL" "$VPRESET"
  if [ -f "$VMODEL/mmserve_model.json" ]; then
    step video 480 "$PY" -m bench.video_serve --model "$VMODEL" "${DT[@]}" --logs "$RES/logs-video" \
      --clips 8 --clip-seconds 30 --clip-fps 30 --clip-size 448 --ttft-rounds 3 --requests 16 \
      --arrival-interval 0.5 --output-len 32 --max-num-seqs 2 ${VHF[@]+"${VHF[@]}"} ${VARGS[@]+"${VARGS[@]}"}
  else
    echo "== video: no model in $VMODEL (make-model failed or the budget was spent); skipped"
  fi
fi

# FP8 against bf16 on the llava-1.5-7b shapes: decode at batch 1 and 32 in-process and through gRPC
# (bench.serve_decode, each side by side with its own engine), and FP8's accuracy against bf16.
if [[ ",$SECTIONS," == *,fp8,* ]]; then
  FMODEL=${MODEL_DIR:-/tmp/llava7b}
  make_once "$FMODEL" "${PRESET:-llava-1.5-7b}"
  FP8_BATCHES=${FP8_BATCHES:-1,32}
  step serve_decode 240 "$PY" -m bench.serve_decode --model "$FMODEL" "${DT[@]}" --batch-sizes "$FP8_BATCHES" \
    --output-len 128 --repeats 2 --logs "$RES/logs-decode"
  step serve_decode_fp8 240 "$PY" -m bench.serve_decode --model "$FMODEL" "${DT[@]}" --quantization fp8 \
    --batch-sizes "$FP8_BATCHES" --output-len 128 --repeats 2 --logs "$RES/logs-decode-fp8"
  step fp8_accuracy 150 "$PY" -m bench.fp8_accuracy --model "$FMODEL" "${DT[@]}" --prompts 16 --steps 256
fi

# Tensor parallelism on two GPUs of one host (the first two the process sees): TP=2 parity with TP=1 and
# HF (tests/gpu), bf16 decode at TP=1 and TP=2 on llava-1.5-7b shapes side by side, how a step's image
# rows reach rank 1 (pickled vs packed over NCCL), and a Qwen2.5-VL-72B-shaped decoder (dummy language
# weights, the tower written by make-model --weights vision) under 64 concurrent image requests with the
# encoder beside rank 0 on GPU 0, against the roofline of the same work.
if [[ ",$SECTIONS," == *,tp,* ]]; then
  TMODEL=${MODEL_DIR:-/tmp/llava7b}
  make_once "$TMODEL" "${PRESET:-llava-1.5-7b}"
  echo "== tests/gpu/test_tensor_parallel_gpu.py (t=$((SECONDS - START))s)"
  timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py 2>&1 | tail -5
  step tp_rows 90 "$PY" -m bench.tp_rows --device "$DEVICE"
  for tp in 1 2; do
    step "serve_decode_tp$tp" 300 "$PY" -m bench.serve_decode --model "$TMODEL" "${DT[@]}" --batch-sizes 1,32 \
      --output-len 128 --repeats 2 --tensor-parallel-size $tp --logs "$RES/logs-decode-tp$tp"
  done
  Q72=${QWEN72_MODEL_DIR:-/tmp/qwen72b}
  make_once "$Q72" "${QWEN72_PRESET:-qwen2.5-vl-72b}" --weights vision
  CUDA_VISIBLE_DEVICES=0 "$PY" -m common.cli encoder --model "$Q72" "${DT[@]}" --port $ENC_PORT \
    --cache-bytes 8000000000 >> "$RES/encoder-72b.log" 2>&1 &
  ENC_PID=$!
  "$PY" -m common.cli decoder --model "$Q72" "${DT[@]}" --port $DEC_PORT --encoder 127.0.0.1:$ENC_PORT \
    --load-format dummy --tensor-parallel-size 2 --kv-cache-bytes "${TP_KV_BYTES:-30000000000}" --max-num-seqs 64 \
    > "$RES/decoder-72b.log" 2>&1 &
  DEC_PID=$!
  PIDS+=($ENC_PID $DEC_PID)
  if wait_healthy $ENC_PORT 300 "$ENC_PID" && wait_healthy $DEC_PORT 600 "$DEC_PID"; then
    step serve_tput_72b 300 "$PY" -m bench.serve_tput --addr 127.0.0.1:$DEC_PORT --encoder 127.0.0.1:$ENC_PORT \
      --model "$Q72" "${DT[@]}" --num-requests 64 --concurrency 64 --repeat-ratio 0.5 --image-size 448 \
      --output-len 32 --no-hf --no-progress --name serve_tput_72b_tp2
  else
    echo "   the 72B-shaped pair did not become healthy"
  fi
  cleanup
  PIDS=()
fi

# The Qwen vision path (issue 37): the GPU tests of the fast path, then bench/vision_path.py on Qwen3-VL-8B
# and Qwen2.5-VL-7B shapes (vision weights only, made here): the tower in-process (reference and fast
# paths, HF's tower), a profile of one forward, and the encoder service through gRPC Encode (1 and 64
# clients, mixed sizes, videos, one client against an encoder decoding in threads) with its stage split.
# VISION_ARGS sets its options (default --images 192 --decode-threads-level
# --videos 2), VISION_PRESETS the presets (CPU smoke: VISION_PRESETS="qwen3-vl-tiny qwen2.5-vl-tiny"),
# VISION_TESTS the GPU test files run first.
if [[ ",$SECTIONS," == *,vision,* ]]; then
  read -r -a VPARGS <<< "${VISION_ARGS:---images 192 --videos 2 --decode-threads-level}"
  echo "== the vision GPU tests (t=$((SECONDS - START))s)"
  timeout 240 "$PY" -m pytest -q -p no:cacheprovider ${VISION_TESTS:-tests/gpu/test_vision_fast_path_gpu.py} \
    2>&1 | tail -8
  for fam in ${VISION_PRESETS:-qwen3-vl-8b qwen2.5-vl-7b}; do
    make_once "/tmp/vision-$fam" "$fam" --weights vision
    step "vision_$fam" 300 "$PY" -m bench.vision_path --model "/tmp/vision-$fam" "${DT[@]}" \
      --logs "$RES/logs-vision-$fam" ${VPARGS[@]+"${VPARGS[@]}"}
  done
fi

# Time to first token (issue 39): bench/ttft.py on each preset's real shapes (random weights, made here
# and deleted after its step: three 7-8B checkpoints do not fit the disk together): cold and warm TTFT of
# one 1024x1024 image + 500 tokens through gRPC with the decoder's TTFT split and the encoder's Encode
# split, 32 one-image requests at once against their roofline, and HF's generate on the Qwen families.
# TTFT_PRESETS (default "qwen2.5-vl-7b qwen3-vl-8b llava-1.5-7b"), TTFT_ARGS (default "--rounds 5 --hf"; words
# split on spaces: several decoder flags go in TTFT_DECODER_ARGS, one string, e.g. "--kv-cache-bytes=N
# --piecewise-graphs", instead of TTFT_ARGS' --decoder-args;
# CPU smoke: TTFT_PRESETS=qwen2.5-vl-tiny TTFT_ARGS="--rounds 1 --concurrency 2 --image-size 256").
# TTFT_WARM_TAIL=N (default 0: none) also profiles, per preset, a warm request's prefill step in-process
# (bench.profile_step --warm-tail N over a TTFT_WARM_PROMPT-token prompt, default 1870; TTFT_WARM_ARGS: more
# of its flags, e.g. --piecewise-graphs). The encoder's
# tower-graph lines are printed after each step. TTFT_MAKE_ARGS: make-model's flags, e.g. "--weights vision"
# with TTFT_DECODER_ARGS="--load-format=dummy" for a checkpoint too large for the disk (Qwen3-VL-30B-A3B: the
# decoder draws its language weights; HF then has no weights to load: leave --hf out).
if [[ ",$SECTIONS," == *,ttft,* ]]; then
  read -r -a TARGS <<< "${TTFT_ARGS:---rounds 5 --hf}"
  read -r -a TMAKE <<< "${TTFT_MAKE_ARGS:-}"
  for fam in ${TTFT_PRESETS:-qwen2.5-vl-7b qwen3-vl-8b llava-1.5-7b}; do
    make_once "/tmp/ttft-$fam" "$fam" ${TMAKE[@]+"${TMAKE[@]}"}
    step "ttft_$fam" 240 "$PY" -m bench.ttft --model "/tmp/ttft-$fam" "${DT[@]}" --logs "$RES/logs-ttft-$fam" \
      "${TARGS[@]}" ${TTFT_DECODER_ARGS:+"--decoder-args=$TTFT_DECODER_ARGS"}
    cp "$RES/ttft_$fam.json" "$OUT/" 2>/dev/null  # each preset's own (the merge keeps one ttft result)
    grep -h "CUDA graph\|WARNING" "$RES/logs-ttft-$fam/encoder.log" 2>/dev/null | tail -4
    # the decoder's graphs and any kernel its first-use checks dropped (a hybrid's "... kernel X dropped")
    grep -h "captured\|dropped\|WARNING" "$RES"/logs-ttft-"$fam"/decoder*.log 2>/dev/null | tail -6
    if [ "${TTFT_WARM_TAIL:-0}" -gt 0 ]; then
      step "warm_step_$fam" 120 "$PY" -m bench.profile_step --model "/tmp/ttft-$fam" "${DT[@]}" \
        --prompt-len "${TTFT_WARM_PROMPT:-1870}" --warm-tail "$TTFT_WARM_TAIL" --steps 8 --top 14 --host-top 20 \
        ${TTFT_WARM_ARGS:-}
      cp "$RES/warm_step_$fam.json" "$OUT/" 2>/dev/null
    fi
    [ "${TTFT_KEEP_MODELS:-0}" = 1 ] || rm -rf "/tmp/ttft-$fam"
  done
fi

# The soak (issue 39): SOAK_ARGS go to bench.soak; e.g. "--seconds 75 --encoder-cache-bytes 1500000000
# --encoder-stall-exit 30" fills a small embedding cache within seconds, and a tower that stops exits with
# every thread's stack in encoder.log. Its step's limit is SOAK_LIMIT_S (default 480; a stalled run's requests
# wait out their deadlines: keep --request-timeout well under it).
if [[ ",$SECTIONS," == *,soak,* ]]; then
  read -r -a SARGS <<< "${SOAK_ARGS:---clients 96 --seconds 240}"
  SOAK_MODEL="/tmp/soak-${SOAK_PRESET:-qwen2.5-vl-7b}"
  make_once "$SOAK_MODEL" "${SOAK_PRESET:-qwen2.5-vl-7b}"
  step soak "${SOAK_LIMIT_S:-480}" "$PY" -m bench.soak --model "$SOAK_MODEL" "${DT[@]}" --logs "$RES/logs-soak" \
    "${SARGS[@]}"
  mkdir -p "$OUT/soak-logs" && cp "$RES"/logs-soak/*.log "$OUT/soak-logs/" 2>/dev/null
  grep -h -A40 "owed work\|Traceback" "$RES"/logs-soak/encoder.log 2>/dev/null | head -80
fi

# Decode at the bandwidth limit (issue 40): batch-1 decode's weight products kernel by kernel (separate op +
# cuBLAS / FP8 kernels against the fused one-row kernel, bench/decode_gemv.py, every family's shapes;
# DECODE_GEMV=0 skips it), the FP8 products at 1-64 rows (bf16 cuBLAS, the earlier FP8 kernels, split-K:
# bench/fp8_gemv.py with DECODE_FP8_GEMV_ARGS; DECODE_FP8_GEMV=0 skips it), decode attention alone with every key
# tile / warps / stages / splits candidate when DECODE_ATTENTION=1 (bench/attention.py with DECODE_ATTENTION_ARGS),
# then per preset decode tok/s at batch 1 and 32
# in-process for each DECODE_RUNS entry QUANT:MODE[:ASYNC] (default "none:off none:auto": bf16 with the
# fused products off, then measured at start-up; MODE is MMSERVE_DECODE_GEMV, QUANT the engine's
# --quantization, ASYNC its --async-scheduling, default auto; each run its own process), a batch-1 step
# profile per DECODE_PROFILE entry QUANT:BATCH[:PDL[:STREAMK]] (default none:1; 0: none; PDL is MMSERVE_PDL: 1, products, 0;
# STREAMK is MMSERVE_FP8_STREAM_K: 0, 1, only), decode through gRPC for each DECODE_SERVED entry QUANT:ASYNC
# (bench.serve_decode --served-only, measured mode; default none: no served run), and FP8's accuracy for
# the presets listed in DECODE_ACCURACY (bench.fp8_accuracy: agreement and KL). DECODE_PRESETS (default
# llava-1.5-7b). Each model is deleted after its steps (disk) unless DECODE_KEEP_MODELS=1.
# DECODE_LOAD_FORMAT=dummy: Qwen presets are made without their language weights (make-model --weights
# vision, some 15 GB less to write) and every decode step draws them on the device (--load-format dummy).
if [[ ",$SECTIONS," == *,decode,* ]]; then
  [ "${DECODE_GEMV:-1}" = 1 ] && step decode_gemv 240 "$PY" -m bench.decode_gemv
  read -r -a FGARGS <<< "${DECODE_FP8_GEMV_ARGS:-}"
  [ "${DECODE_FP8_GEMV:-1}" = 1 ] && step fp8_gemv 300 "$PY" -m bench.fp8_gemv ${FGARGS[@]+"${FGARGS[@]}"}
  read -r -a AARGS <<< "${DECODE_ATTENTION_ARGS:-}"
  [ "${DECODE_ATTENTION:-0}" = 1 ] && step attention 300 "$PY" -m bench.attention ${AARGS[@]+"${AARGS[@]}"}
  LF=${DECODE_LOAD_FORMAT:-auto}
  for fam in ${DECODE_PRESETS:-llava-1.5-7b}; do
    DMODEL="/tmp/decode-$fam"
    if [ "$LF" = dummy ] && [[ "$fam" == qwen* ]]; then
      make_once "$DMODEL" "$fam" --weights vision  # the language model's weights drawn on the device
    else
      make_once "$DMODEL" "$fam"
    fi
    for run in ${DECODE_RUNS:-none:off none:auto}; do
      IFS=: read -r q mode async <<< "$run"
      async=${async:-auto}
      step "decode_tput_${fam}_${q}_${mode}_$async" 150 env MMSERVE_DECODE_GEMV="$mode" "$PY" -m bench.decode_tput \
        --model "$DMODEL" "${DT[@]}" --no-hf --batch-sizes 1,32 --prompt-len 64 --output-len 128 \
        --quantization "$q" --async-scheduling "$async" --load-format "$LF"
    done
    for run in ${DECODE_SERVED:-}; do
      IFS=: read -r q async <<< "$run"
      step "serve_decode_${fam}_${q}_$async" 240 "$PY" -m bench.serve_decode \
        --model "$DMODEL" "${DT[@]}" --served-only --batch-sizes 1,32 --output-len 256 \
        --quantization "$q" --async-scheduling "${async:-auto}" --load-format "$LF" \
        --logs "$RES/logs-decode-$fam-$q-$async"
    done
    for prof in ${DECODE_PROFILE:-none:1}; do
      [ "$prof" = 0 ] && continue
      IFS=: read -r q b pdl sk <<< "$prof"
      [ "$q" = 1 ] && q=none
      step "profile_step_${fam}_${q}_${b:-1}${pdl:+_pdl-$pdl}${sk:+_streamk-$sk}" 150 \
        env MMSERVE_PDL="${pdl:-1}" MMSERVE_FP8_STREAM_K="${sk:-0}" "$PY" -m bench.profile_step \
        --model "$DMODEL" "${DT[@]}" --batch "${b:-1}" --steps 32 --quantization "$q" --load-format "$LF"
    done
    [[ " ${DECODE_ACCURACY:-} " == *" $fam "* ]] && step "fp8_accuracy_$fam" 120 "$PY" -m bench.fp8_accuracy \
      --model "$DMODEL" "${DT[@]}" --prompts 8 --steps 96 --load-format "$LF"
    [ "${DECODE_KEEP_MODELS:-0}" = 1 ] || rm -rf "$DMODEL"
  done
fi

# Gemma 3 (issue 42) on GEMMA_PRESET's real shapes (default gemma-3-4b, random weights, made in
# GEMMA_MODEL_DIR, default /tmp/gemma3-4b): cold and warm TTFT of one 1024x1024 image + 500 tokens through
# gRPC with 32 at once and HF's generate in the same run (bench.ttft, GEMMA_TTFT_ARGS), decode tok/s at
# batch 1 and 32 in-process vs HF and the bandwidth bound (bench.decode_tput, GEMMA_DECODE_ARGS), Encode
# img/s at 1-64 clients vs HF's processor + get_image_features at batch 1 and 32 (bench.encode_tput,
# GEMMA_ENCODE_ARGS). CPU smoke: SECTIONS=gemma GEMMA_PRESET=gemma-3-tiny DEVICE=cpu DTYPE=float32 and
# small GEMMA_*_ARGS (the commented defaults show the knobs).
if [[ ",$SECTIONS," == *,gemma,* ]]; then
  GM=${GEMMA_MODEL_DIR:-/tmp/gemma3-4b}
  make_once "$GM" "${GEMMA_PRESET:-gemma-3-4b}"
  read -r -a GARGS <<< "${GEMMA_TTFT_ARGS:---rounds 5 --hf}"
  step gemma_ttft 240 "$PY" -m bench.ttft --model "$GM" "${DT[@]}" --logs "$RES/logs-gemma" "${GARGS[@]}"
  read -r -a GARGS <<< "${GEMMA_DECODE_ARGS:---batch-sizes 1,32 --prompt-len 64 --output-len 128}"
  step gemma_decode 150 "$PY" -m bench.decode_tput --model "$GM" "${DT[@]}" "${GARGS[@]}"
  read -r -a GARGS <<< "${GEMMA_ENCODE_ARGS:---images 256 --image-size 1024 --concurrency 1,8,32,64}"
  step gemma_encode 180 "$PY" -m bench.encode_tput --model "$GM" "${DT[@]}" "${GARGS[@]}"
fi

# Phi-4-multimodal (issue 43) on PHI4_PRESET's real shapes (default phi-4-mm, random weights with its vision
# and speech LoRA, made in PHI4_MODEL_DIR, default /tmp/phi4mm). PHI4_STEPS lists what runs, in order
# (default "ttft decode decode_vision encode"):
#   ttft           cold and warm TTFT of one 1024x1024 image + 500 tokens through gRPC (the vision adapter
#                  on), 32 at once, and HF's generate in the same run (bench.ttft, PHI4_TTFT_ARGS)
#   decode         decode tok/s at batch 1 and 32 in-process, no adapter (text requests), vs HF and the
#                  bound (bench.decode_tput, PHI4_DECODE_ARGS)
#   decode_vision  the same with the vision adapter (image requests' decode; its bound counts the adapter,
#                  its weights bound does not), merged at load and not (--merge-builtin-adapter both: two
#                  engines, each row with the steps that took the LoRA product or the merged weights)
#   encode         Encode img/s at 1-64 clients vs HF's processor + image embedding (bench.encode_tput,
#                  PHI4_ENCODE_ARGS)
#   tower          one 1024x1024 image through our tower and HF's, our kernels (bench.profile_tower)
#   profile        batch-1 decode step with the adapter, and a 2000-token prefill step with and without it
#                  (bench.profile_step: kernels per step)
# CPU smoke: SECTIONS=phi4mm PHI4_PRESET=phi-4-mm-tiny DEVICE=cpu DTYPE=float32 and small PHI4_*_ARGS.
if [[ ",$SECTIONS," == *,phi4mm,* ]]; then
  PM=${PHI4_MODEL_DIR:-/tmp/phi4mm}
  make_once "$PM" "${PHI4_PRESET:-phi-4-mm}"
  read -r -a DARGS <<< "${PHI4_DECODE_ARGS:---batch-sizes 1,32 --prompt-len 64 --output-len 128}"
  for what in ${PHI4_STEPS:-ttft decode decode_vision encode}; do
    case $what in
      ttft) read -r -a PARGS <<< "${PHI4_TTFT_ARGS:---rounds 5 --hf}"
        step phi4_ttft 240 "$PY" -m bench.ttft --model "$PM" "${DT[@]}" --logs "$RES/logs-phi4" "${PARGS[@]}" ;;
      decode) step phi4_decode 150 "$PY" -m bench.decode_tput --model "$PM" "${DT[@]}" "${DARGS[@]}" ;;
      decode_vision) step phi4_decode_vision 200 "$PY" -m bench.decode_tput --model "$PM" "${DT[@]}" \
        "${DARGS[@]}" --no-hf --lora-adapter vision --merge-builtin-adapter both ;;
      encode) read -r -a PARGS <<< "${PHI4_ENCODE_ARGS:---images 96 --image-size 1024 --concurrency 1,16,64}"
        step phi4_encode 180 "$PY" -m bench.encode_tput --model "$PM" "${DT[@]}" "${PARGS[@]}" ;;
      tower) step phi4_tower 120 "$PY" -m bench.profile_tower --model "$PM" "${DT[@]}" ;;
      profile)
        step phi4_profile_decode_vision 90 "$PY" -m bench.profile_step --model "$PM" "${DT[@]}" --batch 1 \
          --steps 32 --lora-adapter vision
        step phi4_profile_prefill_vision 90 "$PY" -m bench.profile_step --model "$PM" "${DT[@]}" \
          --prompt-len 64 --warm-tail 2000 --steps 4 --top 16 --lora-adapter vision
        step phi4_profile_prefill 90 "$PY" -m bench.profile_step --model "$PM" "${DT[@]}" \
          --prompt-len 64 --warm-tail 2000 --steps 4 --top 16 ;;
      *) echo "== PHI4_STEPS: unknown step $what" ;;
    esac
  done
fi

# NIXL beside CUDA IPC, shared memory and bytes (issue 41), Qwen2.5-VL-7B shapes in NIXL_MODEL_DIR (default
# /tmp/qwen7b, made from NIXL_PRESET, default qwen2.5-vl-7b). Needs a nixl package (nixl-cu13 on CUDA 13).
# 1. tests/gpu/test_nixl_gpu.py (VRAM arena READ into this GPU and into host memory; the pair told to use
#    NIXL, HF-equal). 2. bench.nixl_read: a READ alone between two processes (CUDA and host arenas, into
#    this GPU and host memory). 3. bench.handoff --nixl: one embedding of a NIXL_IMAGE_SIZE² image
#    (default 1024: 1369 x 3584 bf16) from a CUDA arena and an SHM arena, each registered with NIXL, to
#    this GPU, per transport. 4. bench.ttft --transports NIXL_TRANSPORTS (default cuda_ipc,nixl,inline): one decoder per
#    transport beside one encoder, cold/warm TTFT of a 1024² image + 500 tokens through gRPC with each.
# CPU smoke: NIXL_PRESET=qwen2.5-vl-tiny DEVICE=cpu DTYPE=float32 NIXL_TRANSPORTS=shm,nixl,inline
#            NIXL_IMAGE_SIZE=128 NIXL_KV_BYTES=50000000 NIXL_TESTS=0.
if [[ ",$SECTIONS," == *,nixl,* ]]; then
  NMODEL=${NIXL_MODEL_DIR:-/tmp/qwen7b}
  make_once "$NMODEL" "${NIXL_PRESET:-qwen2.5-vl-7b}"
  left=$((BUDGET - (SECONDS - START)))
  if [ "${NIXL_TESTS:-1}" = 1 ] && [ "$left" -gt 60 ]; then
    echo "== nixl GPU tests (t=$((SECONDS - START))s)"
    timeout 150 "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu/test_nixl_gpu.py 2>&1 | tail -15
  fi
  step nixl_read 90 "$PY" -m bench.nixl_read --iters 50
  step nixl_handoff 150 "$PY" -m bench.handoff --model "$NMODEL" "${DT[@]}" --nixl \
    --image-size "${NIXL_IMAGE_SIZE:-1024}" --iters 50 --logs "$RES/logs-handoff"
  step nixl_ttft 360 "$PY" -m bench.ttft --model "$NMODEL" "${DT[@]}" --logs "$RES/logs-nixl-ttft" \
    --transports "${NIXL_TRANSPORTS:-cuda_ipc,nixl,inline}" --concurrency 0 --rounds "${NIXL_ROUNDS:-5}" \
    --image-size "${NIXL_IMAGE_SIZE:-1024}" --decoder-args "--kv-cache-bytes ${NIXL_KV_BYTES:-8000000000}"
fi

# Vision attention (issue 64), no checkpoint needed (random towers built in-process): first
# tests/gpu/test_vision_attention.py (the Triton kernel against an fp32 reference over several cu_seqlens
# layouts at head dims 72 and 80, both towers with it against SDPA, CUDA graphs of two token budgets in one
# pool), then bench/vision_attention.py: the kernel vs cuDNN / flash / efficient / FA2 varlen in ms and
# TFLOP/s (% of 989) on a 4096-patch image and the real per-image layouts at batch 1 and 8, its tile sweep,
# and both towers at batch 1 and 8 with MMSERVE_VISION_ATTENTION=sdpa and =triton (eager and graphs) beside
# HF's. VATTN_ARGS adds options (e.g. "--no-sweep", "--towers none", "--no-hf"); VATTN_TESTS=0 skips the
# tests. $OUT gets vision_attention.json and .log, and test_vision_attention.log. Limits: 120 s the tests,
# 240 s the bench (its tile sweep starts no case after 90 s; the kernels' JSON is written before the towers).
if [[ ",$SECTIONS," == *,vision_attention,* ]]; then
  read -r -a VAARGS <<< "${VATTN_ARGS:-}"
  if [ "${VATTN_TESTS:-1}" = 1 ]; then
    echo "== tests/gpu/test_vision_attention.py (t=$((SECONDS - START))s)"
    timeout 120 "$PY" -m pytest -q -p no:cacheprovider -rs tests/gpu/test_vision_attention.py \
      > "$OUT/test_vision_attention.log" 2>&1
    tail -15 "$OUT/test_vision_attention.log"
  fi
  step vision_attention 240 "$PY" -m bench.vision_attention --device "$DEVICE" --dtype "${DTYPE:-bfloat16}" \
    ${VAARGS[@]+"${VAARGS[@]}"}
  cp "$RES/vision_attention.json" "$RES/vision_attention.log" "$OUT/" 2>/dev/null
fi

# moe (issue 69): tests/gpu/test_fused_moe_gpu.py (bf16 and FP8 experts against the reference, ragged and
# empty experts, ties, a graph replay, both prefill paths) and the QK norm's GPU test, then bench.moe_decode: decode b1 and 32 streams with bf16 and FP8
# experts, the routers spread, HF's random init of the same config beside, against the active-weights
# bound. $OUT gets test_fused_moe.log. Limits: MOE_TESTS_TIMEOUT (240 s) the tests, 540 s the bench. MOE_TESTS: the GPU test
# files instead (e.g. with tests/gpu/test_qwen3_5_moe_gpu.py for MOE_PRESET=qwen3.5-35b-a3b).
# MOE_PREFILL_PROFILE=1 then, in this order (each while the budget lasts): profiles one 1520-token prefill
# step with its host time (bench.profile_step --warm-tail 1520 over a 16-token prompt; 100 s), times every
# grouped-GEMM tiling (and per-assignment GEMV) at MOE_TILING_TOKENS (bench.moe_tiling; 150 s), profiles a batch-1 decode step (70 s)
# and a follow-up's 24-token step over a 1520-token cached prefix (80 s); $OUT gets their json and logs in
# moe_profiles.tgz.
if [[ ",$SECTIONS," == *,moe,* ]]; then
  MOE_DIR=${MOE_MODEL_DIR:-/tmp/moe30b}
  read -r -a MOEARGS <<< "${MOE_ARGS:-}"
  read -r -a MOETESTS <<< "${MOE_TESTS:-tests/gpu/test_fused_moe_gpu.py tests/gpu/test_ops_gpu.py::test_qk_norm_gpu}"
  echo "== ${MOETESTS[*]} (t=$((SECONDS - START))s)"
  timeout "${MOE_TESTS_TIMEOUT:-240}" "$PY" -m pytest -q -p no:cacheprovider -rs "${MOETESTS[@]}" > "$OUT/test_fused_moe.log" 2>&1
  tail -15 "$OUT/test_fused_moe.log"
  make_once "$MOE_DIR" "${MOE_PRESET:-qwen3-vl-30b-a3b}" --weights vision
  step moe_decode 540 "$PY" -m bench.moe_decode --model "$MOE_DIR" "${DT[@]}" --load-format dummy \
    --quantization none,fp8 --batch-sizes 1,32 --prompt-len 64 --output-len 64 --hf-repeats 2 \
    ${MOEARGS[@]+"${MOEARGS[@]}"}
  if [ "${MOE_PREFILL_PROFILE:-0}" = 1 ]; then  # where a cold-like prefill step's and a follow-up's time goes
    step moe_prefill_profile 100 "$PY" -m bench.profile_step --model "$MOE_DIR" "${DT[@]}" --load-format dummy \
      --prompt-len 16 --warm-tail 1520 --steps 3 --top 24 --host-top 12
    step moe_tiling 150 "$PY" -m bench.moe_tiling "${DT[@]}" --tokens "${MOE_TILING_TOKENS:-1,4,32,128,512,1536}"
    step moe_decode_profile 70 "$PY" -m bench.profile_step --model "$MOE_DIR" "${DT[@]}" --load-format dummy \
      --batch 1 --steps 8 --top 24
    step moe_followup_profile 80 "$PY" -m bench.profile_step --model "$MOE_DIR" "${DT[@]}" --load-format dummy \
      --prompt-len 1520 --warm-tail 24 --steps 4 --top 16 --host-top 12
    # one archive: a device call brings back at most 8 files, and results.json and the logs must fit beside
    (cd "$RES" && tar czf "$OUT/moe_profiles.tgz" moe_prefill_profile.* moe_tiling.* moe_decode_profile.* \
      moe_followup_profile.* 2>/dev/null)
    for f in moe_prefill_profile moe_decode_profile moe_followup_profile; do
      grep -A30 "kernels per step" "$RES/$f.log" | head -32
    done
  fi
fi

# deterministic (issue 66): the GPU tests of the mode (kernels, engine per family, encoder), then what the
# mode costs on Qwen3-VL-8B shapes (bench.deterministic_cost: a pair per mode). $OUT gets
# test_deterministic.log and deterministic_cost.{json,log}. Limits: DET_TEST_S (240) the tests, 420 s the bench;
# DET_TESTS=0 / DET_BENCH=0 skip a part (one device call may not hold both).
if [[ ",$SECTIONS," == *,deterministic,* ]]; then
  DET_DIR=${QWEN3_MODEL_DIR:-/tmp/qwen3_8b}
  read -r -a DETARGS <<< "${DET_ARGS:---images 128 --cold-images 8}"
  if [ "${DET_TESTS:-1}" = 1 ]; then
    echo "== tests/gpu/test_deterministic*_gpu.py, test_invariant_matmul_gpu.py (t=$((SECONDS - START))s)"
    timeout "${DET_TEST_S:-240}" "$PY" -m pytest -q -p no:cacheprovider -rs -s --durations=10 \
      tests/gpu/test_deterministic_gpu.py tests/gpu/test_deterministic_encoder_gpu.py \
      tests/gpu/test_invariant_matmul_gpu.py > "$OUT/test_deterministic.log" 2>&1
    grep -e "mode off" -e "passed" -e "failed" -e "Error" -e "PASS" -e "FAIL" "$OUT/test_deterministic.log" | tail -40
  fi
  if [ "${DET_BENCH:-1}" = 1 ]; then
    make_once "$DET_DIR" "${QWEN3_PRESET:-qwen3-vl-8b}" --weights vision
    step deterministic_cost 420 "$PY" -m bench.deterministic_cost --model "$DET_DIR" "${DT[@]}" \
      --load-format dummy --logs "$RES/logs-deterministic" ${DETARGS[@]+"${DETARGS[@]}"}
    cp "$RES/deterministic_cost.json" "$RES/deterministic_cost.log" "$OUT/" 2>/dev/null
  fi
fi

# qwen3_5 (issue 68): the Gated DeltaNet layers' fla kernels. tests/gpu/test_gated_deltanet_fla_gpu.py (fla
# against the torch reference in fp32 and bf16: a varlen prefill of resumed and fresh sequences with snapshots,
# decode rows, the decode step replayed in a CUDA graph, the qwen3.5-tiny engine's greedy tokens; with
# tests/gpu/test_qwen3_5_graphs_gpu.py: the engine's decode graphs over the state slots equal HF), then decode
# tok/s (bench.decode_tput, no HF) on qwen3.5-9b shapes (QWEN3_5_PRESET), the language weights drawn on the
# device, once per Q35_KERNELS entry (MMSERVE_LINEAR_ATTENTION: default "fla torch"). fla-core and einops come
# from .whl (the script installs them into /tmp/site). $OUT gets test_gated_deltanet_fla.log and
# qwen3_5_decode_<kernel>.{json,log}, then qwen3_5_prefill_profile_<tail>.json (bench.profile_step
# --warm-tail: a warm request's prefill step of 11 new tokens over a 1530-token prompt, and a cold-like one of
# 1520 new tokens; wall time against the GPU kernels' time, the kernel table). Limits: 300 s the tests
# (Q35_TESTS_TIMEOUT), 240 s each decode run, 150 s each profile; Q35_TESTS=0 / Q35_BENCH=0 / Q35_PROFILE=0
# skip a part; Q35_TESTS_K picks tests (pytest -k); Q35_PROFILE_CASES lists the profiles as PROMPT:TAIL
# (default "1530:11 16:1520"; "1024:50" is a follow-up's step: 50 new tokens after a 1024-token prefix);
# Q35_ARGS adds decode_tput options.
if [[ ",$SECTIONS," == *,qwen3_5,* ]]; then
  "$PY" -c "import fla, einops; print('   fla', fla.__version__, 'from', fla.__file__)" 2>&1 | tail -1
  if [ "${Q35_TESTS:-1}" = 1 ]; then
    echo "== tests/gpu/test_gated_deltanet_fla_gpu.py (t=$((SECONDS - START))s)"
    timeout "${Q35_TESTS_TIMEOUT:-300}" "$PY" -m pytest -q -s -p no:cacheprovider -rfEs --durations=5 \
      ${Q35_TESTS_K:+-k "$Q35_TESTS_K"} tests/gpu/test_gated_deltanet_fla_gpu.py \
      tests/gpu/test_qwen3_5_graphs_gpu.py > "$OUT/test_gated_deltanet_fla.log" 2>&1
    tail -20 "$OUT/test_gated_deltanet_fla.log"
  fi
  Q35_DIR=${QWEN3_5_MODEL_DIR:-/tmp/qwen3_5_9b}
  if [ "${Q35_BENCH:-1}" = 1 ]; then
    read -r -a Q35ARGS <<< "${Q35_ARGS:-}"
    make_once "$Q35_DIR" "${QWEN3_5_PRESET:-qwen3.5-9b}" --weights vision
    for kernel in ${Q35_KERNELS:-fla torch}; do
      step "qwen3_5_decode_$kernel" 240 env MMSERVE_LINEAR_ATTENTION="$kernel" "$PY" -m bench.decode_tput \
        --model "$Q35_DIR" "${DT[@]}" --no-hf --load-format dummy --batch-sizes 1,32 --prompt-len 512 \
        --output-len 64 ${Q35ARGS[@]+"${Q35ARGS[@]}"}
      cp "$RES/qwen3_5_decode_$kernel.json" "$RES/qwen3_5_decode_$kernel.log" "$OUT/" 2>/dev/null
    done
  fi
  if [ "${Q35_PROFILE:-1}" = 1 ]; then  # where a prefill step's time goes: a warm tail, then a cold-like chunk
    make_once "$Q35_DIR" "${QWEN3_5_PRESET:-qwen3.5-9b}" --weights vision
    for case in ${Q35_PROFILE_CASES:-1530:11 16:1520}; do
      prompt=${case%%:*} tail=${case##*:}
      step "qwen3_5_prefill_profile_$tail" 150 "$PY" -m bench.profile_step --model "$Q35_DIR" "${DT[@]}" \
        --load-format dummy --prompt-len "$prompt" --warm-tail "$tail" --steps 4 --top 30 --host-top 25
      cp "$RES/qwen3_5_prefill_profile_$tail.json" "$OUT/" 2>/dev/null  # its table is in run_gpu.log
    done
  fi
fi

echo "== merge (t=$((SECONDS - START))s)"
"$PY" -m bench.merge "$RES"/*.json --out "$OUT/results.json"
for f in "$RES"/encoder.log "$RES"/decoder.log "$RES"/logs-*/*.log; do
  [ -f "$f" ] || continue
  echo "--- tail of $f"
  grep -v NOT_FOUND "$f" | tail -15
done
echo "== done in $((SECONDS - START))s; results in $OUT"
