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
    # Unique package names, in order.
    local pkgs
    pkgs=$(printf '%s\n' "${missing[@]}" | awk '!seen[$0]++' | tr '\n' ' ')
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

ensure_rust() {
    if ! command -v cargo >/dev/null 2>&1; then
        echo "cargo not found: install Rust from https://rustup.rs (stable, 1.85 or newer)" >&2
        exit 1
    fi
}
