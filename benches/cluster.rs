//! The cluster benchmark: N nodes (each with its own containerd and Ferry) and an upstream
//! registry behind a `tbf`-shaped link, in network namespaces on one bridge, plus a central
//! pull-through cache as the alternative users deploy. For each image of the matrix, side by
//! side in one run: every node pulling straight from upstream (baseline), Ferry (one node first,
//! then the others one by one, then the rest at once), and the cache. Reports median pull time
//! per node and its ratio to the baseline, and the bytes the upstream served, as JSON and a PNG
//! under `benches/results/`.
//!
//! `cargo bench --bench cluster -- [--nodes 4] [--rate 200mbit] [--sizes 10MiB,100MiB,1GiB]
//! [--layers 1,4]`. Needs root (network namespaces). `./scripts/bench.sh` installs what it needs.

#![allow(clippy::unwrap_used)] // a benchmark harness: failures are loud on purpose
#![allow(dead_code)]

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
    out: PathBuf,
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
        out: PathBuf::from(value(
            "--out",
            concat!(env!("CARGO_MANIFEST_DIR"), "/benches/results"),
        )),
    })
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

fn median(v: &[f64]) -> f64 {
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
fn hosts_dir(node: &Node, name: &str, server: SocketAddr, via: Option<SocketAddr>) -> PathBuf {
    let dir = node.dir.join(name);
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
    std::fs::write(host.join("hosts.toml"), text).unwrap();
    dir
}

fn main() {
    let Some(opts) = options() else {
        return;
    };
    let mut net = Net::new();
    let tmp = tempfile::Builder::new()
        .prefix("ferry-bench")
        .tempdir()
        .unwrap();
    let dir = tmp.path();
    let up_ns = net.add_host("up", 1);
    let upstream = SocketAddr::new(net.host_ip(1).into(), 5000);
    let registry = Registry::start_at(&dir.join("registry"), Some(&up_ns), upstream);
    // The upstream's link to the cluster: shaped, as a registry across the internet is.
    let status = in_netns(Some(&up_ns), "tc")
        .args([
            "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", &opts.rate, "burst", "256kb",
            "latency", "100ms",
        ])
        .status()
        .unwrap();
    assert!(status.success(), "tc tbf");
    // The pull-through cache users deploy instead: one registry in the cluster, proxying upstream.
    let cache_ns = net.add_host("cache", 2);
    let cache_addr = SocketAddr::new(net.host_ip(2).into(), 5000);
    let cache = Registry::start_proxy(&dir.join("cache"), &cache_ns, cache_addr, upstream);

    let secret = dir.join("secret");
    std::fs::write(&secret, "benchmark cluster secret, long enough\n").unwrap();
    let secret_arg = secret.to_str().unwrap().to_string();
    let mut nodes: Vec<Node> = Vec::new();
    for i in 0..opts.nodes {
        let seed = (i > 0).then(|| format!("{}:{P2P_PORT}", nodes[0].ip));
        let mut args = vec!["--cluster-secret-file", secret_arg.as_str()];
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
    if opts.nodes > 1 {
        wait_for("nodes connected", || {
            nodes[0].metric("ferry_peers_connected") as usize >= opts.nodes - 1
        });
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
            let mut image = |scenario: &str| {
                let tag = format!("{}-{layers}-{scenario}", label.to_lowercase());
                let img = Image::generate(&dir.join("images").join(&tag), &tag, layers, per_layer);
                img.push(upstream, "bench/app");
                let reference = format!("{upstream}/bench/app:{tag}");
                // The layout is pushed: its disk space is better spent on the nodes.
                let _ = std::fs::remove_dir_all(&img.layout);
                used.push((reference.clone(), img));
                reference
            };
            // Baseline: every node straight from upstream, one after the other.
            let reference = image("baseline");
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
            let reference = image("ferry");
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
            let reference = image("cache");
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
                }
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
    let report = json!({
        "machine": machine(),
        "nodes": opts.nodes, "upstream_rate": opts.rate,
        "results": results,
    });
    std::fs::create_dir_all(&opts.out).unwrap();
    std::fs::write(
        opts.out.join("cluster.json"),
        serde_json::to_string_pretty(&report).unwrap(),
    )
    .unwrap();
    chart(&report, &opts.out.join("cluster.png"));
    println!("{}", table(&report));
    drop(nodes);
    drop((cache, registry, tmp));
    drop(net);
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

/// The README table: median pull time per node and its speed-up over the baseline.
fn table(report: &Value) -> String {
    let mut out = String::from(
        "| image | baseline (s) | Ferry, one by one (s) | Ferry, at once (s) | pull-through cache (s) | upstream bytes: baseline / Ferry / cache |\n|---|---|---|---|---|---|\n",
    );
    for r in report["results"].as_array().into_iter().flatten() {
        let f = |v: &Value| v.as_f64().unwrap_or(0.0);
        out.push_str(&format!(
            "| {} | {:.2} | {:.2} ({:.1}x) | {:.2} ({:.1}x) | {:.2} ({:.1}x) | {} / {} / {} |\n",
            r["image"].as_str().unwrap_or(""),
            f(&r["baseline"]["median_s"]),
            f(&r["ferry"]["one_by_one_median_s"]),
            f(&r["ferry"]["speedup_one_by_one"]),
            f(&r["ferry"]["at_once_median_s"]),
            f(&r["ferry"]["speedup_at_once"]),
            f(&r["pull_through_cache"]["rest_median_s"]),
            f(&r["pull_through_cache"]["speedup"]),
            r["baseline"]["upstream_bytes"],
            r["ferry"]["upstream_bytes"],
            r["pull_through_cache"]["upstream_bytes"],
        ));
    }
    out
}

/// Median pull time per node, per image and scenario, as grouped bars.
fn chart(report: &Value, path: &Path) {
    use plotters::prelude::*;
    let font = std::fs::read("/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf")
        .expect("DejaVu Sans (fonts-dejavu-core)");
    let _ = plotters::style::register_font(
        "sans-serif",
        FontStyle::Normal,
        Box::leak(font.into_boxed_slice()),
    );
    let results = report["results"].as_array().cloned().unwrap_or_default();
    let series = [
        ("baseline", "/baseline/median_s", RGBColor(150, 150, 150)),
        (
            "Ferry, one by one",
            "/ferry/one_by_one_median_s",
            RGBColor(30, 120, 200),
        ),
        (
            "Ferry, at once",
            "/ferry/at_once_median_s",
            RGBColor(20, 170, 120),
        ),
        (
            "pull-through cache",
            "/pull_through_cache/rest_median_s",
            RGBColor(230, 140, 30),
        ),
    ];
    let max = results
        .iter()
        .flat_map(|r| {
            series
                .iter()
                .map(move |(_, p, _)| r.pointer(p).and_then(Value::as_f64).unwrap_or(0.0))
        })
        .fold(0.1f64, f64::max);
    let root = BitMapBackend::new(path, (1200, 600)).into_drawing_area();
    root.fill(&WHITE).unwrap();
    let n = results.len().max(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Median pull time per node (lower is better)",
            ("sans-serif", 24),
        )
        .margin(20)
        .x_label_area_size(60)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..n, 0f64..max * 1.15)
        .unwrap();
    let labels: Vec<String> = results
        .iter()
        .map(|r| r["image"].as_str().unwrap_or("").to_string())
        .collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        // Ticks every half unit: the label sits under the middle of each image's group.
        .x_labels(results.len().max(1) * 2 + 1)
        .x_label_formatter(&|x| {
            if (x.fract() - 0.5).abs() < 0.01 {
                labels.get(x.floor() as usize).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("seconds")
        .draw()
        .unwrap();
    let width = 0.8 / series.len() as f64;
    for (s, (name, pointer, color)) in series.iter().enumerate() {
        let bars = results.iter().enumerate().map(|(i, r)| {
            let v = r.pointer(pointer).and_then(Value::as_f64).unwrap_or(0.0);
            let x0 = i as f64 + 0.1 + s as f64 * width;
            Rectangle::new([(x0, 0.0), (x0 + width, v)], color.filled())
        });
        chart
            .draw_series(bars)
            .unwrap()
            .label(*name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .unwrap();
    root.present().unwrap();
}
