//! The scale simulation (#13): N real Ferry routing stacks (`P2pRouter`: libp2p Kademlia over
//! TCP with noise and yamux, Ferry's record store, its batched announcements and rounds, its
//! lookups) on loopback inside a network namespace of their own, whose `lo` delays every packet
//! (`tc netem`, default 0.25 ms per hop). The nodes run in several worker processes (one
//! process cannot hold the sockets of 1,000 nodes: 20,000 file descriptors at most here),
//! driven by this process over their stdin and stdout.
//!
//! Each node holds `--digests` keys, `--shared` of them the same on every node (the base
//! images every node runs), the rest its own, and advertises them all at start, as Ferry's
//! sync does after its first walk of the store (the store itself is not simulated: the keys
//! are what the DHT sees). Measured per run: the time until every node's announcements are
//! done; DHT requests and loopback bytes per node per second in steady state (a window of
//! two re-announcement intervals, scaled to the default interval); lookup latency of present
//! keys (to the first provider, what a pull waits for) and of absent ones (until the walk
//! ends), and the nodes each of those walks asked (the hops: libp2p-kad asks five at a time
//! and reports no depth); resident memory per node (the workers' RSS over the nodes); the time until a new
//! node's keys (a new identity, keys nobody else has) are findable from other nodes; and
//! lookups under churn (5% of
//! the nodes restarting per minute). Written to `<out>/scale.json` (a list of runs, one per
//! node count and digest count, replaced when re-run) and drawn in `<out>/scale.png`.
//!
//! `cargo bench --bench scale -- [--nodes 100,300,1000] [--digests 10000] [--shared 0.8]
//! [--latency-ms 0.25] [--interval-s 120] [--per-worker 50] [--churn-s 120]
//! [--start-every-ms 0] [--window-s 240] [--idle-s 60] [--out DIR] [--replot] [--table]`; `--table` runs
//! every row of `<out>/scale.json` again, each with the settings it was measured with. `--start-every-ms` starts the
//! nodes one after another, one every that many milliseconds, instead of all at once; a `--window-s` shorter than
//! the interval holds no full round, and the announce traffic is then the first round's. Needs root (a network namespace), except `--replot`. `./scripts/scale.sh`.

#![allow(clippy::unwrap_used)] // a benchmark harness: failures are loud on purpose

