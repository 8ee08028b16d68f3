#!/usr/bin/env bash
# Ferry's main job, end to end, on this one machine (Debian or Ubuntu, as root):
#   1. installs what it needs and builds ferry (release);
#   2. creates three network namespaces on a bridge: an upstream registry and two nodes, each
#      node with its own containerd and its own ferry (node 2 bootstraps from node 1);
#   3. pushes a generated 3-layer image to the upstream registry;
#   4. node 1 pulls it: nobody has it yet, ferry answers 404 and containerd goes upstream;
#   5. node 2 pulls it: containerd asks the registry what the tag points at (the registry's
#      answer, always fresh), then ferry finds node 1 in the DHT and streams every manifest and
#      blob from node 1's containerd store; the upstream registry's log shows that node 2 sent
#      it nothing but the tag lookup;
#   6. runs `ferry cleanup` and removes every process, namespace and link it created.
# Set FERRY_DEMO_KEEP=1 to keep the temp dir (logs, configs) for a look afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

if [ "$(id -u)" -ne 0 ]; then
    echo "demo.sh creates network namespaces: run it as root (sudo ./scripts/demo.sh)" >&2
    exit 1
fi
ensure_packages
ensure_rust
echo "==> building ferry (release)"
cargo build --release --locked --quiet
# Where cargo put it: CARGO_TARGET_DIR when set (relative to here, as cargo reads it).
target_dir=${CARGO_TARGET_DIR:-target}
case $target_dir in /*) ;; *) target_dir="$PWD/$target_dir" ;; esac
FERRY="$target_dir/release/ferry"

WORK=$(mktemp -d /tmp/ferry-demo.XXXXXX)
TAG=$$
BR="fdb$TAG"
NET="10.$((150 + TAG % 50))"
PIDS=()
NSS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    for ns in "${NSS[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
    ip link del "$BR" 2>/dev/null || true
    if [ "${FERRY_DEMO_KEEP:-0}" = 1 ]; then echo "kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

add_host() { # <name> <host-number>: a namespace on the bridge at $NET.0.<n>
    local ns="fd$1$TAG" veth="vd$1$TAG"
    ip netns add "$ns"; NSS+=("$ns")
    ip link add "$veth" type veth peer name eth0 netns "$ns"
    ip link set "$veth" master "$BR"; ip link set "$veth" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "$NET.0.$2/24" dev eth0
    ip -n "$ns" link set eth0 up
}

start_node() { # <name> <host-number> [bootstrap-ip]: containerd + ferry in the node's namespace
    local name=$1 ip="$NET.0.$2" ns="fd$1$TAG" d="$WORK/$1"
    mkdir -p "$d/certs.d/$UPSTREAM"
    cat > "$d/containerd.toml" <<TOML
version = 2
root = "$d/root"
state = "$d/state"
[grpc]
  address = "$d/containerd.sock"
[ttrpc]
  address = "$d/containerd-ttrpc.sock"
[plugins."io.containerd.internal.v1.opt"]
  path = "$d/opt"
[plugins."io.containerd.grpc.v1.cri".containerd]
  snapshotter = "native"
[plugins."io.containerd.grpc.v1.cri".registry]
  config_path = "$d/certs.d"
TOML
    # The operator's own entry for the plain-HTTP upstream; ferry merges its mirror first.
    printf 'server = "http://%s"\n\n[host."http://%s"]\n  capabilities = ["pull", "resolve"]\n' \
        "$UPSTREAM" "$UPSTREAM" > "$d/certs.d/$UPSTREAM/hosts.toml"
    ip netns exec "$ns" containerd --config "$d/containerd.toml" >"$d/containerd.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 100); do ctr --address "$d/containerd.sock" version >/dev/null 2>&1 && break; sleep 0.1; done
    local boot=()
    [ -n "${3:-}" ] && boot=(--bootstrap-peers "$3:5482")
    ip netns exec "$ns" "$FERRY" run \
        --containerd-socket "$d/containerd.sock" \
        --containerd-content-dir "$d/root/io.containerd.content.v1.content" \
        --containerd-config "$d/containerd.toml" \
        --hosts-dir "$d/certs.d" \
        --data-dir "$d/ferry-data" \
        --advertise-addr "$ip" \
        --metrics-addr "$ip:5483" \
        --log-level debug "${boot[@]}" >"$d/ferry.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 200); do curl -sf "http://$ip:5483/readyz" >/dev/null && return 0; sleep 0.05; done
    echo "ferry on $name did not get ready; see $d/ferry.log" >&2; exit 1
}

pull() { # <name> : ctr pull inside the node's namespace, prints the wall time
    local d="$WORK/$1" start end
    start=$(date +%s.%N)
    ip netns exec "fd$1$TAG" ctr --address "$d/containerd.sock" -n k8s.io images pull \
        --hosts-dir "$d/certs.d" "$IMAGE" >"$d/pull.log" 2>&1
    end=$(date +%s.%N)
    python3 -c "print(f'{($end - $start):.2f} s')"
}

metric() { curl -s "http://$1:5483/metrics" | awk -v m="$2" 'index($0, m" ") == 1 {print $2}'; }
# Requests from one node in the registry's log: content (blobs, manifests by digest), and tag
# lookups (the registry's to answer; ferry's own `GET /v2/` reachability probes are neither).
upstream_lines() { grep 'response completed' "$WORK/registry/registry.log" | grep "remoteaddr=\"$1:" || true; }
upstream_from() { upstream_lines "$1" | grep -cE 'uri="/v2/[^"]*/(blobs/|manifests/sha256:)' || true; }
upstream_tags_from() { upstream_lines "$1" | grep -v 'manifests/sha256:' | grep -c '/manifests/' || true; }

