//! Whole nodes in one process (in-memory content stores, the real HTTP listeners): a local miss
//! is served by the node that has the content, over real libp2p; a peer that dies mid-blob is
//! resumed on the next provider from the byte offset already sent; nobody having it is a 404.

#![allow(clippy::unwrap_used)] // test helpers panic by design

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferry::app::{Listeners, PeerSetup, Peering, serve};
use ferry::cli::Flags;
use ferry::config::{Config, Registries};
use ferry::oci::manifest::OCI_MANIFEST;
use ferry::registry::peer_fetch::PeerFetchConfig;
use ferry::routing::memory::MemoryNetwork;
use ferry::routing::sync::SyncConfig;
use ferry::routing::{Peer, Router};
use ferry::store::memory::MemoryStore;
use sha2::Digest as _;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const EVENTUALLY: Duration = Duration::from_secs(20);
const LAYER_BYTES: usize = 3 * 1024 * 1024;

struct Running {
    mirror: SocketAddr,
    peer: SocketAddr,
    ops: SocketAddr,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

fn config(dir: &std::path::Path) -> Config {
    let flags = Flags {
        hosts_dir: Some(dir.join("certs.d").to_str().unwrap().into()),
        data_dir: Some(dir.join("data").to_str().unwrap().into()),
        containerd_config: Some("/nonexistent".into()),
        advertise_addr: Some("127.0.0.1".into()),
        ..Flags::default()
    };
    Config::load(&flags).unwrap()
}

async fn bind() -> TcpListener {
    TcpListener::bind("127.0.0.1:0").await.unwrap()
}

async fn run_node(
    dir: &std::path::Path,
    store: Arc<MemoryStore>,
    peering: impl FnOnce(SocketAddr) -> Peering,
) -> Running {
    let (mirror, peer, ops) = (bind().await, bind().await, bind().await);
    let addrs = (
        mirror.local_addr().unwrap(),
        peer.local_addr().unwrap(),
        ops.local_addr().unwrap(),
    );
    let peering = peering(addrs.1);
    let stop = CancellationToken::new();
    let listeners = Listeners {
        mirror,
        peer: Some(peer),
        ops,
    };
    let shutdown = stop.clone().cancelled_owned();
    let task = tokio::spawn(serve(config(dir), store, listeners, peering, shutdown));
    Running {
        mirror: addrs.0,
        peer: addrs.1,
        ops: addrs.2,
        stop,
        task,
    }
}

impl Running {
    async fn stop(self) {
        self.stop.cancel();
        self.task.await.unwrap();
    }
}

/// An image in `store`: manifest + one layer of random-looking bytes.
fn image(store: &MemoryStore) -> (String, Bytes) {
    let layer: Bytes = (0..LAYER_BYTES)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect::<Vec<_>>()
        .into();
    let layer_digest = store.put(layer.clone());
    let manifest = store.put(format!(
        r#"{{"schemaVersion":2,"mediaType":"{OCI_MANIFEST}","config":{{"digest":"{layer_digest}"}},"layers":[{{"digest":"{layer_digest}"}}]}}"#
    ));
    store.tag("registry.test", "team/app", "v1", &manifest, OCI_MANIFEST);
    (layer_digest.to_string(), layer)
}

fn sha(data: &[u8]) -> String {
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(data)))
}

