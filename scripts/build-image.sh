#!/usr/bin/env bash
# Build the vigil image (Containerfile) with buildah, without a registry.
#   scripts/build-image.sh                 # base: a Debian bookworm rootfs made by debootstrap
#   BASE=docker.io/library/python:3.11-slim-bookworm scripts/build-image.sh   # a pulled base
# Makes build/wheelhouse (vigil's wheel, its runtime dependencies and those of the server extras
# EXTRAS, from the configured package index), then `buildah bud` -> localhost/vigil:<version>. Needs root (or rootless buildah),
# buildah, and debootstrap for the Debian base. Prints each step and how long it took.
#
# For `make test` (the build overlaps the test run; tests/deploy/test_image.py waits for it):
#   scripts/build-image.sh --background    # returns at once; the build runs niced, bounded by
#                                          # `timeout 900`: build/image.log, build/image.pid (the
#                                          # timeout's pid), then build/image.status (its exit status)
#   scripts/build-image.sh --stop          # ends a background build still running, build and all
set -euo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/.."
LOG=build/image.log STATUS=build/image.status PIDFILE=build/image.pid
BUILD_TIMEOUT_SECONDS=900  # a cold build takes ~3 min on 2 shared cores; room for a slow mirror

BASE=${BASE:-localhost/vigil-base:bookworm}
STORAGE=(--storage-driver "${BUILDAH_STORAGE_DRIVER:-vfs}")

# The Debian mirror for the base: $DEBIAN_MIRROR, else the one apt on this machine uses (a site
# behind its own mirror builds from it), else deb.debian.org.
apt_mirror() {
  grep -hoE '(URIs:[[:space:]]*|^deb[[:space:]]+)https?://[^[:space:]]+/debian/?([[:space:]]|$)' \
    /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
    | grep -oE 'https?://[^[:space:]]+' | head -n 1 || true
}
MIRROR=${DEBIAN_MIRROR:-$(apt_mirror)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
MIRROR=${MIRROR%/}

case "${1:-}" in
  --background)
    mkdir -p build
    rm -f "$STATUS" "$PIDFILE" "$STATUS.tmp"
    # The same conditions under which tests/deploy/test_image.py skips.
    if ! command -v buildah >/dev/null || ! command -v debootstrap >/dev/null || [ "$(id -u)" -ne 0 ]; then
      echo "build-image: not started: needs root, buildah and debootstrap (scripts/ensure-system-packages.sh)" \
        | tee "$LOG" >&2
      exit 0
    fi
    # A machine that cannot reach any Debian mirror cannot build the base: say so (the test skips
    # with this line) rather than fail the run on the network. Any other failure fails the test.
    if ! buildah "${STORAGE[@]}" inspect --type image "$BASE" >/dev/null 2>&1 \
        && ! python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=15).close()' \
             "$MIRROR/dists/bookworm/Release" >/dev/null 2>&1; then
      echo "skip: the Debian mirror $MIRROR is unreachable, so the image's base cannot be built" \
        | tee "$LOG" >&2
      head -n 1 "$LOG" >"$STATUS"
      exit 0
    fi
    (
      started=$(date +%s)
      # timeout runs the build in a process group of its own and passes a TERM on to all of it
      # (KILL 30 s later): --stop, and the time limit, end debootstrap and buildah too.
      nice -n 10 timeout -k 30 "$BUILD_TIMEOUT_SECONDS" "$SELF" &
      echo $! >"$PIDFILE"
      rc=0
      wait $! || rc=$?
      echo "$(date -u +%H:%M:%S) [build-image] exit status $rc after $(($(date +%s) - started)) s"
      echo "$rc" >"$STATUS.tmp" && mv "$STATUS.tmp" "$STATUS"
    ) </dev/null >"$LOG" 2>&1 &
    for _ in $(seq 50); do [ -s "$PIDFILE" ] && break; sleep 0.1; done
    echo "build-image: building in the background (pid $(cat "$PIDFILE" 2>/dev/null || echo '?'), log $LOG)" >&2
    exit 0
    ;;
  --stop)
    pid=$(cat "$PIDFILE" 2>/dev/null || true)
    if [ -n "$pid" ] && [ ! -e "$STATUS" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = timeout ]; then
      echo "build-image: stopping the background build (pid $pid)" >&2
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 400); do [ -e "$STATUS" ] && break; sleep 0.1; done
    fi
    exit 0
    ;;
esac

