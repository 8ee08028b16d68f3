#!/usr/bin/env bash
# Fetches newer containerd releases than the machine's (Debian's trixie and sid packages) into
# target/tools/containerd-<suite>/, without touching the machine's apt sources: the suite's
# InRelease is checked with gpgv against Debian's archive keyring, the Packages index against
# InRelease, and the .deb against the index. Prints one `<version> <bin dir>` line per suite.
# Usage: scripts/containerd-versions.sh [suite...]   (default: trixie sid)
set -euo pipefail
cd "$(dirname "$0")/.."
mirror="${FERRY_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
keyring=/usr/share/keyrings/debian-archive-keyring.gpg
arch=$(dpkg --print-architecture)
[ -r "$keyring" ] || { echo "missing $keyring (apt-get install debian-archive-keyring)" >&2; exit 1; }
command -v gpgv >/dev/null || { echo "missing gpgv (apt-get install gpgv)" >&2; exit 1; }

for suite in "${@:-trixie sid}"; do
  for s in $suite; do
    dir="$PWD/target/tools/containerd-$s"
    if [ -x "$dir/usr/bin/containerd" ] && [ -f "$dir/VERSION" ]; then
      echo "$(cat "$dir/VERSION") $dir/usr/bin"
      continue
    fi
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    curl -fsS --retry 3 -o "$tmp/InRelease" "$mirror/dists/$s/InRelease"
    gpgv --quiet --keyring "$keyring" --output "$tmp/Release" "$tmp/InRelease" 2>/dev/null \
      || { echo "$s: InRelease does not verify against $keyring" >&2; exit 1; }
    index="main/binary-$arch/Packages.xz"
    want=$(awk -v f="$index" '/^SHA256:/{s=1; next} /^[A-Za-z]/{s=0} s && $3==f {print $1}' "$tmp/Release")
    [ -n "$want" ] || { echo "$s: $index not in Release" >&2; exit 1; }
    curl -fsS --retry 3 -o "$tmp/Packages.xz" "$mirror/dists/$s/$index"
    echo "$want  $tmp/Packages.xz" | sha256sum -c --quiet -
    read -r version file sha < <(xz -dc "$tmp/Packages.xz" | awk '
      /^Package: /{p=($2=="containerd")} p&&/^Version: /{v=$2} p&&/^Filename: /{f=$2}
      p&&/^SHA256: /{s=$2} /^$/{if(p&&f){print v, f, s; exit} p=0}')
    [ -n "${file:-}" ] || { echo "$s: no containerd package" >&2; exit 1; }
    curl -fsS --retry 3 -o "$tmp/containerd.deb" "$mirror/$file"
    echo "$sha  $tmp/containerd.deb" | sha256sum -c --quiet -
    rm -rf "$dir" && mkdir -p "$dir"
    dpkg-deb -x "$tmp/containerd.deb" "$dir"
    echo "$version" > "$dir/VERSION"
    rm -rf "$tmp"
    trap - EXIT
    echo "$version $dir/usr/bin"
  done
done
