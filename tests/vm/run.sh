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
# boot); 75 stalls left tests not run after the retries the budget allowed (infrastructure).
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
SILENT=${VMLANE_SILENT_SECS:-300}       # no heartbeat from L1 for this long: L1 hung
WAKE=${VMLANE_WAKE_SECS:-60}            # no heartbeat this long: poke L1 (see below)
PROGRESS=${VMLANE_PROGRESS_SECS:-900}   # no test finished for this long: a busy stall
BOOTS=${VMLANE_BOOTS:-3}                # boots of L1 at most (a stall's retries included)
RETRY_MIN=${VMLANE_RETRY_MIN:-600}      # seconds of budget a retry needs
CPU=EPYC-Rome,+svm,+npt,+nrip-save      # -smp 1: -smp 2 panics L1 (QEMU 7.2 nested SVM)
# Every boot runs plain TCG (L1 on the host's TSC); a retry after a stall is time-dilated
# (below). Measured (tests/vm/README.md): plain TCG's creates lose smol's fixed waits inside
# L1 (30 s without boot progress, 180 s for the agent) on a loaded host; icount
# (VMLANE_ICOUNT[_RETRY], e.g. shift=0,sleep=on) won those races but its forked microVMs spun;
# dilation wins them without icount.
ICOUNT_FIRST=${VMLANE_ICOUNT-}
ICOUNT_RETRY=${VMLANE_ICOUNT_RETRY-}
HZ=$(getconf CLK_TCK)
# L1 on a periodic tick: QEMU 7.2's TCG sometimes never delivers L1's one-shot timer interrupt
# (it stays in the APIC's IRR) and L1 then freezes in HLT or never gets the CPU back from L2
# (tests/vm/README.md, rows 18 and 21); a periodic LAPIC timer raises it again 4 ms later.
TICK=${VMLANE_TICK-nohz=off highres=off}
APPEND="console=ttyS0 panic=-1 mitigations=off loglevel=4 $TICK ${VMLANE_APPEND:-}"
# Time dilation (a boot without icount): L1's kernel is told its TSC runs k times faster than
# it does and keeps the TSC as its clock, so L1's clock, and L2's (kvm-clock derives from L1's
# TSC rate), run k times slower than the host's: smol's fixed waits inside L1 then allow k
# times the host's time, which a loaded host needs. The host's TSC rate: /proc/cpuinfo (a few
# % off only changes k a little). Every boot is dilated 4x: undilated, CI's idle host lost
# smol's 180 s agent wait (2026-12-02, the boot probe's bare create), and 2x lost it at load 16.
DILATE=${VMLANE_DILATE:-4}
DILATE_RETRY=${VMLANE_DILATE_RETRY:-4}
HOST_KHZ=""
dilation_check() {
  [ "$DILATE" != 1 ] || [ "$DILATE_RETRY" != 1 ] || return 0
  HOST_KHZ=$(awk '/^cpu MHz/ { printf "%d", $4 * 1000; exit }' /proc/cpuinfo)
  [ -n "$HOST_KHZ" ] && [ "$HOST_KHZ" -gt 0 ] \
    || die "VMLANE_DILATE: no 'cpu MHz' in /proc/cpuinfo to scale (set VMLANE_DILATE=1 VMLANE_DILATE_RETRY=1)"
}
dilate_append() {
  [ "$1" = 1 ] || awk -v k="$1" -v f="$HOST_KHZ" 'BEGIN { printf "tsc_early_khz=%d clocksource=tsc tsc=reliable", f * k }'
}
export DEBIAN_FRONTEND=noninteractive
START=$SECONDS

