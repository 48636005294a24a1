#!/bin/bash
# Inside L1: a heartbeat for the host, and the nested-stack stall detector. A stall is
# L1 sitting idle for $VMLANE_STALL_SECS while a Machine.create is in flight (the hooks
# leave /run/vmlane/create-* markers); idle for that long with no create in flight is
# a hang of smolbench or a test, which is a real failure. Either way pytest is stopped.
S=/mnt/share
# Under VMLANE_DILATE=k, L1's clock runs k times slower than the host's: LIMIT and EVERY are
# meant in host seconds, so both shrink by k in L1's.
k=${VMLANE_DILATION:-1}
LIMIT=$(awk -v l="${VMLANE_STALL_SECS:-420}" -v k="$k" 'BEGIN { printf "%d", l / k }')
EVERY=$(awk -v k="$k" 'BEGIN { printf "%.2f", 15 / k }')
idle_since=$(date +%s)
# A beat on the console too, apart from the 9p one: tells a stuck 9p from a stuck L1.
( while sleep "$EVERY"; do echo "VMLANE beat $(cut -d' ' -f1 /proc/uptime) s" > /dev/ttyS0; done ) &
prev=($(awk '/^cpu /{print $2+$3+$4+$7+$8, $5+$6}' /proc/stat))
while sleep $EVERY; do
  now=$(date +%s)
  beat="$now $(cut -d' ' -f1 /proc/uptime) $(cut -d' ' -f1-3 /proc/loadavg) $(awk '/^MemAvailable/ { print int($2 / 1024) "MiB" }' /proc/meminfo)"
  echo "$beat" > "$S/heartbeat"
  cur=($(awk '/^cpu /{print $2+$3+$4+$7+$8, $5+$6}' /proc/stat))
  busy=$(( cur[0] - prev[0] )); idle=$(( cur[1] - prev[1] )); prev=("${cur[@]}")
  # busy below 3% of the interval counts as idle
  if [ $(( busy * 100 )) -gt $(( (busy + idle) * 3 )) ]; then idle_since=$now; continue; fi
  [ $(( now - idle_since )) -lt "$LIMIT" ] && continue
  pgrep -f "pytest tests/test_smol_real_vm.py" > /dev/null || exit 0
  if ls /run/vmlane/create-* > /dev/null 2>&1; then
    echo "stall: Machine.create idle for $(( now - idle_since )) s (nested-stack stall)" > /run/vmlane/verdict
  else
    echo "hang: L1 idle for $(( now - idle_since )) s with no machine being created (a real failure)" > /run/vmlane/verdict
  fi
  echo "watchdog: $(cat /run/vmlane/verdict); stopping pytest"
  ps -eo pid,etime,time,stat,args --sort=-time | head -15
  pkill -INT -f "pytest tests/test_smol_real_vm.py"; sleep 30
  pkill -KILL -f "pytest tests/test_smol_real_vm.py"
  exit 0
done
