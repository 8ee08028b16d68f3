//! The last hop of a peer pull (`--last-hop`): does a pull served by another node's Ferry take
//! longer than the same pull from a registry next door, and whose CPU does it cost? The
//! matrix's "one by one" and "physical limit" columns are taken minutes apart, on different
//! nodes, after different amounts of disk writing, so their ratio mixes Ferry with the
//! benchmark's own contention. Here one node pulls, alternately, an image from the unshaped
//! registry on the bridge and an image of the same size that another node holds (through its
//! own Ferry, every layer byte from that node's peer address: checked), with the rest of the
//! cluster idle; each pull's wall time and the CPU seconds of every process on the path.

use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use ferry::containerd_config::hosts::BLOCK_BEGIN;

use serde_json::{Value, json};

use super::support::cluster::Node;
use super::support::{Image, Registry, wait_for};
use super::{hosts_dir, median, write_hosts};

/// Pulls of each kind per image shape, alternated.
const RUNS: usize = 3;

/// CPU seconds (user + system) `pid` has used so far, from `/proc/<pid>/stat`.
fn cpu_s(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of the whole line; 12 and 13 after the name.
    (ticks(11) + ticks(12)) / 100.0
}

/// Blob bytes this node's mirror sent its containerd that came from other nodes.
const PEER_BYTES: &str =
    "ferry_served_bytes_total{listener=\"mirror\",kind=\"blob\",source=\"peer\"}";

/// The CPU seconds of the processes on a pull's path, while `pull` runs; and its wall time.
/// Dirty pages are written out first: the image pushed to the registry and, on the peer path,
/// the other node's own pull of it just before would otherwise still be going to the same
/// disk during the measured pull, and charge one kind of pull for the other's set-up.
fn measured(procs: &[(&str, u32)], pull: impl FnOnce()) -> (f64, Value) {
    let synced = std::process::Command::new("sync").status().unwrap();
    assert!(synced.success(), "sync");
    let before: Vec<f64> = procs.iter().map(|(_, pid)| cpu_s(*pid)).collect();
    let start = Instant::now();
    pull();
    let wall = start.elapsed().as_secs_f64();
    let cpu: serde_json::Map<String, Value> = procs
        .iter()
        .zip(before)
        .map(|((name, pid), b)| (name.to_string(), json!(cpu_s(*pid) - b)))
        .collect();
    (wall, Value::Object(cpu))
}

/// Per-process CPU seconds, the median over runs.
fn median_cpu(runs: &[Value]) -> Value {
    let mut out = serde_json::Map::new();
    if let Some(first) = runs.first().and_then(Value::as_object) {
        for name in first.keys() {
            let v: Vec<f64> = runs.iter().filter_map(|r| r[name].as_f64()).collect();
            out.insert(name.clone(), json!(median(&v)));
        }
    }
    Value::Object(out)
}