log() { printf '[%(%H:%M:%S)T] vmlane: %s\n' -1 "$*" >&2; }
die() { log "$*"; echo "vm lane: BROKEN ($*)" | tee "$OUT/summary.txt" >&2 || true; exit 2; }
# One boot of L1 with this checkout in its 9p share; sets VERDICT and leaves attempt-N/.
attempt() {
  local n=$1 limit=$2 share=$LANE/share qpid t0=$SECONDS last now beat icount accel dil append=$APPEND
  if [ "$n" = 1 ]; then icount=$ICOUNT_FIRST; dil=$DILATE; else icount=$ICOUNT_RETRY; dil=$DILATE_RETRY; fi
  [ -z "$icount" ] || dil=1   # icount has its own clock
  append="$append $(dilate_append "$dil")"
  if [ -n "$icount" ]; then accel=${VMLANE_ACCEL:-tcg,thread=single,tb-size=1024}; else accel=${VMLANE_ACCEL:-tcg,thread=multi,tb-size=1024}; fi
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
  echo "export VMLANE_DILATION=$dil" >> "$share/env.sh"
  cp "$OUT/passed.txt" "$share/passed.txt" 2>/dev/null || true
  log "attempt $n: boot L1 (TCG${icount:+ icount $icount}, -smp 1, $MEM; at most $limit s): $append"
  nice -n "${VMLANE_NICE:-0}" qemu-system-x86_64 -accel "$accel" -machine q35 -cpu "$CPU" \
    -smp 1 -m "$MEM" -kernel "$C/kernel/x/boot/vmlinuz-$KVER" -initrd "$C/initrd.img" \
    ${icount:+-icount "$icount"} -append "$append" -monitor unix:"$LANE/monitor.sock",server=on,wait=off ${VMLANE_QEMU_EXTRA:-} \
    -drive file="$C/disk.img",format=raw,if=virtio,snapshot=on \
    -virtfs local,path="$share",mount_tag=share,security_model=none,id=share \
    -nographic -no-reboot -serial stdio -nic none < /dev/null > "$share/console.log" 2>&1 &
  qpid=$!
  VERDICT=""
  last=$SECONDS; prev=""; cpu_then=$(cpu_ticks "$qpid"); done_n=0; done_t=$SECONDS
  local woke=0 woke_for=-1 nmi_for=-1
  while kill -0 "$qpid" 2>/dev/null; do
    sleep 5
    kill -0 "$qpid" 2>/dev/null || break   # QEMU ended: judge by L1's status, not by its absence
    now=$SECONDS
    beat=$(cat "$share/heartbeat" 2>/dev/null || true)
    cpu=$(cpu_ticks "$qpid")
    if [ -n "$beat" ] && [ "$beat" != "$prev" ]; then
      prev=$beat; last=$now; cpu_then=$cpu
      echo "$(date +%s) $beat" >> "$share/results/heartbeats.txt"   # host's clock, then L1's
    fi
    n_now=$(cat "$share/results/collected.txt" "$share/results/outcomes.txt" 2>/dev/null | wc -l || true)
    if [ "$n_now" != "$done_n" ]; then done_n=$n_now; done_t=$now; fi
    # The suite's own job only: no test finished for this long though L1 is busy (seen once:
    # a forked microVM's vCPU spinning with interrupts off for 15+ minutes).
    if [ -z "${VMLANE_JOB:-}" ] && [ ! -f "$share/status" ] && [ $(( now - done_t )) -ge "$PROGRESS" ]; then
      VERDICT="stall: no test finished for $(( now - done_t )) s"; break
    fi
    if [ $(( now - t0 )) -ge "$limit" ]; then
      VERDICT="timeout: L1 ran past its $limit s limit"; break
    fi
    quiet=$(( now - last )); used=$(( (cpu - cpu_then) / HZ ))
    # No heartbeat and QEMU idle: L1 hung (its vCPU waits for an interrupt that never comes).
    # A busy QEMU is L1 at work: with icount, L1's 15 s between heartbeats can take many
    # minutes of emulation while a microVM runs; the attempt's time limit bounds it.
    # L1's timer interrupt pending in its APIC but never delivered by QEMU (measured, see
    # tests/vm/README.md): L1 then sits in HLT (QEMU idle) or the vCPU stays in L2 (QEMU busy),
    # and the real-time heartbeat stops either way. Poke it: first a key press (a new interrupt
    # makes QEMU look at the APIC again; it healed the one tried), then an NMI; each is logged
    # (wakes.txt, frozen-N.txt) and a heartbeat after it shows which one woke L1.
    if [ "$quiet" -ge "$WAKE" ] && [ "$woke_for" != "$last" ]; then
      woke_for=$last; woke=$((woke + 1))
      monitor_dump "$share/results/frozen-$woke.txt"
      monitor_cmd "sendkey shift" "info lapic" >> "$share/results/frozen-$woke.txt"
      echo "$(date -u +%FT%TZ) no heartbeat for $quiet s ($used s of QEMU CPU): key press sent" >> "$share/results/wakes.txt"
      log "attempt $n: L1 silent for $quiet s ($used s of QEMU CPU): key press sent"
    elif [ "$quiet" -ge $(( WAKE + 45 )) ] && [ "$nmi_for" != "$last" ]; then
      nmi_for=$last
      monitor_cmd nmi "info registers" "info lapic" >> "$share/results/frozen-$woke.txt"
      echo "$(date -u +%FT%TZ) still no heartbeat after $quiet s: NMI sent" >> "$share/results/wakes.txt"
      log "attempt $n: L1 still frozen: NMI sent"
    fi
    if [ "$quiet" -ge "$SILENT" ] && [ $(( used * 10 )) -lt "$quiet" ]; then
      VERDICT="stall: no heartbeat from L1 for $quiet s, QEMU idle ($used s of CPU)"; break
    fi
  done
  case $VERDICT in stall:*|timeout:*) monitor_dump "$share/qemu-state.txt" ;; esac
  if kill -0 "$qpid" 2>/dev/null; then kill "$qpid"; sleep 2; kill -9 "$qpid" 2>/dev/null || true; fi
  wait "$qpid" 2>/dev/null || true
  [ -n "$VERDICT" ] || VERDICT=$(cat "$share/status" 2>/dev/null || echo "broken: L1 ended without a status (see console.log)")
  if [ "$woke" -gt 0 ]; then   # did a poke bring L1 back? (a heartbeat after it)
    if [ "$woke_for" != "$last" ]; then VERDICT="$VERDICT (L1 froze $woke time(s) and was woken: wakes.txt)"
    else VERDICT="$VERDICT (L1 froze $woke time(s); the last time neither a key press nor an NMI woke it)"; fi
  fi
  rm -rf "$OUT/attempt-$n"; mkdir -p "$OUT/attempt-$n"
  cp -a "$share/results/." "$share/console.log" "$share/job.log" "$share/status" "$share/qemu-state.txt" "$OUT/attempt-$n/" 2>/dev/null || true
  rm -rf "$share"
  log "attempt $n: $VERDICT after $((SECONDS - t0)) s"
}

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat" 2>/dev/null || echo 0; }

