//! The Kubernetes side against a stand-in API server (tests/support/kube_api.rs) and the real
//! binary: the ready taint is lifted only after readiness and only from Ferry's own node, other
//! taints stay, an Event is recorded; peers are found from the DaemonSet's pods; an API server
//! that is down or slow never delays the mirror.

#![allow(clippy::unwrap_used)] // test helpers panic by design

mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;
use support::kube_api::{self, Cluster, Shared};
use support::*;

const TAINT: &str = "ferry.dev/not-ready";

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

fn start_ferry(
    dir: &std::path::Path,
    containerd: &Containerd,
    kubeconfig: &std::path::Path,
    extra: &[&str],
) -> (Proc, SocketAddr, SocketAddr) {
    let (mirror, metrics) = (free_addr(), free_addr());
    let mut cmd = Ferry::command(dir, containerd, mirror, metrics, extra);
    cmd.env("KUBECONFIG", kubeconfig);
    let proc = Proc::spawn(cmd, dir.join(format!("ferry-{}.log", metrics.port())));
    (proc, mirror, metrics)
}

/// A directory for one test, kept when `FERRY_TEST_KEEP` is set.
fn tempdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("ferry-k8s")
        .disable_cleanup(std::env::var_os("FERRY_TEST_KEEP").is_some())
        .tempdir()
        .unwrap()
}

/// A Ferry at `ip` (its p2p address at `port`) that finds its peers from Ferry's pods.
fn start_bootstrapping(
    dir: &std::path::Path,
    containerd: &Containerd,
    kubeconfig: &std::path::Path,
    (ip, port): (&str, u16),
) -> (Proc, SocketAddr) {
    let p2p = format!("{ip}:{port}");
    let peer = format!("{ip}:{}", free_addr().port());
    let (ferry, _, metrics) = start_ferry(
        dir,
        containerd,
        kubeconfig,
        &[
            "--advertise-addr",
            ip,
            "--p2p-addr",
            &p2p,
            "--peer-addr",
            &peer,
            "--bootstrap-kubernetes",
            "app.kubernetes.io/name=ferry",
        ],
    );
    (ferry, metrics)
}