echo "==> network: bridge $BR, upstream $NET.0.1, node1 $NET.0.11, node2 $NET.0.12"
ip link add "$BR" type bridge
ip addr add "$NET.0.254/24" dev "$BR"
ip link set "$BR" up
add_host up 1; add_host n1 11; add_host n2 12

UPSTREAM="$NET.0.1:5000"
mkdir -p "$WORK/registry"
printf 'version: 0.1\nlog:\n  level: info\nstorage:\n  filesystem:\n    rootdirectory: %s\nhttp:\n  addr: %s\n' \
    "$WORK/registry/data" "$UPSTREAM" > "$WORK/registry/config.yml"
ip netns exec "fdup$TAG" docker-registry serve "$WORK/registry/config.yml" >"$WORK/registry/registry.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do curl -sf "http://$UPSTREAM/v2/" >/dev/null && break; sleep 0.1; done

IMAGE="$UPSTREAM/demo/app:v1"
echo "==> pushing a generated image (3 layers of 16 MiB of random bytes) to $IMAGE"
python3 tests/support/make_image.py "$WORK/image" v1 3 $((16 * 1024 * 1024)) >/dev/null
skopeo copy --quiet --dest-tls-verify=false "oci:$WORK/image:v1" "docker://$IMAGE"
WANT=$(python3 -c "import json;print(json.load(open('$WORK/image/index.json'))['manifests'][0]['digest'])")

echo "==> starting containerd and ferry on node 1 and node 2"
start_node n1 11
start_node n2 12 "$NET.0.11"
for _ in $(seq 100); do [ "$(metric "$NET.0.11" ferry_peers_connected)" = 1 ] && break; sleep 0.1; done
echo "--- node 2's $WORK/n2/certs.d/$UPSTREAM/hosts.toml, merged by ferry:"
cat "$WORK/n2/certs.d/$UPSTREAM/hosts.toml"
echo "---"

echo "==> node 1 pulls (nobody has the image: ferry answers 404, containerd goes upstream)"
echo "    (times are informative only: the upstream here is not bandwidth-limited; see the benchmarks)"
echo "    node 1 pull: $(pull n1)"
for _ in $(seq 100); do [ "$(metric "$NET.0.11" ferry_keys_advertised)" -ge 6 ] 2>/dev/null && break; sleep 0.1; done
echo "    node 1 now advertises $(metric "$NET.0.11" ferry_keys_advertised) keys (digests and the tag)"

echo "==> node 2 pulls (the tag from the registry; everything by digest from node 1's containerd store)"
echo "    node 2 pull: $(pull n2)"
GOT=$(ctr --address "$WORK/n2/containerd.sock" -n k8s.io images ls | awk -v img="$IMAGE" '$1==img {print $3}')
FROM_PEER=$(metric "$NET.0.12" 'ferry_served_total{listener="mirror",kind="blob",source="peer"}')
BYTES_PEER=$(metric "$NET.0.12" 'ferry_served_bytes_total{listener="mirror",kind="blob",source="peer"}')
UP1=$(upstream_from "$NET.0.11")
UP2=$(upstream_from "$NET.0.12")
TAGS2=$(upstream_tags_from "$NET.0.12")

echo "==> result"
echo "    manifests and blobs the upstream sent node 1: $UP1, node 2: $UP2 (node 2's tag lookups: $TAGS2)"
echo "    blobs node 2's ferry got from node 1: ${FROM_PEER:-0} (${BYTES_PEER:-0} bytes)"
echo "    image on node 2: $GOT (pushed: $WANT)"
echo "==> what an operator sees on node 2: ferry status (run on the node itself)"
ip netns exec "fdn2$TAG" "$FERRY" status --metrics-addr "$NET.0.12:5483" | sed 's/^/    /'
"$FERRY" cleanup --hosts-dir "$WORK/n2/certs.d" --containerd-socket "$WORK/n2/containerd.sock"
if [ "$UP2" -eq 0 ] && [ "$GOT" = "$WANT" ] && [ "${FROM_PEER:-0}" -ge 4 ]; then
    echo "==> OK: node 2 asked the registry only what the tag points at; node 1 served every byte, peer to peer"
else
    echo "==> FAILED: see $WORK (rerun with FERRY_DEMO_KEEP=1)" >&2
    exit 1
fi
