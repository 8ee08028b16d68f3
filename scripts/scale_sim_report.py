#!/usr/bin/env python3
"""Collects the simulation's runs (one JSON object a line) into DIR/scale-sim.json (a list of
runs, replacing runs of the same nodes, digests and seed) and draws DIR/scale-sim.svg."""
import json
import sys

runs_file, out = sys.argv[1], sys.argv[2]
new = [json.loads(line) for line in open(runs_file) if line.strip().startswith("{")]
path = f"{out}/scale-sim.json"
try:
    old = json.load(open(path))
except (OSError, ValueError):
    old = []
key = lambda r: (r.get("scenario", "start"), r.get("nodes"), r.get("digests_per_node"), r.get("seed"),
                 r.get("latency_ms"), r.get("loss", 0))
fresh = {key(r) for r in new}
everything = sorted([r for r in old if key(r) not in fresh] + new,
                    key=lambda r: (r.get("scenario", "start"), r["nodes"], r["digests_per_node"]))
json.dump(everything, open(path, "w"), indent=1)
runs = [r for r in everything if r.get("scenario", "start") == "start"]

cols = [("nodes", "nodes"), ("digests_per_node", "digests"), ("lookup_ms_p50", "lookup p50 ms"),
        ("lookup_ms_p99", "p99 ms"), ("notfound_ms_p50", "not found p50 ms"),
        ("announce_msgs_per_node_per_s", "announce msgs/node/s"), ("mem_mib_per_node", "MiB/node"),
        ("findable_after_start_s", "findable s"), ("storm_leaders_per_digest_mean", "leaders mean"),
        ("storm_leaders_per_digest_max", "leaders max"), ("storm_last_node_s_max", "storm last node s"),
        ("wall_s", "wall s")]
fmt = lambda v: "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)
print("| " + " | ".join(c[1] for c in cols) + " |")
print("|" + "---|" * len(cols))
for r in runs:
    print("| " + " | ".join(fmt(r.get(c[0], "")) for c in cols) + " |")

# Scenario (d), a partition: during it and after it heals.
split = [r for r in everything if r.get("scenario") == "partition"]
pcols = [("nodes", "nodes"), ("digests_per_node", "digests"), ("partition_s", "split s"),
         ("partition_same_side_found", "found, same side"), ("partition_across_found", "found, across"),
         ("partition_storm_leaders_per_digest_mean", "leaders mean"), ("partition_storm_leaders_per_digest_max", "max"),
         ("partition_storm_alone_decisions", "alone"), ("partition_storm_decided_s_max", "decided s max"),
         ("healed_across_found", "healed: found across"), ("healed_storm_leaders_per_digest_max", "leaders max")]
if split:
    print("| " + " | ".join(c[1] for c in pcols) + " |")
    print("|" + "---|" * len(pcols))
    for r in split:
        print("| " + " | ".join(fmt(r.get(c[0], "")) for c in pcols) + " |")

# Scenario (b), churn: lookups of the other nodes' keys while nodes restart, and how soon a
# restarted node's keys are found.
churn = [r for r in everything if r.get("scenario") == "churn"]
ccols = [("nodes", "nodes"), ("digests_per_node", "digests"), ("churn_per_minute", "restarts/min"),
         ("churn_restarts", "restarts"), ("churn_lookups", "lookups"), ("churn_lookups_not_found", "not found"),
         ("churn_lookup_ms_p50", "lookup p50 ms"), ("churn_lookup_ms_p99", "p99 ms"),
         ("churn_msgs_per_node_per_s", "msgs/node/s"), ("churn_findable_after_restart_s_max", "restarted findable s max"),
         ("churn_restarted_never_findable", "never findable")]
if churn:
    print("| " + " | ".join(c[1] for c in ccols) + " |")
    print("|" + "---|" * len(ccols))
    for r in churn:
        print("| " + " | ".join(fmt(r.get(c[0], "")) for c in ccols) + " |")

# A small SVG without dependencies: lookup p50/p99 and not-found p50 against the node count.
series = [("lookup_ms_p50", "#1f77b4"), ("lookup_ms_p99", "#ff7f0e"), ("notfound_ms_p50", "#2ca02c")]
xs = sorted({r["nodes"] for r in runs})
top = max([r.get(s, 0) for r in runs for s, _ in series] + [1])
w, h, pad = 640, 360, 50
x_of = lambda n: pad + (w - 2 * pad) * (xs.index(n) / max(len(xs) - 1, 1))
y_of = lambda v: h - pad - (h - 2 * pad) * v / top
svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
       f'<rect width="{w}" height="{h}" fill="white"/>',
       f'<text x="{w/2}" y="20" text-anchor="middle">Ferry scale simulation (simulated time): lookups by cluster size</text>',
       f'<line x1="{pad}" y1="{h-pad}" x2="{w-pad}" y2="{h-pad}" stroke="black"/>',
       f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h-pad}" stroke="black"/>',
       f'<text x="{pad-8}" y="{pad}" text-anchor="end">{top:.3g} ms</text>',
       f'<text x="{pad-8}" y="{h-pad}" text-anchor="end">0</text>']
for n in xs:
    svg.append(f'<text x="{x_of(n)}" y="{h-pad+16}" text-anchor="middle">{n} nodes</text>')
for i, (s, colour) in enumerate(series):
    pts = [(x_of(r["nodes"]), y_of(r.get(s, 0))) for r in sorted(runs, key=lambda r: r["nodes"])]
    svg.append(f'<polyline fill="none" stroke="{colour}" stroke-width="2" points="{" ".join(f"{x:.1f},{y:.1f}" for x, y in pts)}"/>')
    svg.append(f'<text x="{w-pad-150}" y="{pad+16*i}" fill="{colour}">{s}</text>')
svg.append("</svg>")
open(f"{out}/scale-sim.svg", "w").write("\n".join(svg))
print(f"wrote {path} and {out}/scale-sim.svg")
