#!/usr/bin/env bash
# The real-microVM lane: boots smol microVMs under emulation on a host whose own KVM can't.
#
#   bash tests/vm/run.sh          # from the project root: build (cached), boot, test, report
#
# L0 (this host) runs QEMU in pure software emulation (TCG) with an emulated AMD CPU that
# has SVM and nested paging; its Debian guest (L1) loads kvm_amd and runs the real-microVM
# suite (tests/test_smol_real_vm.py) against this checkout, where smol boots real microVMs
# (L2). Results land in tests/vm/results/ (junit.xml, pytest.log, console and job logs).
# Exit: 0 passed; 1 a test failed (or the suite hung); 2 the lane itself broke (build,
# boot); 75 a nested-stack stall happened again after its one retry (infrastructure).
# See tests/vm/README.md for the knobs (VMLANE_*), the costs and the cache.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
LANE=${VMLANE_DIR:-$HOME/.cache/smolbench-vmlane}
C=$LANE/cache
OUT=${VMLANE_RESULTS:-$HERE/results}
MEM=${VMLANE_MEM:-6G}
BUDGET=${VMLANE_BUDGET:-3600}          # seconds for the whole lane, build included
ATTEMPT=${VMLANE_ATTEMPT_TIMEOUT:-2400} # seconds one boot of L1 may take
SILENT=${VMLANE_SILENT_SECS:-600}       # no heartbeat from L1 for this long: L1 hung
CPU=EPYC-Rome,+svm,+npt,+nrip-save      # -smp 1: -smp 2 panics L1 (QEMU 7.2 nested SVM)
export DEBIAN_FRONTEND=noninteractive
START=$SECONDS