PY=${PYTHON:-.venv/bin/python}
VERSION=$("$PY" -c 'import vigil; print(vigil.__version__)')
IMAGE=${IMAGE:-localhost/vigil:$VERSION}
# The extras every server component needs (Containerfile says why one image carries them all).
EXTRAS=${EXTRAS:-k8s,postgres,resiliency}
step() { printf '%s [build-image] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

# On any exit, a stop (TERM from --stop or the time limit) included: remove what a build cut short
# leaves behind, the debootstrap tree and `buildah bud`'s working containers (each a full copy of
# the base with the vfs driver).
rootfs="" ctr="" containers_before=""
new_containers() {
  buildah "${STORAGE[@]}" containers --format '{{.ContainerID}} {{.ImageName}}' 2>/dev/null \
    | awk -v base="$BASE" '$2 == base {print $1}' | grep -vxF -f <(printf '%s\n' "$containers_before") || true
}
cleanup() {
  if [ -n "$rootfs" ]; then
    # debootstrap stopped part-way may leave /proc, /sys or a bind-mounted /dev mounted inside:
    # unmount those before removing the tree, and never cross into them.
    findmnt -rn -o TARGET | grep -F "$rootfs/" | sort -r | xargs -r -d '\n' umount -l 2>/dev/null || true
    rm -rf --one-file-system "$rootfs"
  fi
  [ -z "$ctr" ] || buildah "${STORAGE[@]}" rm "$ctr" >/dev/null 2>&1 || true
  if [ -n "$containers_before" ]; then
    new_containers | xargs -r buildah "${STORAGE[@]}" rm >/dev/null 2>&1 || true
  fi
}
trap cleanup EXIT

if [ "$BASE" = localhost/vigil-base:bookworm ] && ! buildah "${STORAGE[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then
  step "building $BASE from Debian packages (debootstrap minbase + python3, python3-venv)"
  rootfs=$(mktemp -d)
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" \
    "$MIRROR" >/dev/null
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  ctr=$(buildah "${STORAGE[@]}" from scratch)
  mnt=$(buildah "${STORAGE[@]}" mount "$ctr")
  cp -a "$rootfs"/. "$mnt"/
  buildah "${STORAGE[@]}" umount "$ctr" >/dev/null
  rm -rf --one-file-system "$rootfs" && rootfs=""
  buildah "${STORAGE[@]}" config --env PATH=/usr/local/bin:/usr/bin:/bin --cmd /bin/sh "$ctr"
  buildah "${STORAGE[@]}" commit --quiet "$ctr" "$BASE" >/dev/null
  buildah "${STORAGE[@]}" rm "$ctr" >/dev/null && ctr=""
fi

step "wheelhouse: vigil $VERSION[$EXTRAS] and its runtime dependencies"
mkdir -p build  # a fresh clone has none: `pytest tests/deploy/test_image.py` alone builds here first
rm -rf build/wheelhouse build/wheel-build
# setuptools' own build directory, fresh each time (DIST_EXTRA_CONFIG: an extra setup.cfg): its
# default, build/lib, keeps whatever an older checkout built there and the wheel would carry it.
printf '[build]\nbuild_base = build/wheel-build\n' > build/wheel-build.cfg
DIST_EXTRA_CONFIG=build/wheel-build.cfg "$PY" -m pip wheel --quiet -w build/wheelhouse ".[$EXTRAS]"
rm -rf build/wheel-build
step "buildah bud -> $IMAGE (base $BASE)"
containers_before=$(buildah "${STORAGE[@]}" containers --quiet --notruncate 2>/dev/null; echo -)
old_id=$(buildah "${STORAGE[@]}" inspect --type image --format '{{.FromImageID}}' "$IMAGE" 2>/dev/null || true)
buildah "${STORAGE[@]}" bud --quiet --isolation chroot --layers=false --build-arg "BASE=$BASE" \
  --build-arg "EXTRAS=$EXTRAS" -t "$IMAGE" \
  -f Containerfile . >/dev/null
# The previous build of this tag, now untagged: each rebuild (every `make test`) would keep one more.
new_id=$(buildah "${STORAGE[@]}" inspect --type image --format '{{.FromImageID}}' "$IMAGE")
if [ -n "$old_id" ] && [ "$old_id" != "$new_id" ]; then
  buildah "${STORAGE[@]}" rmi "$old_id" >/dev/null 2>&1 || true  # in use by a container: kept
fi
step "done: $IMAGE"
