//! Three nodes and an upstream registry, each in its own network namespace on one bridge; each
//! node runs its own containerd and Ferry, bootstrapped from node 1. Node 1 pulls from upstream;
//! node 2 then gets every manifest and blob from node 1 (the upstream log shows only node 2's
//! resolution of the tag, which is the registry's to answer); with node 1's Ferry stopped,
//! node 3 still pulls.

#![allow(clippy::unwrap_used)] // test helpers panic by design

mod support;

use std::time::Duration;

use support::cluster::{Node, P2P_PORT, registry_host};
use support::netns::Net;
use support::*;

const LAYERS: usize = 3;
const LAYER_BYTES: usize = 4 * 1024 * 1024;

/// Since request `before`, `node` asked the registry for the tag `v1` and nothing else
/// (Ferry's own reachability probes, `GET /v2/` without credentials, aside).
fn asked_upstream_only_the_tag(registry: &Registry, before: usize, node: &Node) {
    let asked: Vec<_> = registry.requests()[before..]
        .iter()
        .filter(|(remote, _, _)| remote.starts_with(&format!("{}:", node.ip)))
        .map(|(_, method, uri)| (method.clone(), uri.clone()))
        .filter(|(_, uri)| uri != "/v2/")
        .collect();
    assert_eq!(
        asked,
        [("HEAD".to_string(), "/v2/team/app/manifests/v1".to_string())],
        "{} asked upstream for more than the tag",
        node.name
    );
}

#[test]
fn node_two_gets_every_blob_from_node_one_and_node_three_survives_node_one_going_away() {
    // Declared first, dropped last: processes stop before their namespaces are deleted.
    let mut net = Net::new();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (registry, registry_addr) = registry_host(&mut net, dir, "up", 1);
    let image = Image::generate(&dir.join("image"), "v1", LAYERS, LAYER_BYTES);
    image.push(registry_addr, "team/app");
    let reference = format!("{registry_addr}/team/app:v1");

    let mut node1 = Node::start(&mut net, dir, "n1", 11, registry_addr, &[]);
    let seed = format!("{}:{P2P_PORT}", node1.ip);
    let node2 = Node::start(
        &mut net,
        dir,
        "n2",
        12,
        registry_addr,
        &["--bootstrap-peers", &seed],
    );
    let node3 = Node::start(
        &mut net,
        dir,
        "n3",
        13,
        registry_addr,
        &["--bootstrap-peers", &seed],
    );
    wait_for("nodes 2 and 3 connected to node 1", || {
        node1.metric("ferry_peers_connected") >= 2
    });

    // Node 1: nobody has the image yet, so its Ferry answers 404 and containerd goes upstream.
    node1
        .containerd
        .pull("k8s.io", &reference, &node1.containerd.hosts_dir);
    assert_eq!(node1.image_digest(&reference), image.manifest);
    let blobs = LAYERS + 1; // layers and config
    let keys = blobs + 2; // + manifest + tag
    wait_for("node 1 advertises the image", || {
        node1.metric("ferry_keys_advertised") >= keys as u64
    });

    // Node 2: every manifest and blob comes from node 1.
    let before = registry.requests().len();
    node2
        .containerd
        .pull("k8s.io", &reference, &node2.containerd.hosts_dir);
    assert_eq!(
        node2.image_digest(&reference),
        image.manifest,
        "node 2 has the right image"
    );
    // The tag is the registry's to answer (it may have moved); everything by digest came
    // from node 1.
    asked_upstream_only_the_tag(&registry, before, &node2);
    assert!(
        node2.metric("ferry_served_total{kind=\"blob\",source=\"peer\"}") >= blobs as u64,
        "{}",
        node2.metrics()
    );
    let image_bytes: u64 = image.digests()[1..]
        .iter()
        .map(|d| image.blob(d).len() as u64)
        .sum();
    assert_eq!(
        node2.metric("ferry_bytes_served_total{kind=\"blob\",source=\"peer\"}"),
        image_bytes
    );
    let content = node2.containerd.ctr(&["-n", "k8s.io", "content", "ls"]);
    for digest in image.digests() {
        assert!(
            content.contains(&digest),
            "node 2's containerd holds {digest}"
        );
    }

    // Node 1's Ferry goes away: node 3 still pulls (from node 2, or upstream).
    node1.ferry.signal("KILL");
    node1.ferry.wait(Duration::from_secs(10));
    node3
        .containerd
        .pull("k8s.io", &reference, &node3.containerd.hosts_dir);
    assert_eq!(node3.image_digest(&reference), image.manifest);

    drop(node3);
    drop(node2);
    drop(node1);
    drop(registry);
    drop(tmp);
    drop(net);
}

/// A new node pool: node 2 starts while the node it bootstraps from is not listening yet
/// (node 1's Ferry comes back a second later). Node 2 is not ready until it has found node 1
/// (it dials again within tens of milliseconds, not 10 s later), so the first pull after it
/// turns ready (the kubelet's, held back by the ready taint until then) gets every blob
/// from node 1 and asks the upstream only for the tag.
#[test]
fn a_node_started_before_its_peer_is_ready_only_once_it_has_found_it() {
    let mut net = Net::new();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (registry, registry_addr) = registry_host(&mut net, dir, "up", 1);
    let image = Image::generate(&dir.join("image"), "v1", LAYERS, LAYER_BYTES);
    image.push(registry_addr, "team/app");
    let reference = format!("{registry_addr}/team/app:v1");
    let ready = |n: &Node| http_status(&format!("http://{}/readyz", n.metrics_addr())) == Some(200);

    let mut node1 = Node::start(&mut net, dir, "n1", 11, registry_addr, &[]);
    node1
        .containerd
        .pull("k8s.io", &reference, &node1.containerd.hosts_dir);
    node1.ferry.stop();

    let seed = format!("{}:{P2P_PORT}", node1.ip);
    let node2 = Node::start(
        &mut net,
        dir,
        "n2",
        12,
        registry_addr,
        &["--bootstrap-peers", &seed],
    );
    wait_for("node 2's containerd to be reachable", || {
        node2.metric("ferry_containerd_up") == 1
    });
    assert!(
        !ready(&node2),
        "ready with no peer while bootstrap names one"
    );
    std::thread::sleep(Duration::from_secs(1));
    node1.spawn_ferry();
    wait_for("node 2 ready", || ready(&node2));
    assert!(node2.metric("ferry_peers_connected") >= 1);
    wait_for("node 1 advertises the image again", || {
        node1.metric("ferry_keys_advertised") >= (LAYERS + 3) as u64
    });

    let before = registry.requests().len();
    node2
        .containerd
        .pull("k8s.io", &reference, &node2.containerd.hosts_dir);
    assert_eq!(node2.image_digest(&reference), image.manifest);
    // The tag is the registry's to answer (it may have moved); everything by digest came
    // from node 1.
    asked_upstream_only_the_tag(&registry, before, &node2);

    drop(node2);
    drop(node1);
    drop(registry);
    drop(tmp);
    drop(net);
}