#[allow(dead_code)] // the cluster report: only its font registration is used here
#[path = "cluster/report.rs"]
mod report;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use ferry::metrics::{DHT_REQUEST_KINDS, DhtLabels, Metrics, OutcomeLabels};
use ferry::ops::problems::Problems;
use ferry::registry::peer::{DEFAULT_RESOLVE_TIMEOUT_MAX, ResolveBound};
use ferry::routing::ContentRouting;
use ferry::routing::bootstrap::{StaticBootstrap, tcp_multiaddr};
use ferry::routing::p2p::{
    ConnectionCaps, DEFAULT_BOOTSTRAP_DIALS, IDLE_CONNECTION_TIMEOUT, NODES_PER_INTERVAL,
    P2pConfig, P2pRouter, ProvideTiming, REPLICAS,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use serde_json::{Value, json};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const P2P_BASE: u16 = 20_000;
const HTTP_BASE: u16 = 40_000;
/// The interval a production node re-announces at (`--reprovide-interval`), whose mean round
/// (75-100% of it) the steady-state traffic is scaled to.
const DEFAULT_INTERVAL_S: f64 = 600.0;
/// A round starts 75-100% of the interval after the last (`announcer.rs`): 0.875 on average.
const MEAN_ROUND: f64 = 0.875;
/// Between two lookups of one worker process (about 50 lookups a second per process).
const LOOKUP_GAP: Duration = Duration::from_millis(20);
/// Ferry's default `--resolve-timeout`: a pull waits this long for a lookup's first provider,
/// then goes upstream. Lookups of present keys slower than this are counted.
const RESOLVE_TIMEOUT_MS: f64 = 20.0;
/// The wait as a node adapts it (`ResolveBound`, between `--resolve-timeout` and
/// `--resolve-timeout-max`): each asking worker keeps one, fed with its lookups in order.
fn resolve_bound() -> ResolveBound {
    ResolveBound::new(
        Duration::from_secs_f64(RESOLVE_TIMEOUT_MS / 1000.0),
        DEFAULT_RESOLVE_TIMEOUT_MAX,
    )
}
/// How often connections are counted during the steady-state window.
const CONNECTION_SAMPLE: Duration = Duration::from_secs(10);
/// The simulation stops when its processes hold more than this (the machine has 24 GiB).
const MEMORY_LIMIT_MIB: f64 = 20.0 * 1024.0;
/// The simulation stops when the nodes' first announcements take longer than this.
const START_LIMIT: Duration = Duration::from_secs(1_800);

#[derive(Debug, Clone)]
struct Options {
    nodes: Vec<usize>,
    digests: usize,
    shared: f64,
    latency_ms: f64,
    interval_s: u64,
    per_worker: usize,
    churn_s: u64,
    /// Nodes start one after another, one every this many milliseconds (0: all at once).
    start_every_ms: u64,
    /// The steady-state window; two intervals unless given.
    window_s: Option<u64>,
    /// Connections without a stream close after this long (Ferry's 60 s unless given).
    idle_s: u64,
    out: PathBuf,
    replot: bool,
    /// Run every row of the report again, each with its own settings.
    table: bool,
}

fn options(args: &[String]) -> Options {
    let mut o = Options {
        nodes: vec![100, 300, 1000],
        digests: 10_000,
        shared: 0.8,
        latency_ms: 0.25,
        interval_s: 120,
        per_worker: 50,
        churn_s: 120,
        start_every_ms: 0,
        window_s: None,
        idle_s: IDLE_CONNECTION_TIMEOUT.as_secs(),
        out: PathBuf::from("benches/results"),
        replot: false,
        table: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let mut v = || it.next().cloned().unwrap_or_default();
        match a.as_str() {
            "--nodes" => o.nodes = v().split(',').map(|n| n.parse().unwrap()).collect(),
            "--digests" => o.digests = v().parse().unwrap(),
            "--shared" => o.shared = v().parse().unwrap(),
            "--latency-ms" => o.latency_ms = v().parse().unwrap(),
            "--interval-s" => o.interval_s = v().parse().unwrap(),
            "--per-worker" => o.per_worker = v().parse().unwrap(),
            "--churn-s" => o.churn_s = v().parse().unwrap(),
            "--start-every-ms" => o.start_every_ms = v().parse().unwrap(),
            "--window-s" => o.window_s = Some(v().parse().unwrap()),
            "--idle-s" => o.idle_s = v().parse().unwrap(),
            "--out" => o.out = PathBuf::from(v()),
            "--replot" => o.replot = true,
            "--table" => o.table = true,
            "--bench" => {}
            other => panic!("unknown option {other}"),
        }
    }
    o
}

/// Node `i`'s keys: the shared ones first, then its own. Key strings are hashed by Kademlia,
/// so sequential numbers spread over the key space like real digests.
fn keys_of(i: usize, digests: usize, shared: f64) -> Vec<String> {
    let n_shared = (digests as f64 * shared).round() as usize;
    (0..digests)
        .map(|j| {
            if j < n_shared {
                format!("sha256:{:032x}{j:032x}", u64::MAX)
            } else {
                format!("sha256:{:032x}{j:032x}", i + 1)
            }
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--worker") {
        return worker(&args[1..]);
    }
    // `cargo test --all-targets` runs bench binaries too, without `--bench`: do nothing then.
    if !args.iter().any(|a| a == "--bench" || a == "--replot") {
        return;
    }
    let opts = options(&args);
    let json_path = opts.out.join("scale.json");
    if opts.replot {
        let report: Value =
            serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
        chart(&report, &opts.out.join("scale.png"));
        println!("{}", table(&report));
        return;
    }
    let ns = Netns::new();
    let mut report: Value = std::fs::read_to_string(&json_path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or_else(|| json!({ "runs": [] }));
    // Each with the row it re-runs (`--table`): replaced even if written by older code.
    let runs: Vec<(Options, usize, Option<Value>)> = if opts.table {
        report["runs"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .map(|r| {
                let (o, n) = as_measured(&r, &opts);
                (o, n, Some(r))
            })
            .collect()
    } else {
        opts.nodes
            .iter()
            .map(|&n| (opts.clone(), n, None))
            .collect()
    };
    for (opts, n, old) in runs {
        let run = run(&ns, &opts, n);
        println!("{}", serde_json::to_string_pretty(&run).unwrap());
        let runs = report["runs"].as_array_mut().unwrap();
        runs.retain(|r| setup(r) != setup(&run) && Some(r) != old.as_ref());
        runs.push(run);
        runs.sort_by_key(|r| {
            (
                r["digests_per_node"].as_u64(),
                mode(r).to_string(),
                r["nodes"].as_u64(),
            )
        });
        report["machine"] = json!(machine());
        std::fs::create_dir_all(&opts.out).unwrap();
        std::fs::write(&json_path, serde_json::to_string_pretty(&report).unwrap()).unwrap();
        chart(&report, &opts.out.join("scale.png"));
    }
    println!("{}", table(&report));
}

/// The settings `row` was measured with (`--table`), for a run that replaces it.
fn as_measured(row: &Value, base: &Options) -> (Options, usize) {
    let n = row["nodes"].as_u64().unwrap() as usize;
    let number = |field: &str| row[field].as_f64();
    let mut o = base.clone();
    o.digests = row["digests_per_node"].as_u64().unwrap() as usize;
    o.shared = number("shared_fraction").unwrap_or(o.shared);
    o.latency_ms = number("latency_ms_per_hop").unwrap_or(o.latency_ms);
    o.interval_s = row["sim_interval_s"].as_u64().unwrap_or(o.interval_s);
    o.churn_s = row["churn_s"].as_u64().unwrap_or(o.churn_s);
    o.start_every_ms = row["start_every_ms"].as_u64().unwrap_or(0);
    o.window_s = number("steady_window_s").map(|w| w.round() as u64);
    o.idle_s = row["idle_timeout_s"].as_u64().unwrap_or(o.idle_s);
    // Recorded since `--table`; before, recovered from the worker count (the same count).
    if let Some(per) = row["per_worker"].as_u64() {
        o.per_worker = per as usize;
    } else if let Some(workers) = row["worker_processes"].as_u64() {
        o.per_worker = n.div_ceil(workers as usize);
    }
    (o, n)
}

/// What makes a row: a run replaces only the one measured with the same settings (a run at
/// the 120 s interval that saturates this machine must not replace one at the real interval).
fn setup(run: &Value) -> (Option<u64>, Option<u64>, String, Option<u64>, u64, u64) {
    (
        run["nodes"].as_u64(),
        run["digests_per_node"].as_u64(),
        mode(run).to_string(),
        run["sim_interval_s"].as_u64(),
        run["start_every_ms"].as_u64().unwrap_or(0),
        run["idle_timeout_s"]
            .as_u64()
            .unwrap_or(IDLE_CONNECTION_TIMEOUT.as_secs()),
    )
}

/// How the nodes started and how often they re-announced, for the table: what to pass to
/// reproduce a row (`--start-every-ms`, `--interval-s`).
fn settings(run: &Value) -> String {
    let start = match run["start_every_ms"].as_u64().unwrap_or(0) {
        0 => "all at once".to_string(),
        ms => format!("one per {ms} ms"),
    };
    let rounds = match run["sim_interval_s"].as_u64() {
        Some(s) => format!("{start}, rounds every {s} s"),
        None => start,
    };
    match run["idle_timeout_s"].as_u64() {
        Some(idle) if idle != IDLE_CONNECTION_TIMEOUT.as_secs() => {
            format!("{rounds}, idle connections kept {idle} s")
        }
        _ => rounds,
    }
}

/// How a run measured its announce traffic: over a steady window of full rounds (every run
/// before `--window-s`), or over the first round. A row is replaced only by one of its kind.
fn mode(run: &Value) -> &str {
    run["announce_measured_over"]
        .as_str()
        .unwrap_or("steady window")
}

fn machine() -> String {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cpus} vCPUs, one run per row")
}

/// The simulation's network namespace (its own loopback, whose byte counters are the
/// simulation's traffic); deleted on drop.
struct Netns {
    name: String,
}

impl Netns {
    fn new() -> Netns {
        let name = format!("ferry-scale-{}", std::process::id());
        let ip = |args: &[&str]| {
            let ok = Command::new("ip").args(args).status().unwrap().success();
            assert!(ok, "ip {}", args.join(" "));
        };
        ip(&["netns", "add", &name]);
        let ns = Netns { name };
        ip(&["-n", &ns.name, "link", "set", "lo", "up"]);
        ns
    }

    fn lo_bytes(&self) -> u64 {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.name,
                "cat",
                "/sys/class/net/lo/statistics/rx_bytes",
            ])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or(0)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .status();
    }
}

/// A worker process and its pipes. Killed on drop (its own child, by PID).
struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Worker {
    fn send(&mut self, command: &Value) {
        writeln!(self.stdin, "{command}").unwrap();
        self.stdin.flush().unwrap();
    }

    fn recv(&mut self) -> Value {
        let mut line = String::new();
        let n = self.stdout.read_line(&mut line).unwrap();
        assert!(n > 0, "a worker stopped (see its log)");
        serde_json::from_str(&line).unwrap()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends `command` to every worker, then collects every answer.
fn all(workers: &mut [Worker], command: impl Fn(usize) -> Value) -> Vec<Value> {
    for (i, w) in workers.iter_mut().enumerate() {
        w.send(&command(i));
    }
    workers.iter_mut().map(Worker::recv).collect()
}

fn sum(answers: &[Value], field: &str) -> f64 {
    answers
        .iter()
        .map(|a| a[field].as_f64().unwrap_or(0.0))
        .sum()
}

fn concat(answers: &[Value], field: &str) -> Vec<f64> {
    answers
        .iter()
        .flat_map(|a| a[field].as_array().cloned().unwrap_or_default())
        .filter_map(|v| v.as_f64())
        .collect()
}

fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// The mean (0 for none).
fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// The settings of a run of `n` nodes, in every row it writes (also one that did not fit or
/// settle): what `--table` runs again and what `setup` tells rows apart by.
fn settings_json(opts: &Options, n: usize) -> Value {
    let window = opts.window_s.unwrap_or(2 * opts.interval_s);
    json!({
        "nodes": n,
        "digests_per_node": opts.digests,
        "shared_fraction": opts.shared,
        "latency_ms_per_hop": opts.latency_ms,
        "worker_processes": n.div_ceil(opts.per_worker),
        "per_worker": opts.per_worker,
        "start_every_ms": opts.start_every_ms,
        "sim_interval_s": opts.interval_s,
        "steady_window_s": window,
        "churn_s": opts.churn_s,
        "idle_timeout_s": opts.idle_s,
        "announce_measured_over": if window < opts.interval_s { "first round" } else { "steady window" },
    })
}

/// `row` with `extra`'s fields added.
fn with(mut row: Value, extra: Value) -> Value {
    if let (Some(row), Some(extra)) = (row.as_object_mut(), extra.as_object()) {
        for (k, v) in extra {
            row.insert(k.clone(), v.clone());
        }
    }
    row
}

fn run(ns: &Netns, opts: &Options, n: usize) -> Value {
    let workers_n = n.div_ceil(opts.per_worker);
    let exe = std::env::current_exe().unwrap();
    let logs = std::env::temp_dir().join(format!("ferry-scale-{n}"));
    std::fs::create_dir_all(&logs).unwrap();
    eprintln!(
        "==> {n} nodes, {} digests each, {workers_n} worker processes (logs: {})",
        opts.digests,
        logs.display()
    );
    let mut workers: Vec<Worker> = (0..workers_n)
        .map(|w| {
            let lo = w * opts.per_worker;
            let hi = ((w + 1) * opts.per_worker).min(n);
            let mut child = Command::new("ip")
                .args(["netns", "exec", &ns.name])
                .arg(&exe)
                .arg("--worker")
                .args([lo, hi, n, opts.digests].map(|v| v.to_string()))
                .args([opts.shared.to_string(), opts.interval_s.to_string()])
                .arg(opts.latency_ms.to_string())
                .arg(logs.join(format!("w{w}")))
                .arg(opts.idle_s.to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(std::fs::File::create(logs.join(format!("w{w}.log"))).unwrap())
                .spawn()
                .unwrap();
            Worker {
                stdin: child.stdin.take().unwrap(),
                stdout: BufReader::new(child.stdout.take().unwrap()),
                child,
            }
        })
        .collect();

    // Start: every node at once (as a new cluster's DaemonSet does), or one after another over
    // `--start-every-ms` (a rolling update, or a cluster growing; also how a long-running
    // cluster's rounds are spread), each advertising all its keys; done when no node has an
    // announcement waiting.
    let started = Instant::now();
    let bytes_at_start = ns.lo_bytes();
    let every = opts.start_every_ms;
    let spread = Duration::from_millis(every * n as u64);
    all(
        &mut workers,
        |_| json!({ "cmd": "start", "every_ms": every }),
    );
    let start_s = started.elapsed().as_secs_f64();
    let mut idle_checks = 0;
    let (announced_s, settled) = loop {
        std::thread::sleep(Duration::from_secs(2));
        let stats = all(&mut workers, |_| json!({ "cmd": "stats" }));
        let pending = sum(&stats, "pending");
        let alone = sum(&stats, "alone");
        let unstarted = sum(&stats, "unstarted");
        eprintln!(
            "    {:>5.0} s: {unstarted} nodes to start, {pending} keys waiting to be announced, {alone} nodes without peers, {:.0} MiB",
            started.elapsed().as_secs_f64(),
            sum(&stats, "rss_kib") / 1024.0
        );
        let rss = sum(&stats, "rss_kib") / 1024.0;
        if rss > MEMORY_LIMIT_MIB {
            eprintln!("    {rss:.0} MiB: more than this machine can hold; {n} nodes do not fit");
            let _ = all(&mut workers, |_| json!({ "cmd": "quit" }));
            return with(
                settings_json(opts, n),
                json!({ "did_not_fit_mib": rss.round() }),
            );
        }
        // The machine's 2 cores cannot carry every node's work: say so instead of waiting.
        if started.elapsed() > START_LIMIT + spread {
            eprintln!(
                "    not settled after {} s: the simulation outgrew this machine's CPU",
                START_LIMIT.as_secs()
            );
            let _ = all(&mut workers, |_| json!({ "cmd": "quit" }));
            return with(
                settings_json(opts, n),
                json!({ "did_not_settle_s": START_LIMIT.as_secs() }),
            );
        }
        // Twice in a row: a round just finishing can show 0 between two walks.
        idle_checks = if pending == 0.0 && alone == 0.0 && unstarted == 0.0 {
            idle_checks + 1
        } else {
            0
        };
        if idle_checks == 2 {
            break (started.elapsed().as_secs_f64() - 2.0, stats);
        }
    };
    // The first round: every node announcing every key, nothing resting yet (requests
    // received per node; the bootstrap's own walks are in it too).
    let first_round_msgs = sum(&settled, "dht_requests") / n as f64;
    // CPU of every process of the simulation (the nodes, their delay lines, the harness).
    let first_round_cpu = sum(&settled, "cpu_s") / n as f64;
    let first_round_bytes = (ns.lo_bytes() - bytes_at_start) as f64 / n as f64;

    // Steady state: two re-announcement intervals with nothing but the DHT's own traffic. A
    // window shorter than an interval holds no full round: the announce traffic is then the
    // first round's, an upper bound (resting only lowers it).
    let window = Duration::from_secs(opts.window_s.unwrap_or(2 * opts.interval_s));
    let from_first_round = window.as_secs() < opts.interval_s;
    eprintln!("    steady state for {} s", window.as_secs());
    let before = all(&mut workers, |_| json!({ "cmd": "stats" }));
    let bytes_before = ns.lo_bytes();
    // Connections come and go with the rounds (idle ones close after a minute): sampled
    // through the window, each node's peers on average and the most any node had.
    let (mut samples, mut connections_sum, mut connections_max) = (0usize, 0.0, 0.0f64);
    let window_end = Instant::now() + window;
    let after = loop {
        std::thread::sleep(
            CONNECTION_SAMPLE.min(window_end.saturating_duration_since(Instant::now())),
        );
        let stats = all(&mut workers, |_| json!({ "cmd": "stats" }));
        samples += 1;
        connections_sum += sum(&stats, "connections") / n as f64;
        connections_max = stats
            .iter()
            .filter_map(|s| s["connections_max"].as_f64())
            .fold(connections_max, f64::max);
        if Instant::now() >= window_end {
            break stats;
        }
    };
    let bytes_after = ns.lo_bytes();
    let received = sum(&after, "dht_requests") - sum(&before, "dht_requests");
    let secs = window.as_secs_f64();
    let mean_round = MEAN_ROUND * opts.interval_s as f64;
    let default_round = MEAN_ROUND * DEFAULT_INTERVAL_S;
    // Per node per round, then at the default interval's mean round.
    // Per node and round: over the window's rounds, or the first round's (nothing rests then).
    let window_per_round =
        |field: &str| (sum(&after, field) - sum(&before, field)) / n as f64 / (secs / mean_round);
    let (per_round, bytes_per_round, cpu_per_round, rested_per_round) = if from_first_round {
        (
            first_round_msgs,
            first_round_bytes,
            first_round_cpu,
            f64::NAN,
        )
    } else {
        (
            received / n as f64 / (secs / mean_round),
            (bytes_after - bytes_before) as f64 / n as f64 / (secs / mean_round),
            window_per_round("cpu_s"),
            window_per_round("rested"),
        )
    };
    let msgs_default = per_round / default_round;
    // The same over the rounds the nodes counted in the window: where rounds fall in a short
    // window moves the window's figure by up to a round a node, this one not.
    let rounds = sum(&after, "rounds") - sum(&before, "rounds");
    let per_counted_round = received / rounds;
    // The steady window's requests by kind, at the default interval as `msgs_default`.
    let by_kind: serde_json::Map<String, Value> = DHT_REQUEST_KINDS
        .iter()
        .map(|kind| {
            let of = |answers: &[Value]| -> f64 {
                answers
                    .iter()
                    .map(|a| a["dht_requests_by_kind"][*kind].as_f64().unwrap_or(0.0))
                    .sum()
            };
            let per_round = (of(&after) - of(&before)) / n as f64 / (secs / mean_round);
            (kind.to_string(), json!(round3(per_round / default_round)))
        })
        .collect();
    let by_kind = match from_first_round {
        true => Value::Null,
        false => Value::Object(by_kind),
    };
    let rss_mib = sum(&after, "rss_kib") / 1024.0 / n as f64;
    let connections = connections_sum / samples as f64;
    // Since start: every node of the first start; restarted nodes add theirs below.
    let dials = sum(&after, "bootstrap_dials") / n as f64;

    // Lookups, one at a time per asking worker: present keys (another node's own), absent
    // keys. One asker per 50 nodes whatever `--per-worker` is, so that the lookups' own load
    // on the 2 cores (each walk meets nodes it is no longer connected to: a handshake each)
    // does not grow with the number of processes (20 askers of 15 nodes saturated the machine
    // at 300 nodes and their lookups timed out).
    let askers = n.div_ceil(50).min(workers_n);
    let asks = |w: usize| askers == workers_n || (0..askers).any(|k| k * workers_n / askers == w);
    let (found_total, absent_total) = (400usize, 100usize);
    let walks_before = all(&mut workers, |_| json!({ "cmd": "stats" }));
    let looked = all(&mut workers, |w| {
        let share = |total: usize| if asks(w) { total.div_ceil(askers) } else { 0 };
        json!({ "cmd": "lookups", "found": share(found_total), "absent": share(absent_total) })
    });
    let found_ms = concat(&looked, "found_ms");
    let absent_ms = concat(&looked, "absent_ms");
    let missed = sum(&looked, "missed");
    let mut missed_owners = concat(&looked, "missed_owners");
    missed_owners.sort_by(f64::total_cmp);
    let missed_found_again = sum(&looked, "missed_found_again");
    // Nodes asked per walk (libp2p-kad's hop count is not reported: it asks five at a time,
    // so a walk's depth in round trips is at least a fifth of this).
    let found_asked = concat(&looked, "found_walk_asked");
    let absent_asked = concat(&looked, "absent_walk_asked");
    // What the walks cost: nodes asked and connections dialled per walk, by outcome (where a
    // lookup's time goes: a round trip per five nodes asked, a handshake per dial).
    let walks_after = all(&mut workers, |_| json!({ "cmd": "stats" }));
    let delta = |f: &str| sum(&walks_after, f) - sum(&walks_before, f);
    let per_walk = |field: &str, outcome: &str| {
        round3(delta(&format!("{field}_{outcome}")) / delta(&format!("walks_{outcome}")))
    };
    // The CPU of every process (both ends of each request, the delay lines, the harness)
    // over the lookups, per node asked: what the walks cost this machine's 2 cores.
    let asked = delta("walk_requests_found") + delta("walk_requests_none");
    let cpu_per_request_ms = delta("cpu_s") * 1000.0 / asked;
    let slow_hits = found_ms
        .iter()
        .filter(|ms| **ms > RESOLVE_TIMEOUT_MS)
        .count();
    // The adaptive wait, per asking worker: the lookups it cut, where it ended, and what a
    // miss cost a pull with it and with the fixed 20 ms.
    let asker_waits: Vec<f64> = looked
        .iter()
        .filter(|l| l["found_ms"].as_array().is_some_and(|a| !a.is_empty()))
        .filter_map(|l| l["wait_ms"].as_f64())
        .collect();
    let absent_wait = concat(&looked, "absent_wait_ms");
    let absent_fixed: Vec<f64> = absent_ms
        .iter()
        .map(|ms| ms.min(RESOLVE_TIMEOUT_MS))
        .collect();
    let walk_costs = json!({
        "lookups_over_resolve_timeout": slow_hits,
        "lookups_over_adaptive_wait": sum(&looked, "over_wait"),
        "adaptive_wait_ms": round3(mean(&asker_waits)),
        "notfound_wait_ms_mean_fixed": round3(mean(&absent_fixed)),
        "notfound_wait_ms_mean_adaptive": round3(mean(&absent_wait)),
        "lookup_cpu_ms_per_request": round3(cpu_per_request_ms),
        "found_walk_requests": per_walk("walk_requests", "found"),
        "found_walk_dials": per_walk("walk_dials", "found"),
        "notfound_walk_requests": per_walk("walk_requests", "none"),
        "notfound_walk_dials": per_walk("walk_dials", "none"),
        "found_walk_requests_p50": percentile(&found_asked, 0.5),
        "found_walk_requests_p99": percentile(&found_asked, 0.99),
        "notfound_walk_requests_p50": percentile(&absent_asked, 0.5),
        "notfound_walk_requests_p99": percentile(&absent_asked, 0.99),
        "walks_measured": found_asked.len() + absent_asked.len(),
        "walks_unattributed": sum(&looked, "walks_unattributed"),
    });

    // A restarted node: until every sampled key of its own is found from other nodes.
    let restarts = workers_n.min(5);
    for w in workers.iter_mut().take(restarts) {
        w.send(&json!({ "cmd": "restart" }));
    }
    let findable: Vec<f64> = workers
        .iter_mut()
        .take(restarts)
        .map(|w| w.recv()["findable_s"].as_f64().unwrap_or(f64::NAN))
        .collect();

    // Churn: 5% of the nodes restart per minute, lookups go on.
    // Restarts shared out among the workers (a worker of 15 nodes alone would be due less
    // than one in a minute).
    let total = (n as f64 * 0.05 * opts.churn_s as f64 / 60.0).round() as usize;
    let churned = all(&mut workers, |w| {
        let restarts = total * (w + 1) / workers_n - total * w / workers_n;
        json!({ "cmd": "churn", "seconds": opts.churn_s, "restarts": restarts, "ask": asks(w) })
    });
    let churn_found = concat(&churned, "found_ms");
    let churn_missed = sum(&churned, "missed");
    let _ = all(&mut workers, |_| json!({ "cmd": "quit" }));
    if std::env::var_os("FERRY_SCALE_LOG").is_none() {
        let _ = std::fs::remove_dir_all(&logs);
    }

    let out = with(
        settings_json(opts, n),
        json!({
            "nodes": n,
            "digests_per_node": opts.digests,
            "shared_fraction": opts.shared,
            "latency_ms_per_hop": opts.latency_ms,
            "worker_processes": workers_n,
            "lookup_gap_ms": LOOKUP_GAP.as_millis() as u64,
            "lookup_ms_p50": round3(percentile(&found_ms, 0.5)),
            "lookup_ms_p99": round3(percentile(&found_ms, 0.99)),
            "lookups": found_ms.len() as f64 + missed,
            "lookups_not_found": missed,
            "notfound_ms_p50": round3(percentile(&absent_ms, 0.5)),
            "notfound_ms_p99": round3(percentile(&absent_ms, 0.99)),
            "announce_msgs_per_node_per_s": round3(msgs_default),
            "announce_msgs_per_node_per_round": round3(per_round),
            "keys_rested_per_node_per_round": round3(rested_per_round),
            "announce_bytes_per_node_per_round": bytes_per_round.round(),
            "announce_measured_over": if from_first_round { "first round" } else { "steady window" },
            "first_round_msgs_per_node": round3(first_round_msgs),
            "first_round_cpu_s_per_node": round3(first_round_cpu),
            "cpu_s_per_node_per_round": round3(cpu_per_round),
            "first_round_bytes_per_node": first_round_bytes.round(),
            "start_every_ms": every,
            "early_rounds_per_node": round3(sum(&after, "early_rounds") / n as f64),
            "steady_window_s": secs,
            "sim_interval_s": opts.interval_s,
            "rss_mib_per_node": round3(rss_mib),
            "connections_per_node": round3(connections),
            "connections_per_node_max": connections_max,
            "connection_samples": samples,
            "bootstrap_dials_per_node": round3(dials),
            "start_all_announced_s": round3(announced_s.max(start_s)),
            "findable_after_start_s": round3(percentile(&findable, 1.0)),
            "findable_after_start_s_each": findable.iter().map(|x| round3(*x)).collect::<Vec<_>>(),
            "churn_per_minute": 0.05,
            "churn_restarts": total,
            "lookup_askers": askers,
            "churn_s": opts.churn_s,
            "churn_lookup_ms_p50": round3(percentile(&churn_found, 0.5)),
            "churn_lookup_ms_p99": round3(percentile(&churn_found, 0.99)),
            "churn_lookups_not_found": churn_missed,
            "churn_lookups": churn_found.len() as f64 + churn_missed,
        }),
    );
    // Beside the macro: one more field there passes its recursion limit.
    let mut out = with(out, walk_costs);
    out["missed_owners"] = json!(missed_owners);
    out["missed_found_again"] = json!(missed_found_again);
    // Walks that timed out place their keys on the nodes they reached: which nodes had any,
    // and whether the missed keys' owners are among them.
    let timed_out: HashMap<u64, u64> = after
        .iter()
        .flat_map(|a| {
            a["timed_out_by_node"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .filter_map(|p| Some((p[0].as_u64()?, p[1].as_u64()?)))
        .collect();
    out["walks_timed_out_per_node"] = json!(round3(sum(&after, "walks_timed_out") / n as f64));
    out["walks_converged_per_node"] = json!(round3(sum(&after, "walks_converged") / n as f64));
    out["batches_failed_per_node"] = json!(round3(sum(&after, "batches_failed") / n as f64));
    out["announce_msgs_per_node_per_s_by_kind"] = by_kind;
    out["announce_rounds_per_node_in_window"] = json!(round3(rounds / n as f64));
    out["announce_msgs_per_counted_round"] = json!(round3(per_counted_round));
    out["announce_msgs_per_node_per_s_counted_rounds"] =
        json!(round3(per_counted_round / default_round));
    out["nodes_with_timed_out_walks"] = json!(timed_out.len());
    out["missed_owners_walks_timed_out"] = json!(
        missed_owners
            .iter()
            .map(|o| timed_out.get(&(*o as u64)).copied().unwrap_or(0))
            .collect::<Vec<_>>()
    );
    out
}

// ---------------------------------------------------------------------------------------------
// The worker: nodes `lo..hi` of `n`, commands on stdin, answers on stdout (one JSON per line).

struct SimNode {
    /// Whose keys it holds (`keys_of`), and the directory of its identity.
    owner: usize,
    identity: String,
    router: P2pRouter,
    token: CancellationToken,
    task: JoinHandle<()>,
    metrics: Arc<Metrics>,
}

#[derive(Clone)]
struct Shape {
    n: usize,
    digests: usize,
    shared: f64,
    timing: ProvideTiming,
    latency: Option<Duration>,
    dir: PathBuf,
    idle: Duration,
}

fn worker(args: &[String]) {
    // `FERRY_SCALE_LOG=<filter>`: the nodes' log lines, into the worker's log (kept then).
    if let Ok(filter) = std::env::var("FERRY_SCALE_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .init();
    }
    let num = |i: usize| args[i].parse::<usize>().unwrap();
    let (lo, hi) = (num(0), num(1));
    let interval = Duration::from_secs(args[5].parse().unwrap());
    let shape = Shape {
        n: num(2),
        digests: num(3),
        shared: args[4].parse().unwrap(),
        timing: ProvideTiming {
            ttl: interval * 3,
            interval,
            replicas: REPLICAS,
            nodes_per_interval: NODES_PER_INTERVAL,
        },
        latency: Some(Duration::from_secs_f64(
            args[6].parse::<f64>().unwrap() / 1000.0,
        ))
        .filter(|d| !d.is_zero()),
        dir: PathBuf::from(&args[7]),
        idle: Duration::from_secs(args[8].parse().unwrap()),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(serve(lo, hi, shape));
}

/// Node `i` (its address), holding `owner`'s keys, its identity in `identity` (a directory name).
fn start_node(i: usize, owner: usize, identity: &str, shape: &Shape) -> SimNode {
    let port = |base: u16| SocketAddr::new(LOOPBACK, base + i as u16);
    // Every earlier node, as the Kubernetes bootstrap lists every Ferry pod: Ferry dials
    // a few of them (`--bootstrap-dials`) and Kademlia finds the rest. Node 0 has none; it
    // waits for the others to dial it.
    let addrs = (0..i)
        .map(|j| tcp_multiaddr(LOOPBACK, P2P_BASE + j as u16))
        .collect();
    let metrics = Arc::new(Metrics::new());
    let token = CancellationToken::new();
    let config = P2pConfig {
        data_dir: shape.dir.join(identity),
        listen: port(P2P_BASE),
        advertise: Some(LOOPBACK),
        peer_http_addr: port(HTTP_BASE),
        timing: shape.timing,
        psk: None,
        simulated_latency: shape.latency,
        transport: None,
        bootstrap_dials: DEFAULT_BOOTSTRAP_DIALS,
        idle_timeout: shape.idle,
        caps: ConnectionCaps::default(),
        draws_seed: None,
    };
    let (router, task) = P2pRouter::start(
        config,
        Arc::new(StaticBootstrap { addrs }),
        true,
        metrics.clone(),
        Arc::new(Problems::new(metrics.clone())),
        token.clone(),
    )
    .unwrap();
    let keys = keys_of(owner, shape.digests, shape.shared);
    let r = router.clone();
    tokio::spawn(async move {
        let _ = r.advertise(keys).await;
    });
    SimNode {
        owner,
        identity: identity.to_string(),
        router,
        token,
        task,
        metrics,
    }
}

fn rand_below(n: usize) -> usize {
    use std::hash::BuildHasher;
    let x = std::collections::hash_map::RandomState::new().hash_one(Instant::now());
    (x % n.max(1) as u64) as usize
}

type Nodes = Arc<Mutex<HashMap<usize, SimNode>>>;

/// This worker's nodes not started yet (`--start-every-ms`).
static UNSTARTED: AtomicUsize = AtomicUsize::new(0);

async fn serve(lo: usize, hi: usize, shape: Shape) {
    use tokio::io::AsyncBufReadExt;
    let nodes: Nodes = Arc::new(Mutex::new(HashMap::new()));
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Ok(Some(line)) = lines.next_line().await {
        let command: Value = serde_json::from_str(&line).unwrap();
        let answer = match command["cmd"].as_str().unwrap_or("") {
            "start" => {
                // Node `i` starts `i` intervals in: in order across the workers, so
                // every node's bootstrap list (the nodes before it) is already listening.
                let every = Duration::from_millis(command["every_ms"].as_u64().unwrap_or(0));
                let (nodes, shape) = (nodes.clone(), shape.clone());
                UNSTARTED.store(hi - lo, Ordering::SeqCst);
                let begun = tokio::time::Instant::now();
                tokio::spawn(async move {
                    for i in lo..hi {
                        tokio::time::sleep_until(begun + every * i as u32).await;
                        let node = start_node(i, i, &format!("n{i}"), &shape);
                        nodes.lock().unwrap().insert(i, node);
                        UNSTARTED.fetch_sub(1, Ordering::SeqCst);
                        tokio::task::yield_now().await;
                    }
                });
                json!({ "starting": hi - lo })
            }
            "stats" => stats(&nodes),
            "lookups" => {
                let found = command["found"].as_u64().unwrap_or(0) as usize;
                let absent = command["absent"].as_u64().unwrap_or(0) as usize;
                lookups(&nodes, &shape, found, absent).await
            }
            "restart" => restart_and_find(&nodes, &shape, lo..hi).await,
            "churn" => {
                let secs = command["seconds"].as_u64().unwrap_or(60);
                let restarts = command["restarts"].as_u64().unwrap_or(0) as usize;
                let ask = command["ask"].as_bool().unwrap_or(true);
                churn(&nodes, &shape, lo..hi, (secs, restarts), ask).await
            }
            "quit" => {
                let all: Vec<SimNode> = nodes.lock().unwrap().drain().map(|(_, n)| n).collect();
                for n in all {
                    n.token.cancel();
                    let _ = n.task.await;
                }
                println!("{}", json!({ "quit": true }));
                return;
            }
            other => json!({ "error": format!("unknown command {other}") }),
        };
        println!("{answer}");
    }
}

fn stats(nodes: &Nodes) -> Value {
    let nodes = nodes.lock().unwrap();
    let mut pending = 0i64;
    let mut requests = 0u64;
    let mut by_kind = serde_json::Map::new();
    let mut connections = 0usize;
    let mut connections_max = 0usize;
    let mut alone = 0usize;
    let mut rested = 0u64;
    let mut early = 0u64;
    let mut rounds = 0u64;
    let mut dials = 0u64;
    // Announcement walks and batches by outcome; each node's timed-out walks, by start order.
    let (mut converged, mut walks_timed_out, mut delivered, mut failed) = (0u64, 0u64, 0u64, 0u64);
    let mut timed_out: Vec<(usize, u64)> = Vec::new();
    let outcome = |family: &Family<OutcomeLabels, Counter>, outcome| {
        family.get_or_create(&OutcomeLabels { outcome }).get()
    };
    // Provider walks (lookups) by outcome: how many, the nodes they asked, the dials.
    let mut walks: HashMap<String, u64> = HashMap::new();
    for (i, n) in nodes.iter() {
        let m = &n.metrics;
        for outcome in ferry::metrics::PROVIDER_WALK_OUTCOMES {
            let labels = OutcomeLabels { outcome };
            for (field, family) in [
                ("walks", &m.provider_walks),
                ("walk_requests", &m.provider_walk_requests),
                ("walk_dials", &m.provider_walk_dials),
            ] {
                *walks.entry(format!("{field}_{outcome}")).or_default() +=
                    family.get_or_create(&labels).get();
            }
        }
        let node_timed_out = outcome(&m.announce_walks, "timed_out");
        if node_timed_out > 0 {
            timed_out.push((*i, node_timed_out));
        }
        walks_timed_out += node_timed_out;
        converged += outcome(&m.announce_walks, "converged");
        delivered += outcome(&m.announce_batches, "delivered");
        failed += outcome(&m.announce_batches, "failed");
        pending += n.metrics.announcements_pending.get();
        dials += n.metrics.bootstrap_dials.get();
        rested += n.metrics.announcements_rested.get();
        early += n.metrics.announce_rounds_early.get();
        rounds += n.metrics.announce_rounds.get();
        for kind in DHT_REQUEST_KINDS {
            let count = n
                .metrics
                .dht_requests
                .get_or_create(&DhtLabels { kind })
                .get();
            requests += count;
            let total = by_kind.entry(kind).or_insert(json!(0u64));
            *total = json!(total.as_u64().unwrap_or(0) + count);
        }
        let c = n.router.connected_peers();
        connections += c;
        connections_max = connections_max.max(c);
        alone += usize::from(c == 0);
    }
    with(
        json!(walks),
        json!({
            "pending": pending,
            "dht_requests": requests,
            "dht_requests_by_kind": by_kind,
            "connections": connections,
            "connections_max": connections_max,
            "alone": alone,
            "rested": rested,
            "early_rounds": early,
            "rounds": rounds,
            "bootstrap_dials": dials,
            "unstarted": UNSTARTED.load(Ordering::SeqCst),
            "rss_kib": rss_kib(),
            "cpu_s": cpu_s(),
            "walks_converged": converged,
            "walks_timed_out": walks_timed_out,
            "batches_delivered": delivered,
            "batches_failed": failed,
            "timed_out_by_node": timed_out,
        }),
    )
}

/// CPU time this worker process has used (user and system, all its threads), in seconds.
fn cpu_s() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which is in parentheses and may hold spaces): utime and
    // stime are the 12th and 13th, in clock ticks (100 a second on Linux).
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let ticks: Vec<f64> = rest
        .split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|t| t.parse().ok())
        .collect();
    ticks.iter().sum::<f64>() / 100.0
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// One lookup: milliseconds to the first provider (`Some`), or `None` when the walk ended
/// without one; and milliseconds until the lookup ended.
async fn lookup(router: &P2pRouter, key: &str) -> (Option<f64>, f64) {
    let started = Instant::now();
    let mut stream = router.lookup(key).await;
    let first = tokio::time::timeout(Duration::from_secs(15), stream.recv()).await;
    let ms = started.elapsed().as_secs_f64() * 1000.0;
    match first {
        Ok(Some(_)) => (Some(ms), ms),
        _ => (None, ms),
    }
}

fn some_router(nodes: &Nodes, except: Option<usize>) -> Option<(usize, P2pRouter)> {
    let (i, router, _) = some_node(nodes, |i| Some(i) == except)?;
    Some((i, router))
}

/// A random node not `skip`ped: its index, its router and its metrics.
fn some_node(
    nodes: &Nodes,
    skip: impl Fn(usize) -> bool,
) -> Option<(usize, P2pRouter, Arc<Metrics>)> {
    let nodes = nodes.lock().unwrap();
    let ids: Vec<usize> = nodes.keys().copied().filter(|i| !skip(*i)).collect();
    let i = *ids.get(rand_below(ids.len()))?;
    Some((i, nodes[&i].router.clone(), nodes[&i].metrics.clone()))
}

/// A node's provider walks and the nodes they asked, by outcome (`PROVIDER_WALK_OUTCOMES`).
struct WalkCount([(u64, u64); 2]);

impl WalkCount {
    fn of(metrics: &Metrics) -> WalkCount {
        WalkCount(ferry::metrics::PROVIDER_WALK_OUTCOMES.map(|outcome| {
            let labels = OutcomeLabels { outcome };
            (
                metrics.provider_walks.get_or_create(&labels).get(),
                metrics.provider_walk_requests.get_or_create(&labels).get(),
            )
        }))
    }
}

/// The nodes one walk asked, and whether it found a provider: read from the asking node's
/// counters once the walk has ended. A walk is counted when it ends, which for one that found
/// a provider is after the lookup returned (at the walk's next step), so this waits for the
/// count to move, for at most libp2p's query timeout and a little more. `None` when it did not
/// end by then or another walk of the node ended with it (not told apart).
async fn walk_asked(metrics: Arc<Metrics>, before: WalkCount) -> Option<(bool, u64)> {
    let deadline = Instant::now() + Duration::from_secs(12);
    loop {
        let now = WalkCount::of(&metrics);
        let ended: Vec<usize> = (0..2).filter(|&k| now.0[k].0 > before.0[k].0).collect();
        match ended[..] {
            [k] if now.0[k].0 == before.0[k].0 + 1 => {
                let found = ferry::metrics::PROVIDER_WALK_OUTCOMES[k] == "found";
                return Some((found, now.0[k].1 - before.0[k].1));
            }
            [] if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            _ => return None,
        }
    }
}

/// A key only node `owner` has.
fn own_key(owner: usize, shape: &Shape) -> String {
    let n_shared = (shape.digests as f64 * shape.shared).round() as usize;
    let j = n_shared + rand_below(shape.digests - n_shared);
    format!("sha256:{:032x}{j:032x}", owner + 1)
}

/// From a random node, a key only another node has: milliseconds to its first provider
/// (`Some(None)` when none was found), or `None` when this worker has no node.
async fn lookup_elsewhere(nodes: &Nodes, shape: &Shape) -> Option<Option<f64>> {
    Some(lookup_owned(nodes, shape).await?.2)
}

/// As [`lookup_elsewhere`], with the owner (its start order) and the key.
async fn lookup_owned(nodes: &Nodes, shape: &Shape) -> Option<(usize, String, Option<f64>)> {
    let (asker, router) = some_router(nodes, None)?;
    lookup_owned_from(asker, &router, shape).await
}

/// As [`lookup_owned`], from node `asker`.
async fn lookup_owned_from(
    asker: usize,
    router: &P2pRouter,
    shape: &Shape,
) -> Option<(usize, String, Option<f64>)> {
    let mut owner = rand_below(shape.n);
    if owner == asker {
        owner = (owner + 1) % shape.n;
    }
    let key = own_key(owner, shape);
    let found = lookup(router, &key).await.0;
    Some((owner, key, found))
}

async fn lookups(nodes: &Nodes, shape: &Shape, found: usize, absent: usize) -> Value {
    let (mut found_ms, mut absent_ms, mut missed) = (Vec::new(), Vec::new(), 0);
    // What a pull would have waited with Ferry's adaptive wait: lookups of present keys it
    // cut, and what each miss cost (the walk, or the wait if shorter).
    let bound = resolve_bound();
    let (mut over_wait, mut absent_wait_ms) = (0, Vec::new());
    let wait_ms = |b: &ResolveBound| b.current().as_secs_f64() * 1000.0;
    // Each missed key: its owner (start order: the early nodes are the ones a growing
    // network strands) and whether a second lookup from another node 2 s later found it (a
    // miss of that walk, not of where the records are).
    let (mut missed_owners, mut found_again) = (Vec::new(), 0);
    // The nodes each walk asked (libp2p-kad reports no walk's depth; it asks five at a
    // time). A lookup goes from a node with no walk of ours still running, so that the
    // node's counters say what this walk alone asked.
    let walking: Arc<Mutex<std::collections::HashSet<usize>>> = Arc::default();
    let mut walks = Vec::new();
    // The asking node, its router, and what its walk is counted from (its counters now, and
    // whether no walk of ours was running on it).
    let pick = || {
        let busy = walking.lock().unwrap().clone();
        let ((i, router, metrics), alone) = some_node(nodes, |i| busy.contains(&i))
            .map(|n| (n, true))
            .or_else(|| some_node(nodes, |_| false).map(|n| (n, false)))?;
        walking.lock().unwrap().insert(i);
        let before = WalkCount::of(&metrics);
        Some((i, router, (i, metrics, before, alone)))
    };
    let count = |(i, metrics, before, alone): (usize, Arc<Metrics>, WalkCount, bool)| {
        let walking = walking.clone();
        tokio::spawn(async move {
            let asked = walk_asked(metrics, before).await;
            walking.lock().unwrap().remove(&i);
            asked.filter(|_| alone)
        })
    };
    for _ in 0..found {
        // One lookup at a time, 20 ms apart: the latency of a lookup, not of a queue of them.
        tokio::time::sleep(LOOKUP_GAP).await;
        let Some((asker, router, walk)) = pick() else {
            break;
        };
        let looked = lookup_owned_from(asker, &router, shape).await;
        walks.push(count(walk));
        match looked {
            Some((_, _, Some(ms))) => {
                over_wait += usize::from(ms > wait_ms(&bound));
                bound.found_after(Duration::from_secs_f64(ms / 1000.0));
                found_ms.push(ms);
            }
            Some((owner, key, None)) => {
                missed += 1;
                missed_owners.push(owner);
                tokio::time::sleep(Duration::from_secs(2)).await;
                if let Some((_, router)) = some_router(nodes, None)
                    && lookup(&router, &key).await.0.is_some()
                {
                    found_again += 1;
                }
            }
            None => break,
        }
    }
    for k in 0..absent {
        let Some((_, router, walk)) = pick() else {
            break;
        };
        let key = format!(
            "sha256:{:032x}{:032x}",
            u64::MAX - 1,
            rand_below(1 << 30) + k
        );
        let ms = lookup(&router, &key).await.1;
        walks.push(count(walk));
        absent_wait_ms.push(ms.min(wait_ms(&bound)));
        absent_ms.push(ms);
    }
    let (mut found_asked, mut absent_asked, mut unattributed) = (Vec::new(), Vec::new(), 0);
    for walk in walks {
        match walk.await.ok().flatten() {
            Some((true, asked)) => found_asked.push(asked),
            Some((false, asked)) => absent_asked.push(asked),
            None => unattributed += 1,
        }
    }
    json!({ "found_ms": found_ms, "absent_ms": absent_ms, "missed": missed,
            "missed_owners": missed_owners, "missed_found_again": found_again,
            "over_wait": over_wait, "wait_ms": wait_ms(&bound), "absent_wait_ms": absent_wait_ms,
            "found_walk_asked": found_asked, "absent_walk_asked": absent_asked,
            "walks_unattributed": unattributed })
}

async fn stop(node: SimNode) {
    node.token.cancel();
    let _ = node.task.await;
}

/// Replaces one random node of this worker by a new one (a new identity at the same address,
/// with keys no other node has, as a node added to the cluster) and measures how long until
/// 20 of its keys are found from other nodes.
async fn restart_and_find(nodes: &Nodes, shape: &Shape, range: std::ops::Range<usize>) -> Value {
    let i = range.start + rand_below(range.len());
    let old = nodes.lock().unwrap().remove(&i);
    if let Some(old) = old {
        stop(old).await;
    }
    let started = Instant::now();
    let owner = shape.n + i;
    let node = start_node(i, owner, &format!("new{i}"), shape);
    nodes.lock().unwrap().insert(i, node);
    let mut waiting: Vec<String> = (0..20).map(|_| own_key(owner, shape)).collect();
    while !waiting.is_empty() && started.elapsed() < Duration::from_secs(300) {
        let Some((_, router)) = some_router(nodes, Some(i)) else {
            break;
        };
        let key = waiting.last().cloned().unwrap_or_default();
        if lookup(&router, &key).await.0.is_some() {
            waiting.pop();
        } else {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    json!({ "findable_s": if waiting.is_empty() { started.elapsed().as_secs_f64() } else { f64::NAN } })
}

/// `restarts` of this worker's nodes restart, evenly over `secs`, while lookups of other
/// nodes' keys go on (about five a second) when this worker `ask`s.
async fn churn(
    nodes: &Nodes,
    shape: &Shape,
    range: std::ops::Range<usize>,
    (secs, restarts): (u64, usize),
    ask: bool,
) -> Value {
    let restarts_per_s = restarts as f64 / secs.max(1) as f64;
    let churner = {
        let (nodes, shape, range) = (nodes.clone(), shape.clone(), range.clone());
        tokio::spawn(async move {
            let started = Instant::now();
            let mut done = 0.0;
            while started.elapsed() < Duration::from_secs(secs) {
                tokio::time::sleep(Duration::from_millis(250)).await;
                // Each restart in the middle of its share of the time.
                let due = started.elapsed().as_secs_f64() * restarts_per_s + 0.5;
                while done + 1.0 <= due {
                    done += 1.0;
                    let i = range.start + rand_below(range.len());
                    let Some(old) = nodes.lock().unwrap().remove(&i) else {
                        continue;
                    };
                    // A restarted pod: same identity, same keys, nothing in memory.
                    let (owner, identity) = (old.owner, old.identity.clone());
                    stop(old).await;
                    let node = start_node(i, owner, &identity, &shape);
                    nodes.lock().unwrap().insert(i, node);
                }
            }
        })
    };
    let (mut found_ms, mut missed) = (Vec::new(), 0);
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(secs) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if !ask {
            continue;
        }
        match lookup_elsewhere(nodes, shape).await {
            Some(Some(ms)) => found_ms.push(ms),
            Some(None) => missed += 1,
            None => continue,
        }
    }
    let _ = churner.await;
    json!({ "found_ms": found_ms, "missed": missed })
}

// ---------------------------------------------------------------------------------------------
// Report.

fn f(v: &Value) -> String {
    match v.as_f64() {
        Some(x) if x.is_finite() => {
            if x >= 100.0 {
                format!("{x:.0}")
            } else {
                format!("{x:.2}")
            }
        }
        _ => "-".to_string(),
    }
}

fn table(report: &Value) -> String {
    let mut out = String::from(
        "| nodes | digests/node | start, rounds | lookup p50 | lookup p99 | not-found p50 | announce msgs/node/s | RSS/node | findable after start | connections/node (mean / most) | bootstrap dials/node | CPU s/node/round | lookups missed (steady / churn) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in report["runs"].as_array().cloned().unwrap_or_default() {
        if let Some(mib) = r["did_not_fit_mib"].as_f64() {
            out.push_str(&format!(
                "| {} | {} | {} | did not fit: {mib:.0} MiB before the start was over ||||||||||\n",
                r["nodes"],
                r["digests_per_node"],
                settings(&r)
            ));
            continue;
        }
        if let Some(s) = r["did_not_settle_s"].as_f64() {
            out.push_str(&format!(
                "| {} | {} | {} | did not settle: announcements not done after {s:.0} s on 2 cores ||||||||||\n",
                r["nodes"], r["digests_per_node"], settings(&r)
            ));
            continue;
        }
        // Measured over the first round only (a window without a full round): an upper bound.
        let msgs = if mode(&r) == "first round" {
            format!("≤ {} (first round)", f(&r["announce_msgs_per_node_per_s"]))
        } else {
            f(&r["announce_msgs_per_node_per_s"])
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} ms | {} ms | {} ms | {} | {} MiB | {} s | {} / {} | {} | {} | {}/{} / {}/{} |\n",
            r["nodes"],
            r["digests_per_node"],
            settings(&r),
            f(&r["lookup_ms_p50"]),
            f(&r["lookup_ms_p99"]),
            f(&r["notfound_ms_p50"]),
            msgs,
            f(&r["rss_mib_per_node"]),
            f(&r["findable_after_start_s"]),
            f(&r["connections_per_node"]),
            f(&r["connections_per_node_max"]),
            f(&r["bootstrap_dials_per_node"]),
            f(&r["cpu_s_per_node_per_round"]),
            r["lookups_not_found"],
            r["lookups"],
            r["churn_lookups_not_found"],
            r["churn_lookups"],
        ));
    }
    out
}

/// A panel: its title, its series (legend, JSON field) and its target.
type Panel<'a> = (&'a str, &'a [(&'a str, &'a str)], f64);

/// Three panels against the node count (for the largest digest count measured): lookup
/// latency, announce traffic, memory; each with its target as a dashed red line.
fn chart(report: &Value, path: &Path) {
    use plotters::prelude::*;
    report::register_font();
    let runs = report["runs"].as_array().cloned().unwrap_or_default();
    // One line per digest count and kind of run (`mode`).
    let mut kinds: Vec<(u64, String)> = runs
        .iter()
        .filter_map(|r| Some((r["digests_per_node"].as_u64()?, mode(r).to_string())))
        .collect();
    kinds.sort_unstable();
    kinds.dedup();
    let runs: Vec<&Value> = runs.iter().collect();
    let root = BitMapBackend::new(path, (1500, 500)).into_drawing_area();
    root.fill(&WHITE).unwrap();
    let panels = root.split_evenly((1, 3));
    let max_n = runs
        .iter()
        .filter_map(|r| r["nodes"].as_f64())
        .fold(10.0, f64::max)
        * 1.1;
    let colors = [
        RGBColor(30, 120, 200),
        RGBColor(20, 170, 120),
        RGBColor(230, 140, 30),
        RGBColor(140, 60, 170),
        RGBColor(120, 120, 120),
        RGBColor(200, 60, 120),
        RGBColor(20, 40, 110),
        RGBColor(150, 200, 60),
        RGBColor(110, 70, 30),
    ];
    let specs: [Panel; 3] = [
        (
            "Lookup latency (ms)",
            &[
                ("present, p50", "lookup_ms_p50"),
                ("present, p99", "lookup_ms_p99"),
                ("absent, p50", "notfound_ms_p50"),
            ],
            20.0,
        ),
        (
            "DHT requests per node per second",
            &[("at the 10 min interval", "announce_msgs_per_node_per_s")],
            10.0,
        ),
        (
            "Resident memory per node (MiB)",
            &[("RSS / nodes", "rss_mib_per_node")],
            64.0,
        ),
    ];
    for (panel, (title, series, target)) in panels.iter().zip(specs) {
        let max = runs
            .iter()
            .flat_map(|r| {
                series
                    .iter()
                    .map(move |(_, k)| r[*k].as_f64().unwrap_or(0.0))
            })
            .filter(|x| x.is_finite())
            .fold(target, f64::max)
            * 1.15;
        let mut chart = ChartBuilder::on(panel)
            .caption(title, ("sans-serif", 18))
            .margin(15)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(0f64..max_n, 0f64..max)
            .unwrap();
        chart.configure_mesh().x_desc("nodes").draw().unwrap();
        let lines = kinds.iter().flat_map(|(d, m)| {
            series
                .iter()
                .map(move |(name, key)| (*d, m.as_str(), *name, *key))
        });
        for (s, (digests, kind, name, key)) in lines.enumerate() {
            let color = colors[s % colors.len()];
            let points: Vec<(f64, f64)> = runs
                .iter()
                .filter(|r| r["digests_per_node"].as_u64() == Some(digests) && mode(r) == kind)
                .filter_map(|r| {
                    Some((
                        r["nodes"].as_f64()?,
                        r[key].as_f64().filter(|x| x.is_finite())?,
                    ))
                })
                .collect();
            chart
                .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
                .unwrap()
                .label(if kind == "first round" {
                    format!("{name}, {digests} digests/node, staggered start")
                } else {
                    format!("{name}, {digests} digests/node")
                })
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 15, y)], color.stroke_width(2))
                });
            chart
                .draw_series(
                    points
                        .into_iter()
                        .map(|p| Circle::new(p, 4, color.filled())),
                )
                .unwrap();
        }
        let red = RGBColor(200, 30, 30);
        chart
            .draw_series(DashedLineSeries::new(
                vec![(0.0, target), (max_n, target)],
                6,
                4,
                red.stroke_width(1),
            ))
            .unwrap()
            .label("target")
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 15, y)], red));
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .unwrap();
    }
    root.present().unwrap();
}
