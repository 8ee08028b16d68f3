#!/usr/bin/env bash
# The scale simulation (#13): N real Ferry routing stacks on a delayed loopback in a network
# namespace of their own; writes benches/results/scale.json and scale.png and prints the table
# the README shows. Options go to `cargo bench --bench scale` (see benches/scale.rs), e.g.
#   ./scripts/scale.sh --nodes 100,300 --digests 10000
# Needs root (a network namespace); `--replot` does not.
#   ./scripts/scale.sh --sim --nodes 30 --digests 1000 --seed 1
# runs the simulation in simulated time instead (sim/, issue #32: one process, a paused clock,
# an in-memory network; no root); it prints one JSON run.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

if [ "${1:-}" = "--sim" ]; then
    shift
    ensure_rust
    # Its own workspace (it patches libp2p's timers onto tokio's clock); its own target dir.
    CARGO_TARGET_DIR="$PWD/target/sim" cargo run --locked --release \
        --manifest-path sim/Cargo.toml -- "$@"
    exit
fi

case " $* " in
    *" --replot "*) ;;
    *)
        if [ "$(id -u)" -ne 0 ]; then
            echo "scale.sh creates a network namespace: run it as root" >&2
            exit 1
        fi
        ;;
esac
ensure_packages /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf:fonts-dejavu-core
ensure_rust
cargo bench --locked --bench scale -- "$@"
