//! Layers stay shareable where containerd discards them once unpacked
//! (`discard_unpacked_layers = true`, as on EKS's AL2023 nodes and Talos) and after the
//! kubelet removed their image: Ferry holds what its node pulls in a containerd lease of its
//! own, within `--keep-budget`, and `ferry cleanup` ends the lease. Pulls go through CRI
//! `PullImage`, as the kubelet's do (only the CRI plugin discards).

#![allow(clippy::unwrap_used)] // test helpers panic by design

mod support;

use std::process::Command;
use std::time::Duration;

use support::cluster::{Node, P2P_PORT, registry_host};
use support::netns::Net;
use support::*;

const LAYERS: usize = 3;
const LAYER_BYTES: usize = 4 * 1024 * 1024;

fn cri_pull(node: &Node, reference: &str) {
    if let Err(out) = node.cri_pull(reference) {
        panic!("CRI PullImage on {} failed: {out}", node.name);
    }
}

fn has(node: &Node, digest: &str) -> bool {
    node.committed_matches(digest)
}

/// Ferry's leases on `node`, as `ctr leases ls` lists them.
fn ferry_leases(node: &Node) -> Vec<String> {
    node.containerd
        .ctr(&["-n", "k8s.io", "leases", "ls", "-q"])
        .lines()
        .filter(|l| l.starts_with("ferry-holds-"))
        .map(str::to_string)
        .collect()
}

/// When Ferry's lease on `node` expires: its `containerd.io/gc.expire` label, as `ctr leases
/// ls` shows it.
fn lease_expiry(node: &Node) -> std::time::SystemTime {
    let listed = node.containerd.ctr(&["-n", "k8s.io", "leases", "ls"]);
    let line = listed
        .lines()
        .find(|l| l.starts_with("ferry-holds-"))
        .expect("Ferry's lease");
    let value = line
        .split("containerd.io/gc.expire=")
        .nth(1)
        .and_then(|v| v.split([',', ' ']).next())
        .expect("an expiry label");
    humantime::parse_rfc3339(value).expect("an RFC 3339 time")
}

/// The node's libp2p peer ID, from `ferry status --json`.
fn peer_id(node: &Node) -> String {
    let status: serde_json::Value = serde_json::from_str(&node.status(true)).unwrap();
    status["this_node"]["id"].as_str().unwrap().to_string()
}

/// `ferry cleanup` on `node`, as the chart's uninstall runs it.
fn cleanup(node: &Node) -> String {
    let out = Command::new("ip")
        .args(["netns", "exec", &node.ns])
        .arg(Ferry::bin())
        .arg("cleanup")
        .arg("--hosts-dir")
        .arg(&node.containerd.hosts_dir)
        .arg("--containerd-socket")
        .arg(&node.containerd.socket)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "ferry cleanup failed: {text}{err}");
    text
}

