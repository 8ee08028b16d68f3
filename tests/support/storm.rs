//! Rollout storms on four nodes (each its own containerd and Ferry) and an upstream registry
//! behind a shaped link, in network namespaces: the cluster, the storm, and what the
//! upstream's log and each node's content store say about it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;

use super::cluster::{Node, P2P_PORT, registry_host};
use super::netns::Net;
use super::*;

pub const NODES: u8 = 4;
pub const LAYERS: usize = 2;
pub const LAYER_BYTES: usize = 12 * 1024 * 1024;
/// The upstream link: slow enough that every download is still in flight when the other
/// nodes ask (12 MiB layers take about half a second each at this rate).
pub const UPSTREAM_RATE: &str = "200mbit";
pub const FAULT_RATE: &str = "50mbit";

pub struct Cluster {
    pub nodes: Vec<Node>,
    pub registry: Registry,
    pub registry_addr: SocketAddr,
}

pub fn cluster(net: &mut Net, dir: &Path, rate: &str) -> Cluster {
    cluster_with(net, dir, rate, &[])
}

/// As [`cluster`], every Ferry started with `args` too.
pub fn cluster_with(net: &mut Net, dir: &Path, rate: &str, args: &[&str]) -> Cluster {
    let (registry, registry_addr) = registry_host(net, dir, "up", 1);
    shape(&net.namespaces[0], rate);
    let nodes = nodes_with(net, dir, registry_addr, args);
    Cluster {
        nodes,
        registry,
        registry_addr,
    }
}

/// The upstream's link to the cluster: shaped, as a registry across the internet is.
pub fn shape(ns: &str, rate: &str) {
    let status = in_netns(Some(ns), "tc")
        .args([
            "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate, "burst", "256kb",
            "latency", "100ms",
        ])
        .status()
        .unwrap();
    assert!(status.success(), "tc tbf");
}

/// What a node sends from its peer address, and nothing else, shaped to `rate`: its own
/// downloads' acknowledgements still leave at once, so it is fed as fast as before.
pub fn shape_peer_sending(ns: &str, rate: &str) {
    let port = super::cluster::PEER_PORT.to_string();
    let steps: [&[&str]; 4] = [
        &[
            "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "10",
        ],
        &[
            "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:10", "htb", "rate",
            "10gbit",
        ],
        &[
            "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:20", "htb", "rate", rate,
            "ceil", rate,
        ],
        &[
            "filter", "add", "dev", "eth0", "protocol", "ip", "parent", "1:", "prio", "1", "u32",
            "match", "ip", "sport", &port, "0xffff", "flowid", "1:20",
        ],
    ];
    for args in steps {
        let status = in_netns(Some(ns), "tc").args(args).status().unwrap();
        assert!(status.success(), "tc {args:?}");
    }
}

/// The nodes, pulling from `registry_addr`, all connected to all.
pub fn nodes(net: &mut Net, dir: &Path, registry_addr: SocketAddr) -> Vec<Node> {
    nodes_with(net, dir, registry_addr, &[])
}

/// As [`nodes`], every Ferry started with `args` too.
pub fn nodes_with(
    net: &mut Net,
    dir: &Path,
    registry_addr: SocketAddr,
    args: &[&str],
) -> Vec<Node> {
    // Every node bootstraps from all the others, as with the Kubernetes bootstrap (every
    // Ferry pod): a restarted node finds them all again at once.
    let mut nodes = Vec::new();
    for i in 1..=NODES {
        let others: Vec<String> = (1..=NODES)
            .filter(|j| *j != i)
            .map(|j| format!("{}:{P2P_PORT}", net.host_ip(10 + j)))
            .collect();
        let others = others.join(",");
        nodes.push(Node::start(
            net,
            dir,
            &format!("n{i}"),
            10 + i,
            registry_addr,
            &[&["--bootstrap-peers", &others][..], args].concat(),
        ));
    }
    // Every node sees every other: they all pick the same coordinator for a digest.
    wait_for("every node connected to every other", || {
        nodes
            .iter()
            .all(|n| n.metric("ferry_peers_connected") >= u64::from(NODES - 1))
    });
    nodes
}

/// Every node pulls `reference` at the same moment; `Err(output)` for a pull that failed.
pub fn storm(nodes: &[Node], references: &[String]) -> Vec<Result<String, String>> {
    let barrier = std::sync::Barrier::new(nodes.len());
    std::thread::scope(|s| {
        let pulls: Vec<_> = nodes
            .iter()
            .enumerate()
            .map(|(i, node)| {
                let barrier = &barrier;
                let reference = &references[i % references.len()];
                s.spawn(move || {
                    barrier.wait();
                    node.try_pull(reference)
                })
            })
            .collect();
        pulls.into_iter().map(|p| p.join().unwrap()).collect()
    })
}

