//! The scale simulation in simulated time (issue #32): N real Ferry routing stacks
//! (`P2pRouter`: Kademlia, Ferry's record store, batched announcements, lookups) in one process
//! on a paused tokio clock, over `net::SimNet`. Time advances only when every node is idle, so
//! a loaded CPU never shows up as latency: figures are in simulated time, `wall_s` says how
//! long the machine took.
//!
//! `cargo run --release -- [--nodes 30] [--digests 1000] [--seed 1] [--latency-ms 1]
//! [--join-s 60] [--lookups 200] [--shared 0.8] [--interval-s 600] [--window-s 1200] [--loss 0]
//! [--nodes-per-interval 4000]`:
//! scenario (a),
//! the start:
//! N nodes join over `--join-s` and announce their digests (`--shared` of them every node's, the
//! rest its own: the real-socket simulation's keys); then lookups of other nodes' own keys and
//! of absent ones from random nodes, and the time until 20 keys of a node started last are
//! found. Prints one JSON run. `--scenario churn [--churn-s 120] [--churn-per-min 0.05]` is
//! scenario (b) after the same start (`churn.rs`), `--scenario partition` is (d). A run stops
//! with exit code 3 and why when it cannot fit the machine's memory (`--max-rss-mib`,
//! `memory.rs`).
//!
//! The clock ticks in whole milliseconds (tokio's timer wheel): a byte written is delivered at
//! the first tick `--latency-ms` after it, so links shorter than 1 ms are 1 ms links here.

mod churn;
mod entropy;
mod handshake;
mod heap;
mod memory;
mod net;
mod partition;
mod storm;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use ferry::metrics::{
    DHT_REQUEST_KINDS, DhtLabels, Metrics, OutcomeLabels, PROVIDER_WALK_OUTCOMES,
};
use ferry::ops::problems::Problems;
use ferry::routing::ContentRouting;
use ferry::routing::bootstrap::{StaticBootstrap, tcp_multiaddr};
use ferry::routing::p2p::{
    ConnectionCaps, DEFAULT_BOOTSTRAP_DIALS, IDLE_CONNECTION_TIMEOUT, NODES_PER_INTERVAL,
    P2pConfig, P2pRouter, ProvideTiming, REPLICAS, TransportFactory,
};
use libp2p::identity::Keypair;
use serde_json::{Value, json};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

#[global_allocator]
static HEAP: heap::Counting = heap::Counting;

const P2P_PORT: u16 = 5482;
const HTTP_PORT: u16 = 5481;
/// A round starts 75-100% of the interval after the last (`announcer.rs`): 0.875 on average.
const MEAN_ROUND: f64 = 0.875;

struct Options {
    nodes: usize,
    digests: usize,
    seed: u64,
    latency: Duration,
    join: Duration,
    lookups: usize,
    /// Keys every node holds (the base images every node runs), as a fraction of `digests`.
    shared: f64,
    /// Re-announcement interval, and the steady state's window (two intervals unless given).
    interval: Duration,
    window: Duration,
    /// The share of writes that lose a segment (each then arrives 200 ms late) and of dials
    /// that lose their SYN (resent after 1 s).
    loss: f64,
    /// Scenario (c): digests every node misses at once, the blob's size, the node links and
    /// the registry's, and `--relay-fanout`.
    storm_digests: usize,
    storm_mib: f64,
    node_gbit: f64,
    upstream_gbit: f64,
    relay_fanout: usize,
    /// `start` (scenarios a and c), `churn` (b) or `partition` (d).
    scenario: String,
    partition: Duration,
    /// Scenario (b): how long the churn lasts, and the share of nodes restarted a minute.
    churn: Duration,
    churn_per_min: f64,
    /// How long an unused connection stays open.
    idle: Duration,
    /// Resident memory at which the run stops (`memory.rs`).
    max_rss_mib: f64,
    /// Beyond this many nodes rounds are spaced out (Ferry's `spacing.rs`).
    nodes_per_interval: usize,
}

