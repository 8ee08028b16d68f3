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
#   ./scripts/bench.sh --hostile [--runs N]  # a pull and the probes under 4,350 hostile
#                                            #   connections, under 1,024 open files, against
#                                            #   the same pull calm (benches/results/hostile.json)
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
if [ "${1:-}" = "--hostile" ]; then
    # The hostile-clients scenario of tests/containerd_e2e.rs (4,350 connections against Ferry
    # under 1,024 open files), its figures collected over --runs N (default 3) runs.
    runs=3
    [ "${2:-}" = "--runs" ] && runs="${3:?--runs N}"
    ensure_packages
    out=benches/results/hostile.jsonl
    : > "$out"
    for _ in $(seq "$runs"); do
        FERRY_BENCH_OUT="$PWD/$out" cargo test --locked --release --features system-tests \
            --test containerd_e2e -- --exact hostile_clients_under_1024_open_files_never_stall_a_pull_or_a_probe
    done
    python3 - "$out" benches/results/hostile.json <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
median = lambda k: statistics.median(r[k] for r in runs)
summary = {"runs": runs, "attacked_over_calm_median": median("attacked_over_calm"),
           "probe_ms_max": max(r["probe_ms_max"] for r in runs),
           "rss_peak_mib_max": max(r["rss_peak_mib"] for r in runs)}
json.dump(summary, open(sys.argv[2], "w"), indent=1)
print(f"{len(runs)} runs: pull under attack {summary['attacked_over_calm_median']:.2f}x calm (median; target 2x), "
      f"slowest probe {summary['probe_ms_max']:.1f} ms (target 1 s), peak RSS {summary['rss_peak_mib_max']:.0f} MiB (chart limit 1 GiB)")
PY
    rm -f "$out"
    exit 0
fi
cargo bench --locked --bench cluster -- "$@"
