#!/usr/bin/env bash
# The scale simulation (#13): N real Ferry routing stacks on a delayed loopback in a network
# namespace of their own; writes benches/results/scale.json and scale.png and prints the table
# the README shows. Options go to `cargo bench --bench scale` (see benches/scale.rs), e.g.
#   ./scripts/scale.sh --nodes 100,300 --digests 10000
# Needs root (a network namespace); `--replot` does not.
#   ./scripts/scale.sh --sim --nodes 30,100 --digests 1000 --seed 1 [--out DIR]
# runs the simulation in simulated time instead (sim/, issue #32: one process per run, a paused
# clock, an in-memory network; no root): DIR/scale-sim.json (default benches/results) and
# DIR/scale-sim.svg; the same seed gives the same figures. A run too large for the machine's
# memory stops with why (`--max-rss-mib`, default 90% of what is available); the others are
# still written, and the script exits 3.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

if [ "${1:-}" = "--sim" ]; then
    shift
    ensure_rust
    # Ferry's crate compiles containerd's API from its protos.
    command -v protoc >/dev/null 2>&1 || install_packages protobuf-compiler
    nodes=30
    out=benches/results
    args=()
    while [ $# -gt 0 ]; do
        case "$1" in
            --nodes) nodes="$2"; shift 2 ;;
            --out) out="$2"; shift 2 ;;
            *) args+=("$1"); shift ;;
        esac
    done
    mkdir -p "$out"
    # Its own workspace (it patches libp2p's timers onto tokio's clock, and its .cargo/config
    # seeds tokio and getrandom), built from inside it; its own target dir.
    (cd sim && CARGO_TARGET_DIR="$PWD/../target/sim" cargo build --locked --release)
    bin=target/sim/x86_64-unknown-linux-gnu/release/ferry-sim
    runs=$(mktemp)
    unfinished=()
    for n in ${nodes//,/ }; do
        echo "==> simulated: $n nodes ${args[*]}" >&2
        # Without address randomization: nothing seeded from an address differs between runs.
        # A run that does not fit in memory says why (exit 3); the others are still reported.
        if ! setarch "$(uname -m)" -R "$bin" --nodes "$n" "${args[@]}" | tee -a "$runs"; then
            unfinished+=("$n")
        fi
    done
    if [ -s "$runs" ]; then
        python3 scripts/scale_sim_report.py "$runs" "$out"
    fi
    rm -f "$runs"
    if [ ${#unfinished[@]} -gt 0 ]; then
        echo "==> not finished (reasons above): ${unfinished[*]} nodes" >&2
        exit 3
    fi
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
