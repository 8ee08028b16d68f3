use std::sync::Weak;

use super::*;
use crate::routing::memory::MemoryNetwork;
use crate::store::memory::MemoryStore;

/// Claims go to the coordinating node's own [`Coalescer`]; a node in `gone` refuses at once,
/// as a node whose Ferry is dead does.
#[derive(Default)]
struct Claims {
    nodes: Mutex<HashMap<String, Weak<Coalescer>>>,
    gone: Mutex<Vec<String>>,
}

#[async_trait::async_trait]
impl ClaimSender for Claims {
    async fn claim(
        &self,
        coordinator: &Peer,
        digest: &Digest,
        claimant: &Peer,
        failed: Option<&str>,
    ) -> Option<Grant> {
        if self.gone.lock().unwrap().contains(&coordinator.id) {
            return None;
        }
        let node = self.nodes.lock().unwrap().get(&coordinator.id)?.upgrade()?;
        Some(node.claim(digest, claimant, failed))
    }
}

fn cluster(n: usize) -> (Vec<Arc<Coalescer>>, Arc<Claims>) {
    let network = MemoryNetwork::new();
    let claims = Arc::new(Claims::default());
    let nodes: Vec<Arc<Coalescer>> = (0..n)
        .map(|i| {
            let me = Peer {
                id: format!("node-{i}"),
                addr: format!("10.0.0.{}:5481", i + 1).parse().unwrap(),
            };
            let config = CoalesceConfig {
                follow_timeout: Duration::from_secs(1),
                relay_fanout: 2,
            };
            let node = Arc::new(Coalescer::new(
                Arc::new(network.node(me.clone())),
                Arc::new(MemoryStore::new()),
                config,
                Arc::new(crate::metrics::Metrics::new()),
                claims.clone(),
            ));
            claims
                .nodes
                .lock()
                .unwrap()
                .insert(me.id, Arc::downgrade(&node));
            node
        })
        .collect();
    (nodes, claims)
}

fn coordinator_of(nodes: &[Arc<Coalescer>], digest: &Digest) -> usize {
    let peers: Vec<Peer> = nodes.iter().map(|n| n.router.local()).collect();
    let c = crate::routing::rendezvous::coordinator(digest, &peers).unwrap();
    peers.iter().position(|p| p == c).unwrap()
}

#[tokio::test]
async fn followers_relay_to_each_other_beyond_the_fanout() {
    let (nodes, _claims) = cluster(6);
    let d = Digest::sha256_of(b"layer");
    let mut sources = Vec::new();
    for node in &nodes {
        match node.decide(&d, None).await {
            Decision::Lead => sources.push("lead".to_string()),
            Decision::Follow(source) => sources.push(source.id),
            Decision::Alone => panic!("alone"),
        }
    }
    assert_eq!(
        sources.iter().filter(|s| *s == "lead").count(),
        1,
        "{sources:?}"
    );
    // The leader feeds two, each of them the next ones: a source other than the leader.
    let leader = format!("node-{}", sources.iter().position(|s| s == "lead").unwrap());
    assert!(
        sources.iter().filter(|s| **s == leader).count() <= 2,
        "{sources:?}"
    );
    assert!(
        sources.iter().any(|s| s != "lead" && *s != leader),
        "{sources:?}"
    );
    // Every follower sees its role, and the leader names no source.
    for (i, node) in nodes.iter().enumerate() {
        let part = &node.in_flight()[0];
        match sources[i].as_str() {
            "lead" => assert_eq!((part.role.as_str(), &part.source), ("leader", &None)),
            source => assert_eq!(part.source.as_deref(), Some(source)),
        }
    }
}

#[tokio::test]
async fn a_gone_coordinator_hands_its_claims_to_the_next_one() {
    let (nodes, claims) = cluster(4);
    let d = Digest::sha256_of(b"layer");
    let gone = coordinator_of(&nodes, &d);
    claims.gone.lock().unwrap().push(format!("node-{gone}"));
    let mut decisions = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        if i != gone {
            decisions.push(node.decide(&d, None).await);
        }
    }
    // One leader among the others, not three fetches upstream.
    let leads = decisions.iter().filter(|d| **d == Decision::Lead).count();
    assert_eq!(leads, 1, "{decisions:?}");
    assert!(!decisions.contains(&Decision::Alone), "{decisions:?}");
}