# What L1's vCPU is doing (halted? in which mode?), from QEMU's monitor: the stall's evidence.
monitor_dump() {
  monitor_cmd "" "info cpus" "info registers" "info lapic" "info pic" "info irq" "info registers" "info cpus" > "$1"
}
monitor_cmd() {
  python3 - "$LANE/monitor.sock" "$@" 2>&1 <<'PY' || true
import socket, sys, time
s = socket.socket(socket.AF_UNIX); s.settimeout(5); s.connect(sys.argv[1])
def cmd(c):
    s.sendall(c.encode() + b"\n"); time.sleep(1); out = b""
    try:
        while True:
            b = s.recv(65536)
            if not b: break
            out += b
            if len(b) < 65536: break
    except socket.timeout:
        pass
    sys.stdout.write(out.decode(errors="replace"))
for c in sys.argv[2:]:
    cmd(c)
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
  dilation_check

  n=1
  while :; do
    left=$(( BUDGET - (SECONDS - START) ))
    [ "$left" -gt 300 ] || die "no time left in VMLANE_BUDGET=$BUDGET s for a boot"
    python3 "$HERE/summary.py" passed "$OUT" > "$OUT/passed.txt"
    attempt "$n" "$(( left < ATTEMPT ? left : ATTEMPT ))"
    echo "$VERDICT" > "$OUT/attempt-$n/verdict"
    case "$VERDICT" in
      stall:*)
        left=$(( BUDGET - (SECONDS - START) ))
        if [ "$n" -ge "$BOOTS" ]; then
          echo "$BOOTS boots is the limit (VMLANE_BOOTS)" > "$OUT/no-retry.txt"
        elif [ "$left" -lt "$RETRY_MIN" ]; then
          echo "$left s of VMLANE_BUDGET=$BUDGET s left, a retry needs $RETRY_MIN s" > "$OUT/no-retry.txt"
        else
          echo "$(date -u +%FT%TZ) attempt $n: $VERDICT; retrying what did not pass" >> "$OUT/retries.log"
          log "RETRY: attempt $n hit a nested-stack stall ($VERDICT); booting again for the tests that did not pass"
          n=$((n + 1)); continue
        fi ;;
    esac
    break
  done
  cp -a "$OUT/attempt-$n/." "$OUT/"
  TOTAL=$((SECONDS - START))
  rc=0
  python3 "$HERE/summary.py" line "$OUT" "$TOTAL" "$BUILD_S" > "$OUT/summary.txt" || rc=$?
  cat "$OUT/summary.txt"
  exit "$rc"
}

# In a function, so that editing this file while the lane runs can't change what runs.
main "$@"
