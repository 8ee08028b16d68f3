//! The component figures of the cluster benchmark, measured on the running cluster: exec to
//! hosts.toml written and to `/readyz` 200; blob throughput from Ferry against nginx
//! (`sendfile on`) serving the same file, locally and through two Ferry hops; provider lookup
//! latency; resident memory idle, with 10,000 advertised digests and while serving four
//! concurrent large pulls.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use ferry::containerd_config::hosts::BLOCK_BEGIN;
use serde_json::{Value, json};

use super::support::cluster::Node;
use super::support::{Ferry, Image, Proc, in_netns, wait_for};
use super::{hosts_dir, median};

const STARTS: usize = 20;
const THROUGHPUT_RUNS: usize = 5;
const LOOKUPS: usize = 200;
/// 2,500 images of a manifest, a config and two layers: 10,000 digests.
const MANY_IMAGES: usize = 2_500;

pub fn run(nodes: &mut [Node], near: SocketAddr, dir: &Path, blob_size: usize) -> Value {
    assert!(nodes.len() >= 2, "component figures need two nodes");
    let last = nodes.len() - 1;
    let startup = startup(&mut nodes[last]);
    // Idle: a node just started, connected, with nothing to do.
    std::thread::sleep(Duration::from_secs(3));
    let idle_kib = nodes[last].ferry.memory_kib("VmRSS");
    eprintln!("== component figures: start-up {startup}, idle {idle_kib} KiB");

    let (blob, size) = big_blob(&nodes[0], near, dir, blob_size);
    let throughput = throughput(nodes, near, dir, &blob, size);
    eprintln!("== throughput {throughput}");
    let serving = four_pulls(nodes, near, &blob, size);
    eprintln!("== four concurrent pulls {serving}");
    let (many, digests) = many_digests(&nodes[0], near, dir);
    let lookups = lookups(&nodes[1], near, &digests);
    eprintln!("== lookups {lookups}");
    json!({
        "startup": startup,
        "throughput": throughput,
        "lookup": lookups,
        "memory": {
            "idle_kib": idle_kib,
            "advertising_10k_digests": many,
            "serving_four_pulls": serving,
        },
    })
}

/// Percentile `p` (0..=100) of `v`, nearest rank.
fn percentile(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1]
}

fn summary(v: &[f64]) -> Value {
    json!({"median": median(v), "p99": percentile(v, 99.0), "all": v})
}

/// `GET path` on `addr` with a plain socket (no client start-up in the measurement): the status.
fn http_status(addr: SocketAddr, path: &str) -> Option<u16> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(50)).ok()?;
    s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut head = [0u8; 12];
    s.read_exact(&mut head).ok()?;
    std::str::from_utf8(&head[9..12]).ok()?.parse().ok()
}

fn ferry_block_written(hosts_dir: &Path) -> bool {
    std::fs::read_dir(hosts_dir)
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| {
            std::fs::read_to_string(e.path().join("hosts.toml"))
                .is_ok_and(|t| t.contains(BLOCK_BEGIN))
        })
}

