#!/usr/bin/env bash
# Ferry's cluster benchmark, on a fresh Debian or Ubuntu machine, as root: installs what it
# needs, then runs benches/cluster.rs (release build). Results: benches/results/cluster.json and
# benches/results/cluster.png; the table for the README is printed at the end.
#   ./scripts/bench.sh                       # 4 nodes, 200mbit upstream, 10MiB,100MiB,1GiB x 1,4 layers
#   ./scripts/bench.sh --sizes 10MiB,100MiB  # any of: --nodes N --rate R --sizes LIST --layers LIST
#                                            #   --component-size SIZE --out DIR; --replot redraws
#                                            #   the chart and reprints the tables from the JSON
#   ./scripts/bench.sh --storm --sizes 100MiB,1GiB --layers 4
#                                            # the rollout storm instead: every node pulls a new
#                                            #   image at once (benches/results/storm.json)
#   ./scripts/bench.sh --last-hop --sizes 1GiB --layers 1,4
#                                            # a peer pull against the registry next door, one
#                                            #   node at a time (benches/results/last_hop.json)
#   ./scripts/bench.sh --keep                # layers kept for peers: the lease's disk and DHT
#                                            #   cost with and without --keep-copies, over 8
#                                            #   rollouts (--versions N) of a 10MiB image
#                                            #   (benches/results/keep.json)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

if [ "$(id -u)" -ne 0 ]; then
    echo "bench.sh creates network namespaces: run it as root" >&2
    exit 1
fi
# Besides what the tests need: the chart's font, and nginx (the component figures compare
# Ferry's blob serving with nginx's sendfile).
ensure_packages /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf:fonts-dejavu-core \
    /usr/sbin/nginx:nginx
ensure_grpc_python # CRI pulls (--keep)
ensure_rust
cargo bench --locked --bench cluster -- "$@"