/// A node without Ferry's lease keeps none of the layers (discarding is on in this
/// containerd); one with it keeps every layer, also once the kubelet removed the image, and
/// another node gets them all from it: the registry serves it nothing but the tag. `ferry
/// cleanup` ends the lease, and containerd then drops what only the lease kept.
#[test]
fn layers_a_discarding_containerd_drops_stay_shareable_until_cleanup() {
    let mut net = Net::new();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (registry, registry_addr) = registry_host(&mut net, dir, "up", 1);
    let image = Image::generate(&dir.join("image"), "v1", LAYERS, LAYER_BYTES);
    image.push(registry_addr, "team/app");
    let reference = format!("{registry_addr}/team/app:v1");

    // The control: the same containerd without Ferry's lease keeps no layer.
    let off = ["--keep-budget", "0"];
    let control = Node::start_discarding(&mut net, dir, "n0", 10, registry_addr, &off);
    cri_pull(&control, &reference);
    wait_for("the control node to discard its layers", || {
        image.layers.iter().all(|l| !has(&control, l))
    });
    assert!(has(&control, &image.manifest), "the image stays");
    drop(control);

    let node1 = Node::start_discarding(&mut net, dir, "n1", 11, registry_addr, &[]);
    cri_pull(&node1, &reference);
    // Longer than the control took to discard: containerd collects after every deletion.
    std::thread::sleep(Duration::from_secs(3));
    for layer in &image.layers {
        assert!(has(&node1, layer), "{layer} kept for peers");
    }
    assert_eq!(ferry_leases(&node1).len(), 1, "one lease of Ferry's");
    assert!(node1.metric("ferry_kept_blobs") >= LAYERS as u64);
    wait_for("node 1 to advertise every layer", || {
        node1.metric("ferry_keys_advertised") >= (LAYERS + 3) as u64
    });
    // The kubelet's image garbage collection: every blob stays held, served and advertised
    // (only the tag goes, which is the registry's to answer anyway).
    node1.cri_remove(&reference).unwrap();
    wait_for("node 1 to withdraw the tag", || {
        node1.metric("ferry_keys_advertised") == (LAYERS + 2) as u64
    });
    assert!(
        node1.image_digest(&reference).is_empty(),
        "the image is gone"
    );

    let seed = format!("{}:{P2P_PORT}", node1.ip);
    let node2 = Node::start(
        &mut net,
        dir,
        "n2",
        12,
        registry_addr,
        &["--bootstrap-peers", &seed],
    );
    wait_for("node 2 to find node 1", || {
        node2.metric("ferry_peers_connected") >= 1
    });
    let before = registry.requests().len();
    cri_pull(&node2, &reference);
    let blobs: Vec<String> = registry.requests()[before..]
        .iter()
        .filter(|(_, _, uri)| uri.contains("/blobs/"))
        .map(|(_, _, uri)| uri.clone())
        .collect();
    assert!(blobs.is_empty(), "the registry served blobs: {blobs:?}");
    for digest in image.digests() {
        assert!(
            node2.committed_matches(&digest),
            "{digest} correct on node 2"
        );
    }

    // Uninstall: Ferry stops, cleanup ends the lease, containerd discards as configured.
    let mut node1 = node1;
    node1.ferry.stop();
    let said = cleanup(&node1);
    assert!(said.contains("lease removed"), "{said}");
    assert!(ferry_leases(&node1).is_empty(), "no lease left");
    wait_for(
        "node 1's containerd to free what only the lease kept",
        || image.digests().iter().all(|d| !has(&node1, d)),
    );
    assert!(
        cleanup(&node1).contains("no lease of ferry's"),
        "twice is harmless"
    );

    drop(node2);
    drop(node1);
    drop(registry);
    drop(tmp);
    drop(net);
}

/// Three single-layer images pulled one after the other, the budget room for two layers:
/// the first pulled goes, and the lease never keeps more than the budget, as containerd
/// counts it (manifests and configs included, though images keep those anyway). A restarted
/// Ferry takes over the lease and what it holds.
#[test]
fn over_the_keep_budget_the_least_recently_pulled_goes_first() {
    let mut net = Net::new();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (registry, registry_addr) = registry_host(&mut net, dir, "up", 1);
    let budget = 2 * LAYER_BYTES + LAYER_BYTES / 2;
    let budget_arg = budget.to_string();
    let mut node = Node::start_discarding(
        &mut net,
        dir,
        "n1",
        11,
        registry_addr,
        &["--keep-budget", &budget_arg],
    );
    let mut layers = Vec::new();
    for tag in ["a", "b", "c"] {
        let image = Image::generate(&dir.join(tag), tag, 1, LAYER_BYTES);
        image.push(registry_addr, "team/app");
        cri_pull(&node, &format!("{registry_addr}/team/app:{tag}"));
        layers.push(image.layers[0].clone());
        // The budget is counted shortly after each pull's holds.
        std::thread::sleep(Duration::from_secs(4));
        let (blobs, bytes) = node.lease_bytes();
        assert!(bytes <= budget as u64, "{blobs} blobs, {bytes} bytes held");
        assert!(node.metric("ferry_kept_alone_bytes") <= bytes);
    }
    wait_for("the first pulled layer to be let go", || {
        !has(&node, &layers[0])
    });
    let (_, bytes) = node.lease_bytes();
    assert!(bytes >= 2 * LAYER_BYTES as u64, "the two newest stay held");
    assert!(has(&node, &layers[1]) && has(&node, &layers[2]));
    assert_eq!(node.metric("ferry_keep_released_total"), 1);
    assert_eq!(node.metric("ferry_keep_budget_bytes"), budget as u64);

    node.restart_ferry_with(&[]);
    wait_for("the restarted Ferry to take over the lease", || {
        node.metric("ferry_kept_blobs") >= 2
    });
    assert_eq!(ferry_leases(&node).len(), 1, "the old lease went");
    // A lease left by a Ferry that never comes back goes on its own.
    let expires = lease_expiry(&node);
    let week = std::time::SystemTime::now() + Duration::from_secs(7 * 24 * 3600);
    let slack = Duration::from_secs(3600);
    assert!(
        expires > week - slack && expires < week + slack,
        "the lease expires 7 days ahead: {expires:?}"
    );
    std::thread::sleep(Duration::from_secs(3));
    assert!(has(&node, &layers[1]) && has(&node, &layers[2]));

    drop(node);
    drop(registry);
    drop(tmp);
    drop(net);
}

