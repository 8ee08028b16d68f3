#!/usr/bin/env bash
# The scale simulation (#13): N real Ferry routing stacks on a delayed loopback in a network
# namespace of their own; writes benches/results/scale.json and scale.png and prints the table
# the README shows. Options go to `cargo bench --bench scale` (see benches/scale.rs), e.g.
#   ./scripts/scale.sh --nodes 100,300 --digests 10000
# Needs root (a network namespace); `--replot` does not.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

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
