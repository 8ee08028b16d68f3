#!/usr/bin/env python3
"""One timeline of a storm or relay test's phase, from a directory kept with FERRY_TEST_KEEP=1:
every node's Ferry log lines that name one of the phase image's blobs, and the registry's
requests for them, in time order, digests and peer IDs shortened to names.

    python3 scripts/timeline.py /tmp/ferry-stormXXXX relay-stalled | grep -v DEBUG
"""
import glob
import os
import re
import sys


def main(test_dir, image):
    blobs = os.listdir(os.path.join(test_dir, image, "blobs/sha256"))
    names, lines = {}, []
    for path in sorted(glob.glob(os.path.join(test_dir, "n*/ferry-*.log"))):
        node = path.split("/")[-2]
        run = "" if path.endswith("-1.log") else "'"  # a restarted Ferry's log
        for line in open(path, errors="replace"):
            started = re.search(r"peer-to-peer node started.*?(12D3\w+)", line)
            if started:
                names[started.group(1)] = node
            if any(b in line for b in blobs):
                lines.append((line[:27], node + run, line[28:].strip()))
    for line in open(os.path.join(test_dir, "up/registry.log"), errors="replace"):
        if "http.request.uri" not in line or not any(b in line for b in blobs):
            continue
        at = re.search(r'time="([^"]+)"', line)
        uri = re.search(r'uri="([^"]+)"', line)
        addr = re.search(r'remoteaddr="?([^" ]+)', line)
        status = re.search(r"http.response.status=(\d+)", line)
        if at and uri:
            what = f"{addr and addr.group(1)} {uri.group(1)} {status and status.group(1)}"
            lines.append((at.group(1)[:27], "upstream", what))
    for at, who, text in sorted(lines):
        for blob in blobs:
            text = text.replace("sha256:" + blob, blob[:6]).replace(blob, blob[:6])
        for peer, node in names.items():
            text = text.replace(peer, node)
        print(at[11:23], who, re.sub(r"\s+", " ", text))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
