//! Relays, on four nodes with `--relay-fanout 1` (so every blob's followers form a chain: the
//! leader streams it to one follower, which relays its own download to the next): each blob
//! still crosses the upstream link once, the leader's link carries it once, and a relay that
//! dies, stalls or turns slow mid-blob costs no pull and at most one more upstream fetch.

#![allow(clippy::unwrap_used)] // test helpers panic by design

mod support;

use support::cluster::Node;
use support::netns::Net;
use support::storm::*;
use support::*;

fn relayed(nodes: &[Node]) -> Vec<u64> {
    each(nodes, "ferry_relayed_bytes_total")
}

fn image_bytes(image: &Image) -> u64 {
    let blobs = image.layout.join("blobs/sha256");
    image
        .layers
        .iter()
        .map(|d| {
            let hex = d.trim_start_matches("sha256:");
            std::fs::metadata(blobs.join(hex)).map_or(0, |m| m.len())
        })
        .sum()
}

#[test]
fn followers_relay_and_a_relay_that_dies_stalls_or_slows_costs_no_pull() {
    let _one = serial();
    let mut net = Net::new();
    let (tmp, dir) = test_dir();
    let dir = dir.as_path();
    let c = cluster_with(&mut net, dir, FAULT_RATE, &["--relay-fanout", "1"]);

    // 1. No fault: each blob goes down a chain. The upstream sends it once, every node has
    //    it byte for byte, followers relayed, and each leader streamed it to one follower.
    let (image, reference) = new_image(&c, dir, "relayed");
    let since = c.registry.requests().len();
    let (led0, relayed0) = (
        sum(&c.nodes, "ferry_inflight_bytes_total"),
        sum(&c.nodes, "ferry_relayed_bytes_total"),
    );
    for (node, result) in c
        .nodes
        .iter()
        .zip(storm(&c.nodes, std::slice::from_ref(&reference)))
    {
        if let Err(out) = result {
            panic!("{}'s pull failed with relays:\n{out}", node.name);
        }
    }
    each_fetched_once(&c.registry, since, &image, "relayed storm");
    all_content_right(&c.nodes.iter().collect::<Vec<_>>(), &image);
    let led = sum(&c.nodes, "ferry_inflight_bytes_total") - led0;
    let relayed_bytes = sum(&c.nodes, "ferry_relayed_bytes_total") - relayed0;
    let layers = image_bytes(&image);
    eprintln!("layers {layers} B: leaders streamed {led} B, relays {relayed_bytes} B");
    assert!(relayed_bytes > 0, "no follower relayed");
    // A leader streams each blob to one follower (fanout 1); the manifest and config, which
    // are not in `layers`, are a few hundred bytes.
    assert!(
        led <= layers + (64 << 10),
        "leaders streamed {led} B of {layers} B of layers"
    );

    // 1b. The kubelet's way (CRI PullImage), every node at once: the same.
    let (image, reference) = new_image(&c, dir, "relayed-cri");
    let since = c.registry.requests().len();
    let relayed0 = sum(&c.nodes, "ferry_relayed_bytes_total");
    let barrier = std::sync::Barrier::new(c.nodes.len());
    std::thread::scope(|s| {
        let pulls: Vec<_> = c
            .nodes
            .iter()
            .map(|node| {
                let (barrier, reference) = (&barrier, &reference);
                s.spawn(move || {
                    barrier.wait();
                    node.cri_pull(reference)
                })
            })
            .collect();
        for (node, pull) in c.nodes.iter().zip(pulls) {
            if let Err(out) = pull.join().unwrap() {
                panic!("{}'s CRI pull failed with relays:\n{out}", node.name);
            }
        }
    });
    each_fetched_once(&c.registry, since, &image, "relayed CRI storm");
    all_content_right(&c.nodes.iter().collect::<Vec<_>>(), &image);
    assert!(
        sum(&c.nodes, "ferry_relayed_bytes_total") > relayed0,
        "no follower relayed"
    );

    // 2. A relay's Ferry is killed mid-blob: its follower's transfer is cut, containerd asks
    //    again with a Range, and Ferry re-attaches it (the dead relay reported) elsewhere.
    let (image, reference) = new_image(&c, dir, "relay-killed");
    let since = c.registry.requests().len();
    let before = relayed(&c.nodes);
    let relay = std::thread::scope(|s| {
        let pulls = s.spawn(|| storm(&c.nodes, std::slice::from_ref(&reference)));
        let relay = relay_mid_blob(&c.nodes, &before);
        // What an operator sees on the relay mid-blob: its role, its source, its follower.
        let status = c.nodes[relay].status(false);
        c.nodes[relay].ferry.signal("KILL");
        assert!(
            status.contains(" relay from ") && status.contains(" to 1 followers ("),
            "{status}"
        );
        for (node, result) in c.nodes.iter().zip(pulls.join().unwrap()) {
            if let Err(out) = result {
                panic!("{}'s pull failed with a relay killed:\n{out}", node.name);
            }
        }
        relay
    });
    eprintln!(
        "relay {} lost its Ferry mid-blob; every pull succeeded",
        c.nodes[relay].name
    );
    all_content_right(&c.nodes.iter().collect::<Vec<_>>(), &image);
    fetched_between(&c.registry, since, &image, 1..=2, "a relay killed");
    let mut c = c;
    c.nodes[relay].start_ferry();
    wait_for("the restarted relay connected to every other", || {
        c.nodes
            .iter()
            .all(|n| n.metric("ferry_peers_connected") >= 3)
    });

    // 3. A relay's Ferry stalls (stopped) mid-blob: its follower hears nothing for the idle
    //    timeout, cuts, and is re-attached; the stalled node's own pull waits for its Ferry
    //    and finishes once it runs again.
    let (image, reference) = new_image(&c, dir, "relay-stalled");
    let since = c.registry.requests().len();
    let before = relayed(&c.nodes);
    std::thread::scope(|s| {
        let pulls = s.spawn(|| storm(&c.nodes, std::slice::from_ref(&reference)));
        let relay = relay_mid_blob(&c.nodes, &before);
        c.nodes[relay].ferry.signal("STOP");
        let others: Vec<&Node> = (0..c.nodes.len())
            .filter(|i| *i != relay)
            .map(|i| &c.nodes[i])
            .collect();
        wait_for_within(
            "every other node to have the image with the relay stalled",
            std::time::Duration::from_secs(120),
            || {
                others
                    .iter()
                    .all(|n| image.digests().iter().all(|d| n.committed_matches(d)))
            },
        );
        eprintln!(
            "relay {} stalled; every other node finished",
            c.nodes[relay].name
        );
        c.nodes[relay].ferry.signal("CONT");
        for (node, result) in c.nodes.iter().zip(pulls.join().unwrap()) {
            if let Err(out) = result {
                panic!("{}'s pull failed with a relay stalled:\n{out}", node.name);
            }
        }
    });
    all_content_right(&c.nodes.iter().collect::<Vec<_>>(), &image);
    fetched_between(&c.registry, since, &image, 1..=2, "a relay stalled");

    // 4. A relay turns slow mid-blob (what it sends from its peer address shaped to 2 Mbit/s,
    //    what it receives not): it sends its follower away, which is re-attached elsewhere.
    let (image, reference) = new_image(&c, dir, "relay-slow");
    let since = c.registry.requests().len();
    let before = relayed(&c.nodes);
    let slow = "ferry_coalesce_total{role=\"relay\",result=\"slow_follower\"}";
    let sent_away = sum(&c.nodes, slow);
    std::thread::scope(|s| {
        let pulls = s.spawn(|| storm(&c.nodes, std::slice::from_ref(&reference)));
        let relay = relay_mid_blob(&c.nodes, &before);
        shape_peer_sending(&c.nodes[relay].ns, "2mbit");
        for (node, result) in c.nodes.iter().zip(pulls.join().unwrap()) {
            if let Err(out) = result {
                panic!("{}'s pull failed with a relay slowed:\n{out}", node.name);
            }
        }
        eprintln!("relay {} slowed; every pull succeeded", c.nodes[relay].name);
    });
    all_content_right(&c.nodes.iter().collect::<Vec<_>>(), &image);
    fetched_between(&c.registry, since, &image, 1..=2, "a relay slowed");
    assert!(
        sum(&c.nodes, slow) > sent_away,
        "the slowed relay sent no follower away"
    );

    drop(c);
    drop(tmp);
    drop(net);
}
