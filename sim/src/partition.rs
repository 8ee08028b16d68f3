//! Scenario (d): the network splits the cluster in two halves for `--partition-s` and heals.
//! During the split: lookups of keys of this side's nodes and of the other side's, and a
//! rollout storm (how many leaders each digest gets when its coordinator is out of reach).
//! After it heals: the same lookups across, and a second storm.

use std::collections::HashSet;
use std::time::Duration;

use serde_json::{Map, Value, json};
use tokio::time::Instant;

use crate::{Node, Options, Rng, first_provider, ip, own_key, percentile, storm};

/// Lookups of each kind, asked at once.
const LOOKUPS: usize = 50;

pub async fn run(nodes: &[Node], o: &Options, net: &crate::net::SimNet, rng: &mut Rng) -> Value {
    let n = nodes.len();
    let half = n / 2;
    let side = |i: usize| i < half;
    let rollout = crate::rollout(nodes, o, net);

    let heals = Instant::now() + o.partition;
    net.split((0..half).map(ip).collect::<HashSet<_>>(), heals);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let mut out = Map::new();
    out.insert("partition_s".into(), json!(o.partition.as_secs()));
    let same = lookups(nodes, o, rng, |a, b| side(a) == side(b)).await;
    put(&mut out, "partition_same_side", same);
    let across = lookups(nodes, o, rng, |a, b| side(a) != side(b)).await;
    put(&mut out, "partition_across", across);
    let during = storm::run(&rollout, o.storm_digests, rng).await;
    rename(&mut out, during, "storm_", "partition_storm_");
    out.insert(
        "partition_storm_ended_before_heal".into(),
        json!(Instant::now() < heals),
    );

    tokio::time::sleep_until(heals + Duration::from_secs(1)).await;
    let healed = lookups(nodes, o, rng, |a, b| side(a) != side(b)).await;
    put(&mut out, "healed_across", healed);
    let after = storm::run(&rollout, o.storm_digests, rng).await;
    rename(&mut out, after, "storm_", "healed_storm_");
    Value::Object(out)
}

/// `LOOKUPS` lookups at once, each of an own key of an owner `pair(asker, owner)` allows: the
/// share that found a provider, and the time to it.
async fn lookups(
    nodes: &[Node],
    o: &Options,
    rng: &mut Rng,
    pair: impl Fn(usize, usize) -> bool,
) -> (f64, f64, f64) {
    let n = nodes.len();
    let mut asked = Vec::new();
    while asked.len() < LOOKUPS {
        let (asker, owner) = (rng.below(n), rng.below(n));
        if asker != owner && pair(asker, owner) {
            asked.push((asker, own_key(owner, o, rng)));
        }
    }
    let found = futures::future::join_all(
        asked
            .iter()
            .map(|(asker, key)| first_provider(&nodes[*asker], key)),
    )
    .await;
    let mut ms: Vec<f64> = found
        .iter()
        .filter(|(_, hit)| *hit)
        .map(|(took, _)| took.as_secs_f64() * 1000.0)
        .collect();
    let share = ms.len() as f64 / LOOKUPS as f64;
    (share, percentile(&mut ms, 0.5), percentile(&mut ms, 0.99))
}

fn put(out: &mut Map<String, Value>, name: &str, (share, p50, p99): (f64, f64, f64)) {
    out.insert(format!("{name}_found"), json!(share));
    out.insert(format!("{name}_ms_p50"), json!(p50));
    out.insert(format!("{name}_ms_p99"), json!(p99));
}

fn rename(out: &mut Map<String, Value>, fields: Value, from: &str, to: &str) {
    if let Value::Object(fields) = fields {
        for (k, v) in fields {
            out.insert(k.replacen(from, to, 1), v);
        }
    }
}
