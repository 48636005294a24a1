#!/bin/bash
# Inside L1: a heartbeat for the host, and the nested-stack stall detector. A stall is
# L1 sitting idle for $VMLANE_STALL_SECS while a Machine.create is in flight (the hooks
# leave /run/vmlane/create-* markers); idle for that long with no create in flight is
# a hang of smolbench or a test, which is a real failure. Either way pytest is stopped.
S=/mnt/share
LIMIT=${VMLANE_STALL_SECS:-420}
EVERY=15
idle_since=$(date +%s)
prev=($(awk '/^cpu /{print $2+$3+$4+$7+$8, $5+$6}' /proc/stat))
while sleep $EVERY; do
  now=$(date +%s)
  echo "$now $(cut -d' ' -f1 /proc/uptime) $(cut -d' ' -f1-3 /proc/loadavg)" > "$S/heartbeat"
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