log() { printf '[%(%H:%M:%S)T] vmlane: %s\n' -1 "$*" >&2; }
die() { log "$*"; echo "vm lane: BROKEN ($*)" | tee "$OUT/summary.txt" >&2 || true; exit 2; }
# One boot of L1 with this checkout in its 9p share; sets VERDICT and leaves attempt-N/.
attempt() {
  local n=$1 limit=$2 share=$LANE/share qpid t0=$SECONDS last now beat
  rm -rf "$share"; mkdir -p "$share/results" "$share/vm"
  mkdir -p "$share/src"
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard \
     | while IFS= read -r -d '' f; do
         case $f in tests/vm/results/*) ;; *) [ -f "$f" ] && printf '%s\0' "$f" ;; esac
       done | xargs -0 cp --parents -a -t "$share/src") || die "cannot copy the checkout (is it a git clone?)"
  cp -a "$HERE/guest" "$share/vm/"
  cp "${VMLANE_JOB:-$HERE/guest/job.sh}" "$share/job.sh"   # VMLANE_JOB: an experiment of your own in L1
  env | grep -E '^(VMLANE_[A-Z_]+|SMOLBENCH_(TEST|SMOL)_[A-Z_]+)=' | grep -v '^VMLANE_DIR=' \
    | while IFS='=' read -r k v; do printf 'export %s=%q\n' "$k" "$v"; done > "$share/env.sh" || true
  echo "export VMLANE_ATTEMPT=$n" >> "$share/env.sh"
  log "attempt $n: boot L1 (TCG, -smp 1, $MEM; at most $limit s)"
  nice -n 10 qemu-system-x86_64 -accel tcg,thread=multi,tb-size=1024 -machine q35 -cpu "$CPU" \
    -smp 1 -m "$MEM" -kernel "$C/kernel/x/boot/vmlinuz-$KVER" -initrd "$C/initrd.img" \
    -append "console=ttyS0 panic=-1 mitigations=off loglevel=4" \
    -drive file="$C/disk.img",format=raw,if=virtio,snapshot=on \
    -virtfs local,path="$share",mount_tag=share,security_model=none,id=share \
    -nographic -no-reboot -serial mon:stdio -nic none < /dev/null > "$share/console.log" 2>&1 &
  qpid=$!
  VERDICT=""
  last=$SECONDS
  while kill -0 "$qpid" 2>/dev/null; do
    sleep 5
    now=$SECONDS
    beat=$(stat -c %Y "$share/heartbeat" 2>/dev/null || echo 0)
    [ "$beat" -gt 0 ] && last=$(( now - ($(date +%s) - beat) ))
    if [ $(( now - t0 )) -ge "$limit" ]; then
      VERDICT="timeout: L1 ran past its $limit s limit"; break
    fi
    if [ $(( now - last )) -ge "$SILENT" ] && [ $(( now - t0 )) -ge "$SILENT" ]; then
      VERDICT="stall: no heartbeat from L1 for $SILENT s (L1 hung)"; break
    fi
  done
  if kill -0 "$qpid" 2>/dev/null; then kill "$qpid"; sleep 2; kill -9 "$qpid" 2>/dev/null || true; fi
  wait "$qpid" 2>/dev/null || true
  [ -n "$VERDICT" ] || VERDICT=$(cat "$share/status" 2>/dev/null || echo "broken: L1 ended without a status (see console.log)")
  rm -rf "$OUT/attempt-$n"; mkdir -p "$OUT/attempt-$n"
  cp -a "$share/results/." "$share/console.log" "$share/job.log" "$share/status" "$OUT/attempt-$n/" 2>/dev/null || true
  rm -rf "$share"
  log "attempt $n: $VERDICT after $((SECONDS - t0)) s"
}

# "passed failed skipped" of a junit.xml ("0 0 0" when there is none).
count_junit() {
  [ -f "$1" ] || { echo "0 0 0"; return; }
  python3 - "$1" <<'PY'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
t = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
print(t["tests"] - t["failures"] - t["errors"] - t["skipped"], t["failures"] + t["errors"], t["skipped"])
PY
}

main() {
  . "$HERE/build.sh"
  t0=$SECONDS
  if [ "${1:-}" = --build-only ]; then mkdir -p "$C"; build; exit 0; fi
  mkdir -p "$OUT"
  rm -rf "${OUT:?}"/*
  if [ "$(id -u)" = 0 ]; then
    mkdir -p "$C"
    build 2> >(tee -a "$OUT/build.log" >&2) || die "the build failed: see tests/vm/results/build.log"
  else
    # debootstrap and chroot need root: only the build runs under sudo; QEMU runs as this user.
    command -v sudo > /dev/null || die "building the lane's guest needs root (debootstrap, chroot): run as root or install sudo"
    sudo env VMLANE_DIR="$LANE" HOME="$HOME" bash "$0" --build-only 2> >(tee -a "$OUT/build.log" >&2) \
      || die "the build failed: see tests/vm/results/build.log"
    sudo chown "$(id -u):$(id -g)" "$LANE"   # for the share; the cache stays root-owned (QEMU only reads it)
  fi
  BUILD_S=$((SECONDS - t0))

  n=1
  while :; do
    left=$(( BUDGET - (SECONDS - START) ))
    [ "$left" -gt 300 ] || die "no time left in VMLANE_BUDGET=$BUDGET s for a boot"
    a0=$SECONDS
    attempt "$n" "$(( left < ATTEMPT ? left : ATTEMPT ))"
    took=$((SECONDS - a0))
    case "$VERDICT" in
      stall:*)
        left=$(( BUDGET - (SECONDS - START) ))
        if [ "$n" -lt 2 ] && [ "$left" -gt "$took" ]; then
          echo "$(date -u +%FT%TZ) attempt $n: $VERDICT; retrying once" >> "$OUT/retries.log"
          log "RETRY: attempt $n hit a nested-stack stall ($VERDICT); booting once more"
          n=$((n + 1)); continue
        fi ;;
    esac
    break
  done
  cp -a "$OUT/attempt-$n/." "$OUT/"
  TOTAL=$((SECONDS - START))
  junit=$OUT/junit.xml
  counts=$(count_junit "$junit")
  read -r passed failed skipped <<< "$counts"
  line="vm lane: $passed passed, $failed failed, $skipped skipped in ${TOTAL} s (build ${BUILD_S} s, attempts $n: $VERDICT)"
  echo "$line" | tee "$OUT/summary.txt"
  case "$VERDICT" in
    stall:*) exit 75 ;;
    "pytest rc=0") [ "$failed" = 0 ] && [ "$skipped" = 0 ] && [ "$passed" -gt 0 ] && exit 0; exit 1 ;;
    "pytest rc="*|hang:*) exit 1 ;;
    *) exit 2 ;;
  esac
}

# In a function, so that editing this file while the lane runs can't change what runs.
main "$@"
