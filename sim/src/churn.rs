//! Scenario (b): the steady state while `--churn-per-min` of the nodes (5%) restart each minute
//! for `--churn-s`. A restart stops a node's stack (its connections close, as when its pod is
//! killed) and 2 s later starts a new identity at its address with keys no other node has, as
//! the real-socket simulation's churn does. Meanwhile: a lookup every 100 ms from a random
//! running node of a key of a node never restarted, and for each new node the time until 20
//! of its keys are found from other nodes.

use std::time::Duration;

use ferry::routing::ContentRouting;
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::{Node, Options, Rng, Sim, dht_requests, keys, own_key, percentile, provider_from};

const TICK: Duration = Duration::from_millis(100);
const DOWN: Duration = Duration::from_secs(2);
/// An asker that started this recently may not know enough nodes yet.
const FRESH: Duration = Duration::from_secs(10);
/// A new node's keys not all found by then count as never.
const FINDABLE_WITHIN: Duration = Duration::from_secs(120);

pub async fn run(sim: &Sim, nodes: &mut [Node], o: &Options, rng: &mut Rng) -> Value {
    let n = nodes.len();
    let restarts = (n as f64 * o.churn_per_min * o.churn.as_secs_f64() / 60.0).round() as usize;
    let every = o.churn / restarts.max(1) as u32;
    // Restarted nodes' counters, kept: the requests they received count too.
    let mut retired: Vec<Node> = Vec::new();
    let requests = |nodes: &[Node], retired: &[Node]| dht_requests(nodes) + dht_requests(retired);
    let before = requests(nodes, &retired);
    let begun = Instant::now();
    let mut down = Vec::<(Instant, usize)>::new();
    let (mut lookups, mut findable): (Vec<JoinHandle<_>>, Vec<JoinHandle<_>>) = (vec![], vec![]);
    // Who restarts, drawn up front: a new node's keys are asked for from nodes that stay up.
    let mut victims: Vec<usize> = Vec::new();
    while victims.len() < restarts.min(n) {
        let i = rng.below(n);
        if !victims.contains(&i) {
            victims.push(i);
        }
    }
    let steady: Vec<usize> = (0..n).filter(|i| !victims.contains(i)).collect();
    let mut started = 0;
    // When each slot's current node started, if it was restarted; and, per lookup, whether its
    // asker had started under `FRESH` before (its routing table still filling).
    let mut born: Vec<Option<Instant>> = vec![None; n];
    let mut fresh_asker = Vec::new();
    while begun.elapsed() < o.churn {
        let now = Instant::now();
        if started < victims.len() && now >= begun + every * started as u32 {
            let i = victims[started];
            nodes[i].token.cancel();
            down.push((now + DOWN, i));
            started += 1;
        }
        while let Some(&(at, i)) = down.first()
            && at <= now
        {
            down.remove(0);
            let who = n + 1 + retired.len();
            let seeds: Vec<usize> = (0..n).filter(|&j| j != i).collect();
            let node = sim.start_as(i, who, &seeds);
            let router = node.router.clone();
            let own = keys(who, o.digests, o.shared);
            tokio::spawn(async move {
                let _ = router.advertise(own).await;
            });
            retired.push(std::mem::replace(&mut nodes[i], node));
            born[i] = Some(now);
            let wanted: Vec<String> = (0..20).map(|_| own_key(who, o, rng)).collect();
            let askers = steady.iter().map(|&j| nodes[j].router.clone()).collect();
            findable.push(tokio::spawn(until_found(askers, wanted, Rng(rng.next()))));
        }
        let askers: Vec<usize> = (0..n)
            .filter(|i| !down.iter().any(|(_, d)| d == i))
            .collect();
        if !askers.is_empty() {
            let a = askers[rng.below(askers.len())];
            // Not its own key: a node is never its own provider.
            let owners: Vec<usize> = (0..n)
                .filter(|&i| i != a && !victims[..started].contains(&i))
                .collect();
            fresh_asker.push(born[a].is_some_and(|b| now.duration_since(b) < FRESH));
            let asker = nodes[a].router.clone();
            let key = own_key(owners[rng.below(owners.len())], o, rng);
            lookups.push(tokio::spawn(
                async move { provider_from(&asker, &key).await },
            ));
        }
        tokio::time::sleep(TICK).await;
    }
    let msgs = (requests(nodes, &retired) - before) as f64 / n as f64 / o.churn.as_secs_f64();
    let (mut found_ms, mut missed_ms, mut missed_fresh) = (Vec::new(), Vec::new(), 0);
    for (lookup, fresh) in lookups.into_iter().zip(fresh_asker) {
        match lookup.await {
            Ok((took, true)) => found_ms.push(took.as_secs_f64() * 1000.0),
            _ if fresh => missed_fresh += 1,
            Ok((took, false)) => missed_ms.push(took.as_secs_f64() * 1000.0),
            Err(_) => missed_ms.push(-1.0),
        }
    }
    let missed = missed_ms.len();
    let mut findable_s: Vec<f64> = Vec::new();
    for f in findable {
        findable_s.push(f.await.ok().flatten().map_or(-1.0, |d| d.as_secs_f64()));
    }
    let never = findable_s.iter().filter(|s| **s < 0.0).count();
    let mut found_s: Vec<f64> = findable_s.into_iter().filter(|s| *s >= 0.0).collect();
    json!({
        "churn_s": o.churn.as_secs(),
        "churn_per_minute": o.churn_per_min,
        "churn_restarts": retired.len(),
        "churn_lookups": found_ms.len() + missed + missed_fresh,
        "churn_lookups_not_found": missed + missed_fresh,
        "churn_lookups_not_found_fresh_asker": missed_fresh,
        "churn_lookups_not_found_ms_p50": percentile(&mut missed_ms, 0.5),
        "churn_lookups_not_found_ms_max": percentile(&mut missed_ms, 1.0),
        "churn_lookup_ms_p50": percentile(&mut found_ms, 0.5),
        "churn_lookup_ms_p99": percentile(&mut found_ms, 0.99),
        "churn_msgs_per_node_per_s": msgs,
        "churn_findable_after_restart_s_p50": percentile(&mut found_s, 0.5),
        "churn_findable_after_restart_s_max": percentile(&mut found_s, 1.0),
        "churn_restarted_never_findable": never,
    })
}

/// How long until every key in `wanted` is found, asked one after another from random
/// `askers`, 200 ms after a miss; `None` past [`FINDABLE_WITHIN`].
async fn until_found(
    askers: Vec<ferry::routing::p2p::P2pRouter>,
    mut wanted: Vec<String>,
    mut rng: Rng,
) -> Option<Duration> {
    let started = Instant::now();
    while let Some(key) = wanted.last() {
        if started.elapsed() > FINDABLE_WITHIN {
            return None;
        }
        let asker = &askers[rng.below(askers.len())];
        if provider_from(asker, key).await.1 {
            wanted.pop();
        } else {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    Some(started.elapsed())
}
