#!/bin/sh
echo "bazel coverage is not supported by this offline build (third_party/remote_coverage_tools_stub)" >&2
exit 1
