#!/usr/bin/env bash
# The node image's own root filesystem on a GPU machine, run as the NVIDIA container runtime runs
# a container: a mount namespace, the image's files as /, only the driver's libraries and
# /dev/nvidia* brought in from the host (no CUDA toolkit of the host's is visible), the image's
# environment and user. Inside it: the image's CUDA check, then a two-stage pp-smoke-run --local
# (both nodes and the emulator in the image, both stages on GPU 0), cold (the image's caches as
# shipped, an empty HOME: a new instance) and then warm.
#
#   bench/image_on_gpu.sh ROOTFS.tar[.zst] MODEL ENVFILE OUT [pp-smoke-run args...]
#
# ROOTFS: the image's files (bench/export_image.sh makes it); ENVFILE: its ENV, one KEY=VALUE a
# line (the same script writes it); OUT: where the reports, logs and figures go (OUT/image_gpu.json).
# MODEL: a GGUF file, or like:NAME for pp-synth-gguf --like NAME written inside the image.
# BASELINE=PKG.tar runs the same passes again with the image's package replaced by PKG.tar's
# (pytest_ppsmoke/ and worker/ of another commit: bench/export_image.sh's landed code) and its
# cache as that commit's image ships it (empty), on the same files: passes named baseline-cold
# and baseline-warm. OVERLAY=PKG.tar replaces the image's package by PKG.tar's (the same layout)
# for the first passes, its cache kept as shipped: a newer commit's code in this image's files.
# Either package is byte-compiled in place, as pip compiled the image's own.
# Needs root (unshare, mount, chroot). Nothing is left mounted: the namespace ends with the script.
set -euo pipefail
rootfs_tar=$1 model=$2 envfile=$3 out=$4
shift 4
mkdir -p "$out"
root=$(mktemp -d /tmp/pp-image-root.XXXXXX)
t0=$(date +%s.%N)
case $rootfs_tar in
  *.zst) zstd -dc -T0 --long=27 "$rootfs_tar" | tar -C "$root" --numeric-owner -xf - ;;
  *) tar -C "$root" --numeric-owner -xf "$rootfs_tar" ;;
esac
t1=$(date +%s.%N)
mkdir -p "$root/models"
case $model in
  like:*) ;;  # written inside, by the image's own pp-synth-gguf
  *) cp "$model" "$root/models/model.gguf" ;;
esac
chown -R 1000:1000 "$root/models"
baseline=${BASELINE:-}
if [[ -n $baseline ]]; then  # the other commit's package, unpacked beside the image's
  mkdir -p "$root/opt/baseline"
  tar -C "$root/opt/baseline" -xf "$baseline"
fi
if [[ -n ${OVERLAY:-} ]]; then  # a newer commit's package in place of the image's
  mkdir -p "$root/opt/overlay"
  tar -C "$root/opt/overlay" -xf "$OVERLAY"
fi

