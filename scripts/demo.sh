#!/usr/bin/env bash
# Ferry's main job, end to end, on this one machine (Debian or Ubuntu; root or sudo):
#   1. installs what it needs and builds ferry (release);
#   2. starts a local containerd ("the node") and a local registry ("upstream") in a temp dir;
#   3. pushes a generated 3-layer image to the registry;
#   4. starts ferry: it writes containerd's hosts.toml mirror entry and serves the node's store;
#   5. the node pulls the image (ferry has nothing yet: 404, containerd falls back upstream);
#   6. a second containerd (standing in for another node) pulls the same image through the
#      config ferry wrote: every byte comes from ferry, the upstream registry serves nothing;
#   7. `ferry cleanup` removes ferry's entries; every process started here is stopped by PID.
# Set FERRY_DEMO_KEEP=1 to keep the temp dir (logs, configs) for a look afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh

ensure_packages
ensure_rust
echo "==> building ferry (release)"
cargo build --release --locked --quiet
FERRY="$PWD/target/release/ferry"

WORK=$(mktemp -d /tmp/ferry-demo.XXXXXX)
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    if [ "${FERRY_DEMO_KEEP:-0}" = 1 ]; then echo "kept $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

start_containerd() { # <dir>
    local d=$1
    mkdir -p "$d"
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
  config_path = "$WORK/node/certs.d"
TOML
    containerd --config "$d/containerd.toml" >"$d/containerd.log" 2>&1 &
    PIDS+=($!)
    for _ in $(seq 100); do ctr --address "$d/containerd.sock" version >/dev/null 2>&1 && return 0; sleep 0.1; done
    echo "containerd in $d did not start; see $d/containerd.log" >&2; exit 1
}

upstream_requests() { grep -c 'response completed.*http.request.uri="/v2/[^"]*/\(blobs\|manifests\)/' "$WORK/registry/registry.log" || true; }

echo "==> starting containerd (the node) and a registry (upstream) in $WORK"
start_containerd "$WORK/node"
REG_PORT=$(free_port)
mkdir -p "$WORK/registry"
cat > "$WORK/registry/config.yml" <<YML
version: 0.1
log:
  level: info
storage:
  filesystem:
    rootdirectory: $WORK/registry/data
http:
  addr: 127.0.0.1:$REG_PORT
YML
docker-registry serve "$WORK/registry/config.yml" >"$WORK/registry/registry.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$REG_PORT/v2/" >/dev/null && break; sleep 0.1; done

IMAGE="127.0.0.1:$REG_PORT/demo/app:v1"
echo "==> generating an image (3 layers of 8 MiB of random bytes) and pushing it to $IMAGE"
python3 tests/support/make_image.py "$WORK/image" v1 3 $((8 * 1024 * 1024)) >/dev/null
skopeo copy --quiet --dest-tls-verify=false "oci:$WORK/image:v1" "docker://$IMAGE"

MIRROR_PORT=$(free_port)
METRICS_PORT=$(free_port)
echo "==> starting ferry (mirror 127.0.0.1:$MIRROR_PORT)"
"$FERRY" run \
    --containerd-socket "$WORK/node/containerd.sock" \
    --containerd-content-dir "$WORK/node/root/io.containerd.content.v1.content" \
    --containerd-config "$WORK/node/containerd.toml" \
    --hosts-dir "$WORK/node/certs.d" \
    --mirror-addr "127.0.0.1:$MIRROR_PORT" \
    --metrics-addr "127.0.0.1:$METRICS_PORT" \
    --data-dir "$WORK/ferry-data" \
    --p2p false \
    --log-level debug >"$WORK/ferry.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$METRICS_PORT/readyz" >/dev/null && break; sleep 0.05; done
curl -s "http://127.0.0.1:$METRICS_PORT/readyz"
echo "--- $WORK/node/certs.d/_default/hosts.toml, written by ferry:"
cat "$WORK/node/certs.d/_default/hosts.toml"
echo "---"

echo "==> the node pulls $IMAGE (ferry has nothing yet: it answers 404 and containerd goes upstream)"
ctr --address "$WORK/node/containerd.sock" -n k8s.io images pull --hosts-dir "$WORK/node/certs.d" "$IMAGE" >/dev/null
BEFORE=$(upstream_requests)
echo "    upstream requests so far: $BEFORE"

echo "==> a second containerd pulls the same image through the config ferry wrote"
start_containerd "$WORK/second"
ctr --address "$WORK/second/containerd.sock" -n k8s.io images pull --hosts-dir "$WORK/node/certs.d" "$IMAGE" >/dev/null
AFTER=$(upstream_requests)
SERVED=$(curl -s "http://127.0.0.1:$METRICS_PORT/metrics" | awk '/^ferry_bytes_served_total\{kind="blob",source="local"\}/ {print $2}')
HITS=$(grep -c 'served method=GET path="/v2/demo/app/blobs/.*status=200' "$WORK/ferry.log" || true)
WANT=$(python3 -c "import json;i=json.load(open('$WORK/image/index.json'));print(i['manifests'][0]['digest'])")
GOT=$(ctr --address "$WORK/second/containerd.sock" -n k8s.io images ls | awk -v img="$IMAGE" '$1==img {print $3}')

echo "==> result"
echo "    blobs ferry served from the node's containerd store: $HITS ($SERVED bytes)"
echo "    upstream requests during the second pull:           $((AFTER - BEFORE))"
echo "    image digest on the second containerd:              $GOT (pushed: $WANT)"

"$FERRY" cleanup --hosts-dir "$WORK/node/certs.d"
if [ "$((AFTER - BEFORE))" -eq 0 ] && [ "$GOT" = "$WANT" ] && [ "${HITS:-0}" -ge 4 ]; then
    echo "==> OK: the second pull was served entirely by ferry"
else
    echo "==> FAILED: see $WORK (rerun with FERRY_DEMO_KEEP=1)" >&2
    exit 1
fi
