//! The storm scenario (`--storm`): every node pulls the same new image at the same moment, as
//! in a rollout. Side by side in one run, each with an image of its own: one node alone
//! straight from upstream (the reference for "as fast as one pull"), every node at once
//! straight from upstream (baseline), through Ferry with coalescing off, through Ferry, and
//! through the pull-through cache. Reports the slowest and the median node and the bytes the
//! upstream sent, against the targets: upstream at most 1.1x the image, slowest node at most
//! 1.3x one node alone.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use super::support::cluster::Node;
use super::support::{Image, Registry, wait_for};
use super::{bytes_served, completed, hosts_dir, median, pull_at_once, timed_pull};

/// The targets of issue #10, in the same run.
const UPSTREAM_TARGET: f64 = 1.1;
const SLOWEST_TARGET: f64 = 1.3;
/// Issue #29's target with every node's link shaped equally (the upstream not the limit).
const EQUAL_LINKS_SLOWEST_TARGET: f64 = 1.5;

pub struct Setup<'a> {
    pub registry: &'a Registry,
    pub upstream: SocketAddr,
    pub cache: SocketAddr,
    /// An unshaped registry on the same bridge: every node pulling from it at once shows what
    /// N simultaneous pulls cost on this machine with no network limit (the physical limit).
    pub near: SocketAddr,
    pub dir: &'a Path,
    /// Columns with these `--relay-fanout` values besides the default's (0: no relays).
    pub fanouts: &'a [usize],
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}

/// One scenario's figures: every node's time, what the upstream sent, and how busy the
/// machine's cores were meanwhile (1.0: every core all the time: the cores were the limit).
fn figures(times: &[f64], upstream_bytes: u64, cpu: &Cpu) -> Value {
    json!({
        "pull_s": times, "slowest_s": max(times), "median_s": median(times),
        "upstream_bytes": upstream_bytes, "cpu_busy": cpu.busy(),
    })
}

/// The machine's CPU counters (`/proc/stat`) at a moment.
struct Cpu {
    busy: u64,
    total: u64,
}

impl Cpu {
    fn now() -> Cpu {
        let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let ticks: Vec<u64> = stat
            .lines()
            .next()
            .unwrap_or("")
            .split_whitespace()
            .skip(1)
            .filter_map(|t| t.parse().ok())
            .collect();
        let total: u64 = ticks.iter().sum();
        // idle and iowait are the 4th and 5th fields.
        let idle = ticks.get(3).copied().unwrap_or(0) + ticks.get(4).copied().unwrap_or(0);
        Cpu {
            busy: total - idle,
            total,
        }
    }

    /// The share of the cores busy since `self`.
    fn busy(&self) -> f64 {
        let now = Cpu::now();
        let total = now.total.saturating_sub(self.total).max(1);
        (now.busy.saturating_sub(self.busy) as f64 / total as f64 * 100.0).round() / 100.0
    }
}

fn wait_connected(nodes: &[Node]) {
    let others = nodes.len() as u64 - 1;
    wait_for("every node connected to every other", || {
        nodes
            .iter()
            .all(|n| n.metric("ferry_peers_connected") >= others)
    });
}