#[tokio::test]
async fn a_follower_whose_relay_was_its_coordinator_follows_the_leader_when_it_dies() {
    let (nodes, claims) = cluster(4);
    let d = Digest::sha256_of(b"layer");
    let c = coordinator_of(&nodes, &d);
    let others: Vec<usize> = (0..4).filter(|i| *i != c).collect();
    let (x, z) = (others[0], others[1]);
    let peer = |i: usize| nodes[i].router.local();
    assert_eq!(nodes[x].decide(&d, None).await, Decision::Lead);
    assert_eq!(nodes[c].decide(&d, None).await, Decision::Follow(peer(x)));
    // A chain: z is sent to the coordinator, relaying.
    assert_eq!(nodes[z].decide(&d, None).await, Decision::Follow(peer(c)));
    claims.gone.lock().unwrap().push(peer(c).id);
    assert_eq!(
        nodes[z].decide(&d, Some(&peer(c))).await,
        Decision::Follow(peer(x)),
        "the leader the coordinator named, not upstream"
    );
}

#[tokio::test]
async fn a_dead_leader_that_coordinated_is_replaced_at_the_next_coordinator() {
    let (nodes, claims) = cluster(4);
    let d = Digest::sha256_of(b"layer");
    let c = coordinator_of(&nodes, &d);
    let others: Vec<usize> = (0..4).filter(|i| *i != c).collect();
    // The coordinator claims first (its claim is local): it leads; the others follow.
    assert_eq!(nodes[c].decide(&d, None).await, Decision::Lead);
    let leader = nodes[c].router.local();
    for i in &others {
        assert!(matches!(
            nodes[*i].decide(&d, None).await,
            Decision::Follow(_)
        ));
    }
    claims.gone.lock().unwrap().push(leader.id.clone());
    // Its followers report it to the next coordinator: the first leads (one more upstream
    // fetch, of what it lacks), the next follows it.
    let first = nodes[others[0]].decide(&d, Some(&leader)).await;
    assert_eq!(first, Decision::Lead);
    let second = nodes[others[1]].decide(&d, Some(&leader)).await;
    assert_eq!(second, Decision::Follow(nodes[others[0]].router.local()));
}

/// Every node claims `digest`; the last that follows, with its source.
async fn a_follower(nodes: &[Arc<Coalescer>], digest: &Digest) -> (Arc<Coalescer>, Peer) {
    let mut follower = None;
    for node in nodes {
        if let Decision::Follow(source) = node.decide(digest, None).await {
            follower = Some((node.clone(), source));
        }
    }
    follower.expect("a follower")
}

/// A relay's own follower often asks before the relay's answer from its source has come (the
/// coordinator answers both at once): it must still get the window, not containerd's writes.
#[tokio::test]
async fn a_follower_asking_before_its_relays_answer_reads_the_same_window() {
    use axum::body::Body;
    use futures::StreamExt;

    let (nodes, _claims) = cluster(3);
    let d = Digest::sha256_of(b"a layer relayed before its answer came");
    let (relay, _source) = a_follower(&nodes, &d).await;
    let total = 3 << 20;
    // The follower asks first: the window is made for the blob's size.
    let asked = relay.window(&d, total).expect("a follower has a window");
    // Then the relay's own answer arrives and streams through it.
    let body: Vec<u8> = (0..total as usize).map(|i| (i % 251) as u8).collect();
    let answer = axum::http::Response::builder()
        .status(200)
        .header(axum::http::header::CONTENT_LENGTH, total)
        .body(Body::from(body))
        .unwrap();
    let teed = relay.relaying(&d, answer);
    let mut stream = teed.into_body().into_data_stream();
    while let Some(chunk) = stream.next().await {
        chunk.unwrap();
    }
    assert_eq!(
        asked.end(),
        total,
        "every byte it received is in the window asked for"
    );
    assert!(Arc::ptr_eq(&asked, &relay.window(&d, total).unwrap()));
    assert!(
        relay.window(&d, total + 1).is_none(),
        "another size is not this blob"
    );
}
