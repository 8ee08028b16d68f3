//! Tags through Ferry, on two nodes and an upstream registry in network namespaces, each
//! node with its own containerd: a pull by tag gets exactly what the registry would give
//! whenever the registry answers (a moved tag reaches every node), and resolves through peers
//! only while it does not. With a private registry, the tag still needs the pull secret on
//! every node.

#![allow(clippy::unwrap_used)] // test helpers panic by design

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use support::cluster::{Node, P2P_PORT, registry_host};
use support::netns::Net;
use support::*;

const LAYERS: usize = 2;
const LAYER_BYTES: usize = 2 * 1024 * 1024;

/// Node 1 and node 2 (bootstrapped from node 1), both with `args`.
fn two_nodes(net: &mut Net, dir: &Path, registry: SocketAddr, args: &[&str]) -> (Node, Node) {
    let node1 = Node::start(net, dir, "n1", 11, registry, args);
    let seed = format!("{}:{P2P_PORT}", node1.ip);
    let mut args2 = vec!["--bootstrap-peers", seed.as_str()];
    args2.extend_from_slice(args);
    let node2 = Node::start(net, dir, "n2", 12, registry, &args2);
    wait_for("node 2 connected to node 1", || {
        node1.metric("ferry_peers_connected") >= 1
    });
    (node1, node2)
}

/// `(method, uri)` of the requests `node` made to the registry since `before`.
fn upstream_requests_of(registry: &Registry, node: &Node, before: usize) -> Vec<(String, String)> {
    registry.requests()[before..]
        .iter()
        .filter(|(remote, _, _)| remote.starts_with(&format!("{}:", node.ip)))
        .map(|(_, method, uri)| (method.clone(), uri.clone()))
        .collect()
}

/// Whether `node` exports the metric line exactly (a gauge that is 0 and a missing one are
/// different things here).
fn has_line(node: &Node, line: &str) -> bool {
    node.metrics().lines().any(|l| l == line)
}

#[test]
fn a_moved_tag_reaches_the_node_that_had_it_and_a_node_that_never_did() {
    let mut net = Net::new();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (registry, registry_addr) = registry_host(&mut net, dir, "up", 1);
    let old = Image::generate(&dir.join("old"), "v1", LAYERS, LAYER_BYTES);
    old.push(registry_addr, "team/app");
    let reference = format!("{registry_addr}/team/app:v1");
    let (node1, node2) = two_nodes(&mut net, dir, registry_addr, &[]);

    node1
        .containerd
        .pull("k8s.io", &reference, &node1.containerd.hosts_dir);
    assert_eq!(node1.image_digest(&reference), old.manifest);
    wait_for("node 1 advertises the old image and its tag", || {
        node1.metric("ferry_keys_advertised") >= (LAYERS + 3) as u64
    });

    // The tag moves upstream (a re-pushed release, `:main`, `:latest`).
    let new = Image::generate_seeded(&dir.join("new"), "v1", LAYERS, LAYER_BYTES, "moved");
    new.push(registry_addr, "team/app");
    assert_ne!(new.manifest, old.manifest);

    // Node 1 holds the old image under that very name: its re-pull gets the new one.
    node1
        .containerd
        .pull("k8s.io", &reference, &node1.containerd.hosts_dir);
    assert_eq!(
        node1.image_digest(&reference),
        new.manifest,
        "node 1 re-pulled the moved tag"
    );
    let ns = registry_addr.to_string().replace(':', "%3A");
    let new_manifest = node1.peer_url(&format!("/v2/team/app/manifests/{}?ns={ns}", new.manifest));
    wait_for("node 1 serves and has announced the new image", || {
        http_status(&new_manifest) == Some(200) && has_line(&node1, "ferry_announcements_pending 0")
    });

    // Node 2 never had it, and node 1 (a peer) knows the tag: node 2 still gets the
    // registry's answer, and every manifest and blob by digest from node 1.
    let before = registry.requests().len();
    node2
        .containerd
        .pull("k8s.io", &reference, &node2.containerd.hosts_dir);
    assert_eq!(
        node2.image_digest(&reference),
        new.manifest,
        "node 2 got the new digest"
    );
    let asked: Vec<_> = upstream_requests_of(&registry, &node2, before)
        .into_iter()
        .filter(|(_, uri)| uri != "/v2/") // Ferry's reachability probes: below
        .collect();
    assert_eq!(
        asked,
        [("HEAD".to_string(), "/v2/team/app/manifests/v1".to_string())],
        "node 2 asked the registry for the tag only; digests came from node 1"
    );
    assert!(
        node2.metric("ferry_served_total{listener=\"mirror\",kind=\"blob\",source=\"peer\"}")
            >= (LAYERS + 1) as u64,
        "{}",
        node2.metrics()
    );
    let content = node2
        .containerd
        .ctr(&["-n", "k8s.io", "content", "ls", "-q"]);
    for digest in new.digests() {
        assert!(content.contains(&digest), "node 2 holds {digest}");
    }
    for node in [&node1, &node2] {
        assert_eq!(
            node.metric("ferry_tag_requests_total{answer=\"peers\"}"),
            0,
            "{}: no tag was answered by peers while the registry answered",
            node.name
        );
        assert!(node.metric("ferry_tag_requests_total{answer=\"upstream\"}") >= 1);
    }

    // What Ferry itself sends the registry: `GET /v2/` probes, no credentials, at most one
    // per 10 s per registry while it is in use.
    let probes = |node: &Node| {
        registry
            .requests()
            .iter()
            .filter(|(remote, _, _)| remote.starts_with(&format!("{}:", node.ip)))
            .filter(|(_, method, uri)| method == "GET" && uri == "/v2/")
            .count()
    };
    let started = Instant::now();
    let first = probes(&node2);
    assert!(
        first >= 1,
        "node 2 probes the registry it pulls by tag from"
    );

    measure_tag_resolution(&node2, &reference);

    let allowed = 1 + (started.elapsed().as_secs() / 10) as usize + 1;
    let sent = probes(&node2) - first;
    assert!(
        sent <= allowed,
        "{sent} probes in {:?}: more than one per 10 s",
        started.elapsed()
    );

    drop(node2);
    drop(node1);
    drop(registry);
    drop(tmp);
    drop(net);
}