# the driver's user-space libraries, as the container runtime finds them (ldconfig's cache)
mapfile -t libs < <(ldconfig -p | awk '/(libcuda\.so|libnvidia-ptxjitcompiler\.so|libnvidia-nvvm\.so|libnvidia-ml\.so)/ {print $NF}' | sort -u)
if [[ ${#libs[@]} -eq 0 ]]; then
  echo "image_on_gpu: no libcuda in ldconfig's cache: is this a GPU machine with a driver?" >&2
  exit 1
fi

env_args=()
while IFS= read -r line; do
  [[ -n $line ]] && env_args+=("$line")
done < "$envfile"

inner=$(cat <<'INNER'
set -euo pipefail
root=$1 out=$2
shift 2
mount --make-rprivate /
for d in dev sys; do mount --rbind "/$d" "$root/$d"; done
mount -t proc proc "$root/proc"
mount -t tmpfs tmpfs "$root/tmp"
chmod 1777 "$root/tmp"
declare -A done=()
for lib in "${LIBS[@]}"; do  # the first of each name, as the loader would find it
  name=$(basename "$lib")
  [[ -n ${done[$name]:-} ]] && continue
  done[$name]=1
  real=$(readlink -f "$lib")
  dest="$root/usr/lib/x86_64-linux-gnu/$name"
  touch "$dest"
  mount --bind -o ro "$real" "$dest"
done
chroot "$root" /sbin/ldconfig
run() {  # as the image's user, with only the image's environment
  chroot --userspec=1000:1000 "$root" /usr/bin/env -i HOME=/home/node "${ENV_ARGS[@]}" "$@"
}
shipped=$(mktemp -d)
cp -a "$root/opt/cache/." "$shipped/"  # the caches as the image ships them, before anything runs
run sh -c 'ls /usr/local/cuda 2>&1 | head -1; command -v nvcc || echo "no nvcc"' > "$out/visible.txt"
run python -m pytest_ppsmoke.stage.cudacheck > "$out/cudacheck.json" 2> "$out/cudacheck.err"
run python -m pytest_ppsmoke.stage.prebuild --check "sm_60 sm_61 sm_70 sm_75 sm_80 sm_86 sm_89 sm_90" > "$out/programs.json" 2>&1 || true
if [[ $MODEL == like:* ]]; then
  run pp-synth-gguf /models/model.gguf --like "${MODEL#like:}" 2> "$out/synth.err"
fi
site=$(echo "$root"/opt/venv/lib/python3*/site-packages)
install_pkg() {  # DIR: its pytest_ppsmoke/ (and worker/, where it has one) in place of the image's
  for d in pytest_ppsmoke worker; do
    if [[ -d $1/$d ]]; then
      rm -rf "${site:?}/$d" && cp -a "$1/$d" "$site/$d"
      # compiled as pip compiles what it installs (the image's own package is): the image's user
      # cannot write site-packages, so without it every process would compile each module again
      chroot "$root" /opt/venv/bin/python -m compileall -q -j 0 "${site#"$root"}/$d" > /dev/null
    fi
  done
}
passes() {  # PREFIX CACHE: cold then warm, from CACHE's files as /opt/cache and an empty HOME
  find "$root/opt/cache" -mindepth 1 -delete
  cp -a "$2/." "$root/opt/cache/"
  chown 1000:1000 "$root/opt/cache" && chmod 0755 "$root/opt/cache"  # as the image makes it (cp -a copies CACHE's own)
  rm -rf "$root/home/node" && mkdir -p "$root/home/node" && chown 1000:1000 "$root/home/node"
  for pass in cold warm; do
    name=$1$pass
    start=$(date +%s.%N)
    set +e
    run sh -c 'cd /home/node && pp-smoke-run "$@"' pp-smoke-run --local --gpus 0 --model /models/model.gguf \
      --report "/tmp/report-$name.json" "${ARGS[@]}" > "$out/run-$name.out" 2> "$out/run-$name.err"
    status=$?
    set -e
    end=$(date +%s.%N)
    cp "$root/tmp/report-$name.json" "$out/report-$name.json" 2>/dev/null || true
    echo "{\"pass\": \"$name\", \"status\": $status, \"start\": $start, \"end\": $end}" >> "$out/passes.jsonl"
  done
}
ARGS=("$@")
[[ -d $root/opt/overlay/pytest_ppsmoke ]] && install_pkg "$root/opt/overlay"
passes "" "$shipped"
if [[ -d $root/opt/baseline/pytest_ppsmoke ]]; then  # the other commit's code, and its image's empty cache
  install_pkg "$root/opt/baseline"
  empty=$(mktemp -d)
  passes baseline- "$empty"
  rm -rf "$empty"
fi
rm -rf "$shipped"
INNER
)
LIBS_DECL=$(declare -p libs | sed 's/declare -a libs=/LIBS=/')
ENV_DECL=$(declare -p env_args | sed 's/declare -a env_args=/ENV_ARGS=/')
MODEL=$model unshare --mount --fork bash -c "$LIBS_DECL; $ENV_DECL; $inner" inner "$root" "$out" "$@"
t2=$(date +%s.%N)
python3 - "$out" "$t0" "$t1" "$t2" "$rootfs_tar" <<'PY'
import json, os, sys
out, t0, t1, t2, tar = sys.argv[1], *map(float, sys.argv[2:5]), sys.argv[5]
unpack, inside = t1 - t0, t2 - t1
passes = [json.loads(line) for line in open(os.path.join(out, "passes.jsonl"))]
for p in passes:
    p["seconds"] = round(p.pop("end") - p.pop("start"), 2)
reports = {}
for p in passes:
    path = os.path.join(out, f"report-{p['pass']}.json")
    if os.path.exists(path):
        r = json.load(open(path))
        reports[p["pass"]] = {k: r.get(k) for k in ("ok", "error", "timings", "split", "reference", "token_ids", "kv")}
result = {
    "rootfs_compressed_bytes": os.path.getsize(tar),
    "unpack_s": round(unpack, 2),
    "inside_s": round(inside, 2),
    "visible": open(os.path.join(out, "visible.txt")).read().strip(),
    "cudacheck": open(os.path.join(out, "cudacheck.json")).read().strip(),
    "cudacheck_err": open(os.path.join(out, "cudacheck.err")).read().strip()[-500:],
    "programs": open(os.path.join(out, "programs.json")).read().strip()[-2000:],
    "passes": passes,
    "reports": reports,
}
json.dump(result, open(os.path.join(out, "image_gpu.json"), "w"), indent=1)
print(json.dumps({k: v for k, v in result.items() if k != "reports"}, indent=1))
for name, r in reports.items():
    ref = r.get("reference") or {}
    print(name, "ok" if r.get("ok") else f"FAILED {r.get('error')}", r.get("timings"), "reference:", ref.get("state"), ref.get("match"))
PY
rm -rf "$root"
