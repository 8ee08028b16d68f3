//! Storm-proof rollouts, on four nodes (each its own containerd and Ferry) and an upstream
//! registry behind a shaped link, in network namespaces: when every node pulls the same new
//! image at the same moment, the upstream registry's own log shows each manifest and blob
//! fetched once, and every node ends with byte-identical content.

#![allow(clippy::unwrap_used)] // test helpers panic by design

mod support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;

use support::cluster::{Node, P2P_PORT, registry_host};
use support::netns::Net;
use support::*;

const NODES: u8 = 4;
const LAYERS: usize = 2;
const LAYER_BYTES: usize = 12 * 1024 * 1024;
/// The upstream link: slow enough that every download is still in flight when the other
/// nodes ask (12 MiB layers take about half a second each at this rate).
const UPSTREAM_RATE: &str = "200mbit";

struct Cluster {
    nodes: Vec<Node>,
    registry: Registry,
    registry_addr: SocketAddr,
}

fn cluster(net: &mut Net, dir: &Path) -> Cluster {
    let (registry, registry_addr) = registry_host(net, dir, "up", 1);
    let status = in_netns(Some(&net.namespaces[0]), "tc")
        .args([
            "qdisc",
            "add",
            "dev",
            "eth0",
            "root",
            "tbf",
            "rate",
            UPSTREAM_RATE,
            "burst",
            "256kb",
            "latency",
            "100ms",
        ])
        .status()
        .unwrap();
    assert!(status.success(), "tc tbf");
    let first = Node::start(net, dir, "n1", 11, registry_addr, &[]);
    let seed = format!("{}:{P2P_PORT}", first.ip);
    let mut nodes = vec![first];
    for i in 2..=NODES {
        nodes.push(Node::start(
            net,
            dir,
            &format!("n{i}"),
            10 + i,
            registry_addr,
            &["--bootstrap-peers", &seed],
        ));
    }
    // Every node sees every other: they all pick the same coordinator for a digest.
    wait_for("every node connected to every other", || {
        nodes
            .iter()
            .all(|n| n.metric("ferry_peers_connected") >= u64::from(NODES - 1))
    });
    Cluster {
        nodes,
        registry,
        registry_addr,
    }
}

/// Every node pulls `reference` at the same moment; `Err(output)` for a pull that failed.
fn storm(nodes: &[Node], references: &[String]) -> Vec<Result<String, String>> {
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
fn upstream_gets(registry: &Registry, since: usize) -> HashMap<String, usize> {
    let mut gets = HashMap::new();
    for (_, method, uri) in &registry.requests()[since..] {
        if method == "GET" && (uri.contains("/blobs/") || uri.contains("/manifests/sha256:")) {
            *gets.entry(uri.clone()).or_insert(0) += 1;
        }
    }
    gets
}

/// The blob as containerd committed it on `node` matches its digest.
fn committed_matches(node: &Node, digest: &str) -> bool {
    let out = std::process::Command::new("ctr")
        .arg("--address")
        .arg(&node.containerd.socket)
        .args(["-n", "k8s.io", "content", "get", digest])
        .output()
        .unwrap();
    out.status.success() && sha256_hex(&out.stdout) == digest
}

/// The test's directory; kept after the test (logs, configs) with `FERRY_TEST_KEEP=1`.
fn test_dir() -> (Option<tempfile::TempDir>, std::path::PathBuf) {
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

fn sum(nodes: &[Node], metric: &str) -> u64 {
    nodes.iter().map(|n| n.metric(metric)).sum()
}

#[test]
fn four_nodes_pulling_one_new_image_at_once_fetch_each_blob_upstream_once() {
    let mut net = Net::new();
    let (tmp, dir) = test_dir();
    let dir = dir.as_path();
    let c = cluster(&mut net, dir);
    let image = Image::generate(&dir.join("image"), "v1", LAYERS, LAYER_BYTES);
    image.push(c.registry_addr, "team/app");
    let reference = format!("{}/team/app:v1", c.registry_addr);

    let since = c.registry.requests().len();
    let results = storm(&c.nodes, std::slice::from_ref(&reference));
    for (node, result) in c.nodes.iter().zip(&results) {
        if let Err(out) = result {
            panic!("{}'s pull failed:\n{out}", node.name);
        }
        assert_eq!(
            node.image_digest(&reference),
            image.manifest,
            "{}",
            node.name
        );
        for digest in image.digests() {
            assert!(committed_matches(node, &digest), "{}: {digest}", node.name);
        }
    }
    let gets = upstream_gets(&c.registry, since);
    for digest in image.digests() {
        let fetched: usize = gets
            .iter()
            .filter(|(uri, _)| uri.ends_with(&digest))
            .map(|(_, n)| n)
            .sum();
        assert_eq!(
            fetched, 1,
            "{digest} fetched from upstream {fetched} times: {gets:?}"
        );
    }
    let followed = sum(
        &c.nodes,
        "ferry_coalesce_total{role=\"follower\",result=\"served\"}",
    );
    // Followers got everything they did not find complete at a provider from a leader.
    assert!(followed >= 1, "followers served: {followed}");
    assert!(
        sum(&c.nodes, "ferry_inflight_bytes_total") > 0,
        "some bytes came from a download in progress"
    );

    drop(c);
    drop(tmp);
    drop(net);
}