/// The cost of Ferry on a healthy pull by tag, printed (run with `--nocapture`; figures in the
/// README): the mirror's 404 for a tag, and `ctr pull` of an image the node already holds
/// (a resolve and nothing else), with and without Ferry's entry in hosts.toml, alternated.
fn measure_tag_resolution(node: &Node, reference: &str) {
    const ROUNDS: usize = 15;
    let ns = reference.split('/').next().unwrap().replace(':', "%3A");
    let head = format!("/v2/team/app/manifests/v1?ns={ns}");
    let mut answers = Vec::new();
    for _ in 0..200 {
        let (status, took) = in_namespace_head(node, &head);
        assert_eq!(status, 404);
        answers.push(took);
    }
    // The operator's hosts dir without Ferry's block: what containerd does without Ferry.
    let without = node.dir.join("certs.d-without-ferry");
    copy_without_ferry(&node.containerd.hosts_dir, &without);
    let (mut with_ferry, mut without_ferry) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        for (dir, times) in [
            (&node.containerd.hosts_dir, &mut with_ferry),
            (&without, &mut without_ferry),
        ] {
            let started = Instant::now();
            node.containerd.pull("k8s.io", reference, dir);
            times.push(started.elapsed());
        }
    }
    let median = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let (a, w, wo) = (
        median(&mut answers),
        median(&mut with_ferry),
        median(&mut without_ferry),
    );
    eprintln!(
        "tag resolution with a healthy registry: mirror 404 for a tag {:.2} ms (median of 200, \
         from the node's namespace); ctr pull of a held image by tag: {:.1} ms with Ferry, \
         {:.1} ms without (medians of {ROUNDS}, alternated), difference {:+.1} ms",
        a.as_secs_f64() * 1e3,
        w.as_secs_f64() * 1e3,
        wo.as_secs_f64() * 1e3,
        (w.as_secs_f64() - wo.as_secs_f64()) * 1e3,
    );
}

/// A HEAD to the node's mirror from inside its namespace, as containerd sends it: the status
/// and curl's own time from connect to the end of the answer (no process start-up in it).
fn in_namespace_head(node: &Node, target: &str) -> (u16, Duration) {
    let out = in_netns(Some(&node.ns), "curl")
        .args([
            "-s",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code} %{time_total}",
            "-I",
        ])
        .arg(format!("http://127.0.0.1:5480{target}"))
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let mut parts = text.split_whitespace();
    let code = parts.next().and_then(|c| c.parse().ok()).unwrap_or(0);
    let secs: f64 = parts.next().and_then(|t| t.parse().ok()).unwrap_or(0.0);
    (code, Duration::from_secs_f64(secs))
}

fn copy_without_ferry(from: &Path, to: &Path) {
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let file = entry.path().join("hosts.toml");
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        let kept = match ferry::containerd_config::hosts::cleanup(&text) {
            ferry::containerd_config::hosts::Cleaned::Restored(t) => t,
            ferry::containerd_config::hosts::Cleaned::Untouched => text,
            _ => continue,
        };
        let dir = to.join(entry.file_name());
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("hosts.toml"), kept).unwrap();
    }
}