/// The operator's entry for the registry next door (plain HTTP) in `node`'s containerd hosts
/// dir, once its Ferry has merged its mirror into it (Ferry re-reads the dir every minute).
fn operator_entry(node: &Node, registry: SocketAddr) {
    let file = write_hosts(&node.containerd.hosts_dir, registry, None);
    let started = Instant::now();
    while !std::fs::read_to_string(&file).is_ok_and(|t| t.contains(BLOCK_BEGIN)) {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "Ferry never merged its mirror into {}",
            file.display()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Runs the comparison for each `(label, bytes)` in `sizes` and each layer count, with the
/// zero-copy upgrade on and then off (the pulling node's Ferry restarted with
/// `--zero-copy false`: it no longer offers it, so the serving node copies as before).
pub fn run(
    nodes: &mut [Node],
    near_registry: &Registry,
    near: SocketAddr,
    dir: &Path,
    sizes: &[(String, usize)],
    layers: &[usize],
) -> Value {
    assert!(nodes.len() >= 2, "the last hop needs two nodes");
    operator_entry(&nodes[1], near);
    let mut rounds = Vec::new();
    for (label, total) in sizes {
        for &layers in layers {
            for zero_copy in [true, false] {
                let extra: &[&str] = if zero_copy {
                    &[]
                } else {
                    &["--zero-copy", "false"]
                };
                nodes[1].restart_ferry_with(extra);
                wait_for("the pulling node reconnected", || {
                    nodes[1].metric("ferry_peers_connected") >= 1
                });
                let shape = Shape {
                    label,
                    total: *total,
                    layers,
                    zero_copy,
                };
                rounds.push(round(
                    &nodes[0],
                    &nodes[1],
                    near_registry,
                    near,
                    dir,
                    &shape,
                ));
            }
        }
    }
    Value::Array(rounds)
}

/// One image shape, one setting.
struct Shape<'a> {
    label: &'a str,
    total: usize,
    layers: usize,
    zero_copy: bool,
}

/// `RUNS` pulls of each kind, alternated, on `puller`: from the registry next door, and
/// through its Ferry from `holder`.
fn round(
    holder: &Node,
    puller: &Node,
    near_registry: &Registry,
    near: SocketAddr,
    dir: &Path,
    shape: &Shape,
) -> Value {
    let (label, total, layers) = (shape.label, shape.total, shape.layers);
    let direct = hosts_dir(puller, "near", near, None);
    let holder_direct = hosts_dir(holder, "near", near, None);
    let plural = if layers > 1 { "s" } else { "" };
    let name = format!("{label} in {layers} layer{plural}");
    let setting = if shape.zero_copy { "on" } else { "off" };
    eprintln!("== last hop: {name}, zero-copy {setting}");
    let image = |tag: String| {
        let img = Image::generate(&dir.join("images").join(&tag), &tag, layers, total / layers);
        img.push(near, "bench/lasthop");
        let _ = std::fs::remove_dir_all(&img.layout);
        (format!("{near}/bench/lasthop:{tag}"), img)
    };
    let (mut registry_s, mut peer_s) = (Vec::new(), Vec::new());
    let (mut registry_cpu, mut peer_cpu) = (Vec::new(), Vec::new());
    for run in 0..RUNS {
        let tag = |kind: &str| format!("{}-{layers}-{setting}-{kind}-{run}", label.to_lowercase());
        // The registry next door, straight.
        let (reference, img) = image(tag("registry"));
        let procs = [
            ("registry", near_registry.proc.pid()),
            ("pulling_containerd", puller.containerd.proc.pid()),
        ];
        let (wall, cpu) = measured(&procs, || {
            puller.containerd.pull("k8s.io", &reference, &direct);
        });
        registry_s.push(wall);
        registry_cpu.push(cpu);
        puller.forget(&reference, &img.digests());

        // Another node holds it; this node pulls through its Ferry.
        let (reference, img) = image(tag("peer"));
        let advertised = holder.metric("ferry_keys_advertised");
        holder.containerd.pull("k8s.io", &reference, &holder_direct);
        wait_for("the holder advertises the image", || {
            holder.metric("ferry_keys_advertised") >= advertised + layers as u64 + 2
        });
        let from_peers = puller.metric(PEER_BYTES);
        let zero_copy_before = holder.metric("ferry_zero_copy_bytes_total");
        let procs = [
            ("serving_ferry", holder.ferry.pid()),
            ("pulling_ferry", puller.ferry.pid()),
            ("pulling_containerd", puller.containerd.proc.pid()),
            ("registry", near_registry.proc.pid()),
        ];
        let (wall, cpu) = measured(&procs, || {
            puller
                .containerd
                .pull("k8s.io", &reference, &puller.containerd.hosts_dir);
        });
        // What the column claims: every layer byte came from the other node, sent the way
        // the row says.
        let layer_bytes = (total / layers * layers) as u64;
        let got = puller.metric(PEER_BYTES) - from_peers;
        assert!(
            got >= layer_bytes,
            "{name}: {got} bytes from peers, the layers hold {layer_bytes}"
        );
        let zero_copied = holder.metric("ferry_zero_copy_bytes_total") - zero_copy_before;
        if shape.zero_copy {
            assert!(
                zero_copied >= layer_bytes,
                "{name}: {zero_copied} bytes with sendfile"
            );
        } else {
            assert_eq!(zero_copied, 0, "{name}: zero-copy is off");
        }
        peer_s.push(wall);
        peer_cpu.push(cpu);
        puller.forget(&reference, &img.digests());
        holder.forget(&reference, &img.digests());
        eprintln!(
            "   run {run}: registry next door {:.2} s, peer {:.2} s",
            registry_s[run], peer_s[run]
        );
    }
    let (reg, peer) = (median(&registry_s), median(&peer_s));
    json!({
        "image": name, "total_bytes": total, "layers": layers, "runs": RUNS,
        "zero_copy": shape.zero_copy,
        "registry_next_door": {"pull_s": registry_s, "median_s": reg, "cpu_s": median_cpu(&registry_cpu)},
        "peer": {"pull_s": peer_s, "median_s": peer, "cpu_s": median_cpu(&peer_cpu)},
        "ratio": if reg > 0.0 { peer / reg } else { 0.0 },
    })
}

/// The last-hop table, as the README shows it.
pub fn table(report: &Value) -> String {
    let mut out = String::from(
        "| image | zero-copy | registry next door (s) | peer through Ferry (s) | ratio | CPU s, registry path: registry / containerd | CPU s, peer path: serving Ferry / pulling Ferry / containerd |\n|---|---|---|---|---|---|---|\n",
    );
    for r in report["last_hop"].as_array().into_iter().flatten() {
        let reg = &r["registry_next_door"];
        let peer = &r["peer"];
        let cpu = |v: &Value, k: &str| v["cpu_s"][k].as_f64().unwrap_or(0.0);
        out.push_str(&format!(
            "| {} | {} | {:.2} | {:.2} | {:.2}x | {:.2} / {:.2} | {:.2} / {:.2} / {:.2} |\n",
            r["image"].as_str().unwrap_or(""),
            if r["zero_copy"].as_bool().unwrap_or(false) {
                "on"
            } else {
                "off"
            },
            reg["median_s"].as_f64().unwrap_or(0.0),
            peer["median_s"].as_f64().unwrap_or(0.0),
            r["ratio"].as_f64().unwrap_or(0.0),
            cpu(reg, "registry"),
            cpu(reg, "pulling_containerd"),
            cpu(peer, "serving_ferry"),
            cpu(peer, "pulling_ferry"),
            cpu(peer, "pulling_containerd"),
        ));
    }
    out
}
