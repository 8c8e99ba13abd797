#!/usr/bin/env bash
# The README's two commands on a fresh Debian 12 machine, as a newcomer pastes them: a minimal
# bookworm root made with mmdebstrap (its essential packages and the system's python3, nothing
# else), a clone of this repository at REF in /root/pytest-ppsmoke, and one of the commands of the
# README's first block at REF run there as root, as written, with a clean environment (no pip
# configuration or cache of this machine's) and fresh caches (a cold run). bash traces each simple
# command with its start time, so the figures come from the command as written:
#   install_s  from the start to the command's last step (pp-smoke-run, or pytest)
#   apt_s      from the start to the first step after apt-get (the venv, or pip)
#   total_s    from the start to the command's exit: for the main job, the time to the first verdict
#   failed_at  the step the command stopped at, when its exit status is not 0
# and its output's tail. The chroot runs in a mount namespace of its own (/proc, /sys and this
# machine's /dev inside it), so nothing is left mounted; its directory is removed at the end.
# Needs root, mmdebstrap, the Debian mirror and the package index.
#   bench/fresh_debian.sh [--ref REF] [--readme FILE] [--base TAR] [--timeout S] [--out FILE] main|tests|uv-main|uv-tests
# main, tests: the first block's two commands; uv-main, uv-tests: the same with uv (the README's
# block beside them). --readme: the commands from FILE rather than REF's README.md. --base: a root made before (mmdebstrap --variant=minbase
# --include=python3 bookworm TAR), else one is made here (about 30 s, not counted).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
ref=HEAD base="" out="" limit=1800 readme_file=""
while [[ $# -gt 1 ]]; do
  case $1 in
    --ref) ref=$2; shift 2 ;;
    --base) base=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --readme) readme_file=$2; shift 2 ;;
    --timeout) limit=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
which=${1:?main, tests, uv-main or uv-tests}
commit=$(git rev-parse "$ref")

# the command, as the README at REF writes it: the first block's lines that are not comments
# (main, then tests); the uv block's for uv-*
if [[ -n $readme_file ]]; then readme=$(cat "$readme_file"); else readme=$(git show "$commit:README.md"); fi
block() { awk -v n="$1" '/^```/ {inside = !inside; if (inside) k++; next} inside && k == n && !/^#/ && NF' <<<"$readme"; }
case $which in
  main) cmd=$(block 1 | sed -n 1p) ;;
  tests) cmd=$(block 1 | sed -n 2p) ;;
  uv-main | uv-tests)
    uvblock=$(awk '/^```/ {inside = !inside; if (inside) {k++; b = ""}; if (!inside && b ~ /uv pip install/) {printf "%s", b; exit}; next} inside && !/^#/ && NF {b = b $0 "\n"}' <<<"$readme")
    [[ $which == uv-main ]] && cmd=$(sed -n 1p <<<"$uvblock") || cmd=$(sed -n 2p <<<"$uvblock") ;;
  *) echo "main, tests, uv-main or uv-tests, got $which" >&2; exit 2 ;;
esac
[[ -n $cmd ]] || { echo "README.md at $commit has no $which command" >&2; exit 1; }

work=$(mktemp -d /tmp/pp-fresh-debian.XXXXXX)
trap 'rm -rf --one-file-system "$work"' EXIT
root=$work/root
mkdir "$root"
if [[ -z $base ]]; then
  base=$work/base.tar
  mmdebstrap --quiet --variant=minbase --include=python3 bookworm "$base" http://deb.debian.org/debian
fi
tar -C "$root" --numeric-owner -xf "$base"
cp /etc/resolv.conf "$root/etc/resolv.conf"
# this machine's certificate authorities, where they differ from pip's own (a proxy that signs the
# package index's TLS with an authority of its own): given to pip and uv through the environment
mkdir -p "$root/etc/ssl"
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/this-machines-cas.crt"
git clone -q --no-hardlinks "$repo" "$root/root/pytest-ppsmoke"
git -C "$root/root/pytest-ppsmoke" checkout -q "$commit"
# the command as a script of its own, pasted as written after a cd into the clone; bash traces each
# step with its start (seconds since the epoch) into /tmp/trace, the command's own output goes to
# the log
{
  echo 'cd /root/pytest-ppsmoke || exit 98'
  echo 'exec 9>/tmp/trace; BASH_XTRACEFD=9; PS4='"'"'+$EPOCHREALTIME '"'"'; set -x'
  printf '%s\n' "$cmd"
} >"$root/tmp/fresh-run.sh"

# inside: a private mount namespace, so nothing stays mounted however the run ends
set +e
timeout --kill-after=30 "$limit" unshare --mount --propagation private bash -c '
  mount -t proc proc "$1/proc" && mount -t sysfs sys "$1/sys" && mount --rbind /dev "$1/dev" || exit 97
  exec chroot "$1" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 TERM=dumb DEBIAN_FRONTEND=noninteractive \
    PIP_CERT=/etc/ssl/this-machines-cas.crt SSL_CERT_FILE=/etc/ssl/this-machines-cas.crt bash /tmp/fresh-run.sh
' _ "$root" >"$work/log" 2>&1 </dev/null
status=$?
set -e
end=$(date +%s.%N)

python3 - "$root/tmp/trace" "$work/log" "$end" "$status" "$which" "$commit" "$cmd" "${out:-/dev/stdout}" \
  "${readme_file:-README.md at $commit}" <<'EOF'
import json, platform, re, sys
trace, log, end, status, which, commit, cmd, out, source = sys.argv[1:]
steps = []
for line in open(trace, errors="replace"):
    m = re.match(r"\++(\d+\.\d+) (.*)", line.rstrip("\n"))
    if m:
        steps.append((float(m.group(1)), m.group(2)))
start = steps[0][0] if steps else float(end)
last = "pp-smoke-run" if "pp-smoke-run" in cmd else "pytest"
run = next((t for t, s in steps if last in s.split()[:4]), None)
after_apt = next((t for t, s in steps if not s.startswith("apt-get")), None)
tail = open(log, errors="replace").read().splitlines()[-25:]
result = {
    "which": which, "commit": commit, "command": cmd, "command_from": source, "exit_status": int(status),
    "apt_s": round(after_apt - start, 1) if after_apt else None,
    "install_s": round(run - start, 1) if run else None,
    "total_s": round(float(end) - start, 1),
    "failed_at": steps[-1][1] if steps and int(status) != 0 else None,
    "machine": f"{platform.node()}: {platform.machine()}, {__import__('os').cpu_count()} cores",
    "steps": [{"at_s": round(t - start, 1), "step": s[:200]} for t, s in steps],
    "output_tail": tail,
}
with open(out, "w") as f:
    json.dump(result, f, indent=1)
    f.write("\n")
print(f"{which} at {commit[:7]}: exit {status}; apt {result['apt_s']} s, install {result['install_s']} s, "
      f"total {result['total_s']} s" + (f"; stopped at: {result['failed_at'][:120]}" if result["failed_at"] else ""), file=sys.stderr)
EOF
exit "$status"