/// Runs the storm for each `(label, bytes)` in `sizes`, in `layers` layers.
pub fn run(nodes: &mut [Node], setup: &Setup, sizes: &[(String, usize)], layers: usize) -> Value {
    let mut rounds: Vec<(String, usize, Value)> = Vec::new();
    let image = |tag: &str, per_layer: usize| -> (String, Image) {
        let img = Image::generate(&setup.dir.join("images").join(tag), tag, layers, per_layer);
        img.push(setup.upstream, "storm/app");
        let _ = std::fs::remove_dir_all(&img.layout);
        (format!("{}/storm/app:{tag}", setup.upstream), img)
    };
    let forget = |nodes: &[Node], reference: &str, img: &Image| {
        for n in nodes {
            n.forget(reference, &img.digests());
        }
    };
    let plain: Vec<PathBuf> = nodes
        .iter()
        .map(|n| hosts_dir(n, "plain", setup.upstream, None))
        .collect();
    let via: Vec<PathBuf> = nodes
        .iter()
        .map(|n| hosts_dir(n, "via-cache", setup.upstream, Some(setup.cache)))
        .collect();
    let near: Vec<PathBuf> = nodes
        .iter()
        .map(|n| hosts_dir(n, "near", setup.near, None))
        .collect();
    wait_connected(nodes);
    for (label, total) in sizes {
        let per_layer = total / layers;
        let tag = |scenario: &str| format!("{}-{scenario}", label.to_lowercase());
        eprintln!("== storm: {label} in {layers} layers");

        let (reference, img) = image(&tag("alone"), per_layer);
        let alone = timed_pull(&nodes[0], &reference, &plain[0]);
        forget(nodes, &reference, &img);

        let (reference, img) = image(&tag("baseline"), per_layer);
        let mark = completed(setup.registry);
        let everyone: Vec<&Node> = nodes.iter().collect();
        let dirs = |n: &Node, d: &[PathBuf]| d[nodes_index(&everyone, n)].clone();
        let cpu = Cpu::now();
        let baseline = pull_at_once(&everyone, &reference, |n| dirs(n, &plain));
        let baseline = figures(&baseline, bytes_served(setup.registry, mark), &cpu);
        forget(nodes, &reference, &img);

        let (reference, img) = image(&tag("ferry"), per_layer);
        let mark = completed(setup.registry);
        let cpu = Cpu::now();
        let ferry = pull_at_once(&everyone, &reference, |n| n.containerd.hosts_dir.clone());
        let ferry = figures(&ferry, bytes_served(setup.registry, mark), &cpu);
        forget(nodes, &reference, &img);

        let (reference, img) = image(&tag("cache"), per_layer);
        let mark = completed(setup.registry);
        let cpu = Cpu::now();
        let cache = pull_at_once(&everyone, &reference, |n| dirs(n, &via));
        let cache = figures(&cache, bytes_served(setup.registry, mark), &cpu);
        forget(nodes, &reference, &img);

        // The physical limit at once: the same storm from the registry next door, unshaped.
        let limit_tag = tag("limit");
        let img = Image::generate(
            &setup.dir.join("images").join(&limit_tag),
            &limit_tag,
            layers,
            per_layer,
        );
        img.push(setup.near, "storm/app");
        let _ = std::fs::remove_dir_all(&img.layout);
        let reference = format!("{}/storm/app:{limit_tag}", setup.near);
        let cpu = Cpu::now();
        let limit = pull_at_once(&everyone, &reference, |n| dirs(n, &near));
        let limit = figures(&limit, 0, &cpu);
        forget(nodes, &reference, &img);

        let entry = json!({
            "image": format!("{label} in {layers} layers"), "total_bytes": total, "layers": layers,
            "alone_s": alone,
            "baseline": baseline,
            "ferry": ferry,
            "pull_through_cache": cache,
            "limit_at_once": limit,
        });
        eprintln!("{}", serde_json::to_string_pretty(&entry).unwrap());
        rounds.push((label.clone(), *total, entry));
    }

    // The same storms through Ferry with coalescing off, without relays, and with other
    // fanouts, in the same run.
    let mut modes: Vec<(String, Vec<String>)> = vec![(
        "uncoalesced".into(),
        vec!["--coalesce".into(), "false".into()],
    )];
    for f in setup.fanouts {
        modes.push((
            format!("fanout_{f}"),
            vec!["--relay-fanout".into(), f.to_string()],
        ));
    }
    for (mode, args) in &modes {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        for n in nodes.iter_mut() {
            n.restart_ferry_with(&args);
        }
        wait_connected(nodes);
        for (label, total, entry) in &mut rounds {
            let per_layer = *total / layers;
            let tag = format!("{}-{}", label.to_lowercase(), mode.replace('_', "-"));
            let (reference, img) = image(&tag, per_layer);
            let mark = completed(setup.registry);
            let everyone: Vec<&Node> = nodes.iter().collect();
            let cpu = Cpu::now();
            let times = pull_at_once(&everyone, &reference, |n| n.containerd.hosts_dir.clone());
            let bytes = bytes_served(setup.registry, mark);
            entry[format!("ferry_{mode}")] = figures(&times, bytes, &cpu);
            forget(nodes, &reference, &img);
        }
    }
    for n in nodes.iter_mut() {
        n.restart_ferry_with(&[]);
    }
    json!({"results": rounds.into_iter().map(|(_, _, e)| e).collect::<Vec<_>>()})
}

fn nodes_index(nodes: &[&Node], node: &Node) -> usize {
    nodes.iter().position(|n| n.name == node.name).unwrap()
}