/// The statuses the registry answered `node`'s `request` (`METHOD URI`) with, from its access
/// log (requests it refused are in no other line).
fn statuses(registry: &Registry, node: &Node, request: &str) -> Vec<String> {
    registry.requests(); // waits until the log stops growing
    let prefix = format!("{} - - [", node.ip);
    let quoted = format!("\"{request} HTTP/1.1\" ");
    registry
        .proc
        .log_text()
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .filter_map(|l| l.split(&quoted).nth(1))
        .filter_map(|rest| rest.split(' ').next().map(str::to_string))
        .collect()
}

/// `tenant:tenant-a-password`, bcrypt (the only hash the registry's htpasswd auth takes).
const TENANT: &str = "tenant:tenant-a-password";
const TENANT_HTPASSWD: &str = "tenant:$2b$05$EZAZN8AQ2ABNk4t5URbLnuwVrEigixPc3VFJTtS0dB/DjCGDJueKy";

/// A private registry (every request needs credentials): a node without the pull secret
/// cannot pull a tag another node holds (the mirror sends every tag upstream, which refuses
/// it); with it, the tag comes from the registry and every digest from the node that has
/// them. By digest nothing asks the registry, credentials or not: what the README's Security
/// section says, pinned here so that it stays true.
#[test]
fn a_private_tag_needs_the_pull_secret_on_every_node_and_digests_come_from_peers() {
    let mut net = Net::new();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let ns = net.add_host("up", 1);
    let registry_addr = SocketAddr::new(net.host_ip(1), 5000);
    let registry =
        Registry::start_private(&dir.join("up"), Some(&ns), registry_addr, TENANT_HTPASSWD);
    let image = Image::generate(&dir.join("img"), "v1", LAYERS, LAYER_BYTES);
    image.push_as(registry_addr, "tenant/app", Some(TENANT));
    let reference = format!("{registry_addr}/tenant/app:v1");
    let (node1, node2) = two_nodes(&mut net, dir, registry_addr, &[]);
    let seed = format!("{}:{P2P_PORT}", node1.ip);
    let node3 = Node::start(
        &mut net,
        dir,
        "n3",
        13,
        registry_addr,
        &["--bootstrap-peers", &seed],
    );

    // Node 1 pulls with the pull secret, and shares what it got.
    node1
        .containerd
        .try_pull_as(
            "k8s.io",
            &reference,
            &node1.containerd.hosts_dir,
            Some(TENANT),
        )
        .unwrap();
    assert_eq!(node1.image_digest(&reference), image.manifest);
    wait_for("node 1 advertises the image and its tag", || {
        node1.metric("ferry_keys_advertised") >= (LAYERS + 3) as u64
            && has_line(&node1, "ferry_announcements_pending 0")
    });

    // Node 2 without it: refused by the registry, as without Ferry, and nothing of the image
    // reaches it. (containerd words it differently by version and run: "401 Unauthorized",
    // "authorization failed", 2.x's "not found"; the registry's log says what happened.)
    let refused = node2
        .containerd
        .try_pull_as("k8s.io", &reference, &node2.containerd.hosts_dir, None)
        .unwrap_err();
    let tag_answers = statuses(&registry, &node2, "HEAD /v2/tenant/app/manifests/v1");
    assert!(
        !tag_answers.is_empty() && tag_answers.iter().all(|s| s == "401"),
        "node 2's tag requests were answered {tag_answers:?}: {refused}"
    );
    let content = |node: &Node| {
        node.containerd
            .ctr(&["-n", "k8s.io", "content", "ls", "-q"])
    };
    for digest in image.digests() {
        assert!(!content(&node2).contains(&digest), "node 2 got {digest}");
    }
    assert_eq!(
        node2.metric("ferry_tag_requests_total{answer=\"peers\"}"),
        0
    );

    // Node 2 with it: the tag from the registry, every digest from node 1.
    let before = registry.requests().len();
    node2
        .containerd
        .try_pull_as(
            "k8s.io",
            &reference,
            &node2.containerd.hosts_dir,
            Some(TENANT),
        )
        .unwrap();
    assert_eq!(node2.image_digest(&reference), image.manifest);
    let asked: Vec<_> = upstream_requests_of(&registry, &node2, before)
        .into_iter()
        .filter(|(_, uri)| uri != "/v2/")
        .collect();
    assert!(
        !asked.is_empty()
            && asked
                .iter()
                .all(|(method, uri)| method == "HEAD" && uri == "/v2/tenant/app/manifests/v1"),
        "node 2 asked the registry for the tag only (a 401, then with credentials): {asked:?}"
    );
    for digest in image.digests() {
        assert!(content(&node2).contains(&digest), "node 2 holds {digest}");
    }

    // Node 3, by digest, without credentials: nothing asks the registry (README, Security).
    wait_for("node 3 connected", || {
        node3.metric("ferry_peers_connected") >= 1
    });
    let before = registry.requests().len();
    let pinned = format!("{registry_addr}/tenant/app@{}", image.manifest);
    node3
        .containerd
        .try_pull_as("k8s.io", &pinned, &node3.containerd.hosts_dir, None)
        .unwrap();
    let asked: Vec<_> = upstream_requests_of(&registry, &node3, before)
        .into_iter()
        .filter(|(_, uri)| uri != "/v2/")
        .collect();
    assert_eq!(asked, [], "node 3 got everything from peers");
    for digest in image.digests() {
        assert!(content(&node3).contains(&digest), "node 3 holds {digest}");
    }

    drop(node3);
    drop(node2);
    drop(node1);
    drop(registry);
    drop(tmp);
    drop(net);
}

