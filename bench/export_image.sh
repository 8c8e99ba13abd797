#!/usr/bin/env bash
# The node image's root filesystem and environment as files, for a machine with a GPU but no
# container engine (bench/image_on_gpu.sh runs them there): OUT/rootfs.tar.zst (the image's files,
# numeric owners) and OUT/env (its ENV, one KEY=VALUE a line), from buildah's storage; with
# SPLIT_MB set, the archive is also cut into OUT/rootfs.part.NN of that many MB. With LEAN=1 the
# archive leaves out what only this machine's base carries, tinygrad's CPU device's clang and
# LLVM (debian:bookworm-slim, the registry's base, has neither; a GPU node never runs them), and
# the documentation (usr/share/doc, man, info): a smaller archive to carry to a GPU machine.
#
#   bench/export_image.sh [IMAGE] OUT          (IMAGE: the package's default --image)
set -euo pipefail
image=${1:-$(python -c 'import pytest_ppsmoke; print(pytest_ppsmoke.DEFAULT_IMAGE)')}
out=${2:?usage: bench/export_image.sh [IMAGE] OUT}
driver=${STORAGE_DRIVER:-overlay}
grep -qw overlay /proc/filesystems || driver=${STORAGE_DRIVER:-vfs}
buildah=(buildah --storage-driver "$driver")
mkdir -p "$out"
ctr=$("${buildah[@]}" from --pull=never --quiet "$image")
trap '"${buildah[@]}" umount "$ctr" >/dev/null 2>&1; "${buildah[@]}" rm "$ctr" >/dev/null 2>&1' EXIT
mnt=$("${buildah[@]}" mount "$ctr")
lean=()
if [[ -n ${LEAN:-} ]]; then
  lean=(--exclude=./usr/lib/llvm-* --exclude='./usr/lib/x86_64-linux-gnu/libLLVM*' --exclude='./usr/lib/x86_64-linux-gnu/libclang*'
        --exclude='./usr/lib/x86_64-linux-gnu/libz3*' --exclude=./usr/lib/gcc --exclude='./usr/bin/clang*'
        --exclude=./usr/share/doc --exclude=./usr/share/man --exclude=./usr/share/info --exclude=./usr/include)
fi
tar -C "$mnt" --numeric-owner "${lean[@]}" -cf - . | zstd -T0 -${ZSTD_LEVEL:-12} --long=27 -q -f -o "$out/rootfs.tar.zst"
"${buildah[@]}" inspect --type image --format '{{range .OCIv1.Config.Env}}{{println .}}{{end}}' "$image" | sed '/^$/d' > "$out/env"
du -b "$out/rootfs.tar.zst" "$out/env"
if [[ -n ${SPLIT_MB:-} ]]; then
  split -b "${SPLIT_MB}M" -d "$out/rootfs.tar.zst" "$out/rootfs.part."
  ls -l "$out"/rootfs.part.*
fi
