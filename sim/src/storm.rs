//! Scenario (c), the rollout storm: every node misses the same digests within a second and
//! asks the real `Coalescer` (its coordinator found through the real DHT, the real lease
//! table) who fetches them. Claims travel as one round trip on the simulated network. What
//! the coordinators decided is then timed on a flow model of the data path: each node gets
//! what its source receives, shared among the source's followers, behind its own link.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferry::coalesce::{ClaimSender, CoalesceConfig, Coalescer, Decision, Grant};
use ferry::metrics::Metrics;
use ferry::oci::Digest;
use ferry::routing::{ContentRouting, Peer};
use ferry::store::memory::MemoryStore;
use serde_json::{Value, json};

use crate::Rng;
use crate::net::SimNet;

/// Claims between the nodes' coalescers: a round trip, then the coordinator's answer.
pub struct Claims {
    nodes: Mutex<HashMap<String, Arc<Coalescer>>>,
    received: Mutex<HashMap<String, u64>>,
    /// Claims sent into a partition: their coordinator was out of the claimant's reach.
    across: AtomicUsize,
    net: SimNet,
}

impl Claims {
    fn new(net: SimNet) -> Arc<Claims> {
        Arc::new(Claims {
            nodes: Mutex::default(),
            received: Mutex::default(),
            across: AtomicUsize::new(0),
            net,
        })
    }
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
        // A claim into a partition waits for it to heal (the claimant's deadline cuts it).
        if let Some(heals) = self
            .net
            .held_until(claimant.addr.ip(), coordinator.addr.ip())
        {
            self.across.fetch_add(1, Ordering::Relaxed);
            tokio::time::sleep_until(heals).await;
        }
        tokio::time::sleep(self.net.latency() * 2).await;
        let node = self.nodes.lock().unwrap().get(&coordinator.id).cloned()?;
        *self
            .received
            .lock()
            .unwrap()
            .entry(coordinator.id.clone())
            .or_default() += 1;
        Some(node.claim(digest, claimant, failed))
    }
}

/// The data path's model.
#[derive(Clone, Copy)]
pub struct Flow {
    pub blob_bytes: f64,
    /// Each node's link, bytes per second (both ways).
    pub node_rate: f64,
    /// The registry's, bytes per second, shared by the leaders of one digest.
    pub upstream_rate: f64,
    /// What a relay holds back before passing bytes on (containerd's 1 MiB write buffer).
    pub hop_lag_bytes: f64,
}

/// A coalescer for each router, all claiming through `claims`.
fn coalescers(
    routers: &[Arc<dyn ContentRouting>],
    claims: &Arc<Claims>,
    relay_fanout: usize,
) -> Vec<Arc<Coalescer>> {
    routers
        .iter()
        .map(|router| {
            let node = Arc::new(Coalescer::new(
                router.clone(),
                Arc::new(MemoryStore::new()),
                CoalesceConfig {
                    follow_timeout: Duration::from_secs(10),
                    relay_fanout,
                },
                Arc::new(Metrics::new()),
                claims.clone(),
            ));
            claims
                .nodes
                .lock()
                .unwrap()
                .insert(router.local().id, node.clone());
            node
        })
        .collect()
}

/// What a storm runs on: each node's coalescer and ID, the claims between them, the data path.
pub struct Rollout {
    nodes: Vec<Arc<Coalescer>>,
    ids: Vec<String>,
    claims: Arc<Claims>,
    flow: Flow,
}

impl Rollout {
    pub fn new(
        routers: &[Arc<dyn ContentRouting>],
        net: SimNet,
        relay_fanout: usize,
        flow: Flow,
    ) -> Rollout {
        let claims = Claims::new(net);
        Rollout {
            nodes: coalescers(routers, &claims, relay_fanout),
            ids: routers.iter().map(|r| r.local().id).collect(),
            claims,
            flow,
        }
    }
}