fn options() -> Options {
    let args: Vec<String> = std::env::args().collect();
    let value = |flag: &str, default: &str| {
        // The last occurrence, so a flag given again overrides the first.
        args.iter()
            .rposition(|a| a == flag)
            .and_then(|i| args.get(i + 1).cloned())
            .unwrap_or_else(|| default.to_string())
    };
    let interval = Duration::from_secs(value("--interval-s", "600").parse().expect("--interval-s"));
    Options {
        nodes: value("--nodes", "30").parse().expect("--nodes"),
        digests: value("--digests", "1000").parse().expect("--digests"),
        seed: value("--seed", "1").parse().expect("--seed"),
        latency: Duration::from_secs_f64(
            value("--latency-ms", "1")
                .parse::<f64>()
                .expect("--latency-ms")
                / 1000.0,
        ),
        join: Duration::from_secs(value("--join-s", "60").parse().expect("--join-s")),
        lookups: value("--lookups", "200").parse().expect("--lookups"),
        shared: value("--shared", "0.8").parse().expect("--shared"),
        interval,
        window: match args.iter().any(|a| a == "--window-s") {
            true => Duration::from_secs(value("--window-s", "").parse().expect("--window-s")),
            false => interval * 2,
        },
        loss: value("--loss", "0").parse().expect("--loss"),
        storm_digests: value("--storm-digests", "10")
            .parse()
            .expect("--storm-digests"),
        storm_mib: value("--storm-mib", "1024").parse().expect("--storm-mib"),
        node_gbit: value("--node-gbit", "10").parse().expect("--node-gbit"),
        upstream_gbit: value("--upstream-gbit", "1")
            .parse()
            .expect("--upstream-gbit"),
        relay_fanout: value("--relay-fanout", "2")
            .parse()
            .expect("--relay-fanout"),
        scenario: value("--scenario", "start"),
        partition: Duration::from_secs(
            value("--partition-s", "60").parse().expect("--partition-s"),
        ),
        churn: Duration::from_secs(value("--churn-s", "120").parse().expect("--churn-s")),
        churn_per_min: value("--churn-per-min", "0.05")
            .parse()
            .expect("--churn-per-min"),
        max_rss_mib: match args.iter().any(|a| a == "--max-rss-mib") {
            true => value("--max-rss-mib", "").parse().expect("--max-rss-mib"),
            false => memory::default_bound_mib(),
        },
        nodes_per_interval: value("--nodes-per-interval", &NODES_PER_INTERVAL.to_string())
            .parse()
            .expect("--nodes-per-interval"),
        idle: match args.iter().any(|a| a == "--idle-s") {
            true => Duration::from_secs_f64(value("--idle-s", "").parse().expect("--idle-s")),
            false => IDLE_CONNECTION_TIMEOUT,
        },
    }
}

/// SplitMix64: the run's one source of chance, so a seed gives one run.
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    pub(crate) fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn ip(i: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(
        10,
        (i >> 16) as u8,
        (i >> 8) as u8,
        i as u8 + 1,
    ))
}

/// Owner `i`'s keys, the first `shared` of them every node's: the real-socket simulation's
/// (`benches/scale.rs` `keys_of`), so the two compare.
fn keys(i: usize, digests: usize, shared: f64) -> Vec<String> {
    let n_shared = (digests as f64 * shared).round() as usize;
    (0..digests)
        .map(|j| {
            let owner = if j < n_shared { u64::MAX } else { i as u64 + 1 };
            format!("sha256:{owner:032x}{j:032x}")
        })
        .collect()
}

/// One of owner `i`'s own keys (no other node has it).
fn own_key(i: usize, o: &Options, rng: &mut Rng) -> String {
    let n_shared = (o.digests as f64 * o.shared).round() as usize;
    let j = n_shared + rng.below(o.digests - n_shared);
    format!("sha256:{:032x}{j:032x}", i as u64 + 1)
}

struct Node {
    router: P2pRouter,
    metrics: Arc<Metrics>,
    /// Cancelled, the node's stack stops and its connections close (a crash or a restart).
    token: CancellationToken,
}

struct Sim {
    net: net::SimNet,
    dir: tempfile::TempDir,
    token: CancellationToken,
    timing: ProvideTiming,
    seed: u64,
    idle: Duration,
}

