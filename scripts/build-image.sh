#!/usr/bin/env bash
# Build the vigil image (Containerfile) with buildah, without a registry.
#   scripts/build-image.sh                 # base: a Debian bookworm rootfs made by debootstrap
#   BASE=docker.io/library/python:3.11-slim-bookworm scripts/build-image.sh   # a pulled base
# Makes build/wheelhouse (vigil's wheel and its runtime dependencies, from the configured package
# index), then `buildah bud` -> localhost/vigil:<version>. Needs root (or rootless buildah),
# buildah, and debootstrap for the Debian base. Prints each step and how long it took.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
VERSION=$("$PY" -c 'import vigil; print(vigil.__version__)')
IMAGE=${IMAGE:-localhost/vigil:$VERSION}
BASE=${BASE:-localhost/vigil-base:bookworm}
STORAGE=(--storage-driver "${BUILDAH_STORAGE_DRIVER:-vfs}")
step() { printf '%s [build-image] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

if [ "$BASE" = localhost/vigil-base:bookworm ] && ! buildah "${STORAGE[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then
  step "building $BASE from Debian packages (debootstrap minbase + python3, python3-venv)"
  rootfs=$(mktemp -d)
  trap 'rm -rf "$rootfs"' EXIT
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" \
    "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >/dev/null
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  ctr=$(buildah "${STORAGE[@]}" from scratch)
  mnt=$(buildah "${STORAGE[@]}" mount "$ctr")
  cp -a "$rootfs"/. "$mnt"/
  buildah "${STORAGE[@]}" umount "$ctr" >/dev/null
  buildah "${STORAGE[@]}" config --env PATH=/usr/local/bin:/usr/bin:/bin --cmd /bin/sh "$ctr"
  buildah "${STORAGE[@]}" commit --quiet "$ctr" "$BASE" >/dev/null
  buildah "${STORAGE[@]}" rm "$ctr" >/dev/null
fi

step "wheelhouse: vigil $VERSION and its runtime dependencies"
rm -rf build/wheelhouse
"$PY" -m pip wheel --quiet -w build/wheelhouse .
step "buildah bud -> $IMAGE (base $BASE)"
buildah "${STORAGE[@]}" bud --quiet --isolation chroot --layers=false --build-arg "BASE=$BASE" -t "$IMAGE" \
  -f Containerfile . >/dev/null
step "done: $IMAGE"
