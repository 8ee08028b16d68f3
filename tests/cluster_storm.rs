//! Storm-proof rollouts, on four nodes (each its own containerd and Ferry) and an upstream
//! registry behind a shaped link, in network namespaces: when every node pulls the same new
//! image at the same moment, the upstream registry's own log shows each manifest and blob
//! fetched once, and every node ends with byte-identical content.

#![allow(clippy::unwrap_used)] // test helpers panic by design

mod support;

use std::net::SocketAddr;
use std::path::Path;

use support::cluster::Node;
use support::netns::Net;
use support::storm::*;
use support::*;

#[test]
fn four_nodes_pulling_one_new_image_at_once_fetch_each_blob_upstream_once() {
    let _one = serial();
    let mut net = Net::new();
    let (tmp, dir) = test_dir();
    let dir = dir.as_path();
    let c = cluster(&mut net, dir, UPSTREAM_RATE);
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
            assert!(node.committed_matches(&digest), "{}: {digest}", node.name);
        }
    }
    each_fetched_once(&c.registry, since, &image, "four nodes");
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

    // One node, two containerd namespaces (kubelet's and nerdctl's, say) pulling another new
    // image at once: one transfer, so the upstream still sends each blob once.
    let (image, reference) = new_image(&c, dir, "v2");
    let node = &c.nodes[0];
    let since = c.registry.requests().len();
    let barrier = std::sync::Barrier::new(2);
    let results: Vec<Result<String, String>> = std::thread::scope(|s| {
        let pulls: Vec<_> = ["k8s.io", "default"]
            .into_iter()
            .map(|ns| {
                let (barrier, reference) = (&barrier, &reference);
                s.spawn(move || {
                    barrier.wait();
                    node.try_pull_in(ns, reference)
                })
            })
            .collect();
        pulls.into_iter().map(|p| p.join().unwrap()).collect()
    });
    for (ns, result) in ["k8s.io", "default"].iter().zip(&results) {
        if let Err(out) = result {
            panic!("{}'s pull in {ns} failed:\n{out}", node.name);
        }
        for digest in image.digests() {
            assert!(node.committed_matches_in(ns, &digest), "{ns}: {digest}");
        }
    }
    each_fetched_once(&c.registry, since, &image, "two namespaces on one node");
    // containerd 1.x sends both namespaces' requests for a digest, and the second reads the
    // first one's download; 2.x fetches a digest once for both namespaces itself (seen with
    // 2.1.9: one request per digest reached the mirror), so there is nothing to share.
    let shared = node.metric("ferry_coalesce_total{role=\"local\",result=\"shared\"}");
    if containerd_major() < 2 {
        assert!(
            shared >= 1,
            "the second namespace read the first one's download: {shared}"
        );
    }

    drop(c);
    drop(tmp);
    drop(net);
}