async fn get(url: &str, range: Option<&str>) -> (u16, Vec<u8>, reqwest::header::HeaderMap) {
    let mut req = reqwest::Client::new().get(url);
    if let Some(r) = range {
        req = req.header("range", r);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    (
        status,
        r.bytes().await.map(|b| b.to_vec()).unwrap_or_default(),
        headers,
    )
}

async fn metric(ops: SocketAddr, line_prefix: &str) -> u64 {
    let (_, body, _) = get(&format!("http://{ops}/metrics"), None).await;
    String::from_utf8_lossy(&body)
        .lines()
        .find(|l| l.starts_with(line_prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn p2p_setup(
    dir: &std::path::Path,
    http: SocketAddr,
    p2p: SocketAddr,
    bootstrap: Option<SocketAddr>,
) -> Peering {
    let mut flags = Flags {
        advertise_addr: Some("127.0.0.1".into()),
        peer_addr: Some(http.to_string()),
        p2p_addr: Some(p2p.to_string()),
        resolve_timeout: Some("2s".into()),
        ..Flags::default()
    };
    if let Some(b) = bootstrap {
        flags.bootstrap_peers = Some(b.to_string());
    }
    let settings = Config::load(&flags).unwrap().p2p.unwrap();
    Peering::P2p(PeerSetup::from_settings(&settings, &dir.join("data"), &Registries::All).unwrap())
}

/// Peering through an in-memory router, as node `id` of `network`.
fn memory_peering(network: &MemoryNetwork, id: &str, http: SocketAddr) -> Peering {
    Peering::Router {
        router: Arc::new(network.node(Peer {
            id: id.into(),
            addr: http,
        })),
        fetch: PeerFetchConfig {
            resolve_timeout: Duration::from_millis(500),
            resolve_latest: false,
        },
        sync: SyncConfig {
            registries: Registries::All,
            interval: Duration::from_secs(3600),
        },
    }
}

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_miss_is_served_by_the_node_that_has_it_over_real_libp2p() {
    let tmp = tempfile::tempdir().unwrap();
    let (p2p_a, p2p_b, p2p_c) = (free_addr(), free_addr(), free_addr());
    let store_a = Arc::new(MemoryStore::new());
    let (layer, bytes) = image(&store_a);
    let a = run_node(&tmp.path().join("a"), store_a, |http| {
        p2p_setup(&tmp.path().join("a"), http, p2p_a, None)
    })
    .await;
    let b = run_node(
        &tmp.path().join("b"),
        Arc::new(MemoryStore::new()),
        |http| p2p_setup(&tmp.path().join("b"), http, p2p_b, Some(p2p_a)),
    )
    .await;
    let c = run_node(
        &tmp.path().join("c"),
        Arc::new(MemoryStore::new()),
        |http| p2p_setup(&tmp.path().join("c"), http, p2p_c, Some(p2p_a)),
    )
    .await;

    let url = format!(
        "http://{}/v2/team/app/blobs/{layer}?ns=registry.test",
        b.mirror
    );
    let start = Instant::now();
    loop {
        let (status, body, _) = get(&url, None).await;
        if status == 200 {
            assert_eq!(sha(&body), layer, "bytes from the peer match the digest");
            assert_eq!(body, bytes);
            break;
        }
        assert_eq!(
            status, 404,
            "until A's keys are in the DHT, a miss is a 404"
        );
        assert!(start.elapsed() < EVENTUALLY, "B never found A's layer");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(metric(b.ops, "ferry_served_total{kind=\"blob\",source=\"peer\"}").await >= 1);
    assert_eq!(
        metric(
            b.ops,
            "ferry_bytes_served_total{kind=\"blob\",source=\"peer\"}"
        )
        .await,
        LAYER_BYTES as u64
    );

    // The tag resolves through the peer as well, and a range passes through.
    let (status, body, headers) = get(
        &format!(
            "http://{}/v2/team/app/manifests/v1?ns=registry.test",
            c.mirror
        ),
        None,
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(headers["content-type"], OCI_MANIFEST);
    assert_eq!(
        sha(&body),
        headers["docker-content-digest"].to_str().unwrap()
    );
    let (status, body, headers) = get(
        &format!("http://{}/v2/team/app/blobs/{layer}", c.mirror),
        Some("bytes=100-199"),
    )
    .await;
    assert_eq!(
        (status, headers["content-range"].to_str().unwrap()),
        (206, format!("bytes 100-199/{LAYER_BYTES}").as_str())
    );
    assert_eq!(body, bytes[100..200]);

    // The peer address serves local content only: C's peer address never asks A.
    let (status, _, _) = get(
        &format!("http://{}/v2/team/app/blobs/{layer}", c.peer),
        None,
    )
    .await;
    assert_eq!(status, 404);
    // Nobody has it: a 404, fast (bounded by --resolve-timeout, here 2 s).
    let absent = sha(b"nobody");
    let (status, _, _) = get(
        &format!("http://{}/v2/team/app/blobs/{absent}", b.mirror),
        None,
    )
    .await;
    assert_eq!(status, 404);
    for n in [a, b, c] {
        n.stop().await;
    }
}

/// A peer that sends the headers and part of the body of every blob, then drops the connection.
async fn dying_peer(full: Bytes, cut_at: usize) -> SocketAddr {
    let listener = bind().await;
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut conn, _)) = listener.accept().await {
            let full = full.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let _ = conn.read(&mut buf).await;
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\ncontent-type: application/octet-stream\r\n\r\n",
                    full.len()
                );
                let _ = conn.write_all(head.as_bytes()).await;
                let _ = conn.write_all(&full[..cut_at]).await;
                // Dropped here: the body ends early.
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_dying_mid_blob_is_resumed_on_the_next_provider() {
    let tmp = tempfile::tempdir().unwrap();
    let network = MemoryNetwork::new();
    let store_good = Arc::new(MemoryStore::new());
    let (layer, bytes) = image(&store_good);
    let good = run_node(&tmp.path().join("good"), store_good, |_| Peering::Off).await;
    let cut_at = 1_000_000;
    let dying = dying_peer(bytes.clone(), cut_at).await;
    // The memory router lists providers by ID: the dying peer comes first.
    network
        .node(Peer {
            id: "a-dying".into(),
            addr: dying,
        })
        .advertise(vec![layer.clone()])
        .await
        .unwrap();
    network
        .node(Peer {
            id: "b-good".into(),
            addr: good.peer,
        })
        .advertise(vec![layer.clone()])
        .await
        .unwrap();

    let asker = run_node(
        &tmp.path().join("asker"),
        Arc::new(MemoryStore::new()),
        |http| memory_peering(&network, "c-asker", http),
    )
    .await;
    let (status, body, _) = get(
        &format!("http://{}/v2/team/app/blobs/{layer}", asker.mirror),
        None,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(body.len(), bytes.len());
    assert_eq!(sha(&body), layer, "the resumed transfer is byte-identical");
    assert!(metric(asker.ops, "ferry_peer_failures_total{stage=\"body\"}").await >= 1);

    // With only the dying peer, the transfer fails loudly (a reset), never a short 200.
    let lonely = MemoryNetwork::new();
    lonely
        .node(Peer {
            id: "a-dying".into(),
            addr: dying,
        })
        .advertise(vec![layer.clone()])
        .await
        .unwrap();
    let doomed = run_node(
        &tmp.path().join("doomed"),
        Arc::new(MemoryStore::new()),
        |http| memory_peering(&lonely, "c", http),
    )
    .await;
    let response = reqwest::get(format!(
        "http://{}/v2/team/app/blobs/{layer}",
        doomed.mirror
    ))
    .await
    .unwrap();
    assert_eq!(response.status(), 200);
    assert!(
        response.bytes().await.is_err(),
        "a truncated body must be an error for the client"
    );
    for n in [good, asker, doomed] {
        n.stop().await;
    }
}