/// The columns a result has, in order: label and key.
fn columns(r: &Value) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = vec![
        ("baseline (no mirror)".into(), "baseline".into()),
        ("Ferry, coalescing off".into(), "ferry_uncoalesced".into()),
        (
            "Ferry, coalescing without relays (fanout 0)".into(),
            "ferry_fanout_0".into(),
        ),
    ];
    let mut fanouts: Vec<usize> = r
        .as_object()
        .into_iter()
        .flat_map(|o| o.keys())
        .filter_map(|k| k.strip_prefix("ferry_fanout_")?.parse().ok())
        .filter(|f| *f > 0)
        .collect();
    fanouts.sort();
    for f in fanouts {
        out.push((
            format!("Ferry, relays with fanout {f}"),
            format!("ferry_fanout_{f}"),
        ));
    }
    out.push(("Ferry (default: relays)".into(), "ferry".into()));
    out.push(("pull-through cache".into(), "pull_through_cache".into()));
    out.retain(|(_, k)| !r[k.as_str()].is_null());
    out
}

/// The slowest-node target: 1.5x alone on equal node links, 1.3x where the upstream limits.
fn slowest_target(report: &Value) -> f64 {
    if report["node_rate"].is_string() {
        EQUAL_LINKS_SLOWEST_TARGET
    } else {
        SLOWEST_TARGET
    }
}

/// The share of the cores a column kept busy, as a percentage (`-` from older results).
fn busy(c: &Value) -> String {
    c["cpu_busy"]
        .as_f64()
        .map_or("-".into(), |b| format!("{:.0}%", b * 100.0))
}

/// The storm table, as printed (and copied into the README).
pub fn table(report: &Value) -> String {
    let mib = |v: &Value| v.as_f64().unwrap_or(0.0) / (1 << 20) as f64;
    let mut out = format!(
        "storm: {} nodes pull a new image at the same moment; upstream {}; each node's link {}\n\
         | image | one node alone | column | slowest | median | upstream MiB (x image) | cores busy |\n\
         |---|---|---|---|---|---|---|\n",
        report["nodes"],
        report["upstream_rate"],
        report["node_rate"].as_str().unwrap_or("unshaped")
    );
    let slowest_target = slowest_target(report);
    for r in report["storm"]["results"].as_array().into_iter().flatten() {
        let total = r["total_bytes"].as_f64().unwrap_or(1.0);
        let alone = r["alone_s"].as_f64().unwrap_or(0.0);
        for (column, key) in columns(r) {
            let c = &r[key.as_str()];
            let slowest = c["slowest_s"].as_f64().unwrap_or(0.0);
            let up = c["upstream_bytes"].as_f64().unwrap_or(0.0);
            out.push_str(&format!(
                "| {} | {alone:.2} s | {column} | {slowest:.2} s ({:.2}x alone) | {:.2} s | {:.1} ({:.2}x) | {} |\n",
                r["image"].as_str().unwrap_or(""),
                slowest / alone.max(1e-9),
                c["median_s"].as_f64().unwrap_or(0.0),
                mib(&c["upstream_bytes"]),
                up / total,
                busy(c),
            ));
        }
        let limit = &r["limit_at_once"];
        let limit_slowest = limit["slowest_s"].as_f64().unwrap_or(0.0);
        if limit_slowest > 0.0 {
            out.push_str(&format!(
                "| {} | {alone:.2} s | physical limit at once (registry next door, unshaped) | {limit_slowest:.2} s ({:.2}x alone) | {:.2} s | - | {} |\n",
                r["image"].as_str().unwrap_or(""),
                limit_slowest / alone.max(1e-9),
                limit["median_s"].as_f64().unwrap_or(0.0),
                busy(limit),
            ));
        }
        let f = &r["ferry"];
        let up = f["upstream_bytes"].as_f64().unwrap_or(0.0) / total;
        let slowest = f["slowest_s"].as_f64().unwrap_or(0.0);
        let slow = slowest / alone.max(1e-9);
        out.push_str(&format!(
            "targets for {}: upstream {up:.2}x <= {UPSTREAM_TARGET}x: {}; slowest {slow:.2}x alone <= {slowest_target}x: {}",
            r["image"].as_str().unwrap_or(""),
            if up <= UPSTREAM_TARGET { "met" } else { "MISSED" },
            if slow <= slowest_target { "met" } else { "MISSED" },
        ));
        // What no mirror can beat on this machine: one node alone through the shaped link,
        // or every node at once with no link at all, whichever is slower.
        let floor = alone.max(limit_slowest);
        if limit_slowest > 0.0 {
            out.push_str(&format!(
                "; slowest {:.2}x the physical limit ({floor:.2} s)",
                slowest / floor.max(1e-9)
            ));
        }
        out.push('\n');
    }
    out
}