impl Sim {
    /// Starts node `i`, bootstrapping from `seeds`, with a key drawn from the seed.
    fn start(&self, i: usize, seeds: &[usize]) -> Node {
        self.start_as(i, i, seeds)
    }

    /// Starts identity `who` (its key drawn from the seed) at node `i`'s address.
    fn start_as(&self, i: usize, who: usize, seeds: &[usize]) -> Node {
        let data_dir = self.dir.path().join(format!("n{who}"));
        std::fs::create_dir_all(&data_dir).expect("data dir");
        let mut secret = [0u8; 32];
        let mut rng = Rng(self.seed ^ (who as u64).wrapping_mul(0x1000_0000_01b3));
        for chunk in secret.chunks_mut(8) {
            chunk.copy_from_slice(&rng.next().to_le_bytes());
        }
        let key = Keypair::ed25519_from_bytes(secret).expect("key");
        std::fs::write(
            data_dir.join("node.key"),
            key.to_protobuf_encoding().expect("key encoding"),
        )
        .expect("write key");
        let net = self.net.clone();
        let my_ip = ip(i);
        let factory =
            TransportFactory(Arc::new(move |key: &Keypair| Ok(net.transport(my_ip, key))));
        let metrics = Arc::new(Metrics::new());
        let config = P2pConfig {
            data_dir,
            listen: SocketAddr::new(my_ip, P2P_PORT),
            advertise: Some(my_ip),
            peer_http_addr: SocketAddr::new(my_ip, HTTP_PORT),
            timing: self.timing,
            psk: None,
            simulated_latency: None,
            transport: Some(factory),
            bootstrap_dials: DEFAULT_BOOTSTRAP_DIALS,
            idle_timeout: self.idle,
            caps: ConnectionCaps::default(),
            draws_seed: Some(self.seed),
        };
        let addrs = seeds
            .iter()
            .map(|&j| tcp_multiaddr(ip(j), P2P_PORT))
            .collect();
        let token = self.token.child_token();
        let (router, _task) = P2pRouter::start(
            config,
            Arc::new(StaticBootstrap { addrs }),
            true,
            metrics.clone(),
            Arc::new(Problems::new(metrics.clone())),
            token.clone(),
        )
        .expect("router");
        Node {
            router,
            metrics,
            token,
        }
    }
}

/// DHT requests the nodes received, by kind.
fn requests_by_kind(nodes: &[Node]) -> Vec<u64> {
    DHT_REQUEST_KINDS
        .iter()
        .map(|&kind| {
            nodes
                .iter()
                .map(|n| {
                    n.metrics
                        .dht_requests
                        .get_or_create(&DhtLabels { kind })
                        .get()
                })
                .sum()
        })
        .collect()
}

/// Lookups' provider walks so far, summed over the nodes, by outcome (`found`, `none`): walks,
/// nodes asked and dials, as the real-socket simulation counts them.
fn provider_walks(nodes: &[Node]) -> Vec<[u64; 3]> {
    PROVIDER_WALK_OUTCOMES
        .iter()
        .map(|&outcome| {
            let labels = OutcomeLabels { outcome };
            let mut sums = [0u64; 3];
            for n in nodes {
                let m = &n.metrics;
                let families = [
                    &m.provider_walks,
                    &m.provider_walk_requests,
                    &m.provider_walk_dials,
                ];
                for (sum, family) in sums.iter_mut().zip(families) {
                    *sum += family.get_or_create(&labels).get();
                }
            }
            sums
        })
        .collect()
}

