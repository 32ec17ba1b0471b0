#!/usr/bin/env bash
# idle_guard.sh IDLE LOG COMMAND...: runs COMMAND, whose output goes to LOG, and stops it (SIGTERM,
# SIGKILL 10 s later) once LOG has not grown for IDLE seconds: a hung kernel (e.g. an overdrawn
# setmaxnreg) then costs IDLE seconds of device time, not the step's whole limit. For commands that
# print progress every few seconds (bench/run.py). Exit status: COMMAND's, or 125 when stopped.
idle=$1 log=$2
shift 2
"$@" &
pid=$!
size=-1
quiet=0
while kill -0 "$pid" 2>/dev/null; do
  sleep 1
  now=$(stat -c %s "$log" 2>/dev/null || echo 0)
  if [[ $now != "$size" ]]; then size=$now quiet=0; else quiet=$((quiet + 1)); fi
  if ((quiet >= idle)); then
    echo "idle_guard: no output for $idle s, stopped: $*"
    pkill -TERM -P "$pid" 2>/dev/null
    kill -TERM "$pid" 2>/dev/null
    for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    pkill -KILL -P "$pid" 2>/dev/null
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    exit 125
  fi
done
wait "$pid"
