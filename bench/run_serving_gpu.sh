#!/usr/bin/env bash
# The serving-path measurements on one GPU (llava-1.5-7b preset, bf16), in about 9 minutes:
# served vs in-process decode, the handoff, SHM upload overlap (profiler trace), and the GPU tests of
# the serving path.
#
#   OUT=/some/dir bash bench/run_serving_gpu.sh [STEP ...]       (from the repository root)
#
# STEPs (default all): tests handoff serve_decode copy_overlap gateway (the gateway step needs starlette,
# uvicorn and pydantic installed). Not in the default: encode_tput (encoder throughput vs HF, ~3 min)
# and encode_tests (the encoder's GPU preprocessing tests). Env: OUT (required), MODEL_DIR (default
# /tmp/llava7b, made when missing), PYTHON (default python3), BUDGET_S (default 560: each step's timeout
# is cut to what is left).
set -u
OUT=${OUT:?set OUT to the results directory}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
MODEL=${MODEL_DIR:-/tmp/llava7b}
START=$SECONDS
BUDGET=${BUDGET_S:-560}
STEPS=${*:-tests handoff serve_decode copy_overlap gateway}
DT=(--device cuda --dtype bfloat16)
exec > >(tee -a "$OUT/run_serving_gpu.log") 2>&1

step() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - (SECONDS - START)))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then echo "== $name: skipped (budget spent)"; return; fi
  echo "== $name (timeout ${limit}s, t=$((SECONDS - START))s)"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | grep -v -e "it/s]" -e "s/it]" | tail -40
  echo "   rc=${PIPESTATUS[0]} after $((SECONDS - START))s"
}

echo "== $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null) steps: $STEPS"
for s in $STEPS; do
  case $s in
    tests)
      step gpu_tests 240 "$PY" -m pytest -q -x -p no:cacheprovider tests/gpu/test_lease_race_gpu.py \
        tests/gpu/test_pair_gpu.py tests/gpu/test_engine_gpu.py tests/gpu/test_transport_gpu.py \
        tests/gpu/test_real_configs_gpu.py ;;
    encode_tests)
      step encode_tests 120 "$PY" -m pytest -q -x -p no:cacheprovider tests/gpu/test_pixels_gpu.py ;;
    handoff|serve_decode|copy_overlap|gateway|encode_tput)
      if [ ! -f "$MODEL/mmserve_model.json" ]; then
        step make_model 120 "$PY" -m common.cli make-model --preset llava-1.5-7b --out "$MODEL" "${DT[@]}"
      fi
      case $s in
        handoff) step handoff 90 "$PY" -m bench.handoff --model "$MODEL" "${DT[@]}" --iters 50 \
                   --image-size 336 --arenas cuda,shm --out "$OUT/handoff.json" ;;
        serve_decode) step serve_decode 300 "$PY" -m bench.serve_decode --model "$MODEL" "${DT[@]}" \
                        --batch-sizes 8,32 --output-len 192 --repeats 2 --out "$OUT/serve_decode.json" ;;
        copy_overlap) step copy_overlap 120 "$PY" -m bench.copy_overlap --model "$MODEL" "${DT[@]}" \
                        --trace "$OUT/copy_overlap_trace.json.gz" --out "$OUT/copy_overlap.json" ;;
        encode_tput) step encode_tput 240 "$PY" -m bench.encode_tput --model "$MODEL" "${DT[@]}" \
                       --images 256 --concurrency 1,8,32,64 --hf-batches 1,32 --out "$OUT/encode_tput.json" ;;
        gateway) step gateway_latency 150 "$PY" -m bench.gateway_latency --model "$MODEL" "${DT[@]}" \
                   --rounds 30 --out "$OUT/gateway_latency.json" ;;
      esac ;;
    *) echo "unknown step $s" ;;
  esac
done
echo "== done in $((SECONDS - START))s"
