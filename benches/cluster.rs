//! The cluster benchmark: N nodes (each with its own containerd and Ferry) and an upstream
//! registry behind a `tbf`-shaped link, in network namespaces on one bridge, plus a central
//! pull-through cache as the alternative users deploy. For each image of the matrix, side by
//! side in one run: every node pulling straight from upstream (baseline), Ferry (one node first,
//! then the others one by one, then the rest at once), the cache, and the physical limit (every
//! node pulling from an unshaped registry on the same bridge: containerd's own cost). Reports
//! median pull time per node and its ratio to the baseline, and the bytes the upstream served;
//! then the component figures (`components.rs`). JSON and a PNG under `benches/results/`.
//!
//! `cargo bench --bench cluster -- [--nodes 4] [--rate 200mbit] [--sizes 10MiB,100MiB,1GiB]
//! [--layers 1,4] [--component-size 1GiB] [--out DIR] [--replot] [--storm] [--last-hop]
//! [--node-rate R] [--relay-fanouts LIST] [--keep] [--versions N]`. `--storm` runs the rollout scenario instead
//! (`cluster/storm.rs`): every node pulling a new image at once; `--node-rate` shapes each
//! node's link both ways, `--rate none` leaves the upstream's unshaped.
//! `--last-hop` instead compares a peer pull with a pull from the registry next door, one node
//! pulling at a time (`cluster/last_hop.rs`). `--keep [--versions 8]` measures layers kept
//! for peers instead (`cluster/keep.rs`): disk and DHT traffic of the lease, with and without
//! `--keep-copies`, and what a node joining after the rollouts gets from peers. Needs root (network namespaces), except
//! `--replot`: redraw the chart and reprint the tables from the JSON.
//! `./scripts/bench.sh` installs what it needs.

#![allow(clippy::unwrap_used)] // a benchmark harness: failures are loud on purpose
#![allow(dead_code)]

#[path = "cluster/components.rs"]
mod components;
#[path = "cluster/keep.rs"]
mod keep;
#[path = "cluster/last_hop.rs"]
mod last_hop;
#[path = "cluster/report.rs"]
mod report;
#[path = "cluster/storm.rs"]
mod storm;
#[path = "../tests/support/mod.rs"]
mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde_json::{Value, json};
use support::cluster::{Node, P2P_PORT};
use support::netns::Net;
use support::{Image, Registry, in_netns, wait_for};

struct Options {
    nodes: usize,
    rate: String,
    sizes: Vec<(String, usize)>,
    layers: Vec<usize>,
    component_size: usize,
    out: PathBuf,
    /// Only redraw the chart and print the tables from `<out>/cluster.json` (no root needed).
    replot: bool,
    /// The storm scenario only (every node pulling a new image at once): `<out>/storm.json`.
    storm: bool,
    /// Each node's link, both ways (`tbf`); `None`: unshaped.
    node_rate: Option<String>,
    /// Storm columns with these `--relay-fanout` values besides the default's (default: 0,
    /// coalescing without relays).
    fanouts: Vec<usize>,
    /// Layers kept for peers only (`cluster/keep.rs`): `<out>/keep.json`.
    keep: bool,
    /// Versions rolled out in the keep scenario.
    versions: usize,
    /// The last hop only (a peer pull against the registry next door, one node pulling at a
    /// time): `<out>/last_hop.json`.
    last_hop: bool,
}

fn parse_size(s: &str) -> usize {
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: usize = n.parse().expect("size");
    n * match unit {
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => 1,
    }
}

