#!/usr/bin/env bash
# Programs made ahead on the NULL device, with no GPU in use, then read by a cold worker on the
# GPU: each stage's worker of a 2-stage split of MODEL (and the reference on stage 0) starts cold
# (empty weight cache and tinygrad database) twice, once on a database the prebuild filled for this
# GPU's architecture and once on an empty one (the baseline), and says its programs generated and
# read, and its seconds.
#
#   bench/prebuild_gpu.sh OUT ARCH [MODEL.gguf]       (ARCH: sm_90 on an H100 or H200)
#
# TARGET and DEVICE (defaults CUDA:ARCH and CUDA) run the same on another device: TARGET=CPU
# DEVICE=CPU HALF=1 checks the script on a machine with no GPU.
set -euo pipefail
out=$1 arch=$2 model=${3:-/tmp/llama1b.gguf}
mkdir -p "$out"
[[ -f $model ]] || python3 -m pytest_ppsmoke.stage.synth "$model" --shape llama-3.2-1b
dbs=$(mktemp -d /tmp/prebuild.XXXXXX)
( SECONDS=0; CACHEDB=$dbs/made.db python3 -m pytest_ppsmoke.stage.prebuild --target "${TARGET:-CUDA:$arch}" --model "$model" \
    --stages 2 --max-tokens 64 >"$out/prebuild.json"; echo "prebuild ${SECONDS} s" >&2 )
cold() {  # NAME DB
  env CACHEDB="$2" "${DEVICE:-CUDA}=1" python3 - "$model" "$1" <<'PY' >"$out/$1.json"
import json, os, sys, time
from pytest_ppsmoke.nodeenv import NodeEnv, process_env
from pytest_ppsmoke.stage import prebuild as P
model, name = sys.argv[1], sys.argv[2]
ids, workers = (), []
for stage in range(2):
    node = NodeEnv(stage=stage, num_stages=2, model=model, weight_cache="off", program_cache=True)
    started = time.monotonic()
    got = P._run({**process_env(node.for_worker()), **os.environ}, stage, 2, ids, 64, "Say hello")
    ids = got.pop("ids", ids)
    workers.append({**got, "seconds": round(time.monotonic() - started, 2)})
print(json.dumps({"run": name, "workers": workers}))
PY
}
cold baseline "$dbs/empty.db"
cold prebuilt "$dbs/made.db"
cat "$out"/*.json
rm -rf "$dbs"
