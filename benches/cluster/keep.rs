//! Layers kept for peers (`--keep`): what Ferry's lease costs in disk and DHT traffic, and what
//! it saves. Every node's containerd discards layers once unpacked (EKS AL2023's and Talos's
//! default) and pulls through CRI, as the kubelet does. Each column is a fresh cluster: the
//! nodes roll out `versions` images one after the other (every node pulls version v at once,
//! then the kubelet removes version v-1), the keep budget room for three versions. Then a node
//! that joins pulls every earlier version (a scale-up of an old deployment, or a rollback):
//! what the cluster still holds comes from peers, the rest from upstream.
//! Columns: no lease (`--keep-budget 0`), the lease least recently used first
//! (`--keep-copies 0`), the lease with `--keep-copies 2` (the default).

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::support::cluster::{Node, P2P_PORT};
use super::support::netns::Net;
use super::support::{Image, Registry, wait_for};
use super::{bytes_served, completed};

/// Versions the budget has room for, beyond what images keep.
const BUDGET_VERSIONS: usize = 3;
/// After a rollout's pulls: the keeper counts 2 s after new holds, then up to 2 s per count.
const SETTLE: Duration = Duration::from_secs(6);

struct Mode {
    name: &'static str,
    args: Vec<String>,
}

fn modes(budget: usize) -> Vec<Mode> {
    let budget = budget.to_string();
    let lease = |copies: &str| {
        vec![
            "--keep-budget".into(),
            budget.clone(),
            "--keep-copies".into(),
            copies.into(),
        ]
    };
    vec![
        Mode {
            name: "no lease",
            args: vec!["--keep-budget".into(), "0".into()],
        },
        Mode {
            name: "lease, LRU only (--keep-copies 0)",
            args: lease("0"),
        },
        Mode {
            name: "lease, --keep-copies 2",
            args: lease("2"),
        },
    ]
}

/// The sum of every series of `family` on `node`.
fn family_sum(node: &Node, family: &str) -> f64 {
    node.metrics()
        .lines()
        .filter(|l| l.starts_with(family) && !l.starts_with('#'))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn cri(node: &Node, reference: &str, remove: bool) {
    let done = if remove {
        node.cri_remove(reference)
    } else {
        node.cri_pull(reference)
    };
    if let Err(out) = done {
        panic!("CRI on {} for {reference}: {out}", node.name);
    }
}

/// Runs every column; `image_bytes` per version in `layers` layers.
pub fn run(nodes: usize, image_bytes: usize, layers: usize, versions: usize) -> Value {
    let mut net = Net::new();
    let tmp = tempfile::Builder::new()
        .prefix("ferry-bench-keep")
        .tempdir()
        .unwrap();
    let dir = tmp.path();
    let up_ns = net.add_host("up", 1);
    let upstream = SocketAddr::new(net.host_ip(1), 5000);
    let registry = Registry::start_at(&dir.join("registry"), Some(&up_ns), upstream);
    let images: Vec<Image> = (0..versions)
        .map(|v| {
            let tag = format!("v{v}");
            let image = Image::generate(
                &dir.join("images").join(&tag),
                &tag,
                layers,
                image_bytes / layers,
            );
            image.push(upstream, "bench/app");
            let _ = std::fs::remove_dir_all(&image.layout);
            image
        })
        .collect();
    let refs: Vec<String> = images
        .iter()
        .map(|i| format!("{upstream}/bench/app:{}", i.tag))
        .collect();
    let secret = dir.join("secret");
    std::fs::write(&secret, "benchmark cluster secret, long enough\n").unwrap();
    let budget = BUDGET_VERSIONS * image_bytes + image_bytes / layers / 2;
    let cluster = Cluster {
        dir,
        secret: &secret,
        registry: &registry,
        upstream,
        images: &images,
        refs: &refs,
        image_bytes,
        nodes,
    };
    let columns: Vec<Value> = modes(budget)
        .into_iter()
        .enumerate()
        .map(|(m, mode)| {
            eprintln!("== {}", mode.name);
            let first_host = 11 + (m * (nodes + 1)) as u8;
            column(&mut net, &cluster, &mode, first_host)
        })
        .collect();
    drop(registry);
    drop(tmp);
    drop(net);
    json!({
        "nodes": nodes,
        "versions": versions,
        "image_bytes": image_bytes,
        "layers": layers,
        "budget_bytes": budget,
        "columns": columns,
    })
}

/// What every column shares.
struct Cluster<'a> {
    dir: &'a Path,
    secret: &'a Path,
    registry: &'a Registry,
    upstream: SocketAddr,
    images: &'a [Image],
    refs: &'a [String],
    image_bytes: usize,
    nodes: usize,
}

