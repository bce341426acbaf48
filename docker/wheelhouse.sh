#!/usr/bin/env bash
# Fill a wheelhouse with every wheel the mmserve image needs, so that `docker build` can run with
# no network at all (air-gapped clusters, or hosts that reach a package index but no image registry):
#
#   docker/wheelhouse.sh                  # CPU: torch==2.13.0 (CPU build) + deps -> docker/wheelhouse/
#   docker/wheelhouse.sh --gpu            # GPU: CUDA torch build + cupy-cuda12x
#   docker build --build-arg OFFLINE=1 ...   (the Dockerfile then installs with --no-index)
#
# Env:
#   WHEELHOUSE       target dir (default docker/wheelhouse, inside the build context; git-ignored)
#   TORCH_SPEC       default torch==2.13.0 (pin it: a bare `torch` pulls a multi-GB CUDA build)
#   TORCH_INDEX_URL  where the torch build lies; default for CPU: none (PyPI/find-links as pip is
#                    configured; add https://download.pytorch.org/whl/cpu where pip has no CPU wheel),
#                    for --gpu: https://download.pytorch.org/whl/cu128
#   PY_VERSION       target python (default 3.11: python:3.11-slim and Debian bookworm)
#   PLATFORM         target arch (default x86_64)
#   PIP              pip command (default: python3 -m pip)
#   MORE_EXTRAS      more pyproject extras, comma-separated, e.g. nixl (for an image built with EXTRAS=nixl)
# Wheels are fetched for the target (cp$PY_VERSION, manylinux glibc <= 2.36), not for this host,
# so the host may run another Python. Everything is a wheel: no compiler is needed in the image.
set -euo pipefail
cd "$(dirname "$0")/.."

GPU=0
[[ "${1:-}" == "--gpu" ]] && GPU=1
WHEELHOUSE="${WHEELHOUSE:-docker/wheelhouse}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
PY_VERSION="${PY_VERSION:-3.11}"
PLATFORM="${PLATFORM:-x86_64}"
PIP="${PIP:-python3 -m pip}"
if [[ $GPU == 1 ]]; then
    TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cu128}"
    EXTRAS="gpu"
else
    TORCH_INDEX_URL="${TORCH_INDEX_URL:-}"
    EXTRAS=""
fi
EXTRAS="$EXTRAS${MORE_EXTRAS:+,$MORE_EXTRAS}"
mkdir -p "$WHEELHOUSE"

# The project's runtime requirements, read from pyproject.toml (torch is pinned separately).
REQS="$(mktemp)"; trap 'rm -f "$REQS"' EXIT
python3 - "$EXTRAS" > "$REQS" <<'PY'
import sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = [r for r in p["dependencies"] if not r.replace(" ", "").lower().startswith("torch")]
for extra in filter(None, sys.argv[1].split(",")):
    reqs += p.get("optional-dependencies", {}).get(extra, [])
print("\n".join(reqs))
PY
# setuptools + wheel: the image builds the mmserve wheel itself from the source (offline too).
echo "setuptools>=68" >> "$REQS"
echo "wheel" >> "$REQS"

PLAT_ARGS=()
for minor in $(seq 36 -1 17); do PLAT_ARGS+=(--platform "manylinux_2_${minor}_${PLATFORM}"); done
PLAT_ARGS+=(--platform "manylinux2014_${PLATFORM}" --platform "linux_${PLATFORM}")
TARGET_ARGS=(--only-binary=:all: --python-version "$PY_VERSION" --implementation cp
             --abi "cp${PY_VERSION/./}" "${PLAT_ARGS[@]}")

TORCH_ARGS=()
[[ -n "$TORCH_INDEX_URL" ]] && TORCH_ARGS+=(--extra-index-url "$TORCH_INDEX_URL")

echo "wheelhouse: $TORCH_SPEC ${TORCH_INDEX_URL:+from $TORCH_INDEX_URL} + $(tr '\n' ' ' < "$REQS")-> $WHEELHOUSE"
# One resolve for everything, so torch's own deps (sympy, networkx, ...) agree with the rest.
$PIP download --dest "$WHEELHOUSE" "${TARGET_ARGS[@]}" "${TORCH_ARGS[@]}" "$TORCH_SPEC" -r "$REQS"
ls "$WHEELHOUSE"/*.whl | wc -l | xargs echo "wheelhouse: wheels:"
du -sh "$WHEELHOUSE"
