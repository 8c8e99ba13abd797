#!/usr/bin/env bash
# The node image's base on a machine that reaches Debian's package archive but no image registry:
# a minimal root filesystem of the Debian release docker/Dockerfile's BASE names
# (debian:<release>-slim), made by mmdebstrap from this machine's own apt sources (its mirror and
# keyring; none is written here), imported into buildah's storage (its driver: STORAGE_DRIVER, else
# overlay, as pytest_ppsmoke/cloud/image.py chooses it) as IMAGE. Built once per machine: an
# existing IMAGE is kept. docker/Dockerfile's apt step installs python3, python3-venv and
# ca-certificates on top, as it does on debian:<release>-slim. The one package added here is clang,
# which tinygrad's CPU device compiles its kernels with: without a GPU it stands in for CUDA.
#
#   docker/debian-base.sh [IMAGE]      (default localhost/pp-debian-base:<release>)
set -euo pipefail

here=$(dirname "$0")
release=$(sed -n 's/^ARG BASE=debian:\([a-z]*\)-slim$/\1/p' "$here/Dockerfile")
if [[ -z $release ]]; then
  echo "debian-base: docker/Dockerfile's ARG BASE is not debian:<release>-slim" >&2
  exit 1
fi
. /etc/os-release
if [[ ${VERSION_CODENAME:-} != "$release" ]]; then
  echo "debian-base: this machine's apt sources are for ${VERSION_CODENAME:-an unknown release}, the image's base is Debian $release; build on a $release machine, or on debian:$release-slim from a registry (python -m pytest_ppsmoke.cloud.image --base registry)" >&2
  exit 1
fi
image=${1:-localhost/pp-debian-base:$release}
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
  "$release" "$work/rootfs.tar" "${sources[@]}"
ctr=$("${buildah[@]}" from scratch)
"${buildah[@]}" add --quiet "$ctr" "$work/rootfs.tar" / >/dev/null
"${buildah[@]}" config --cmd /bin/bash --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
"${buildah[@]}" commit --quiet "$ctr" "$image" >/dev/null
echo "debian-base: built $image"