fn column(net: &mut Net, c: &Cluster, mode: &Mode, first_host: u8) -> Value {
    let (dir, secret, upstream, images, refs, count) =
        (c.dir, c.secret, c.upstream, c.images, c.refs, c.nodes);
    let hosts: Vec<u8> = (0..=count).map(|i| first_host + i as u8).collect();
    let start = |net: &mut Net, i: usize| {
        let others: Vec<String> = hosts[..count]
            .iter()
            .filter(|h| **h != hosts[i])
            .map(|h| format!("{}:{P2P_PORT}", net.host_ip(*h)))
            .collect();
        let seed = others.join(",");
        let mut args: Vec<&str> = vec![
            "--cluster-secret-file",
            secret.to_str().unwrap(),
            "--log-level",
            "info",
            "--bootstrap-peers",
            &seed,
        ];
        args.extend(mode.args.iter().map(String::as_str));
        let name = format!("k{}", hosts[i]);
        Node::start_discarding(net, dir, &name, hosts[i], upstream, &args)
    };
    let nodes: Vec<Node> = (0..count).map(|i| start(net, i)).collect();
    wait_for("nodes connected", || {
        nodes
            .iter()
            .all(|n| n.metric("ferry_peers_connected") as usize >= count - 1)
    });
    let dht = |nodes: &[Node]| -> f64 {
        nodes
            .iter()
            .map(|n| family_sum(n, "ferry_dht_requests_received_total"))
            .sum()
    };
    let dht_before = dht(&nodes);
    let started = Instant::now();
    for (v, reference) in refs.iter().enumerate() {
        std::thread::scope(|s| {
            for node in &nodes {
                s.spawn(move || cri(node, reference, false));
            }
        });
        if v > 0 {
            for node in &nodes {
                cri(node, &refs[v - 1], true);
            }
        }
        std::thread::sleep(SETTLE);
    }
    let seconds = started.elapsed().as_secs_f64();
    let dht_per_node_s = (dht(&nodes) - dht_before) / count as f64 / seconds;
    let held: Vec<(usize, u64)> = nodes.iter().map(Node::lease_bytes).collect();
    let lookups: f64 = nodes
        .iter()
        .map(|n| n.metric("ferry_keep_copy_lookups_total") as f64)
        .sum::<f64>()
        / count as f64;
    // Versions whose every layer some node's lease keeps (a layer let go may stay on disk
    // until containerd's next collection; no node offers it any more).
    let leased: Vec<BTreeSet<String>> = nodes
        .iter()
        .map(|n| n.lease_blobs().into_iter().map(|(d, _)| d).collect())
        .collect();
    let kept_versions = images
        .iter()
        .filter(|image| {
            image
                .layers
                .iter()
                .all(|l| leased.iter().any(|held| held.contains(l)))
        })
        .count();

    // A node joins and pulls every earlier version.
    let joiner = start(net, count);
    wait_for("the new node connected", || {
        joiner.metric("ferry_peers_connected") as usize >= count
    });
    let mark = completed(c.registry);
    for reference in &refs[..refs.len() - 1] {
        cri(&joiner, reference, false);
    }
    let upstream_bytes = bytes_served(c.registry, mark);
    let earlier_bytes = (c.refs.len() - 1) as u64 * c.image_bytes as u64;
    let column = json!({
        "mode": mode.name,
        "held_bytes_per_node": held.iter().map(|h| h.1).collect::<Vec<_>>(),
        "held_blobs_per_node": held.iter().map(|h| h.0).collect::<Vec<_>>(),
        "versions_kept_in_cluster": kept_versions,
        "dht_requests_per_node_per_s": dht_per_node_s,
        "copy_lookups_per_node": lookups,
        "rollout_seconds": seconds,
        "joiner_upstream_bytes": upstream_bytes,
        "joiner_earlier_bytes": earlier_bytes,
    });
    drop(joiner);
    drop(nodes);
    column
}

/// One row's text for a column.
type Cell = Box<dyn Fn(&Value) -> String>;

/// The README's table: one column per mode.
pub fn table(report: &Value) -> String {
    let columns = report["columns"].as_array().cloned().unwrap_or_default();
    let versions = report["versions"].as_u64().unwrap_or(0);
    let mib = |b: f64| format!("{:.1}", b / (1u64 << 20) as f64);
    let mut rows: Vec<(String, Cell)> = Vec::new();
    rows.push((
        "held by the lease per node, MiB (mean / max)".into(),
        Box::new(move |c: &Value| {
            let held: Vec<f64> = c["held_bytes_per_node"]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_f64).collect())
                .unwrap_or_default();
            let mean = held.iter().sum::<f64>() / held.len().max(1) as f64;
            let max = held.iter().copied().fold(0.0, f64::max);
            format!("{} / {}", mib(mean), mib(max))
        }),
    ));
    rows.push((
        format!("versions some node still has (of {versions})"),
        Box::new(|c: &Value| c["versions_kept_in_cluster"].to_string()),
    ));
    rows.push((
        "a new node's earlier versions from upstream".into(),
        Box::new(|c: &Value| {
            let up = c["joiner_upstream_bytes"].as_f64().unwrap_or(0.0);
            let all = c["joiner_earlier_bytes"].as_f64().unwrap_or(1.0);
            format!("{:.0}%", 100.0 * up / all)
        }),
    ));
    rows.push((
        "DHT requests per node per second".into(),
        Box::new(|c: &Value| {
            format!(
                "{:.2}",
                c["dht_requests_per_node_per_s"].as_f64().unwrap_or(0.0)
            )
        }),
    ));
    rows.push((
        "copy lookups per node".into(),
        Box::new(|c: &Value| format!("{:.1}", c["copy_lookups_per_node"].as_f64().unwrap_or(0.0))),
    ));
    let mut out = format!(
        "{} nodes, {} versions of {} MiB in {} layer(s), budget {} MiB per node\n\n|  |",
        report["nodes"],
        versions,
        report["image_bytes"].as_u64().unwrap_or(0) >> 20,
        report["layers"],
        report["budget_bytes"].as_u64().unwrap_or(0) >> 20,
    );
    for c in &columns {
        out.push_str(&format!(" {} |", c["mode"].as_str().unwrap_or("")));
    }
    out.push_str(&format!("\n|---|{}\n", "---|".repeat(columns.len())));
    for (name, cell) in rows {
        out.push_str(&format!("| {name} |"));
        for c in &columns {
            out.push_str(&format!(" {} |", cell(c)));
        }
        out.push('\n');
    }
    out
}