#[test]
fn with_the_registry_down_a_tag_resolves_through_peers_and_upstream_again_once_it_is_back() {
    let mut net = Net::new();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let (mut registry, registry_addr) = registry_host(&mut net, dir, "up", 1);
    let old = Image::generate(&dir.join("old"), "v1", LAYERS, LAYER_BYTES);
    old.push(registry_addr, "team/app");
    let reference = format!("{registry_addr}/team/app:v1");
    // Named registries are probed from the start, before their first pull.
    let name = registry_addr.to_string();
    let (node1, node2) = two_nodes(&mut net, dir, registry_addr, &["--registries", &name]);
    let up = |node: &Node, value: u8| {
        has_line(
            node,
            &format!("ferry_upstream_up{{registry=\"{registry_addr}\"}} {value}"),
        )
    };
    wait_for("node 2 has found the registry answering", || up(&node2, 1));

    node1
        .containerd
        .pull("k8s.io", &reference, &node1.containerd.hosts_dir);
    wait_for("node 1 advertises the image and its tag", || {
        node1.metric("ferry_keys_advertised") >= (LAYERS + 3) as u64
    });

    // The registry goes away (refused connections, as for a registry outage or a partition).
    registry.proc.stop();
    wait_for("node 2 notices the registry is not answering", || {
        up(&node2, 0)
    });

    // Node 2 never had the image: it resolves the tag through node 1 and pulls every blob.
    let out = node2
        .try_pull(&reference)
        .unwrap_or_else(|e| panic!("node 2's pull by tag failed with the registry down:\n{e}"));
    assert_eq!(node2.image_digest(&reference), old.manifest, "{out}");
    assert_eq!(
        node2.metric("ferry_tag_requests_total{answer=\"peers\"}"),
        1,
        "{}",
        node2.metrics()
    );
    assert!(
        node2.ferry.log_text().contains("answered a tag from peers"),
        "the tag from peers is logged"
    );
    let content = node2
        .containerd
        .ctr(&["-n", "k8s.io", "content", "ls", "-q"]);
    for digest in old.digests() {
        assert!(content.contains(&digest), "node 2 holds {digest}");
    }

    // Pulls by digest are unaffected: with the registry still down, node 2 (its copy gone)
    // pulls the same image by digest, every byte from node 1, no tag involved.
    node2.forget(&reference, &old.digests());
    let by_digest = format!("{registry_addr}/team/app@{}", old.manifest);
    node2
        .try_pull(&by_digest)
        .unwrap_or_else(|e| panic!("node 2's pull by digest failed with the registry down:\n{e}"));
    let content = node2
        .containerd
        .ctr(&["-n", "k8s.io", "content", "ls", "-q"]);
    for digest in old.digests() {
        assert!(content.contains(&digest), "node 2 holds {digest} again");
    }
    assert_eq!(
        node2.metric("ferry_tag_requests_total{answer=\"peers\"}"),
        1,
        "a pull by digest resolves no tag"
    );

    // The registry is back and the tag has moved meanwhile: the next pull by tag goes
    // upstream again and gets the new image.
    registry = Registry::start_at(&dir.join("up"), Some(&net.namespaces[0]), registry_addr);
    let new = Image::generate_seeded(&dir.join("new"), "v1", LAYERS, LAYER_BYTES, "moved");
    new.push(registry_addr, "team/app");
    assert_ne!(new.manifest, old.manifest);
    wait_for("node 2 finds the registry answering again", || {
        up(&node2, 1)
    });
    let before = registry.requests().len();
    node2
        .containerd
        .pull("k8s.io", &reference, &node2.containerd.hosts_dir);
    assert_eq!(node2.image_digest(&reference), new.manifest);
    assert!(
        upstream_requests_of(&registry, &node2, before)
            .iter()
            .any(|(m, uri)| m == "HEAD" && uri == "/v2/team/app/manifests/v1"),
        "node 2 resolved the tag upstream again"
    );
    assert_eq!(
        node2.metric("ferry_tag_requests_total{answer=\"peers\"}"),
        1,
        "no further tag from peers"
    );

    drop(node2);
    drop(node1);
    drop(registry);
    drop(tmp);
    drop(net);
}
