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

pub struct Setup<'a> {
    pub registry: &'a Registry,
    pub upstream: SocketAddr,
    pub cache: SocketAddr,
    /// An unshaped registry on the same bridge: every node pulling from it at once shows what
    /// N simultaneous pulls cost on this machine with no network limit (the physical limit).
    pub near: SocketAddr,
    pub dir: &'a Path,
}

fn max(v: &[f64]) -> f64 {
    v.iter().copied().fold(0.0, f64::max)
}

/// One scenario's figures: every node's time, and what the upstream sent.
fn figures(times: &[f64], upstream_bytes: u64) -> Value {
    json!({
        "pull_s": times, "slowest_s": max(times), "median_s": median(times),
        "upstream_bytes": upstream_bytes,
    })
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
        let baseline = pull_at_once(&everyone, &reference, |n| dirs(n, &plain));
        let baseline_bytes = bytes_served(setup.registry, mark);
        forget(nodes, &reference, &img);

        let (reference, img) = image(&tag("ferry"), per_layer);
        let mark = completed(setup.registry);
        let ferry = pull_at_once(&everyone, &reference, |n| n.containerd.hosts_dir.clone());
        let ferry_bytes = bytes_served(setup.registry, mark);
        forget(nodes, &reference, &img);

        let (reference, img) = image(&tag("cache"), per_layer);
        let mark = completed(setup.registry);
        let cache = pull_at_once(&everyone, &reference, |n| dirs(n, &via));
        let cache_bytes = bytes_served(setup.registry, mark);
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
        let limit = pull_at_once(&everyone, &reference, |n| dirs(n, &near));
        forget(nodes, &reference, &img);

        let entry = json!({
            "image": format!("{label} in {layers} layers"), "total_bytes": total, "layers": layers,
            "alone_s": alone,
            "baseline": figures(&baseline, baseline_bytes),
            "ferry": figures(&ferry, ferry_bytes),
            "pull_through_cache": figures(&cache, cache_bytes),
            "limit_at_once": figures(&limit, 0),
        });
        eprintln!("{}", serde_json::to_string_pretty(&entry).unwrap());
        rounds.push((label.clone(), *total, entry));
    }

    // The same storms through Ferry with coalescing off, in the same run.
    for n in nodes.iter_mut() {
        n.restart_ferry_with(&["--coalesce", "false"]);
    }
    wait_connected(nodes);
    for (label, total, entry) in &mut rounds {
        let per_layer = *total / layers;
        let (reference, img) = image(&format!("{}-uncoalesced", label.to_lowercase()), per_layer);
        let mark = completed(setup.registry);
        let everyone: Vec<&Node> = nodes.iter().collect();
        let times = pull_at_once(&everyone, &reference, |n| n.containerd.hosts_dir.clone());
        entry["ferry_uncoalesced"] = figures(&times, bytes_served(setup.registry, mark));
        forget(nodes, &reference, &img);
    }
    for n in nodes.iter_mut() {
        n.restart_ferry_with(&[]);
    }
    json!({"results": rounds.into_iter().map(|(_, _, e)| e).collect::<Vec<_>>()})
}

fn nodes_index(nodes: &[&Node], node: &Node) -> usize {
    nodes.iter().position(|n| n.name == node.name).unwrap()
}

/// The storm table, as printed (and copied into the README).
pub fn table(report: &Value) -> String {
    let mib = |v: &Value| v.as_f64().unwrap_or(0.0) / (1 << 20) as f64;
    let mut out = format!(
        "storm: {} nodes pull a new image at the same moment; upstream {}\n\
         | image | one node alone | column | slowest | median | upstream MiB (x image) |\n\
         |---|---|---|---|---|---|\n",
        report["nodes"], report["upstream_rate"]
    );
    for r in report["storm"]["results"].as_array().into_iter().flatten() {
        let total = r["total_bytes"].as_f64().unwrap_or(1.0);
        let alone = r["alone_s"].as_f64().unwrap_or(0.0);
        for (column, key) in [
            ("baseline (no mirror)", "baseline"),
            ("Ferry, coalescing off", "ferry_uncoalesced"),
            ("Ferry", "ferry"),
            ("pull-through cache", "pull_through_cache"),
        ] {
            let c = &r[key];
            let slowest = c["slowest_s"].as_f64().unwrap_or(0.0);
            let up = c["upstream_bytes"].as_f64().unwrap_or(0.0);
            out.push_str(&format!(
                "| {} | {alone:.2} s | {column} | {slowest:.2} s ({:.2}x alone) | {:.2} s | {:.1} ({:.2}x) |\n",
                r["image"].as_str().unwrap_or(""),
                slowest / alone.max(1e-9),
                c["median_s"].as_f64().unwrap_or(0.0),
                mib(&c["upstream_bytes"]),
                up / total,
            ));
        }
        let limit = &r["limit_at_once"];
        let limit_slowest = limit["slowest_s"].as_f64().unwrap_or(0.0);
        if limit_slowest > 0.0 {
            out.push_str(&format!(
                "| {} | {alone:.2} s | physical limit at once (registry next door, unshaped) | {limit_slowest:.2} s ({:.2}x alone) | {:.2} s | - |\n",
                r["image"].as_str().unwrap_or(""),
                limit_slowest / alone.max(1e-9),
                limit["median_s"].as_f64().unwrap_or(0.0),
            ));
        }
        let f = &r["ferry"];
        let up = f["upstream_bytes"].as_f64().unwrap_or(0.0) / total;
        let slowest = f["slowest_s"].as_f64().unwrap_or(0.0);
        let slow = slowest / alone.max(1e-9);
        out.push_str(&format!(
            "targets for {}: upstream {up:.2}x <= {UPSTREAM_TARGET}x: {}; slowest {slow:.2}x alone <= {SLOWEST_TARGET}x: {}",
            r["image"].as_str().unwrap_or(""),
            if up <= UPSTREAM_TARGET { "met" } else { "MISSED" },
            if slow <= SLOWEST_TARGET { "met" } else { "MISSED" },
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
/// 1.3x), and the upstream bytes against the image (target 1.1x). Lower is better in both.
pub fn chart(report: &Value, path: &Path) {
    use plotters::prelude::*;
    super::report::register_font();
    let results = report["storm"]["results"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let columns = [
        ("baseline (no mirror)", "baseline", RGBColor(150, 150, 150)),
        (
            "Ferry, coalescing off",
            "ferry_uncoalesced",
            RGBColor(30, 120, 200),
        ),
        ("Ferry", "ferry", RGBColor(20, 170, 120)),
        (
            "pull-through cache",
            "pull_through_cache",
            RGBColor(230, 140, 30),
        ),
        (
            "physical limit at once (no upstream)",
            "limit_at_once",
            RGBColor(120, 80, 160),
        ),
    ];
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
            "target: 1.3x",
            SLOWEST_TARGET,
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
                .label(*name)
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
