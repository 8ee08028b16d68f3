//! Three nodes and an upstream registry, each in its own network namespace on one bridge; each
//! node runs its own containerd and Ferry, bootstrapped from node 1. Node 1 pulls from upstream;
//! node 2 then gets every manifest and blob from node 1 (the upstream log shows only node 2's
//! resolution of the tag, which is the registry's to answer); with node 1's Ferry stopped,
//! node 3 still pulls.

#![allow(clippy::unwrap_used)] // test helpers panic by design

mod support;

use std::time::Duration;

use support::cluster::{Node, P2P_PORT, PEER_PORT, registry_host};
use support::netns::Net;
use support::*;

const LAYERS: usize = 3;
const LAYER_BYTES: usize = 4 * 1024 * 1024;

/// Since request `before`, `node` asked the registry for the tag `v1` and nothing else
/// (Ferry's own reachability probes, `GET /v2/` without credentials, aside).
fn asked_upstream_only_the_tag(registry: &Registry, before: usize, node: &Node) {
    // `10.0.0.5:40000` or `[fd00::5]:40000`
    let from_node = |remote: &str| {
        remote.rsplit_once(':').is_some_and(|(host, _)| {
            host.trim_start_matches('[').trim_end_matches(']') == node.ip.to_string()
        })
    };
    let asked: Vec<_> = registry.requests()[before..]
        .iter()
        .filter(|(remote, _, _)| from_node(remote))
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

/// The debug page on node 2 (`--debug-page true`), through a real HTTP client on the node
/// (python's urllib in its network namespace): the page names node 1 and the pulls; a test
/// pull of a layer comes from node 1, whole and matching its digest; an unknown digest says
/// nobody has it; from another host the page is refused.
fn debug_page_shows_the_node_and_test_pulls_through_peers(
    node1: &Node,
    node2: &Node,
    image: &Image,
) {
    let node1_id =
        serde_json::from_str::<serde_json::Value>(&node1.status(true)).unwrap()["this_node"]["id"]
            .as_str()
            .unwrap()
            .to_string();
    let from_outside = http_status(&format!("http://{}/debug", node2.metrics_addr()));
    assert_eq!(from_outside, Some(403));
    let (code, page) = node2.get_on_node("/debug");
    assert_eq!(code, 200, "{page}");
    for part in [
        ": <span class=\"ok\">ready</span>",
        node1_id.as_str(),
        "Recent pulls",
        image.layers[0].as_str(),
        "Test pull",
    ] {
        assert!(page.contains(part), "{part:?} in:\n{page}");
    }
    let layer = &image.layers[0];
    let (code, report) = node2.get_on_node(&format!("/debug/test-pull?digest={layer}&format=json"));
    assert_eq!(code, 200, "{report}");
    let report: serde_json::Value = serde_json::from_str(&report).unwrap();
    assert_eq!(report["ok"], true, "{report:#}");
    let served = report["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["outcome"] == "verified")
        .unwrap();
    assert_eq!(served["peer"], node1_id.as_str(), "{report:#}");
    assert_eq!(served["bytes"], image.blob(layer).len() as u64);
    // The HTML form of the same, as the page's button asks for it.
    let (code, page) = node2.get_on_node(&format!("/debug/test-pull?digest={layer}"));
    assert_eq!(code, 200);
    assert!(
        page.contains("OK") && page.contains("matching the digest"),
        "{page}"
    );
    let absent = format!("sha256:{}", "0".repeat(64));
    let (code, report) =
        node2.get_on_node(&format!("/debug/test-pull?digest={absent}&format=json"));
    assert_eq!(code, 200);
    let report: serde_json::Value = serde_json::from_str(&report).unwrap();
    assert_eq!(report["ok"], false);
    assert!(
        report["summary"]
            .as_str()
            .unwrap()
            .contains("no node advertises"),
        "{report:#}"
    );
    let (code, _) = node2.get_on_node("/debug/test-pull?digest=sha256:nothex");
    assert_eq!(code, 400);
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
        &["--bootstrap-peers", &seed, "--debug-page", "true"],
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
        node2.metric("ferry_served_total{listener=\"mirror\",kind=\"blob\",source=\"peer\"}")
            >= blobs as u64,
        "{}",
        node2.metrics()
    );
    let image_bytes: u64 = image.digests()[1..]
        .iter()
        .map(|d| image.blob(d).len() as u64)
        .sum();
    assert_eq!(
        node2.metric("ferry_served_bytes_total{listener=\"mirror\",kind=\"blob\",source=\"peer\"}"),
        image_bytes
    );
    // The same bytes, seen from the node that served them: its peer listener counts them,
    // its mirror listener (what its own containerd got) does not.
    assert_eq!(
        node1.metric("ferry_served_bytes_total{listener=\"peer\",kind=\"blob\",source=\"local\"}"),
        image_bytes,
        "{}",
        node1.metrics()
    );
    assert_eq!(
        node1
            .metric("ferry_served_bytes_total{listener=\"mirror\",kind=\"blob\",source=\"local\"}"),
        0
    );
    // The layers (1 MiB and more) went from node 1's page cache to the socket with sendfile;
    // the config, a few hundred bytes, through hyper.
    let large: u64 = image
        .layers
        .iter()
        .map(|d| image.blob(d).len() as u64)
        .filter(|&n| n >= ferry::registry::zero_copy::MIN_BYTES)
        .sum();
    assert!(large > 0);
    assert_eq!(node1.metric("ferry_zero_copy_bytes_total"), large);
    // An operator asks node 2 where its pulls came from: `ferry status`.
    let text = node2.status(false);
    for part in [
        ": ready",
        "containerd reachable: yes",
        "peers connected: ",
        "blob from other nodes",
        "not downloaded from registries thanks to peers: ",
        "recent pulls",
    ] {
        assert!(text.contains(part), "{part:?} in:\n{text}");
    }
    // It names images: from anywhere but the node itself, `/status` is refused.
    let from_outside = http_status(&format!("http://{}/status", node2.metrics_addr()));
    assert_eq!(from_outside, Some(403));
    let status: serde_json::Value = serde_json::from_str(&node2.status(true)).unwrap();
    assert!(!status["peers"].as_array().unwrap().is_empty(), "{status}");
    // What it advertises names the image it pulled (a tag key; digests are counted, not listed).
    wait_for("node 2 advertises the image", || {
        let status: serde_json::Value = serde_json::from_str(&node2.status(true)).unwrap();
        status["advertised_tags"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t == reference.as_str())
    });
    let recent = status["recent"].as_array().unwrap();
    for layer in &image.layers {
        assert!(
            recent.iter().any(|p| p["source"] == "peer"
                && p["what"].as_str().unwrap().ends_with(layer.as_str())
                && p["bytes"] == image.blob(layer).len() as u64),
            "{layer} from a peer in {recent:?}"
        );
    }
    let content = node2.containerd.ctr(&["-n", "k8s.io", "content", "ls"]);
    for digest in image.digests() {
        assert!(
            content.contains(&digest),
            "node 2's containerd holds {digest}"
        );
    }
    debug_page_shows_the_node_and_test_pulls_through_peers(&node1, &node2, &image);

    // Node 1's Ferry goes away: node 3 still pulls (from node 2, or upstream).
    node1.ferry.signal("KILL");
    node1.ferry.wait(Duration::from_secs(10));
    node3
        .containerd
        .pull("k8s.io", &reference, &node3.containerd.hosts_dir);
    assert_eq!(node3.image_digest(&reference), image.manifest);

    // A blob deleted on node 2 (by hand here, by garbage collection in life) is withdrawn on
    // its event alone: node 2 walks the one image that had it, not its whole store.
    let walked = |reason: &str| {
        node2.metric(&format!(
            "ferry_sync_images_walked_total{{reason=\"{reason}\"}}"
        ))
    };
    let (full, change) = (walked("full"), walked("change"));
    assert!(
        change >= 1,
        "node 2's pull was walked on its event: {}",
        node2.ferry.log_text()
    );
    let keys = node2.metric("ferry_keys_advertised");
    node2
        .containerd
        .ctr(&["-n", "k8s.io", "content", "rm", &image.layers[0]]);
    wait_for("node 2 withdraws the deleted layer", || {
        node2.metric("ferry_keys_advertised") == keys - 1
    });
    assert!(walked("change") > change);
    assert_eq!(walked("full"), full, "no whole-store walk for it");

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

    // The kubelet's pull, right after the node turned ready: CRI PullImage.
    let before = registry.requests().len();
    if let Err(out) = node2.cri_pull(&reference) {
        panic!("CRI PullImage failed: {out}");
    }
    assert_eq!(node2.image_digest(&reference), image.manifest);
    // The tag is the registry's to answer (it may have moved); everything by digest came
    // from node 1.
    asked_upstream_only_the_tag(&registry, before, &node2);
    for digest in image.digests() {
        assert!(node2.committed_matches(&digest), "{digest} correct");
    }

    drop(node2);
    drop(node1);
    drop(registry);
    drop(tmp);
    drop(net);
}

/// IPv6 end to end: an IPv6-only network (no IPv4 address on any node), the peer address
/// written the way the chart writes it on an IPv6 node (`$(NODE_IP):port`, no brackets), the
/// bootstrap peer too. Node 2 runs as in the chart's pod-network mode: its mirror listens on
/// `[::]` and containerd reaches it at `http://$(HOST_IP):5480`, so its hosts.toml names an
/// IPv6 URL (in the form this containerd reads). Node 2 gets every blob from node 1, over IPv6. (The registry's host
/// also has an IPv4 address, only for the test to push the image: skopeo cannot parse a
/// reference with an IPv6 address. The nodes pull from it over IPv6.)
#[test]
fn an_ipv6_only_cluster_shares_every_blob_over_ipv6() {
    let mut net = Net::new_v6();
    // FERRY_TEST_KEEP=1 keeps logs and state for a look after a failure.
    let tmp = tempfile::Builder::new()
        .prefix("ferry-ipv6")
        .disable_cleanup(std::env::var_os("FERRY_TEST_KEEP").is_some())
        .tempdir()
        .unwrap();
    let dir = tmp.path();
    let up = net.add_host("up", 1);
    let push_addr = std::net::SocketAddr::new(net.add_ipv4(&up, 1).into(), 5000);
    let registry_addr = std::net::SocketAddr::new(net.host_ip(1), 5000);
    let any = "[::]:5000".parse().unwrap();
    let registry = Registry::start_listening(&dir.join("up"), Some(&up), any, registry_addr);
    let image = Image::generate(&dir.join("image"), "v1", 2, LAYER_BYTES);
    image.push(push_addr, "team/app");
    let reference = format!("{registry_addr}/team/app:v1");

    let (ip1, ip2) = (net.host_ip(11), net.host_ip(12));
    let peer1 = format!("{ip1}:{PEER_PORT}");
    let node1 = Node::start(
        &mut net,
        dir,
        "n1",
        11,
        registry_addr,
        &["--peer-addr", &peer1],
    );
    let (peer2, seed) = (format!("{ip2}:{PEER_PORT}"), format!("{ip1}:{P2P_PORT}"));
    let target = format!("http://{ip2}:5480");
    let node2 = Node::start_with_mirror(
        &mut net,
        dir,
        "n2",
        12,
        registry_addr,
        "[::]:5480".parse().unwrap(),
        &[
            "--peer-addr",
            &peer2,
            "--bootstrap-peers",
            &seed,
            "--mirror-allow-remote",
            "true",
            "--mirror-target",
            &target,
        ],
    );
    let hosts = std::fs::read_to_string(
        node2
            .containerd
            .hosts_dir
            .join(registry_addr.to_string())
            .join("hosts.toml"),
    )
    .unwrap();
    assert!(
        hosts.contains(&format!("\"http://[{ip2}]:5480\"")),
        "{hosts}"
    );
    wait_for("node 2 connected to node 1", || {
        node1.metric("ferry_peers_connected") >= 1
    });

    node1
        .containerd
        .pull("k8s.io", &reference, &node1.containerd.hosts_dir);
    wait_for("node 1 advertises the image", || {
        node1.metric("ferry_keys_advertised") >= 5
    });
    let before = registry.requests().len();
    node2
        .containerd
        .pull("k8s.io", &reference, &node2.containerd.hosts_dir);
    assert_eq!(node2.image_digest(&reference), image.manifest);
    asked_upstream_only_the_tag(&registry, before, &node2);
    let image_bytes: u64 = image.digests()[1..]
        .iter()
        .map(|d| image.blob(d).len() as u64)
        .sum();
    assert_eq!(
        node2.metric("ferry_served_bytes_total{listener=\"mirror\",kind=\"blob\",source=\"peer\"}"),
        image_bytes,
        "every blob came from node 1"
    );
    for digest in image.digests() {
        assert!(node2.committed_matches(&digest), "{digest} correct");
    }
}

/// An outsider on the node network, without the cluster secret, holding hundreds of half-open
/// private-network handshakes against node 1's p2p port (the 24-byte nonce, then silence)
/// takes at most a few of its handshake slots: node 2, a member, still connects to node 1,
/// turns ready and gets every blob from it.
#[test]
fn an_outsiders_handshakes_never_take_what_members_need() {
    let mut net = Net::new();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (registry, registry_addr) = registry_host(&mut net, dir, "up", 1);
    let image = Image::generate(&dir.join("image"), "v1", LAYERS, LAYER_BYTES);
    image.push(registry_addr, "team/app");
    let reference = format!("{registry_addr}/team/app:v1");
    let secret = dir.join("secret");
    std::fs::write(&secret, "the members' secret, thirty-two bytes or more").unwrap();
    let secret_arg = secret.to_str().unwrap();
    let node1 = Node::start(
        &mut net,
        dir,
        "n1",
        11,
        registry_addr,
        &["--cluster-secret-file", secret_arg],
    );
    node1
        .containerd
        .pull("k8s.io", &reference, &node1.containerd.hosts_dir);
    wait_for("node 1 advertises the image", || {
        node1.metric("ferry_keys_advertised") >= (LAYERS + 3) as u64
    });

    let outsider = net.add_host("out", 20);
    let script = r#"
import socket, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
held = []
for _ in range(n):
    try:
        s = socket.create_connection((host, port), timeout=2)
        s.sendall(b"\x07" * 24)
        held.append(s)
    except OSError:
        pass
print("holding", len(held), flush=True)
while True:
    for i, s in enumerate(held):
        try:
            s.sendall(b"")
        except OSError:
            try:
                s = socket.create_connection((host, port), timeout=2)
                s.sendall(b"\x07" * 24)
                held[i] = s
            except OSError:
                pass
    time.sleep(0.5)
"#;
    let mut cmd = in_netns(Some(&outsider), "python3");
    cmd.args([
        "-c",
        script,
        &node1.ip.to_string(),
        &P2P_PORT.to_string(),
        "500",
    ]);
    let attack = Proc::spawn(cmd, dir.join("outsider.log"));
    wait_for("the outsider to hold its connections", || {
        attack.log_text().contains("holding")
    });

    let seed = format!("{}:{P2P_PORT}", node1.ip);
    let node2 = Node::start(
        &mut net,
        dir,
        "n2",
        12,
        registry_addr,
        &[
            "--bootstrap-peers",
            &seed,
            "--cluster-secret-file",
            secret_arg,
        ],
    );
    wait_for("node 2 ready with node 1 as its peer", || {
        http_status(&format!("http://{}/readyz", node2.metrics_addr())) == Some(200)
    });
    let before = registry.requests().len();
    node2.try_pull(&reference).unwrap();
    asked_upstream_only_the_tag(&registry, before, &node2);
    let log = node1.ferry.log_text();
    assert!(
        log.contains(&format!("connections from {} already", net.host_ip(20))),
        "the outsider was never refused: its connections are not counted"
    );
    drop(attack);
    drop(node2);
    drop(node1);
    drop(registry);
    drop(tmp);
    drop(net);
}