#[test]
fn faults_during_a_storm_never_fail_a_pull_or_commit_a_wrong_byte() {
    let _one = serial();
    let mut net = Net::new();
    let (tmp, dir) = test_dir();
    let dir = dir.as_path();
    // Slower, so that a fault can be injected while the leader is mid-blob (a layer takes
    // about two seconds).
    let mut c = cluster(&mut net, dir, FAULT_RATE);

    // 1. The leader's Ferry is killed mid-blob: its followers' transfers are cut, and
    //    containerd resumes them (from another leader, or upstream with a Range).
    let (image, reference) = new_image(&c, dir, "ferry-killed");
    let before = inflight(&c.nodes);
    let leader = std::thread::scope(|s| {
        let pulls = s.spawn(|| storm(&c.nodes, std::slice::from_ref(&reference)));
        let leader = leader_mid_blob(&c.nodes, &before);
        c.nodes[leader].ferry.signal("KILL");
        for (node, result) in c.nodes.iter().zip(pulls.join().unwrap()) {
            if let Err(out) = result {
                panic!(
                    "{}'s pull failed with the leader's Ferry killed:\n{out}",
                    node.name
                );
            }
        }
        leader
    });
    eprintln!(
        "leader {} lost its Ferry mid-blob; every pull succeeded",
        c.nodes[leader].name
    );
    all_content_right(&c.nodes.iter().collect::<Vec<_>>(), &image);
    c.nodes[leader].start_ferry();
    wait_for("the restarted node connected to every other", || {
        c.nodes[leader].metric("ferry_peers_connected") >= u64::from(NODES - 1)
    });

    // 2. The leader's containerd is killed mid-download: its followers hear nothing more,
    //    stop following it and fetch the rest themselves. The leader's own pull dies with its
    //    containerd; after a restart, it pulls again.
    let (image, reference) = new_image(&c, dir, "containerd-killed");
    let before = inflight(&c.nodes);
    let (leader, results) = std::thread::scope(|s| {
        let pulls = s.spawn(|| storm(&c.nodes, std::slice::from_ref(&reference)));
        let leader = leader_mid_blob(&c.nodes, &before);
        c.nodes[leader].containerd.proc.signal("KILL");
        (leader, pulls.join().unwrap())
    });
    for (i, (node, result)) in c.nodes.iter().zip(&results).enumerate() {
        if i != leader
            && let Err(out) = result
        {
            panic!(
                "{}'s pull failed with the leader's containerd killed:\n{out}",
                node.name
            );
        }
    }
    let followers: Vec<&Node> = c
        .nodes
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != leader)
        .map(|(_, n)| n)
        .collect();
    all_content_right(&followers, &image);
    c.nodes[leader].containerd.restart();
    c.nodes[leader]
        .try_pull(&reference)
        .unwrap_or_else(|out| panic!("the leader's pull after its containerd restarted:\n{out}"));
    all_content_right(&[&c.nodes[leader]], &image);

    // 3. The coordinator of the image's first layer is killed as the storm starts: claims to
    //    it are refused at once and go to the next coordinator (or upstream, as without
    //    coalescing, where none answers).
    let (image, reference) = new_image(&c, dir, "coordinator-killed");
    let ids: Vec<ferry::routing::Peer> = c
        .nodes
        .iter()
        .map(|n| ferry::routing::Peer {
            id: peer_id(n),
            addr: SocketAddr::new(n.ip, support::cluster::PEER_PORT),
        })
        .collect();
    let first_layer: ferry::oci::Digest = image.layers[0].parse().unwrap();
    let coordinator = ferry::routing::rendezvous::coordinator(&first_layer, &ids).unwrap();
    let coordinator = ids.iter().position(|p| p == coordinator).unwrap();
    std::thread::scope(|s| {
        let pulls = s.spawn(|| storm(&c.nodes, std::slice::from_ref(&reference)));
        c.nodes[coordinator].ferry.signal("KILL");
        for (node, result) in c.nodes.iter().zip(pulls.join().unwrap()) {
            if let Err(out) = result {
                panic!(
                    "{}'s pull failed with the coordinator killed:\n{out}",
                    node.name
                );
            }
        }
    });
    all_content_right(&c.nodes.iter().collect::<Vec<_>>(), &image);
    c.nodes[coordinator].start_ferry();
    wait_for("the restarted coordinator connected to every other", || {
        c.nodes
            .iter()
            .all(|n| n.metric("ferry_peers_connected") >= u64::from(NODES - 1))
    });

    // 4. Two different images storm at once (half the nodes each): each of their manifests
    //    and blobs is fetched upstream once.
    let (a, ref_a) = new_image(&c, dir, "storm-a");
    let (b, ref_b) = new_image(&c, dir, "storm-b");
    let since = c.registry.requests().len();
    let results = storm(&c.nodes, &[ref_a.clone(), ref_b.clone()]);
    for (node, result) in c.nodes.iter().zip(&results) {
        if let Err(out) = result {
            panic!("{}'s pull failed in a two-image storm:\n{out}", node.name);
        }
    }
    let gets = upstream_gets(&c.registry, since);
    for digest in a.digests().into_iter().chain(b.digests()) {
        let fetched: usize = gets
            .iter()
            .filter(|(uri, _)| uri.ends_with(&digest))
            .map(|(_, n)| n)
            .sum();
        assert_eq!(fetched, 1, "{digest}: {gets:?}");
    }
    all_content_right(&[&c.nodes[0], &c.nodes[2]], &a);
    all_content_right(&[&c.nodes[1], &c.nodes[3]], &b);

    drop(c);
    drop(tmp);
    drop(net);
}

#[test]
fn an_upstream_failing_the_leaders_request_costs_no_pull() {
    let _one = serial();
    let mut net = Net::new();
    let (tmp, dir) = test_dir();
    let dir = dir.as_path();
    // The registry on port 5001, behind a front on 5000 that fails the first GET of every
    // blob (the leader's, in a storm) with a 503; the nodes know only the front.
    let up = net.add_host("up", 1);
    let ip = net.host_ip(1);
    let registry = Registry::start_at(&dir.join("up"), Some(&up), SocketAddr::new(ip, 5001));
    let front_addr = SocketAddr::new(ip, 5000);
    let front_log = dir.join("front.log");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/flaky_front.py");
    let mut cmd = in_netns(Some(&up), "python3");
    cmd.arg(script)
        .arg(front_addr.to_string())
        .arg(registry.addr.to_string())
        .arg(&front_log);
    let front = Proc::spawn(cmd, dir.join("front.out"));
    wait_for("the front to listen", || {
        std::net::TcpStream::connect(front_addr).is_ok()
    });
    shape(&up, UPSTREAM_RATE);
    let nodes = nodes(&mut net, dir, front_addr);
    let image = Image::generate(&dir.join("image"), "v1", LAYERS, LAYER_BYTES);
    image.push(registry.addr, "team/app");
    let reference = format!("{front_addr}/team/app:v1");

    for (node, result) in nodes
        .iter()
        .zip(storm(&nodes, std::slice::from_ref(&reference)))
    {
        if let Err(out) = result {
            panic!(
                "{}'s pull failed with the upstream failing the leader:\n{out}",
                node.name
            );
        }
    }
    all_content_right(&nodes.iter().collect::<Vec<_>>(), &image);
    // The fault happened, and still each blob crossed the upstream link once: the leader's
    // containerd retried on its next host (the server entry) while its followers waited.
    let log = std::fs::read_to_string(&front_log).unwrap();
    for digest in std::iter::once(&image.config).chain(&image.layers) {
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| l.contains(digest.as_str()))
            .collect();
        let failed = lines.iter().filter(|l| l.ends_with(" 503")).count();
        let served = lines
            .iter()
            .filter(|l| l.contains(" GET ") && l.ends_with(" 200"))
            .count();
        assert_eq!((failed, served), (1, 1), "{digest}: {lines:?}");
    }

    drop(nodes);
    drop(front);
    drop(registry);
    drop(tmp);
    drop(net);
}