/// `GET`s of each manifest and blob in the registry's log since `since`, by URI.
pub fn upstream_gets(registry: &Registry, since: usize) -> HashMap<String, usize> {
    let mut gets = HashMap::new();
    for (_, method, uri) in &registry.requests()[since..] {
        if method == "GET" && (uri.contains("/blobs/") || uri.contains("/manifests/sha256:")) {
            *gets.entry(uri.clone()).or_insert(0) += 1;
        }
    }
    gets
}

/// The registry's own log since `since` shows every manifest and blob of `image` fetched once.
pub fn each_fetched_once(registry: &Registry, since: usize, image: &Image, what: &str) {
    fetched_between(registry, since, image, 1..=1, what);
}

/// Every manifest and blob of `image` was fetched upstream a number of times in `times`.
pub fn fetched_between(
    registry: &Registry,
    since: usize,
    image: &Image,
    times: std::ops::RangeInclusive<usize>,
    what: &str,
) {
    let gets = upstream_gets(registry, since);
    for digest in image.digests() {
        let fetched: usize = gets
            .iter()
            .filter(|(uri, _)| uri.ends_with(&digest))
            .map(|(_, n)| n)
            .sum();
        assert!(
            times.contains(&fetched),
            "{what}: {digest} fetched from upstream {fetched} times: {gets:?}"
        );
    }
}

/// The test's directory; kept after the test (logs, configs) with `FERRY_TEST_KEEP=1`.
pub fn test_dir() -> (Option<tempfile::TempDir>, std::path::PathBuf) {
    let tmp = tempfile::Builder::new()
        .prefix("ferry-storm")
        .tempdir()
        .unwrap();
    let path = tmp.path().to_path_buf();
    eprintln!("test dir: {}", path.display());
    if std::env::var_os("FERRY_TEST_KEEP").is_some() {
        let _ = tmp.keep();
        return (None, path);
    }
    (Some(tmp), path)
}

pub fn sum(nodes: &[Node], metric: &str) -> u64 {
    nodes.iter().map(|n| n.metric(metric)).sum()
}

/// Storms share the machine's two cores and the upstream link's timing: one at a time.
static ONE_STORM_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    ONE_STORM_AT_A_TIME
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// A new image `tag` (its own random layers), pushed upstream; its reference.
pub fn new_image(c: &Cluster, dir: &Path, tag: &str) -> (Image, String) {
    let image = Image::generate_seeded(&dir.join(tag), tag, LAYERS, LAYER_BYTES, tag);
    image.push(c.registry_addr, "team/app");
    (image, format!("{}/team/app:{tag}", c.registry_addr))
}

/// Every node committed every digest of `image` byte for byte.
pub fn all_content_right(nodes: &[&Node], image: &Image) {
    for node in nodes {
        for digest in image.digests() {
            assert!(
                node.committed_matches(&digest),
                "{}: {digest} missing or wrong",
                node.name
            );
        }
    }
}

/// The node serving followers out of its download right now (in-flight bytes growing past
/// `before` by at least 1 MiB: mid-blob).
pub fn leader_mid_blob(nodes: &[Node], before: &[u64]) -> usize {
    growing_past(nodes, "ferry_inflight_bytes_total", before)
}

/// The node relaying right now (relayed bytes growing past `before` by at least 1 MiB).
pub fn relay_mid_blob(nodes: &[Node], before: &[u64]) -> usize {
    growing_past(nodes, "ferry_relayed_bytes_total", before)
}

fn growing_past(nodes: &[Node], metric: &str, before: &[u64]) -> usize {
    let mut found = None;
    wait_for(&format!("a node's {metric} growing mid-blob"), || {
        found = nodes
            .iter()
            .zip(before)
            .position(|(n, b)| n.metric(metric) > b + (1 << 20));
        found.is_some()
    });
    found.unwrap()
}

/// `metric` on every node, in order.
pub fn each(nodes: &[Node], metric: &str) -> Vec<u64> {
    nodes.iter().map(|n| n.metric(metric)).collect()
}

pub fn inflight(nodes: &[Node]) -> Vec<u64> {
    each(nodes, "ferry_inflight_bytes_total")
}

/// This node's libp2p peer ID, from its Ferry's start-up line.
pub fn peer_id(node: &Node) -> String {
    node.ferry
        .log_text()
        .lines()
        .find(|l| l.contains("peer-to-peer node started"))
        .and_then(|l| l.split("peer_id=").nth(1))
        .and_then(|r| r.split_whitespace().next())
        .unwrap_or_else(|| panic!("{}: no peer ID in its log", node.name))
        .to_string()
}