/// Exec to hosts.toml written and to `/readyz` 200, over `STARTS` starts of a real node's Ferry
/// (p2p and cluster secret on), its entries removed by `ferry cleanup` before each start.
fn startup(node: &mut Node) -> Value {
    let (mut hosts_ms, mut ready_ms) = (Vec::new(), Vec::new());
    for _ in 0..STARTS {
        node.ferry.stop();
        let cleanup = Command::new(Ferry::bin())
            .arg("cleanup")
            .arg("--hosts-dir")
            .arg(&node.containerd.hosts_dir)
            .output()
            .unwrap();
        assert!(cleanup.status.success(), "ferry cleanup");
        assert!(!ferry_block_written(&node.containerd.hosts_dir));
        let start = Instant::now();
        node.spawn_ferry();
        let (mut hosts, mut ready) = (None, None);
        while ready.is_none() || hosts.is_none() {
            assert!(start.elapsed() < Duration::from_secs(30), "ferry start");
            if hosts.is_none() && ferry_block_written(&node.containerd.hosts_dir) {
                hosts = Some(start.elapsed());
            }
            if ready.is_none() && http_status(node.metrics_addr(), "/readyz") == Some(200) {
                ready = Some(start.elapsed());
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        hosts_ms.push(hosts.unwrap().as_secs_f64() * 1e3);
        ready_ms.push(ready.unwrap().as_secs_f64() * 1e3);
    }
    wait_for("restarted node reconnects", || {
        node.metric("ferry_peers_connected") >= 1
    });
    json!({"starts": STARTS, "hosts_written_ms": summary(&hosts_ms), "readyz_ms": summary(&ready_ms)})
}

/// A one-layer image of `size` bytes pushed to the unshaped registry and pulled by `node`
/// straight from it; returns the layer's digest and size (gzip adds a little), once `node`'s
/// Ferry advertises it.
fn big_blob(node: &Node, near: SocketAddr, dir: &Path, size: usize) -> (String, usize) {
    let img = Image::generate(&dir.join("images/component"), "component", 1, size);
    img.push(near, "bench/component");
    let _ = std::fs::remove_dir_all(&img.layout);
    let before = node.metric("ferry_keys_advertised");
    let direct = hosts_dir(node, "near", near, None);
    node.containerd.pull(
        "k8s.io",
        &format!("{near}/bench/component:component"),
        &direct,
    );
    wait_for("the large blob is advertised", || {
        node.metric("ferry_keys_advertised") >= before + 4
    });
    let digest = img.layers[0].clone();
    let path = node
        .containerd
        .content_dir()
        .join("blobs/sha256")
        .join(digest.trim_start_matches("sha256:"));
    let size = std::fs::metadata(path).unwrap().len() as usize;
    (digest, size)
}

/// One download with curl in `ns`: bytes/second, after checking status and size.
fn download(ns: &str, url: &str, size: usize) -> f64 {
    let out = in_netns(Some(ns), "curl")
        .args(["-s", "-o", "/dev/null", "--max-time", "900"])
        .args(["-w", "%{http_code} %{size_download} %{time_total}", url])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let f: Vec<&str> = text.split_whitespace().collect();
    assert!(
        f.len() == 3 && f[0] == "200" && f[1] == size.to_string(),
        "{url}: {text}"
    );
    size as f64 / f[2].parse::<f64>().unwrap()
}

fn mirror_url(near: SocketAddr, repo: &str, digest: &str) -> String {
    format!("http://127.0.0.1:5480/v2/{repo}/blobs/{digest}?ns={near}")
}

/// nginx with `sendfile on`, serving `node`'s content store on port 8080 in its namespace.
fn nginx(node: &Node, dir: &Path) -> Proc {
    let prefix = dir.join("nginx");
    std::fs::create_dir_all(prefix.join("logs")).unwrap();
    let root = node.containerd.content_dir().join("blobs/sha256");
    // One process (no master): stopping it by PID stops all of nginx.
    let conf = format!(
        "daemon off;\nmaster_process off;\nerror_log {p}/logs/error.log;\npid {p}/nginx.pid;\n\
         events {{}}\nhttp {{\n  sendfile on;\n  tcp_nopush on;\n  access_log off;\n  \
         default_type application/octet-stream;\n  server {{\n    listen 8080;\n    \
         root {root};\n  }}\n}}\n",
        p = prefix.display(),
        root = root.display()
    );
    std::fs::write(prefix.join("nginx.conf"), conf).unwrap();
    let mut cmd = in_netns(Some(&node.ns), "nginx");
    cmd.arg("-p")
        .arg(&prefix)
        .arg("-c")
        .arg(prefix.join("nginx.conf"));
    let proc = Proc::spawn(cmd, prefix.join("nginx.out"));
    let addr = SocketAddr::new(node.ip, 8080);
    wait_for("nginx", || http_status(addr, "/").is_some());
    proc
}

/// Ferry and nginx serving the same blob, runs alternated: locally (curl in the serving node's
/// namespace) and from another node (Ferry: two hops, the other node's mirror fetching from
/// the serving node's peer address; nginx: across the same bridge).
fn throughput(nodes: &[Node], near: SocketAddr, dir: &Path, blob: &str, size: usize) -> Value {
    let (a, b) = (&nodes[0], &nodes[1]);
    let _nginx = nginx(a, dir);
    let hex = blob.trim_start_matches("sha256:");
    let ferry_url = mirror_url(near, "bench/component", blob);
    let nginx_local = format!("http://127.0.0.1:8080/{hex}");
    let nginx_remote = format!("http://{}:8080/{hex}", a.ip);
    let mut runs: [Vec<f64>; 4] = Default::default();
    for _ in 0..THROUGHPUT_RUNS {
        runs[0].push(download(&a.ns, &ferry_url, size));
        runs[1].push(download(&a.ns, &nginx_local, size));
        runs[2].push(download(&b.ns, &ferry_url, size));
        runs[3].push(download(&b.ns, &nginx_remote, size));
    }
    let mib = |v: &Vec<f64>| median(v) / (1 << 20) as f64;
    let [ferry_local, nginx_local, ferry_hops, nginx_remote] = runs.each_ref().map(mib);
    json!({
        "blob_bytes": size, "runs": THROUGHPUT_RUNS,
        "ferry_local_mib_s": ferry_local, "nginx_local_mib_s": nginx_local,
        "ferry_two_hops_mib_s": ferry_hops, "nginx_across_bridge_mib_s": nginx_remote,
        "local_ratio": ferry_local / nginx_local,
        "two_hops_ratio": ferry_hops / nginx_local,
        "two_hops_ratio_same_path": ferry_hops / nginx_remote,
    })
}

/// Four concurrent downloads of the large blob through the other nodes' mirrors, all served by
/// the first node's peer address: peak resident memory of the serving and receiving Ferrys.
fn four_pulls(nodes: &[Node], near: SocketAddr, blob: &str, size: usize) -> Value {
    let url = mirror_url(near, "bench/component", blob);
    let others = &nodes[1..];
    let before = nodes[0].ferry.memory_kib("VmRSS");
    let (done, peaks) = std::thread::scope(|s| {
        let pulls: Vec<_> = (0..4)
            .map(|i| {
                let ns = others[i % others.len()].ns.clone();
                let url = url.clone();
                s.spawn(move || download(&ns, &url, size))
            })
            .collect();
        let mut peaks = vec![0u64; nodes.len()];
        while pulls.iter().any(|p| !p.is_finished()) {
            for (peak, node) in peaks.iter_mut().zip(nodes) {
                *peak = (*peak).max(node.ferry.memory_kib("VmRSS"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let rates: Vec<f64> = pulls.into_iter().map(|p| p.join().unwrap()).collect();
        (rates, peaks)
    });
    json!({
        "serving_before_kib": before,
        "serving_peak_kib": peaks[0],
        "receiving_peak_kib": peaks[1..].iter().max(),
        "per_pull_mib_s": done.iter().map(|r| r / (1 << 20) as f64).collect::<Vec<_>>(),
    })
}

/// Imports `MANY_IMAGES` tiny images into `node` and waits until its Ferry advertises them all:
/// resident memory then, and the layer digests (for lookups from other nodes).
fn many_digests(node: &Node, near: SocketAddr, dir: &Path) -> (Value, Vec<String>) {
    let tar = dir.join("many.tar");
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/benches/cluster/many_images.py"
    );
    let out = Command::new("python3")
        .arg(script)
        .arg(&tar)
        .arg(format!("{near}/bench/many"))
        .arg(MANY_IMAGES.to_string())
        .output()
        .unwrap();
    assert!(out.status.success(), "many_images.py");
    let digests: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    let before_kib = node.ferry.memory_kib("VmRSS");
    let before = node.metric("ferry_keys_advertised");
    let tar = tar.to_str().unwrap();
    node.containerd.ctr(&[
        "-n",
        "k8s.io",
        "images",
        "import",
        "--no-unpack",
        "--all-platforms",
        tar,
    ]);
    // Digests and one tag per image.
    let keys = (MANY_IMAGES * 5) as u64;
    let start = Instant::now();
    let mut peak = 0;
    // Counted, then announced: done when none is queued or in flight any more.
    while node.metric("ferry_keys_advertised") < before + keys
        || node.metric("ferry_announcements_pending") > 0
    {
        assert!(
            start.elapsed() < Duration::from_secs(900),
            "advertising 10k"
        );
        peak = peak.max(node.ferry.memory_kib("VmRSS"));
        std::thread::sleep(Duration::from_millis(100));
    }
    let advertised_s = start.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_secs(5));
    let after = node.ferry.memory_kib("VmRSS");
    let value = json!({
        "digests": MANY_IMAGES * 4, "keys": keys,
        "before_kib": before_kib, "peak_kib": peak.max(after), "settled_kib": after,
        "advertise_s": advertised_s,
    });
    (value, digests)
}

fn metric_f64(text: &str, name: &str) -> f64 {
    text.lines()
        .find(|l| l.split_whitespace().next() == Some(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// `LOOKUPS` blobs that only another node has, requested one at a time through `node`'s mirror:
/// each is one provider lookup, timed by Ferry itself (the lookup histogram's sum, read after
/// each request; curl's own start-up is not in the figure).
fn lookups(node: &Node, near: SocketAddr, digests: &[String]) -> Value {
    let (sum, count) = (
        "ferry_peer_lookup_duration_seconds_sum",
        "ferry_peer_lookup_duration_seconds_count",
    );
    let mut last = node.metrics();
    let (mut took_ms, mut missed) = (Vec::new(), 0);
    // Spread over the set: neighbouring digests were advertised at about the same moment.
    let step = (digests.len() / LOOKUPS).max(1);
    for d in digests.iter().step_by(step).take(LOOKUPS) {
        let out = in_netns(Some(&node.ns), "curl")
            .args(["-s", "-o", "/dev/null", "-I", "-w", "%{http_code}"])
            .arg(mirror_url(near, "bench/many", d))
            .output()
            .unwrap();
        let now = node.metrics();
        let n = metric_f64(&now, count) - metric_f64(&last, count);
        assert_eq!(n, 1.0, "one lookup per request");
        if String::from_utf8_lossy(&out.stdout) == "200" {
            took_ms.push((metric_f64(&now, sum) - metric_f64(&last, sum)) * 1e3);
        } else {
            missed += 1;
        }
        last = now;
    }
    json!({"lookups": took_ms.len() + missed, "found": took_ms.len(), "missed": missed, "ms": summary(&took_ms)})
}