fn options() -> Option<Options> {
    let args: Vec<String> = std::env::args().collect();
    // `cargo test --all-targets` runs bench binaries too, without `--bench`: do nothing then.
    if !args.iter().any(|a| a == "--bench") {
        return None;
    }
    let value = |flag: &str, default: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1).cloned())
            .unwrap_or_else(|| default.to_string())
    };
    Some(Options {
        nodes: value("--nodes", "4").parse().expect("--nodes"),
        rate: value("--rate", "200mbit"),
        sizes: value("--sizes", "10MiB,100MiB,1GiB")
            .split(',')
            .map(|s| (s.to_string(), parse_size(s)))
            .collect(),
        layers: value("--layers", "1,4")
            .split(',')
            .map(|s| s.parse().expect("--layers"))
            .collect(),
        component_size: parse_size(&value("--component-size", "1GiB")),
        replot: args.iter().any(|a| a == "--replot"),
        storm: args.iter().any(|a| a == "--storm"),
        last_hop: args.iter().any(|a| a == "--last-hop"),
        keep: args.iter().any(|a| a == "--keep"),
        versions: value("--versions", "8").parse().expect("--versions"),
        node_rate: Some(value("--node-rate", "")).filter(|r| !r.is_empty()),
        fanouts: value("--relay-fanouts", "0")
            .split(',')
            .filter(|s| !s.is_empty())
            .map(|s| s.parse().expect("--relay-fanouts"))
            .collect(),
        out: PathBuf::from(value(
            "--out",
            concat!(env!("CARGO_MANIFEST_DIR"), "/benches/results"),
        )),
    })
}

/// The upstream's shaper queues up to 100 ms, as a path across the internet does.
const WAN_QUEUE: (&str, &str) = ("256kb", "100ms");
/// A node's link queues little, as a switch port does: a 100 ms queue on every hop would
/// measure the shaper's bufferbloat, not the link.
const LAN_QUEUE: (&str, &str) = ("64kb", "10ms");

/// A `tbf` on `dev` in namespace `ns` (`None`: the host's), with `queue`'s burst and latency.
fn shape(ns: Option<&str>, dev: &str, rate: &str, queue: (&str, &str)) {
    let (burst, latency) = queue;
    let status = in_netns(ns, "tc")
        .args([
            "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", burst, "latency",
            latency,
        ])
        .status()
        .unwrap();
    assert!(status.success(), "tc tbf on {dev}");
}

/// Pulls `reference` on `node` through `hosts_dir`; returns the wall time.
fn timed_pull(node: &Node, reference: &str, hosts_dir: &Path) -> f64 {
    let start = Instant::now();
    node.containerd.pull("k8s.io", reference, hosts_dir);
    start.elapsed().as_secs_f64()
}