/// A blob deleted outright (`ctr content rm`, as an operator frees disk) is held no longer:
/// containerd removes its file, as it would without Ferry.
#[test]
fn a_blob_deleted_outright_is_freed_despite_the_lease() {
    let mut net = Net::new();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (registry, registry_addr) = registry_host(&mut net, dir, "up", 1);
    let image = Image::generate(&dir.join("image"), "v1", LAYERS, LAYER_BYTES);
    image.push(registry_addr, "team/app");
    let reference = format!("{registry_addr}/team/app:v1");
    let node = Node::start(&mut net, dir, "n1", 11, registry_addr, &[]);
    node.try_pull(&reference).unwrap();
    wait_for("node 1 to hold what it pulled", || {
        node.metric("ferry_kept_blobs") >= (LAYERS + 2) as u64
    });
    node.forget(&reference, &image.digests());
    wait_for("the holds to end", || node.metric("ferry_kept_blobs") == 0);

    drop(node);
    drop(registry);
    drop(tmp);
    drop(net);
}

/// Over the budget, a blob another node keeps goes before the last copy in the cluster,
/// though the last copy was used longer ago (`--keep-copies 1`): one DHT count per blob
/// looked at, none while within the budget. The other node comes first in the blob's
/// rendezvous order, so it is the one that keeps it.
#[test]
fn over_the_budget_the_last_copy_in_the_cluster_goes_last() {
    let mut net = Net::new();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (registry, registry_addr) = registry_host(&mut net, dir, "up", 1);
    let node2 = Node::start(&mut net, dir, "n2", 12, registry_addr, &[]);
    let seed = format!("{}:{P2P_PORT}", node2.ip);
    let budget = (LAYER_BYTES + LAYER_BYTES / 2).to_string();
    let args = [
        "--keep-budget",
        &budget,
        "--keep-copies",
        "1",
        "--bootstrap-peers",
        &seed,
    ];
    let node1 = Node::start_discarding(&mut net, dir, "n1", 11, registry_addr, &args);
    wait_for("node 1 to find node 2", || {
        node1.metric("ferry_peers_connected") >= 1
    });
    let (id1, id2) = (peer_id(&node1), peer_id(&node2));
    let only_here = Image::generate(&dir.join("only-here"), "only-here", 1, LAYER_BYTES);
    // An image whose layer node 2 keeps ahead of node 1 (half of all images).
    let also_there = (0..64)
        .map(|i| {
            let tag = format!("also-there-{i}");
            Image::generate(&dir.join(&tag), &tag, 1, LAYER_BYTES)
        })
        .find(|image| {
            let layer: ferry::oci::Digest = image.layers[0].parse().unwrap();
            ferry::routing::rendezvous::ahead(&id2, &id1, &layer)
        })
        .expect("an image node 2 keeps first");
    let refs: Vec<String> = [&only_here, &also_there]
        .iter()
        .map(|image| {
            image.push(registry_addr, "team/app");
            format!("{registry_addr}/team/app:{}", image.tag)
        })
        .collect();
    let layers = [only_here.layers[0].clone(), also_there.layers[0].clone()];
    node2.try_pull(&refs[1]).unwrap();
    cri_pull(&node1, &refs[0]);
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(
        node1.metric("ferry_keep_copy_lookups_total"),
        0,
        "within budget"
    );
    cri_pull(&node1, &refs[1]);
    wait_for("node 1 to let the other node's blob go", || {
        !has(&node1, &layers[1])
    });
    assert!(
        has(&node1, &layers[0]),
        "the last copy in the cluster stays"
    );
    assert_eq!(node1.metric("ferry_keep_released_total"), 1);
    assert_eq!(node1.metric("ferry_keep_copy_lookups_total"), 2);

    drop(node1);
    drop(node2);
    drop(registry);
    drop(tmp);
    drop(net);
}
