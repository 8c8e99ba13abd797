#!/usr/bin/env bash
# The node image's base on a machine that reaches Debian's package archive but no image registry:
# a minimal Debian root filesystem made by mmdebstrap from this machine's own apt sources (its
# mirror, suite and keyring; none is written here), imported into buildah's storage (its driver:
# STORAGE_DRIVER, else overlay, as pytest_ppsmoke/cloud/image.py chooses it) as
# IMAGE. Built once per machine: an existing IMAGE is kept. docker/Dockerfile's apt step installs
# python3, python3-venv and ca-certificates on top, as it does on the CUDA base. The base carries
# clang, which tinygrad's CPU device compiles its kernels with: here, without a GPU, it stands in
# for the CUDA base's libnvrtc.
#
#   docker/debian-base.sh [IMAGE]      (default localhost/pp-debian-base:<codename>)
set -euo pipefail

. /etc/os-release
suite=${VERSION_CODENAME:?/etc/os-release names no VERSION_CODENAME}
image=${1:-localhost/pp-debian-base:$suite}
if [[ -z ${STORAGE_DRIVER:-} ]]; then
  STORAGE_DRIVER=vfs
  grep -qw overlay /proc/filesystems && STORAGE_DRIVER=overlay
fi
buildah=(buildah --storage-driver "$STORAGE_DRIVER")

if "${buildah[@]}" inspect --type image "$image" >/dev/null 2>&1; then
  echo "debian-base: $image exists"
  exit 0
fi
sources=()
for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
  [[ -s $f ]] && sources+=("$f")
done
if [[ ${#sources[@]} -eq 0 ]]; then
  echo "debian-base: no apt sources on this machine (/etc/apt/sources.list, /etc/apt/sources.list.d/)" >&2
  exit 1
fi
work=$(mktemp -d)
ctr=""
cleanup() { [[ -n $ctr ]] && "${buildah[@]}" rm "$ctr" >/dev/null 2>&1; rm -rf "$work"; }
trap cleanup EXIT
# minbase: apt and dpkg (and clang); the sources files are copied in, so the build's apt step
# reaches the same archive
mmdebstrap --quiet --variant=minbase --include=clang --mode=root --format=tar \
  "$suite" "$work/rootfs.tar" "${sources[@]}"
ctr=$("${buildah[@]}" from scratch)
"${buildah[@]}" add --quiet "$ctr" "$work/rootfs.tar" / >/dev/null
"${buildah[@]}" config --cmd /bin/bash --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
"${buildah[@]}" commit --quiet "$ctr" "$image" >/dev/null
echo "debian-base: built $image"