/// Every node misses each of `digests` at a moment drawn in the first second.
pub async fn run(rollout: &Rollout, digests: usize, rng: &mut Rng) -> Value {
    let Rollout {
        nodes,
        ids,
        claims,
        flow,
    } = rollout;
    let flow = *flow;
    let keys: Vec<Digest> = (0..digests)
        .map(|d| Digest::sha256_of(format!("storm/{}/{d}", rng.next()).as_bytes()))
        .collect();
    let started = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        for (d, key) in keys.iter().enumerate() {
            let at = Duration::from_micros(rng.below(1_000_000) as u64);
            let (node, key) = (node.clone(), key.clone());
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep_until(started + at).await;
                let decision = node.decide(&key, None).await;
                (i, d, decision, started.elapsed())
            }));
        }
    }
    let mut decided = Vec::new();
    for t in tasks {
        decided.push(t.await.expect("decision"));
    }
    let across = claims.across.swap(0, Ordering::Relaxed);
    let index: HashMap<&str, usize> = ids
        .iter()
        .enumerate()
        .map(|(i, id)| (id.as_str(), i))
        .collect();
    let mut leaders = vec![0usize; digests];
    let mut alone = 0usize;
    // Per digest: each node's source (None: it leads, or goes alone to the registry).
    let mut source = vec![vec![None; nodes.len()]; digests];
    let mut decided_at = vec![vec![Duration::ZERO; nodes.len()]; digests];
    for (i, d, decision, at) in &decided {
        decided_at[*d][*i] = *at;
        match decision {
            Decision::Lead => leaders[*d] += 1,
            Decision::Alone => alone += 1,
            Decision::Follow(p) => source[*d][*i] = index.get(p.id.as_str()).copied(),
        }
    }
    let mut last = Vec::new();
    let mut depth_max = 0;
    let mut fanout_max = 0;
    for d in 0..digests {
        let (done, depth, fanout) = finish_times(&source[d], &decided_at[d], flow);
        last.push(done.iter().cloned().fold(0.0, f64::max));
        depth_max = depth_max.max(depth);
        fanout_max = fanout_max.max(fanout);
    }
    let star = star_time(nodes.len(), flow);
    let received = claims.received.lock().unwrap();
    let claims_max = received.values().copied().max().unwrap_or(0);
    let leaders_mean = leaders.iter().sum::<usize>() as f64 / digests as f64;
    let alone_one = blob_time_alone(flow);
    let mut waits: Vec<f64> = decided.iter().map(|(.., at)| at.as_secs_f64()).collect();
    waits.sort_by(|a, b| a.total_cmp(b));
    let wait_at = |p: f64| waits[((waits.len() - 1) as f64 * p).round() as usize];
    json!({
        "storm_digests": digests,
        "storm_leaders_per_digest_mean": leaders_mean,
        "storm_leaders_per_digest_max": leaders.iter().copied().max().unwrap_or(0),
        "storm_alone_decisions": alone,
        "storm_claims_across_partition": across,
        // From the first miss: each miss is at most 1 s in, so a wait beyond that is the decision's.
        "storm_decided_s_p50": wait_at(0.5),
        "storm_decided_s_max": wait_at(1.0),
        "storm_claims_per_node_mean": received.values().sum::<u64>() as f64 / nodes.len() as f64,
        "storm_claims_per_node_max": claims_max,
        "storm_tree_depth_max": depth_max,
        "storm_fanout_max": fanout_max,
        "storm_last_node_s_max": last.iter().cloned().fold(0.0, f64::max),
        "storm_one_node_alone_s": alone_one,
        "storm_without_relays_last_node_s": star,
        "storm_blob_mib": flow.blob_bytes / 1048576.0,
        "storm_node_gbit": flow.node_rate * 8.0 / 1e9,
        "storm_upstream_gbit": flow.upstream_rate * 8.0 / 1e9,
    })
}

/// One node pulling the blob from the registry by itself.
fn blob_time_alone(flow: Flow) -> f64 {
    flow.blob_bytes / flow.upstream_rate.min(flow.node_rate)
}

/// Every follower streaming from the one leader (`--relay-fanout 0`): N - 1 streams share
/// the leader's link.
fn star_time(nodes: usize, flow: Flow) -> f64 {
    let leader = flow.upstream_rate.min(flow.node_rate);
    let share = (flow.node_rate / (nodes.saturating_sub(1).max(1)) as f64).min(leader);
    flow.blob_bytes / share + flow.hop_lag_bytes / share
}

/// When each node has the blob, the tree's depth and its widest fan-out. A node's rate is its
/// source's, shared among the source's followers, within its own link; nodes without a source
/// (leaders, or alone) share the registry. A follower starts once its source has passed on
/// the bytes it holds back, and not before it decided; it ends no earlier than its source.
fn finish_times(
    source: &[Option<usize>],
    decided_at: &[Duration],
    flow: Flow,
) -> (Vec<f64>, usize, usize) {
    let n = source.len();
    let mut children = vec![0usize; n];
    for s in source.iter().flatten() {
        children[*s] += 1;
    }
    let roots = source.iter().filter(|s| s.is_none()).count().max(1);
    let mut rate: Vec<Option<f64>> = vec![None; n];
    let (mut depth, mut start, mut done) = (vec![0usize; n], vec![0.0f64; n], vec![0.0f64; n]);
    for first in 0..n {
        // Up the chain of sources to one already timed, or a root (the lease table never
        // builds a cycle; one would be cut where it closes).
        let mut chain = vec![first];
        while let Some(&last) = chain.last() {
            match source[last] {
                Some(s) if rate[s].is_none() && !chain.contains(&s) => chain.push(s),
                _ => break,
            }
        }
        for &i in chain.iter().rev() {
            if rate[i].is_some() {
                continue;
            }
            let decided = decided_at[i].as_secs_f64();
            match source[i].and_then(|s| rate[s].map(|r| (s, r))) {
                Some((s, source_rate)) => {
                    // What the source already holds comes at this node's share of the
                    // source's link; the rest no faster than the source receives it.
                    let share = flow.node_rate / children[s] as f64;
                    rate[i] = Some(source_rate.min(share));
                    depth[i] = depth[s] + 1;
                    start[i] = (start[s] + flow.hop_lag_bytes / source_rate).max(decided);
                    done[i] = (start[i] + flow.blob_bytes / share)
                        .max(done[s] + flow.hop_lag_bytes / share);
                }
                None => {
                    let r = (flow.upstream_rate / roots as f64).min(flow.node_rate);
                    rate[i] = Some(r);
                    start[i] = decided;
                    done[i] = decided + flow.blob_bytes / r;
                }
            }
        }
    }
    let fanout = children.iter().copied().max().unwrap_or(0);
    (done, depth.iter().copied().max().unwrap_or(0), fanout)
}