fn taints(cluster: &Shared, node: &str) -> Vec<String> {
    let c = cluster.lock().unwrap();
    let n = c
        .nodes
        .iter()
        .find(|n| n["metadata"]["name"] == node)
        .unwrap();
    n["spec"]["taints"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|t| t["key"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn the_ready_taint_goes_only_after_readiness_and_only_from_our_node() {
    let rt = runtime();
    let tmp = tempfile::tempdir().unwrap();
    let cluster: Shared = Arc::new(Mutex::new(Cluster::default()));
    {
        let mut c = cluster.lock().unwrap();
        c.nodes.push(kube_api::node(
            "node-a",
            json!([{"key": "other.example/dedicated", "value": "gpu", "effect": "NoSchedule"}, {"key": TAINT, "effect": "NoSchedule"}, {"key": "node.kubernetes.io/not-ready", "effect": "NoExecute"}]),
        ));
        c.nodes.push(kube_api::node(
            "node-b",
            json!([{"key": TAINT, "effect": "NoSchedule"}]),
        ));
    }
    let api = rt.block_on(kube_api::serve(cluster.clone()));
    let kubeconfig = kube_api::kubeconfig(tmp.path(), &format!("http://{api}"));
    let mut containerd = Containerd::start(&tmp.path().join("node"));
    containerd.stop();

    let (_ferry, _, metrics) = start_ferry(
        tmp.path(),
        &containerd,
        &kubeconfig,
        &["--p2p", "false", "--node-name", "node-a"],
    );
    wait_for("ferry listening", || {
        std::net::TcpStream::connect(metrics).is_ok()
    });
    // Not ready (containerd is down): the taint stays.
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        taints(&cluster, "node-a").contains(&TAINT.to_string()),
        "lifted before ready"
    );
    assert!(
        cluster
            .lock()
            .unwrap()
            .requests
            .iter()
            .all(|(m, _, _)| m != "PATCH")
    );

    containerd.restart();
    wait_for("taint lifted once ready", || {
        !taints(&cluster, "node-a").contains(&TAINT.to_string())
    });
    assert_eq!(
        taints(&cluster, "node-a"),
        vec![
            "other.example/dedicated".to_string(),
            "node.kubernetes.io/not-ready".to_string()
        ],
        "other taints untouched, in order"
    );
    assert_eq!(
        taints(&cluster, "node-b"),
        vec![TAINT.to_string()],
        "another node is never touched"
    );
    wait_for("the ready event", || {
        !cluster.lock().unwrap().events.is_empty()
    });
    let c = cluster.lock().unwrap();
    let event = &c.events[0];
    assert_eq!(event["involvedObject"]["kind"], "Node");
    assert_eq!(event["involvedObject"]["name"], "node-a");
    assert_eq!(event["reason"], "FerryReady");
    assert_eq!(event["metadata"]["namespace"], "default");
    let patches: Vec<_> = c.requests.iter().filter(|(m, _, _)| m == "PATCH").collect();
    assert_eq!(patches.len(), 1, "{patches:?}");
    assert_eq!(patches[0].1, "/api/v1/nodes/node-a?");
    assert_eq!(patches[0].2, "application/merge-patch+json");
}

#[test]
fn a_node_without_the_taint_is_left_alone() {
    let rt = runtime();
    let tmp = tempfile::tempdir().unwrap();
    let cluster: Shared = Arc::new(Mutex::new(Cluster::default()));
    cluster.lock().unwrap().nodes.push(kube_api::node(
        "node-a",
        json!([{"key": "x/y", "effect": "NoSchedule"}]),
    ));
    let api = rt.block_on(kube_api::serve(cluster.clone()));
    let kubeconfig = kube_api::kubeconfig(tmp.path(), &format!("http://{api}"));
    let containerd = Containerd::start(&tmp.path().join("node"));
    let (_ferry, _, _) = start_ferry(
        tmp.path(),
        &containerd,
        &kubeconfig,
        &["--p2p", "false", "--node-name", "node-a"],
    );
    wait_for("the ready event", || {
        !cluster.lock().unwrap().events.is_empty()
    });
    assert_eq!(taints(&cluster, "node-a"), vec!["x/y".to_string()]);
    assert!(
        cluster
            .lock()
            .unwrap()
            .requests
            .iter()
            .all(|(m, _, _)| m != "PATCH"),
        "no patch at all"
    );
}

/// A node whose containerd config defeats Ferry (the kubelet's pulls would not use the hosts
/// dir; unpacked layers are discarded, so the node has nothing to share): each problem is a
/// `FerryMisconfigured` Warning on the node, with its fix, once; the node still becomes ready.
#[test]
fn each_configuration_problem_is_a_warning_event_on_the_node_once() {
    let rt = runtime();
    let tmp = tempfile::tempdir().unwrap();
    let cluster: Shared = Arc::new(Mutex::new(Cluster::default()));
    cluster.lock().unwrap().nodes.push(kube_api::node(
        "node-a",
        json!([{"key": TAINT, "effect": "NoSchedule"}]),
    ));
    let api = rt.block_on(kube_api::serve(cluster.clone()));
    let kubeconfig = kube_api::kubeconfig(tmp.path(), &format!("http://{api}"));
    let containerd = Containerd::start(&tmp.path().join("node"));
    let config = tmp.path().join("containerd-config.toml");
    std::fs::write(
        &config,
        "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  discard_unpacked_layers = true\n",
    )
    .unwrap();
    let (_ferry, _, _) = start_ferry(
        tmp.path(),
        &containerd,
        &kubeconfig,
        &[
            "--p2p",
            "false",
            "--node-name",
            "node-a",
            "--containerd-config",
            config.to_str().unwrap(),
            // Without Ferry's lease: discarding layers is a problem only then.
            "--keep-budget",
            "0",
        ],
    );
    let warnings = || -> Vec<serde_json::Value> {
        cluster
            .lock()
            .unwrap()
            .events
            .iter()
            .filter(|e| e["reason"] == "FerryMisconfigured")
            .cloned()
            .collect()
    };
    wait_for("both warnings", || warnings().len() >= 2);
    wait_for("the taint lifted all the same", || {
        !taints(&cluster, "node-a").contains(&TAINT.to_string())
    });
    // Two more looks (every 5 s): a problem that still holds is not reported again.
    std::thread::sleep(Duration::from_secs(11));
    let events = warnings();
    assert_eq!(events.len(), 2, "{events:#?}");
    for (problem, fix) in [
        ("cri_config_path_unset", "config_path"),
        ("discard_unpacked_layers", "discard_unpacked_layers = false"),
    ] {
        let event = events
            .iter()
            .find(|e| e["message"].as_str().unwrap().starts_with(problem))
            .unwrap_or_else(|| panic!("{problem} in {events:#?}"));
        assert_eq!(event["type"], "Warning");
        assert_eq!(event["involvedObject"]["kind"], "Node");
        assert_eq!(event["involvedObject"]["name"], "node-a");
        // `kubectl describe node` finds a node's events by a uid equal to its name.
        assert_eq!(event["involvedObject"]["uid"], "node-a");
        assert_eq!(event["source"]["component"], "ferry");
        assert!(
            event["message"].as_str().unwrap().contains(fix),
            "{problem}: the fix in {event}"
        );
    }
}

#[test]
fn peers_are_bootstrapped_from_the_daemonsets_pods() {
    let rt = runtime();
    let tmp = tempdir();
    let cluster: Shared = Arc::new(Mutex::new(Cluster::default()));
    // Two nodes on one machine: distinct loopback addresses, the same p2p port.
    let port = free_addr().port();
    {
        let mut c = cluster.lock().unwrap();
        c.pods.push(kube_api::pod("ferry-a", "127.0.0.2"));
        c.pods.push(kube_api::pod("ferry-b", "127.0.0.3"));
        let mut other = kube_api::pod("not-ferry", "127.0.0.9");
        other["metadata"]["labels"] = json!({"app": "something-else"});
        c.pods.push(other);
    }
    let api = rt.block_on(kube_api::serve(cluster.clone()));
    let kubeconfig = kube_api::kubeconfig(tmp.path(), &format!("http://{api}"));
    let mut nodes = Vec::new();
    for (name, ip) in [("a", "127.0.0.2"), ("b", "127.0.0.3")] {
        let dir = tmp.path().join(name);
        let containerd = Containerd::start(&dir.join("containerd"));
        let (ferry, metrics) = start_bootstrapping(&dir, &containerd, &kubeconfig, (ip, port));
        nodes.push((containerd, ferry, metrics));
    }
    for (_, _, metrics) in &nodes {
        let url = format!("http://{metrics}/metrics");
        wait_for(
            &format!("the node at {metrics} connected to the other pod"),
            || {
                let r = http("GET", &url, &[]);
                String::from_utf8_lossy(&r.body)
                    .lines()
                    .any(|l| l.starts_with("ferry_peers_connected ") && !l.ends_with(" 0"))
            },
        );
    }
    let c = cluster.lock().unwrap();
    let list = c.requests.iter().find(|(m, uri, _)| {
        m == "GET"
            && uri.starts_with("/api/v1/namespaces/ferry/pods")
            && !uri.contains("watch=true")
    });
    assert!(
        list.is_some_and(|(_, uri, _)| uri
            .contains("labelSelector=app.kubernetes.io%2Fname%3Dferry")
            // From the API server's cache, not etcd.
            && uri.contains("resourceVersion=0")),
        "{:?}",
        c.requests
    );
    assert!(
        !c.requests
            .iter()
            .any(|(_, uri, _)| uri.contains("watch=true")),
        "pods are listed when a node needs peers, never watched: {:?}",
        c.requests
    );
}

#[test]
fn a_node_named_many_pods_dials_only_a_few_and_lists_them_rarely() {
    let rt = runtime();
    let tmp = tempdir();
    let cluster: Shared = Arc::new(Mutex::new(Cluster::default()));
    // 20 other Ferry pods whose p2p port accepts a connection and never answers (nodes hung
    // mid-start): a dial to them neither succeeds nor fails for 10 s, so every dial made is
    // counted here, on real sockets, at distinct loopback addresses.
    let port = free_addr().port();
    let accepted = Arc::new(Mutex::new(Vec::new()));
    {
        let mut c = cluster.lock().unwrap();
        c.pods.push(kube_api::pod("ferry-self", "127.0.0.2"));
        for i in 10..30 {
            let ip = format!("127.0.0.{i}");
            c.pods.push(kube_api::pod(&format!("ferry-{i}"), &ip));
            // With SO_REUSEPORT, as libp2p binds its dialling sockets to its own listening
            // port (on one machine, every node listens on the same port).
            let socket = tokio::net::TcpSocket::new_v4().unwrap();
            socket.set_reuseaddr(true).unwrap();
            socket.set_reuseport(true).unwrap();
            socket
                .bind(format!("{ip}:{port}").parse().unwrap())
                .unwrap();
            let accepted = accepted.clone();
            rt.spawn(async move {
                let listener = socket.listen(64).unwrap();
                while let Ok((conn, _)) = listener.accept().await {
                    accepted.lock().unwrap().push(conn);
                }
            });
        }
    }
    let api = rt.block_on(kube_api::serve(cluster.clone()));
    let kubeconfig = kube_api::kubeconfig(tmp.path(), &format!("http://{api}"));
    let containerd = Containerd::start(&tmp.path().join("containerd"));
    let (_ferry, metrics) =
        start_bootstrapping(tmp.path(), &containerd, &kubeconfig, ("127.0.0.2", port));
    wait_for("a first bootstrap dial", || {
        !accepted.lock().unwrap().is_empty()
    });
    // The node keeps looking for peers (it has none) for these seconds: it dials no more
    // while its dials hang, and does not list the pods again each time it looks.
    std::thread::sleep(Duration::from_secs(3));
    let dialled = accepted.lock().unwrap().len();
    assert!(
        dialled <= 3,
        "{dialled} of 20 pods dialled (--bootstrap-dials 3)"
    );
    let url = format!("http://{metrics}/metrics");
    let body = String::from_utf8_lossy(&http("GET", &url, &[]).body).to_string();
    assert!(
        body.lines()
            .any(|l| l == format!("ferry_bootstrap_dials_total {dialled}")),
        "{body}"
    );
    let c = cluster.lock().unwrap();
    let lists = c
        .requests
        .iter()
        .filter(|(m, uri, _)| m == "GET" && uri.starts_with("/api/v1/namespaces/ferry/pods"))
        .count();
    assert_eq!(lists, 1, "{:?}", c.requests);
}

#[test]
fn an_api_server_that_is_down_or_slow_never_delays_the_mirror() {
    let tmp = tempfile::tempdir().unwrap();
    // Slow: accepts connections and never answers.
    let slow = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let slow_addr = slow.local_addr().unwrap();
    // Down: nothing listens.
    let down = free_addr();
    let hosts = tmp.path().join("plain-certs.d");
    std::fs::create_dir_all(&hosts).unwrap();
    let registry = Registry::start(&tmp.path().join("registry"));
    let image = Image::generate(&tmp.path().join("image"), "v1", 1, 256 * 1024);
    image.push(registry.addr, "team/app");
    let containerd = Containerd::start(&tmp.path().join("node"));
    containerd.pull("k8s.io", &format!("{}/team/app:v1", registry.addr), &hosts);
    for (what, server) in [("slow", slow_addr), ("down", down)] {
        let dir = tmp.path().join(what);
        std::fs::create_dir_all(&dir).unwrap();
        let kubeconfig = kube_api::kubeconfig(&dir, &format!("http://{server}"));
        let mut c2 = Containerd {
            netns: None,
            ..containerd_view(&containerd)
        };
        c2.hosts_dir = dir.join("certs.d");
        let started = Instant::now();
        let (ferry, mirror, metrics) = start_ferry(
            &dir,
            &c2,
            &kubeconfig,
            &[
                "--p2p",
                "false",
                "--node-name",
                "node-a",
                "--bootstrap-kubernetes",
                "app=ferry",
            ],
        );
        wait_for("mirror listening and hosts.toml written", || {
            std::net::TcpStream::connect(mirror).is_ok()
                && c2.hosts_dir.join("_default/hosts.toml").exists()
        });
        eprintln!("{what} API server: mirror up after {:?}", started.elapsed());
        wait_for("ready", || {
            http_status(&format!("http://{metrics}/readyz")) == Some(200)
        });
        let layer = &image.layers[0];
        let r = http(
            "GET",
            &format!("http://{mirror}/v2/team/app/blobs/{layer}"),
            &[],
        );
        assert_eq!(
            (r.status, sha256_hex(&r.body)),
            (200, layer.clone()),
            "{what}: the mirror serves"
        );
        drop(ferry);
        std::mem::forget(c2); // shares containerd's process with `containerd`
    }
    drop(slow);
}

/// Another handle on the same containerd (same socket and content), without owning its process.
fn containerd_view(c: &Containerd) -> Containerd {
    Containerd {
        dir: c.dir.clone(),
        socket: c.socket.clone(),
        config: c.config.clone(),
        hosts_dir: c.hosts_dir.clone(),
        proc: Proc {
            child: None,
            log: c.proc.log.clone(),
        },
        netns: None,
    }
}

/// The uninstall hook's wait (`ferry wait-cleanup`, the real binary): it returns once the
/// cleanup DaemonSet is ready on every node and leaves the DaemonSet to Helm; when that does
/// not happen in time it deletes the DaemonSet itself (Helm leaves a failed hook's objects
/// behind, which would keep the cleanup pods on every node for good) and fails.
#[test]
fn the_uninstall_wait_succeeds_once_every_node_is_cleaned_and_never_leaves_the_daemonset() {
    let rt = runtime();
    let tmp = tempfile::tempdir().unwrap();
    let cluster: Shared = Arc::new(Mutex::new(Cluster::default()));
    let api = rt.block_on(kube_api::serve(cluster.clone()));
    let kubeconfig = kube_api::kubeconfig(tmp.path(), &format!("http://{api}"));
    let wait = |timeout: &str| {
        std::process::Command::new(Ferry::bin())
            .args([
                "wait-cleanup",
                "--daemonset",
                "ferry-cleanup",
                "--timeout",
                timeout,
            ])
            .env("KUBECONFIG", &kubeconfig)
            .output()
            .unwrap()
    };
    let deletes = |cluster: &Shared| {
        cluster
            .lock()
            .unwrap()
            .requests
            .iter()
            .filter(|(m, p, _)| m == "DELETE" && p.contains("/daemonsets/ferry-cleanup"))
            .count()
    };

    // 1 of 3 nodes cleaned; the other two finish 3 s later.
    cluster
        .lock()
        .unwrap()
        .daemonsets
        .push(kube_api::daemonset("ferry-cleanup", 3, 1));
    let finisher = {
        let cluster = cluster.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(3));
            let mut c = cluster.lock().unwrap();
            c.daemonsets[0]["status"]["numberReady"] = json!(3);
        })
    };
    let started = Instant::now();
    let out = wait("60s");
    finisher.join().unwrap();
    assert!(out.status.success(), "{out:?}");
    assert!(
        started.elapsed() >= Duration::from_secs(3),
        "returned before every node was cleaned"
    );
    assert_eq!(
        deletes(&cluster),
        0,
        "on success the DaemonSet is Helm's to delete"
    );

    // Never finishes: after its timeout the wait deletes the DaemonSet and fails.
    {
        let mut c = cluster.lock().unwrap();
        c.daemonsets[0] = kube_api::daemonset("ferry-cleanup", 3, 2);
    }
    let out = wait("3s");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("was deleted"), "{stderr}");
    assert_eq!(deletes(&cluster), 1);
    assert!(
        cluster.lock().unwrap().daemonsets.is_empty(),
        "the DaemonSet is gone"
    );
}