/// Pulls on several nodes at once; returns each wall time.
fn pull_at_once(nodes: &[&Node], reference: &str, hosts: impl Fn(&Node) -> PathBuf) -> Vec<f64> {
    std::thread::scope(|s| {
        let handles: Vec<_> = nodes
            .iter()
            .map(|n| {
                let dir = hosts(n);
                s.spawn(move || timed_pull(n, reference, &dir))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if v.is_empty() {
        return 0.0;
    }
    v[v.len() / 2]
}

/// Bytes the registry sent, from its log (`http.response.written`), since `mark` lines.
fn bytes_served(registry: &Registry, mark: usize) -> u64 {
    registry
        .proc
        .log_text()
        .lines()
        .filter(|l| l.contains("response completed"))
        .skip(mark)
        .filter_map(|l| l.split("http.response.written=").nth(1))
        .filter_map(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

fn completed(registry: &Registry) -> usize {
    registry
        .proc
        .log_text()
        .lines()
        .filter(|l| l.contains("response completed"))
        .count()
}

/// A plain hosts dir that sends `node` straight to `server` (optionally through `via` first).
pub fn hosts_dir(node: &Node, name: &str, server: SocketAddr, via: Option<SocketAddr>) -> PathBuf {
    let dir = node.dir.join(name);
    write_hosts(&dir, server, via);
    dir
}

/// `<dir>/<server>/hosts.toml`: the plain-HTTP `server`, tried after `via` when there is one.
/// Returns the file.
pub fn write_hosts(dir: &Path, server: SocketAddr, via: Option<SocketAddr>) -> PathBuf {
    let host = dir.join(server.to_string());
    std::fs::create_dir_all(&host).unwrap();
    let mut text = format!("server = \"http://{server}\"\n");
    if let Some(cache) = via {
        text.push_str(&format!(
            "\n[host.\"http://{cache}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
        ));
    }
    text.push_str(&format!(
        "\n[host.\"http://{server}\"]\n  capabilities = [\"pull\", \"resolve\"]\n"
    ));
    let file = host.join("hosts.toml");
    std::fs::write(&file, text).unwrap();
    file
}

fn main() {
    let Some(opts) = options() else {
        return;
    };
    if opts.replot && opts.storm {
        let text = std::fs::read_to_string(opts.out.join("storm.json")).unwrap();
        let report: Value = serde_json::from_str(&text).unwrap();
        storm::chart(&report, &opts.out.join("storm.png"));
        println!("{}", storm::table(&report));
        return;
    }
    if opts.replot && opts.last_hop {
        let text = std::fs::read_to_string(opts.out.join("last_hop.json")).unwrap();
        println!("{}", last_hop::table(&serde_json::from_str(&text).unwrap()));
        return;
    }
    if opts.keep {
        let file = opts.out.join("keep.json");
        let report = if opts.replot {
            serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap()
        } else {
            let (_, size) = opts.sizes[0].clone();
            let mut report = keep::run(opts.nodes, size, opts.layers[0], opts.versions);
            report["machine"] = machine();
            write_report(&opts.out, "keep.json", &report);
            report
        };
        println!("{}", keep::table(&report));
        return;
    }
    if opts.replot {
        let text = std::fs::read_to_string(opts.out.join("cluster.json")).unwrap();
        let report: Value = serde_json::from_str(&text).unwrap();
        report::chart(&report, &opts.out.join("cluster.png"));
        println!("{}", report::table(&report));
        println!("{}", report::components(&report));
        return;
    }
    let mut net = Net::new();
    let tmp = tempfile::Builder::new()
        .prefix("ferry-bench")
        .tempdir()
        .unwrap();
    let dir = tmp.path();
    let up_ns = net.add_host("up", 1);
    let upstream = SocketAddr::new(net.host_ip(1), 5000);
    let registry = Registry::start_at(&dir.join("registry"), Some(&up_ns), upstream);
    // The upstream's link to the cluster: shaped, as a registry across the internet is
    // (`--rate none`: a registry as fast as the nodes' links, as in a cloud region).
    if opts.rate != "none" {
        shape(Some(&up_ns), "eth0", &opts.rate, WAN_QUEUE);
    }
    // The pull-through cache users deploy instead: one registry in the cluster, proxying upstream.
    let cache_ns = net.add_host("cache", 2);
    let cache_addr = SocketAddr::new(net.host_ip(2), 5000);
    let cache = Registry::start_proxy(&dir.join("cache"), &cache_ns, cache_addr, upstream);
    // The physical limit: a registry on the same bridge, unshaped. No mirror can beat it.
    let near_ns = net.add_host("near", 3);
    let near = SocketAddr::new(net.host_ip(3), 5000);
    let near_registry = Registry::start_at(&dir.join("near"), Some(&near_ns), near);

    let secret = dir.join("secret");
    std::fs::write(&secret, "benchmark cluster secret, long enough\n").unwrap();
    let secret_arg = secret.to_str().unwrap().to_string();
    let mut nodes: Vec<Node> = Vec::new();
    for i in 0..opts.nodes {
        // Every node bootstraps from all the others (as the Kubernetes bootstrap does): a
        // restarted node finds them all again at once.
        let others: Vec<String> = (0..opts.nodes)
            .filter(|j| *j != i)
            .map(|j| format!("{}:{P2P_PORT}", net.host_ip(11 + j as u8)))
            .collect();
        let seed = (opts.nodes > 1).then(|| others.join(","));
        // Info, as operators run it: debug lines cost time on the data path.
        let mut args = vec![
            "--cluster-secret-file",
            secret_arg.as_str(),
            "--log-level",
            "info",
        ];
        if let Some(seed) = &seed {
            args.extend(["--bootstrap-peers", seed.as_str()]);
        }
        let node = Node::start(
            &mut net,
            dir,
            &format!("n{i}"),
            11 + i as u8,
            upstream,
            &args,
        );
        nodes.push(node);
    }
    // Each node's own link, both ways: what it sends leaves its end, what it receives leaves
    // the bridge's end.
    if let Some(rate) = &opts.node_rate {
        for node in &nodes {
            shape(Some(&node.ns), "eth0", rate, LAN_QUEUE);
            shape(None, &Net::bridge_side(&node.ns), rate, LAN_QUEUE);
        }
    }
    if opts.nodes > 1 {
        wait_for("nodes connected", || {
            nodes[0].metric("ferry_peers_connected") as usize >= opts.nodes - 1
        });
    }

    if opts.storm {
        let setup = storm::Setup {
            registry: &registry,
            upstream,
            cache: cache_addr,
            near,
            dir,
            fanouts: &opts.fanouts,
        };
        let layers = *opts.layers.last().unwrap_or(&4);
        let results = storm::run(&mut nodes, &setup, &opts.sizes, layers);
        let report = json!({
            "machine": machine(),
            "nodes": opts.nodes, "upstream_rate": opts.rate,
            "node_rate": opts.node_rate,
            "storm": results,
        });
        write_report(&opts.out, "storm.json", &report);
        storm::chart(&report, &opts.out.join("storm.png"));
        println!("{}", storm::table(&report));
        drop(nodes);
        drop((cache, near_registry, registry, tmp));
        drop(net);
        return;
    }
    if opts.last_hop {
        let rounds = last_hop::run(
            &mut nodes,
            &near_registry,
            near,
            dir,
            &opts.sizes,
            &opts.layers,
        );
        let report = json!({
            "machine": machine(),
            "nodes": opts.nodes,
            "last_hop": rounds,
        });
        write_report(&opts.out, "last_hop.json", &report);
        println!("{}", last_hop::table(&report));
        drop(nodes);
        drop((cache, near_registry, registry, tmp));
        drop(net);
        return;
    }
    let mut results = Vec::new();
    for (label, total) in &opts.sizes {
        for &layers in &opts.layers {
            let per_layer = total / layers;
            let name = format!(
                "{label} in {layers} layer{}",
                if layers > 1 { "s" } else { "" }
            );
            eprintln!("== {name}");
            // A distinct image per scenario, so no scenario finds another's content anywhere.
            let mut used: Vec<(String, Image)> = Vec::new();
            let mut image = |scenario: &str, registry: SocketAddr| {
                let tag = format!("{}-{layers}-{scenario}", label.to_lowercase());
                let img = Image::generate(&dir.join("images").join(&tag), &tag, layers, per_layer);
                img.push(registry, "bench/app");
                let reference = format!("{registry}/bench/app:{tag}");
                // The layout is pushed: its disk space is better spent on the nodes.
                let _ = std::fs::remove_dir_all(&img.layout);
                used.push((reference.clone(), img));
                reference
            };
            // Baseline: every node straight from upstream, one after the other.
            let reference = image("baseline", upstream);
            let mark = completed(&registry);
            let plain: Vec<PathBuf> = nodes
                .iter()
                .map(|n| hosts_dir(n, "plain", upstream, None))
                .collect();
            let baseline: Vec<f64> = nodes
                .iter()
                .zip(&plain)
                .map(|(n, h)| timed_pull(n, &reference, h))
                .collect();
            let baseline_bytes = bytes_served(&registry, mark);

            // Ferry: the first node, then one by one, then the rest at once.
            let reference = image("ferry", upstream);
            let mark = completed(&registry);
            let advertised = nodes[0].metric("ferry_keys_advertised");
            let first = timed_pull(&nodes[0], &reference, &nodes[0].containerd.hosts_dir);
            // Index or manifest, config, layers, tag: wait until the first node announces them.
            let new_keys = (layers + 3) as u64;
            wait_for("first node advertises", || {
                nodes[0].metric("ferry_keys_advertised") >= advertised + new_keys
            });
            let half = opts.nodes.div_ceil(2);
            let one_by_one: Vec<f64> = nodes[1..half.max(1)]
                .iter()
                .map(|n| timed_pull(n, &reference, &n.containerd.hosts_dir))
                .collect();
            let rest: Vec<&Node> = nodes[half.max(1)..].iter().collect();
            let at_once = pull_at_once(&rest, &reference, |n| n.containerd.hosts_dir.clone());
            let ferry_bytes = bytes_served(&registry, mark);

            // The central pull-through cache.
            let reference = image("cache", upstream);
            let mark = completed(&registry);
            let via: Vec<PathBuf> = nodes
                .iter()
                .map(|n| hosts_dir(n, "via-cache", upstream, Some(cache_addr)))
                .collect();
            let cache_first = timed_pull(&nodes[0], &reference, &via[0]);
            let cache_rest: Vec<f64> = nodes[1..]
                .iter()
                .zip(&via[1..])
                .map(|(n, h)| timed_pull(n, &reference, h))
                .collect();
            let cache_bytes = bytes_served(&registry, mark);

            // The physical limit: the same pull with the registry next door.
            let reference = image("limit", near);
            let limit: Vec<f64> = nodes
                .iter()
                .map(|n| timed_pull(n, &reference, &hosts_dir(n, "near", near, None)))
                .collect();

            let base = median(&baseline);
            let ratio = |t: f64| if t > 0.0 { base / t } else { 0.0 };
            let entry = json!({
                "image": name, "total_bytes": total, "layers": layers,
                "baseline": {"pull_s": baseline, "median_s": base, "upstream_bytes": baseline_bytes},
                "ferry": {
                    "first_s": first,
                    "one_by_one_s": one_by_one, "one_by_one_median_s": median(&one_by_one),
                    "at_once_s": at_once, "at_once_median_s": median(&at_once),
                    "speedup_one_by_one": ratio(median(&one_by_one)), "speedup_at_once": ratio(median(&at_once)),
                    "upstream_bytes": ferry_bytes
                },
                "pull_through_cache": {
                    "first_s": cache_first, "rest_s": cache_rest, "rest_median_s": median(&cache_rest),
                    "speedup": ratio(median(&cache_rest)), "upstream_bytes": cache_bytes
                },
                "physical_limit": {"pull_s": limit, "median_s": median(&limit), "speedup": ratio(median(&limit))}
            });
            eprintln!("{}", serde_json::to_string_pretty(&entry).unwrap());
            results.push(entry);
            // Every node forgets this round's images (content and unpacked snapshots): a 1 GiB
            // matrix would otherwise fill the disk several times over.
            for (reference, img) in &used {
                for node in &nodes {
                    node.forget(reference, &img.digests());
                }
            }
        }
    }
    let components = components::run(&mut nodes, near, dir, opts.component_size);
    let report = json!({
        "machine": machine(),
        "nodes": opts.nodes, "upstream_rate": opts.rate,
        "results": results,
        "components": components,
    });
    write_report(&opts.out, "cluster.json", &report);
    report::chart(&report, &opts.out.join("cluster.png"));
    println!("{}", report::table(&report));
    println!("{}", report::components(&report));
    drop(nodes);
    drop((cache, near_registry, registry, tmp));
    drop(net);
}

/// Writes `report` as `<out>/<name>`, pretty-printed.
fn write_report(out: &Path, name: &str, report: &Value) {
    std::fs::create_dir_all(out).unwrap();
    std::fs::write(
        out.join(name),
        serde_json::to_string_pretty(report).unwrap(),
    )
    .unwrap();
}

fn machine() -> Value {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split(':').nth(1))
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    json!({"cpus": cpus, "cpu": model})
}
