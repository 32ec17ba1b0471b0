#!/usr/bin/env bash
# Builds and installs the package from this tree with the machine's own jax (what every script
# here does first; a later call on the same machine skips it while the sources are unchanged).
# Usage, from the repository root: bash bench/device/build.sh
# Log: $OUT/build.log.
source "$(dirname "$0")/common.sh"
build
summary