/// One of a node's outcome counters, by outcome, summed over the nodes.
fn by_outcome<const N: usize>(
    nodes: &[Node],
    outcomes: [&'static str; N],
    count: fn(&Metrics, &OutcomeLabels) -> u64,
) -> [u64; N] {
    outcomes.map(|outcome| {
        let labels = OutcomeLabels { outcome };
        nodes.iter().map(|n| count(&n.metrics, &labels)).sum()
    })
}

/// The announcers' walks so far (converged or timed out), summed over the nodes.
fn announce_walks(nodes: &[Node]) -> u64 {
    let walks = by_outcome(nodes, ferry::metrics::WALK_OUTCOMES, |m, l| {
        m.announce_walks.get_or_create(l).get()
    });
    walks.iter().sum()
}

/// The announcers' regions so far, summed over the nodes: planned, confirmed, walked.
fn announce_hops(nodes: &[Node]) -> [u64; 3] {
    by_outcome(nodes, ferry::metrics::HOP_OUTCOMES, |m, l| {
        m.announce_hops.get_or_create(l).get()
    })
}

/// The announcers' batches so far, summed over the nodes: delivered, retried, failed.
fn announce_batches(nodes: &[Node]) -> [u64; 3] {
    by_outcome(nodes, ferry::metrics::BATCH_OUTCOMES, |m, l| {
        m.announce_batches.get_or_create(l).get()
    })
}

/// Announcement rounds started, summed over the nodes.
fn announce_rounds(nodes: &[Node]) -> u64 {
    nodes.iter().map(|n| n.metrics.announce_rounds.get()).sum()
}

fn dht_requests(nodes: &[Node]) -> u64 {
    requests_by_kind(nodes).iter().sum()
}

/// Time to the first provider of `key` from `node`, or `None` when the walk ends with nobody.
async fn first_provider(node: &Node, key: &str) -> (Duration, bool) {
    provider_from(&node.router, key).await
}

async fn provider_from(router: &P2pRouter, key: &str) -> (Duration, bool) {
    let started = Instant::now();
    let mut found = router.lookup(key).await;
    let hit = found.recv().await.is_some();
    (started.elapsed(), hit)
}

async fn until_walk_ends(node: &Node, key: &str) -> Duration {
    let started = Instant::now();
    let mut found = node.router.lookup(key).await;
    while found.recv().await.is_some() {}
    started.elapsed()
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(((v.len() as f64 - 1.0) * p).round() as usize)
        .copied()
        .unwrap_or(0.0)
}

unsafe extern "C" {
    /// mimalloc's (the sim's allocator, `heap.rs`): gives freed heap back to the system.
    fn mi_collect(force: bool);
}

/// A line of `/proc/self/status` in MiB: `VmRSS:` now, `VmHWM:` the peak.
fn status_mib(field: &str) -> f64 {
    memory::proc_mib("/proc/self/status", field).unwrap_or(0.0)
}

/// Resident memory once freed heap is given back: what the nodes hold, not what the first
/// round's messages once took (the allocator keeps freed memory for reuse).
fn live_mib() -> f64 {
    // SAFETY: mi_collect takes no pointers and only returns free pages.
    unsafe { mi_collect(true) };
    status_mib("VmRSS:")
}

/// The storm's coalescers on `nodes`, and the data path's model from the options.
fn rollout(nodes: &[Node], o: &Options, net: &net::SimNet) -> storm::Rollout {
    let routers: Vec<Arc<dyn ContentRouting>> = nodes
        .iter()
        .map(|n| Arc::new(n.router.clone()) as Arc<dyn ContentRouting>)
        .collect();
    let flow = storm::Flow {
        blob_bytes: o.storm_mib * 1_048_576.0,
        node_rate: o.node_gbit * 1e9 / 8.0,
        upstream_rate: o.upstream_gbit * 1e9 / 8.0,
        hop_lag_bytes: 1_048_576.0,
    };
    storm::Rollout::new(&routers, net.clone(), o.relay_fanout, flow)
}

/// What names a run in the report: its scenario and settings.
fn run_fields(o: &Options) -> serde_json::Map<String, Value> {
    let Value::Object(fields) = json!({
        "scenario": o.scenario,
        "nodes": o.nodes,
        "digests_per_node": o.digests,
        "seed": o.seed,
        "clock": "simulated",
        "latency_ms": o.latency.as_secs_f64() * 1000.0,
        "loss": o.loss,
        "idle_s": o.idle.as_secs_f64(),
    }) else {
        unreachable!("a JSON object")
    };
    fields
}

async fn run(o: Options) -> serde_json::Value {
    let wall = std::time::Instant::now();
    let interval = o.interval;
    let sim = Sim {
        net: net::SimNet::new(o.latency, o.loss, o.seed),
        dir: tempfile::tempdir().expect("tempdir"),
        token: CancellationToken::new(),
        timing: ProvideTiming {
            ttl: interval * 3,
            interval,
            replicas: REPLICAS,
            nodes_per_interval: o.nodes_per_interval,
        },
        seed: o.seed,
        idle: o.idle,
    };
    let mut rng = Rng(o.seed);
    let mut nodes: Vec<Node> = Vec::new();
    let every = o.join / o.nodes.max(1) as u32;
    let begun = Instant::now();
    memory::phase("the join");
    for i in 0..o.nodes {
        tokio::time::sleep_until(begun + every * i as u32).await;
        // Every earlier node, as the Kubernetes bootstrap lists every pod; Ferry dials a few.
        let seeds: Vec<usize> = (0..i).collect();
        let node = sim.start(i, &seeds);
        let r = node.router.clone();
        let k = keys(i, o.digests, o.shared);
        tokio::spawn(async move {
            let _ = r.advertise(k).await;
        });
        nodes.push(node);
    }
    // The first round's announcements settle.
    tokio::time::sleep(Duration::from_secs(60)).await;
    let joined_s = begun.elapsed().as_secs_f64();
    let first_round = dht_requests(&nodes) as f64 / o.nodes as f64;
    let per_node = |ends: usize| ends as f64 / o.nodes as f64;
    // The join and first rounds' peak, before lookups and the storm open their own.
    let joining_peak = per_node(net::ends().1);
    eprintln!(
        "joined after {:.0} s wall: {:.1} MiB/node live, {:.1} connections/node ({joining_peak:.1} at most)",
        wall.elapsed().as_secs_f64(),
        live_mib() / o.nodes as f64,
        per_node(net::ends().0)
    );
    eprintln!(
        "join per node: requests {:?} {:?}, announce walks {:.0}, hops (planned, confirmed, walked) {:?}, early rounds {:.1}, batches {:?}, connections opened {:.0}",
        DHT_REQUEST_KINDS,
        requests_by_kind(&nodes)
            .iter()
            .map(|&r| per_node(r as usize).round())
            .collect::<Vec<_>>(),
        per_node(announce_walks(&nodes) as usize),
        announce_hops(&nodes).map(|h| per_node(h as usize).round()),
        per_node(
            nodes
                .iter()
                .map(|n| n.metrics.announce_rounds_early.get() as usize)
                .sum()
        ),
        announce_batches(&nodes).map(|b| per_node(b as usize).round()),
        per_node(net::opened()),
    );

    let fields = match o.scenario.as_str() {
        "partition" => {
            memory::phase("the partition");
            Some(partition::run(&nodes, &o, &sim.net, &mut rng).await)
        }
        "churn" => {
            memory::phase("the churn");
            Some(churn::run(&sim, &mut nodes, &o, &mut rng).await)
        }
        _ => None,
    };
    if let Some(fields) = fields {
        sim.token.cancel();
        let mut report = run_fields(&o);
        report.insert("joined_s".into(), json!(joined_s));
        report.insert(
            "connections_per_node_peak_joining".into(),
            json!(joining_peak),
        );
        report.insert("first_round_msgs_per_node".into(), json!(first_round));
        report.insert("wall_s".into(), json!(wall.elapsed().as_secs_f64()));
        if let Value::Object(fields) = fields {
            report.extend(fields);
        }
        return Value::Object(report);
    }
    assert_eq!(o.scenario, "start", "--scenario: start, churn or partition");

    // Steady state: requests over a window.
    memory::phase("the steady state");
    let before = dht_requests(&nodes);
    let before_kinds = requests_by_kind(&nodes);
    let walks_before_window = announce_walks(&nodes);
    let rounds_before = announce_rounds(&nodes);
    let hops_before = announce_hops(&nodes);
    let window = o.window;
    tokio::time::sleep(window).await;
    // What a node holds between rollouts, before the lookups and the storm open connections.
    let steady_mem = live_mib() / o.nodes as f64;
    let steady_connections = per_node(net::ends().0);
    let steady_heap = heap::live_mib() / o.nodes as f64;
    eprintln!(
        "steady after {:.0} s wall: {steady_mem:.1} MiB/node live ({steady_heap:.1} heap), {steady_connections:.1} connections/node",
        wall.elapsed().as_secs_f64(),
    );
    // A window holds whole rounds, so where rounds fall in it moves its rate by up to a round
    // a node (two intervals after the join hold exactly two: 12.5% under the mean round's
    // rate). Requests over the rounds started in the window do not depend on that.
    let rounds = (announce_rounds(&nodes) - rounds_before) as f64;
    // Rounds are spaced out beyond `--nodes-per-interval` nodes: the interval each node uses.
    let in_effect = nodes
        .iter()
        .map(|n| n.metrics.announce_interval.get() as f64)
        .sum::<f64>()
        / o.nodes as f64;
    let mean_round = MEAN_ROUND * in_effect;
    let received = (dht_requests(&nodes) - before) as f64;
    let per_round = received / rounds;
    let msgs = per_round / mean_round;
    let msgs_window = received / o.nodes as f64 / window.as_secs_f64();
    let announce_walk_rate = (announce_walks(&nodes) - walks_before_window) as f64
        / o.nodes as f64
        / window.as_secs_f64();
    let msgs_by_kind: serde_json::Map<String, Value> = DHT_REQUEST_KINDS
        .iter()
        .zip(requests_by_kind(&nodes).iter().zip(&before_kinds))
        .map(|(kind, (after, before))| {
            let rate = (after - before) as f64 / rounds / mean_round;
            (kind.to_string(), json!(rate))
        })
        .collect();
    let hops_per_round: Vec<f64> = (announce_hops(&nodes).iter().zip(hops_before))
        .map(|(after, before)| (after - before) as f64 / rounds)
        .collect();
    eprintln!(
        "steady requests per node per s: {msgs:.3} {} over {:.2} rounds a node ({per_round:.1} requests a round, hops (planned, confirmed, walked) {hops_per_round:.1?} a round; {msgs_window:.3} over the window)",
        Value::Object(msgs_by_kind.clone()),
        rounds / o.nodes as f64,
    );

    memory::phase("the lookups");
    let walks_before = provider_walks(&nodes);
    let mut found_ms = Vec::new();
    let mut missed = 0;
    for _ in 0..o.lookups {
        let asker = rng.below(o.nodes);
        let owner = (asker + 1 + rng.below(o.nodes - 1)) % o.nodes;
        let key = own_key(owner, &o, &mut rng);
        let (took, hit) = first_provider(&nodes[asker], &key).await;
        if hit {
            found_ms.push(took.as_secs_f64() * 1000.0);
        } else {
            missed += 1;
        }
    }
    let mut absent_ms = Vec::new();
    for i in 0..o.lookups.min(50) {
        let asker = rng.below(o.nodes);
        let key = format!("sha256:{:032x}{i:032x}", u64::MAX - 1);
        absent_ms.push(until_walk_ends(&nodes[asker], &key).await.as_secs_f64() * 1000.0);
    }
    // A walk that found goes on in the background; it is counted when it ends.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let walks = provider_walks(&nodes);
    let per_walk = |outcome: usize, field: usize| {
        let delta = |i: usize| (walks[outcome][i] - walks_before[outcome][i]) as f64;
        delta(field) / delta(0)
    };

    // A node that joins now (a new identity, keys nobody else has): how long until 20 of
    // its keys are found from other nodes, asked one after another, 200 ms after a miss.
    let newcomer = o.nodes;
    let seeds: Vec<usize> = (0..o.nodes).collect();
    let started = Instant::now();
    let node = sim.start(newcomer, &seeds);
    let r = node.router.clone();
    let k = keys(newcomer, o.digests, o.shared);
    tokio::spawn(async move {
        let _ = r.advertise(k).await;
    });
    nodes.push(node);
    let mut waiting: Vec<String> = (0..20).map(|_| own_key(newcomer, &o, &mut rng)).collect();
    while let Some(key) = waiting.last()
        && started.elapsed() < Duration::from_secs(600)
    {
        let asker = rng.below(o.nodes);
        if first_provider(&nodes[asker], key).await.1 {
            waiting.pop();
        } else {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let findable = if waiting.is_empty() {
        started.elapsed()
    } else {
        Duration::MAX
    };
    // Scenario (c): the rollout storm, on the nodes that started together.
    let rollout = rollout(&nodes[..o.nodes], &o, &sim.net);
    // Printed before the storm, whose connections are the run's peak of memory.
    eprintln!(
        "storm starts after {:.0} s wall: {:.0} MiB RSS; lookups p50 / p99 {:.1} / {:.1} ms ({missed} missed), not found p50 {:.1} ms, findable after start {:.2} s",
        wall.elapsed().as_secs_f64(),
        status_mib("VmRSS:"),
        percentile(&mut found_ms, 0.5),
        percentile(&mut found_ms, 0.99),
        percentile(&mut absent_ms, 0.5),
        findable.as_secs_f64(),
    );
    memory::phase("the storm");
    let storm = storm::run(&rollout, o.storm_digests, &mut rng).await;
    let mem = live_mib() / (o.nodes + 1) as f64;
    let heap_mib = heap::live_mib() / (o.nodes + 1) as f64;
    let peak = status_mib("VmHWM:");
    let (ends, ends_peak) = net::ends();
    sim.token.cancel();
    let mut report = json!({
        "joined_s": joined_s,
        "lookup_ms_p50": percentile(&mut found_ms, 0.5),
        "lookup_ms_p99": percentile(&mut found_ms, 0.99),
        "lookups_missed": missed,
        "notfound_ms_p50": percentile(&mut absent_ms, 0.5),
        "found_walk_requests": per_walk(0, 1),
        "found_walk_dials": per_walk(0, 2),
        "notfound_walk_requests": per_walk(1, 1),
        "notfound_walk_dials": per_walk(1, 2),
        "announce_msgs_per_node_per_s": msgs,
        "announce_msgs_per_node_per_s_by_kind": msgs_by_kind,
        "announce_msgs_per_node_per_s_window": msgs_window,
        "announce_rounds_per_node_in_window": rounds / o.nodes as f64,
        "announce_msgs_per_counted_round": per_round,
        "announce_hops_per_counted_round": hops_per_round,
        "steady_window_s": window.as_secs(),
        "announce_walks_per_node_per_s": announce_walk_rate,
        "announce_batches_per_node": announce_batches(&nodes).map(|b| b as f64 / (o.nodes + 1) as f64),
        "first_round_msgs_per_node": first_round,
        "shared_fraction": o.shared,
        "interval_s": o.interval.as_secs(),
        "interval_in_effect_s": in_effect,
        "nodes_per_interval": o.nodes_per_interval,
        "mem_mib_per_node": mem,
        "mem_peak_mib_total": peak,
        "mem_mib_per_node_steady": steady_mem,
        "heap_mib_per_node": heap_mib,
        "heap_mib_per_node_steady": steady_heap,
        "connections_per_node_steady": steady_connections,
        "connections_per_node_peak_joining": joining_peak,
        "connections_per_node": ends as f64 / (o.nodes + 1) as f64,
        "connections_per_node_peak": ends_peak as f64 / (o.nodes + 1) as f64,
        "findable_after_start_s": if findable == Duration::MAX { -1.0 } else { findable.as_secs_f64() },
        "wall_s": wall.elapsed().as_secs_f64(),
    });
    if let (Some(report), Value::Object(storm)) = (report.as_object_mut(), storm) {
        report.extend(run_fields(&o));
        report.extend(storm);
    }
    report
}

fn main() {
    let o = options();
    // Each scenario ends in a storm and a lookup needs another node to ask.
    if o.storm_digests == 0 || o.nodes < 2 {
        eprintln!("--storm-digests must be at least 1 and --nodes at least 2");
        std::process::exit(2);
    }
    let seed = o.seed;
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default_hook(info);
        eprintln!("the simulation failed: replay it with --seed {seed} (and the same options)");
    }));
    if let Err(why) = memory::check_fits(o.nodes, o.digests, o.max_rss_mib) {
        eprintln!("{why}");
        std::process::exit(3);
    }
    memory::watch(o.max_rss_mib, seed);
    entropy::seed(o.seed);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .rng_seed(tokio::runtime::RngSeed::from_bytes(&o.seed.to_le_bytes()))
        .build()
        .expect("runtime");
    let report = runtime.block_on(run(o));
    println!("{report}");
}