/// A chart panel: title, target label, target, and the ratio it shows for a result's column.
type Panel<'a> = (&'a str, &'a str, f64, &'a dyn Fn(&Value, &str) -> f64);

/// Two panels of grouped bars per image: the slowest node against one node alone (target
/// 1.3x, 1.5x on equal node links), and the upstream bytes against the image (target 1.1x).
/// Lower is better in both.
pub fn chart(report: &Value, path: &Path) {
    use plotters::prelude::*;
    super::report::register_font();
    let results = report["storm"]["results"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let palette = [
        RGBColor(150, 150, 150),
        RGBColor(30, 120, 200),
        RGBColor(200, 60, 120),
        RGBColor(60, 200, 200),
        RGBColor(100, 100, 30),
        RGBColor(20, 170, 120),
        RGBColor(230, 140, 30),
        RGBColor(120, 80, 160),
    ];
    let mut named = results.first().map(columns).unwrap_or_default();
    named.push((
        "physical limit at once (no upstream)".into(),
        "limit_at_once".into(),
    ));
    let columns: Vec<(String, String, RGBColor)> = named
        .into_iter()
        .enumerate()
        .map(|(i, (name, key))| (name, key, palette[i % palette.len()]))
        .collect();
    let target = slowest_target(report);
    let target_label = format!("target: {target}x");
    let slowest = |r: &Value, key: &str| {
        r[key]["slowest_s"].as_f64().unwrap_or(0.0) / r["alone_s"].as_f64().unwrap_or(1.0)
    };
    let upstream = |r: &Value, key: &str| {
        r[key]["upstream_bytes"].as_f64().unwrap_or(0.0) / r["total_bytes"].as_f64().unwrap_or(1.0)
    };
    let root = BitMapBackend::new(path, (1400, 600)).into_drawing_area();
    root.fill(&WHITE).unwrap();
    let panels = root.split_evenly((1, 2));
    let metrics: [Panel; 2] = [
        (
            "Slowest node, in pulls of one node alone",
            &target_label,
            target,
            &slowest,
        ),
        (
            "Bytes from upstream, in images",
            "target: 1.1x",
            UPSTREAM_TARGET,
            &upstream,
        ),
    ];
    let labels: Vec<String> = results
        .iter()
        .map(|r| r["image"].as_str().unwrap_or("").to_string())
        .collect();
    for (panel, (title, target_label, target, value)) in panels.iter().zip(metrics) {
        let max = results
            .iter()
            .flat_map(|r| columns.iter().map(move |(_, k, _)| value(r, k)))
            .fold(target, f64::max);
        let n = results.len().max(1) as f64;
        let mut chart = ChartBuilder::on(panel)
            .caption(title, ("sans-serif", 22))
            .margin(20)
            .x_label_area_size(50)
            .y_label_area_size(50)
            .build_cartesian_2d(0f64..n, 0f64..max * 1.5)
            .unwrap();
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(results.len().max(1) * 2 + 1)
            .x_label_formatter(&|x| {
                if (x.fract() - 0.5).abs() < 0.01 {
                    labels.get(x.floor() as usize).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .y_desc("lower is better")
            .draw()
            .unwrap();
        let width = 0.8 / columns.len() as f64;
        for (s, (name, key, color)) in columns.iter().enumerate() {
            let bars = results.iter().enumerate().map(|(i, r)| {
                let x0 = i as f64 + 0.1 + s as f64 * width;
                Rectangle::new([(x0, 0.0), (x0 + width, value(r, key))], color.filled())
            });
            chart
                .draw_series(bars)
                .unwrap()
                .label(name.clone())
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 10, y + 5)], color.filled())
                });
        }
        let red = RGBColor(200, 30, 30);
        chart
            .draw_series(DashedLineSeries::new(
                [(0.0, target), (n, target)],
                8,
                6,
                red.stroke_width(2),
            ))
            .unwrap()
            .label(target_label)
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 12, y)], red.stroke_width(2)));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .unwrap();
    }
    root.present().unwrap();
}
