#!/usr/bin/env bash
# Probes of the ce/sm engines' protocol with R processes on ONE GPU (tests/mp_gpu_worker.py, every
# rank on GPU 0), each launch bounded, for hangs like engine ce's EP8
# deadlock: settings that change how the ranks' streams meet (CUDA_DEVICE_MAX_CONNECTIONS=1 puts
# every stream of a context into one hardware queue) and which parts run.
# Usage, from the repository root: bash bench/device/ep_probe.sh PROBE...
#   PROBE: NAME/R/SECONDS/ENV/ARGS, ENV and ARGS comma-separated (may be empty), e.g.
#     one-queue/8/240/CUDA_DEVICE_MAX_CONNECTIONS=1/engines=ce,parts=stage1,iters=2,timeout=20
# Log: $OUT/probes.log (per probe: each process's exit status, its progress and trace lines, the
# tail of a failed one's output), and a summary line per probe.
source "$(dirname "$0")/common.sh"
build
cd /tmp  # the installed package, not the checkout's sources
LOG=$OUT/probes.log
: > "$LOG"
for spec in "$@"; do
  IFS=/ read -r name R limit envs args <<< "$spec"
  port=$((20000 + RANDOM % 20000))
  seed=$RANDOM
  t0=$SECONDS
  pids=()
  for ((i = 0; i < R; ++i)); do
    # shellcheck disable=SC2046
    env -u XLA_FLAGS XLA_PYTHON_CLIENT_PREALLOCATE=false ${envs//,/ } \
      timeout -k 5 "$limit" python3 "$REPO/tests/mp_gpu_worker.py" "$i" "$R" "$port" "$seed" 0 \
      ${args//,/ } > "/tmp/probe-$name-$i.log" 2>&1 &
    pids+=($!)
  done
  ok=0
  status=()
  for ((i = 0; i < R; ++i)); do
    wait "${pids[$i]}"
    rc=$?
    status+=("$rc")
    grep -q "^OK rank $i" "/tmp/probe-$name-$i.log" && ((ok += 1))
  done
  line="probe $name (R = $R, env '${envs}', args '${args}', seed $seed): $ok of $R OK, exit ${status[*]}, $((SECONDS - t0)) s"
  echo "== $line" | tee -a "$LOG"
  note "$line"
  for ((i = 0; i < R; ++i)); do
    f=/tmp/probe-$name-$i.log
    echo "-- process $i (exit ${status[$i]})" >> "$LOG"
    grep -E "^\[rank|OK rank" "$f" | head -60 >> "$LOG"
    if ! grep -q "^OK rank $i" "$f"; then
      echo "   tail:" >> "$LOG"
      grep -vE "^\[rank" "$f" | tail -25 >> "$LOG"
    fi
  done
done
summary
