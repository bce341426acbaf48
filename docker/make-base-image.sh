#!/usr/bin/env bash
# Make a Debian bookworm base image (python3.11 + venv) without any image registry:
# debootstrap a minimal root filesystem and `docker import` it.
#
#   docker/make-base-image.sh [TAG]          default TAG: mmserve-base:bookworm
#
# Env: SUITE (bookworm), MIRROR (http://deb.debian.org/debian), WORKDIR (a temp dir),
#      FORCE=1 to rebuild an existing tag.
# Needs root, debootstrap and a Docker engine. The image has python3 (3.11 on bookworm),
# python3-venv (ensurepip) and ca-certificates; nothing else, no compilers.
# Then build mmserve on it:  docker build --build-arg BASE_IMAGE=mmserve-base:bookworm ...
set -euo pipefail

TAG="${1:-mmserve-base:bookworm}"
SUITE="${SUITE:-bookworm}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
PACKAGES="${PACKAGES:-python3,python3-venv,ca-certificates}"

if [[ "${FORCE:-0}" != 1 ]] && docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "make-base-image: $TAG exists (FORCE=1 to rebuild)"
    exit 0
fi
command -v debootstrap >/dev/null || { echo "need debootstrap: apt-get install -y debootstrap" >&2; exit 1; }
[[ $(id -u) == 0 ]] || { echo "debootstrap needs root" >&2; exit 1; }

WORKDIR="${WORKDIR:-$(mktemp -d /tmp/mmserve-rootfs.XXXXXX)}"
ROOTFS="$WORKDIR/rootfs"
cleanup() {
    # debootstrap may leave proc/sys mounted if interrupted
    for m in proc sys dev/pts dev; do umount -l "$ROOTFS/$m" 2>/dev/null || true; done
    rm -rf "$WORKDIR"
}
trap cleanup EXIT

echo "make-base-image: debootstrap $SUITE ($PACKAGES) into $ROOTFS"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR"

# Trim: apt lists and caches, docs, man pages, locales other than C (python runs with C.UTF-8).
# The stdlib .pyc files stay: the servers run as non-root and could not write them at run time.
chroot "$ROOTFS" apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin \
       "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/info/* \
       "$ROOTFS"/var/log/*.log "$ROOTFS"/var/log/apt/* "$ROOTFS"/tmp/* \
       "$ROOTFS"/debootstrap
find "$ROOTFS"/usr/share/locale -mindepth 1 -maxdepth 1 ! -name 'locale.alias' -exec rm -rf {} + 2>/dev/null || true
if [[ -x "$ROOTFS/usr/bin/python3" ]]; then chroot "$ROOTFS" python3 --version; fi

echo "make-base-image: docker import -> $TAG"
tar --numeric-owner -C "$ROOTFS" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' \
    --message "debootstrap --variant=minbase $SUITE + $PACKAGES" \
    - "$TAG"
docker image ls "$TAG"
