//! Whole nodes in one process (in-memory content stores, the real HTTP listeners): a local miss
//! is served by the node that has the content, over real libp2p; a peer that dies mid-blob is
//! resumed on the next provider from the byte offset already sent; nobody having it is a 404.

#![allow(clippy::unwrap_used)] // test helpers panic by design

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferry::app::{Listeners, PeerSetup, Peering, Stores, serve};
use ferry::cli::settings;
use ferry::config::{Config, Registries, RegistryFilters};
use ferry::oci::manifest::OCI_MANIFEST;
use ferry::registry::ResolveTags;
use ferry::registry::peer::PeerFetchConfig;
use ferry::routing::memory::MemoryNetwork;
use ferry::routing::sync::SyncConfig;
use ferry::routing::{ContentRouting, Peer};
use ferry::store::memory::MemoryStore;
use ferry::trust::{ClusterSecret, token};
use ferry::wire::TOKEN_HEADER;
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

fn config(dir: &std::path::Path, more: &[&str]) -> Config {
    let (hosts, data) = (dir.join("certs.d"), dir.join("data"));
    let args = [
        "--hosts-dir",
        hosts.to_str().unwrap(),
        "--data-dir",
        data.to_str().unwrap(),
        "--containerd-config",
        "/nonexistent",
        "--advertise-addr",
        "127.0.0.1",
    ];
    settings(args.iter().chain(more).copied()).unwrap()
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
    let config = config(dir, &[]);
    let holds_images = !ferry::store::ContentStore::images(store.as_ref())
        .await
        .unwrap_or_default()
        .is_empty();
    let stores = Stores {
        content: store.clone(),
        holder: Some(store),
    };
    let task = tokio::spawn(serve(config, stores, listeners, peering, shutdown));
    // A node serves peers only what its sync has taken stock of (its first reconcile runs
    // at start, a moment later on a loaded machine): wait for it, or a test that advertises
    // the node by hand can ask it too early and get a 404 (seen once in a full run).
    if holds_images {
        let started = Instant::now();
        while metric(addrs.2, "ferry_keys_advertised").await == 0
            && started.elapsed() < Duration::from_secs(10)
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
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
    secret: Option<ClusterSecret>,
) -> Peering {
    let (http, p2p) = (http.to_string(), p2p.to_string());
    let bootstrap = bootstrap.map(|b| b.to_string()).unwrap_or_default();
    let config = config(
        dir,
        &[
            "--peer-addr",
            &http,
            "--p2p-addr",
            &p2p,
            "--bootstrap-peers",
            &bootstrap,
            "--resolve-timeout",
            "2s",
            // There is no registry here at all: tags resolve through peers, as air-gapped.
            "--resolve-tags",
            "always",
        ],
    );
    Peering::P2p(Box::new(PeerSetup::from_settings(&config, secret).unwrap()))
}

/// Peering through an in-memory router, as node `id` of `network`.
fn memory_peering(network: &MemoryNetwork, id: &str, http: SocketAddr) -> Peering {
    memory_peering_verifying(
        network,
        id,
        http,
        PeerFetchConfig::with_resolve_timeout(Duration::ZERO).verify_before_serving,
    )
}

/// As [`memory_peering`], verifying blobs up to `verify_limit` bytes before serving them.
fn memory_peering_verifying(
    network: &MemoryNetwork,
    id: &str,
    http: SocketAddr,
    verify_limit: u64,
) -> Peering {
    let mut fetch = PeerFetchConfig::with_resolve_timeout(Duration::from_millis(500));
    fetch.verify_before_serving = verify_limit;
    Peering::Given {
        router: Arc::new(network.node(Peer {
            id: id.into(),
            addr: http,
        })),
        fetch,
        // There is no registry here at all: tags resolve through peers, as air-gapped.
        tags: ResolveTags::Always,
        coalesce: None,
        sync: SyncConfig {
            registries: Registries::All,
            filters: RegistryFilters::default(),
            interval: Duration::from_secs(3600),
            held: None,
        },
        secret: None,
    }
}

#[path = "support/ports.rs"]
mod ports;

use ports::free_addr;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_miss_is_served_by_the_node_that_has_it_over_real_libp2p() {
    let tmp = tempfile::tempdir().unwrap();
    let (p2p_a, p2p_b, p2p_c) = (free_addr(), free_addr(), free_addr());
    let store_a = Arc::new(MemoryStore::new());
    let (layer, bytes) = image(&store_a);
    // A private cluster: pnet on libp2p, signed requests between peer addresses.
    let secret = || {
        Some(ClusterSecret::from_bytes(
            b"in-process cluster secret, 32 bytes+",
        ))
    };
    let node =
        |name: &'static str, store: Arc<MemoryStore>, p2p: SocketAddr, seed: Option<SocketAddr>| {
            let dir = tmp.path().join(name);
            async move {
                run_node(&dir.clone(), store, |http| {
                    p2p_setup(&dir, http, p2p, seed, secret())
                })
                .await
            }
        };
    let a = node("a", store_a, p2p_a, None).await;
    let b = node("b", Arc::new(MemoryStore::new()), p2p_b, Some(p2p_a)).await;
    let c = node("c", Arc::new(MemoryStore::new()), p2p_c, Some(p2p_a)).await;

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
    assert!(
        metric(
            b.ops,
            "ferry_served_total{listener=\"mirror\",kind=\"blob\",source=\"peer\"}"
        )
        .await
            >= 1
    );
    assert_eq!(
        metric(
            b.ops,
            "ferry_served_bytes_total{listener=\"mirror\",kind=\"blob\",source=\"peer\"}"
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
    let target = format!("/v2/team/app/blobs/{layer}");
    let r = reqwest::Client::new()
        .get(format!("http://{}{target}", c.peer))
        .header(
            TOKEN_HEADER,
            token::sign(&secret().unwrap(), "GET", &target),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    // A's peer address: without a valid token, 401 and nothing about what exists.
    let target = format!("/v2/team/app/blobs/{layer}");
    let url_a = format!("http://{}{target}", a.peer);
    let other = ClusterSecret::from_bytes(b"a secret from another cluster....");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    for (what, token) in [
        ("none", None),
        ("garbage", Some("v1.123.abc".to_string())),
        ("wrong secret", Some(token::sign(&other, "GET", &target))),
        (
            "expired",
            Some(token::sign_at(
                &secret().unwrap(),
                "GET",
                &target,
                now - 120,
            )),
        ),
        (
            "other path",
            Some(token::sign(&secret().unwrap(), "GET", "/v2/")),
        ),
    ] {
        let mut req = reqwest::Client::new().get(&url_a);
        if let Some(t) = &token {
            req = req.header(TOKEN_HEADER, t);
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status(), 401, "{what}");
        assert!(r.text().await.unwrap().contains("UNAUTHORIZED"), "{what}");
    }
    let absent_target = format!("/v2/team/app/blobs/{}", sha(b"absent"));
    let r = reqwest::get(format!("http://{}{absent_target}", a.peer))
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        401,
        "an absent blob looks the same as a present one without a token"
    );
    let r = reqwest::Client::new()
        .get(&url_a)
        .header(
            TOKEN_HEADER,
            token::sign(&secret().unwrap(), "GET", &target),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(sha(&r.bytes().await.unwrap()), layer);
    assert!(metric(a.ops, "ferry_peer_auth_failures_total{reason=\"expired\"}").await >= 1);

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
    // B found A's layer through the DHT: the time it took is kept for B's next run, where
    // the wait for a lookup starts from what it learnt.
    let kept = std::fs::read_to_string(tmp.path().join("b/data/lookup-times")).unwrap();
    assert!(
        !kept.is_empty() && kept.lines().all(|l| l.parse::<u64>().is_ok()),
        "{kept:?}"
    );
}

/// A peer that sends the headers and part of the body of every blob, then drops the connection.
async fn dying_peer(full: Bytes, cut_at: usize) -> SocketAddr {
    dying_peer_speaking(full, cut_at, false).await
}

/// As [`dying_peer`]; `zero_copy`: it answers an offer of the zero-copy upgrade with a `101`,
/// as a Ferry sending the blob with `sendfile` does, and dies the same way.
async fn dying_peer_speaking(full: Bytes, cut_at: usize, zero_copy: bool) -> SocketAddr {
    let listener = bind().await;
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut conn, _)) = listener.accept().await {
            let full = full.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let n = conn.read(&mut buf).await.unwrap_or(0);
                let request = String::from_utf8_lossy(&buf[..n]).to_ascii_lowercase();
                let offered =
                    request.contains(&format!("upgrade: {}", ferry::wire::ZERO_COPY_PROTOCOL));
                let head = if zero_copy && offered {
                    format!(
                        "HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: {}\r\n{}: 200\r\n{}: {}\r\n\r\n",
                        ferry::wire::ZERO_COPY_PROTOCOL,
                        ferry::wire::ZERO_COPY_STATUS_HEADER,
                        ferry::wire::ZERO_COPY_LENGTH_HEADER,
                        full.len()
                    )
                } else {
                    format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\ncontent-type: application/octet-stream\r\n\r\n",
                        full.len()
                    )
                };
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
    // The good node advertises through the memory network as "b-good" (its sync does it).
    let good = run_node(&tmp.path().join("good"), store_good, |http| {
        memory_peering(&network, "b-good", http)
    })
    .await;
    let cut_at = 1_000_000;
    let dying = dying_peer(bytes.clone(), cut_at).await;
    // The memory router lists providers by ID: the dying peer comes first.
    advertise(&network, "a-dying", dying, &layer).await;
    advertise(&network, "b-good", good.peer, &layer).await;

    // Both paths: the blob (3 MiB) is verified whole before serving under the default limit
    // (4 MiB), and streamed with resume when the limit is lower.
    for (limit, path) in [
        (4 << 20, "verified whole"),
        (1 << 20, "streamed and resumed"),
    ] {
        let asker = run_node(
            &tmp.path().join(format!("asker-{limit}")),
            Arc::new(MemoryStore::new()),
            |http| memory_peering_verifying(&network, "c-asker", http, limit),
        )
        .await;
        let (status, body, _) = get(
            &format!("http://{}/v2/team/app/blobs/{layer}", asker.mirror),
            None,
        )
        .await;
        assert_eq!(status, 200, "{path}");
        assert_eq!(body.len(), bytes.len(), "{path}");
        assert_eq!(
            sha(&body),
            layer,
            "{path}: byte-identical despite the dying peer"
        );
        assert!(
            metric(asker.ops, "ferry_peer_failures_total{stage=\"body\"}").await >= 1,
            "{path}"
        );
        asker.stop().await;
    }

    // With only the dying peer: a clean 404 when verifying first (containerd goes upstream),
    // an error mid-body when streaming (a reset, never a short 200).
    let lonely = MemoryNetwork::new();
    lonely
        .node(Peer {
            id: "a-dying".into(),
            addr: dying,
        })
        .advertise(vec![layer.clone()])
        .await
        .unwrap();
    let verified = run_node(
        &tmp.path().join("doomed-v"),
        Arc::new(MemoryStore::new()),
        |http| memory_peering(&lonely, "c", http),
    )
    .await;
    let (status, _, _) = get(
        &format!("http://{}/v2/team/app/blobs/{layer}", verified.mirror),
        None,
    )
    .await;
    assert_eq!(status, 404);
    let streamed = run_node(
        &tmp.path().join("doomed-s"),
        Arc::new(MemoryStore::new()),
        |http| memory_peering_verifying(&lonely, "c", http, 1 << 20),
    )
    .await;
    let response = reqwest::get(format!(
        "http://{}/v2/team/app/blobs/{layer}",
        streamed.mirror
    ))
    .await
    .unwrap();
    assert_eq!(response.status(), 200);
    assert!(
        response.bytes().await.is_err(),
        "a truncated body must be an error for the client"
    );
    for n in [good, verified, streamed] {
        n.stop().await;
    }
}

/// Lists the node `id` at `addr` as a provider of `key` on `network`.
async fn advertise(network: &MemoryNetwork, id: &str, addr: SocketAddr, key: &str) {
    network
        .node(Peer {
            id: id.into(),
            addr,
        })
        .advertise(vec![key.to_string()])
        .await
        .unwrap();
}

/// A node whose store keeps its blobs as files (as containerd does), advertised as `id`.
async fn file_node(
    dir: &std::path::Path,
    network: &MemoryNetwork,
    id: &str,
) -> (Running, String, Bytes) {
    let files = dir.join("files");
    std::fs::create_dir_all(&files).unwrap();
    let store = Arc::new(MemoryStore::with_files(&files));
    let (layer, bytes) = image(&store);
    let node = run_node(dir, store, |http| memory_peering(network, id, http)).await;
    advertise(network, id, node.peer, &layer).await;
    (node, layer, bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_blob_is_sent_with_sendfile_whole_and_by_range() {
    let tmp = tempfile::tempdir().unwrap();
    let network = MemoryNetwork::new();
    let (holder, layer, bytes) = file_node(&tmp.path().join("holder"), &network, "holder").await;
    let sent = || metric(holder.ops, "ferry_zero_copy_bytes_total");
    let len = bytes.len() as u64;
    // Both of the asking node's paths: streamed on (limit 1 MiB), and verified whole before
    // serving (4 MiB, where a range is answered from the whole blob, asked for after the
    // range's own answer is dropped: at least the whole blob is sent).
    for (limit, range_costs) in [(1u64 << 20, 2_000_000), (4 << 20, len)] {
        let asker = run_node(
            &tmp.path().join(format!("asker-{limit}")),
            Arc::new(MemoryStore::new()),
            |http| memory_peering_verifying(&network, "asker", http, limit),
        )
        .await;
        let url = format!("http://{}/v2/team/app/blobs/{layer}", asker.mirror);
        let before = sent().await;
        let (status, body, _) = get(&url, None).await;
        assert_eq!(status, 200, "limit {limit}");
        assert_eq!(sha(&body), layer, "limit {limit}: byte-identical");
        assert_eq!(
            sent().await - before,
            len,
            "limit {limit}: sent with sendfile"
        );

        let before = sent().await;
        let (status, body, headers) = get(&url, Some("bytes=1000-2000999")).await;
        assert_eq!(status, 206, "limit {limit}");
        assert_eq!(
            body,
            bytes[1000..2_001_000],
            "limit {limit}: the range's bytes"
        );
        assert_eq!(
            headers["content-range"],
            format!("bytes 1000-2000999/{len}").as_str()
        );
        let range_sent = sent().await - before;
        if limit < len {
            assert_eq!(range_sent, range_costs, "limit {limit}: only the range");
        } else {
            assert!(range_sent >= range_costs, "limit {limit}: {range_sent}");
        }
        asker.stop().await;
    }

    // An asker that does not offer the upgrade (an older Ferry) gets plain HTTP.
    let before = sent().await;
    let (status, body, _) = get(
        &format!("http://{}/v2/team/app/blobs/{layer}", holder.peer),
        None,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(sha(&body), layer);
    assert_eq!(sent().await, before, "no upgrade offered, none made");
    // Bytes sent past hyper are still counted as served.
    assert!(
        metric(
            holder.ops,
            "ferry_served_bytes_total{listener=\"peer\",kind=\"blob\",source=\"local\"}"
        )
        .await
            >= 4 * len
    );
    holder.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_copy_peer_dying_mid_blob_is_resumed_on_the_next_provider() {
    let tmp = tempfile::tempdir().unwrap();
    let network = MemoryNetwork::new();
    let (good, layer, bytes) = file_node(&tmp.path().join("good"), &network, "b-good").await;
    let cut_at = 1_000_000;
    let dying = dying_peer_speaking(bytes.clone(), cut_at, true).await;
    // Listed by ID: the dying peer is asked first.
    advertise(&network, "a-dying", dying, &layer).await;
    let asker = run_node(
        &tmp.path().join("asker"),
        Arc::new(MemoryStore::new()),
        |http| memory_peering_verifying(&network, "c-asker", http, 1 << 20),
    )
    .await;
    let (status, body, _) = get(
        &format!("http://{}/v2/team/app/blobs/{layer}", asker.mirror),
        None,
    )
    .await;
    assert_eq!(status, 200);
    assert_eq!(sha(&body), layer, "byte-identical despite the dying peer");
    assert!(metric(asker.ops, "ferry_peer_failures_total{stage=\"body\"}").await >= 1);
    assert_eq!(
        metric(good.ops, "ferry_zero_copy_bytes_total").await,
        (bytes.len() - cut_at) as u64,
        "the rest, from the byte the dying peer stopped at, with sendfile"
    );
    for n in [asker, good] {
        n.stop().await;
    }
}

/// A peer that serves a blob's full length with one byte changed (a liar, or a disk gone bad
/// under a Ferry without the integrity check).
async fn lying_peer(full: Bytes) -> SocketAddr {
    let mut wrong = full.to_vec();
    wrong[full.len() / 2] ^= 0xff;
    dying_peer(Bytes::from(wrong), full.len()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_serving_wrong_bytes_is_quarantined_and_ferry_status_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let network = MemoryNetwork::new();
    let store_good = Arc::new(MemoryStore::new());
    let (layer, bytes) = image(&store_good);
    let good = run_node(&tmp.path().join("good"), store_good, |http| {
        memory_peering(&network, "b-good", http)
    })
    .await;
    let liar = lying_peer(bytes.clone()).await;
    // Listed by ID: the liar is asked first.
    for (id, addr) in [("a-liar", liar), ("b-good", good.peer)] {
        advertise(&network, id, addr, &layer).await;
    }
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
    assert_eq!(sha(&body), layer, "the good peer's bytes, never the liar's");
    assert_eq!(
        metric(asker.ops, "ferry_peer_failures_total{stage=\"verify\"}").await,
        1
    );
    // The operator's view: `/status` (what `ferry status` prints) names the liar as
    // quarantined.
    let (code, status, _) = get(&format!("http://{}/status", asker.ops), None).await;
    assert_eq!(code, 200);
    let status: serde_json::Value = serde_json::from_slice(&status).unwrap();
    let passed_over = status["passed_over"].as_array().unwrap();
    assert_eq!(passed_over.len(), 1, "{status:#}");
    assert_eq!(passed_over[0]["id"], "a-liar");
    assert_eq!(passed_over[0]["quarantined"], true);
    assert!(passed_over[0]["seconds_left"].as_u64().unwrap() > 60);
    let text: ferry::ops::status::Status = serde_json::from_value(status).unwrap();
    assert!(
        text.text(0).contains("a-liar: QUARANTINED"),
        "{}",
        text.text(0)
    );
    for n in [good, asker] {
        n.stop().await;
    }
}

/// Node "b-good" of `network`, holding `image`: the node, its layer's digest and bytes.
async fn good_node(dir: &std::path::Path, network: &MemoryNetwork) -> (Running, String, Bytes) {
    let store = Arc::new(MemoryStore::new());
    let (layer, bytes) = image(&store);
    let node = run_node(&dir.join("good"), store, |http| {
        memory_peering(network, "b-good", http)
    })
    .await;
    (node, layer, bytes)
}

/// Node "c-asker" of `network`, holding nothing, its peer fetching as `tweak` sets it.
async fn asker(
    dir: &std::path::Path,
    network: &MemoryNetwork,
    tweak: impl FnOnce(&mut PeerFetchConfig),
) -> Running {
    run_node(dir, Arc::new(MemoryStore::new()), |http| {
        let mut peering = memory_peering(network, "c-asker", http);
        if let Peering::Given { fetch, .. } = &mut peering {
            tweak(fetch);
        }
        peering
    })
    .await
}

/// A peer that answers every request with `body` under `content_type` (and its digest).
async fn typed_peer(body: Bytes, content_type: &'static str) -> SocketAddr {
    let listener = bind().await;
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut conn, _)) = listener.accept().await {
            let body = body.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let _ = conn.read(&mut buf).await;
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\ncontent-type: {content_type}\r\ndocker-content-digest: {}\r\nconnection: close\r\n\r\n",
                    body.len(),
                    sha(&body)
                );
                let _ = conn.write_all(head.as_bytes()).await;
                let _ = conn.write_all(&body).await;
            });
        }
    });
    addr
}

/// The right bytes of a manifest under a wrong (known) type would fail every pull that asked
/// that peer first: the type comes from the verified bytes, and the peer is charged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manifest_under_a_wrong_type_is_caught_and_its_peer_charged() {
    let tmp = tempfile::tempdir().unwrap();
    let network = MemoryNetwork::new();
    let (good, layer, _) = good_node(tmp.path(), &network).await;
    // The image's own manifest, as `image` writes it.
    let manifest = Bytes::from(format!(
        r#"{{"schemaVersion":2,"mediaType":"{OCI_MANIFEST}","config":{{"digest":"{layer}"}},"layers":[{{"digest":"{layer}"}}]}}"#
    ));
    let digest = sha(&manifest);
    let liar = typed_peer(manifest.clone(), ferry::oci::manifest::OCI_INDEX).await;
    for (id, addr) in [("a-liar", liar), ("b-good", good.peer)] {
        advertise(&network, id, addr, &digest).await;
    }
    let asker = asker(&tmp.path().join("asker"), &network, |_| {}).await;
    let url = format!(
        "http://{}/v2/team/app/manifests/{digest}?ns=registry.test",
        asker.mirror
    );
    let (status, body, headers) = get(&url, None).await;
    assert_eq!(status, 200);
    assert_eq!(body, manifest.to_vec());
    assert_eq!(
        headers["content-type"], OCI_MANIFEST,
        "the type the bytes have"
    );
    assert_eq!(
        metric(asker.ops, "ferry_peer_failures_total{stage=\"verify\"}").await,
        1,
        "the liar is charged"
    );
    for n in [good, asker] {
        n.stop().await;
    }
}

/// A Range no peer can answer (several ranges, or malformed) is left to the registry at once:
/// a 404, no provider asked or charged. A single range is answered from the peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_no_peer_can_answer_goes_to_the_registry_without_charging_peers() {
    let tmp = tempfile::tempdir().unwrap();
    let network = MemoryNetwork::new();
    let (good, layer, bytes) = good_node(tmp.path(), &network).await;
    advertise(&network, "b-good", good.peer, &layer).await;
    let asker = asker(&tmp.path().join("asker"), &network, |_| {}).await;
    let url = format!("http://{}/v2/team/app/blobs/{layer}", asker.mirror);
    for bad in ["bytes=0-1,5-9", "bytes=x-y", "items=0-9"] {
        let (status, _, _) = get(&url, Some(bad)).await;
        assert_eq!(status, 404, "{bad}");
    }
    let (status, body, _) = get(&url, Some("bytes=10-19")).await;
    assert_eq!(status, 206);
    assert_eq!(body, bytes[10..20].to_vec());
    for stage in ["status", "body", "connect"] {
        let series = format!("ferry_peer_failures_total{{stage=\"{stage}\"}}");
        assert_eq!(metric(asker.ops, &series).await, 0, "{stage}");
    }
    for n in [good, asker] {
        n.stop().await;
    }
}

/// A peer that sends the headers of every blob, then one byte every 100 ms: never silent long
/// enough for the idle timeout.
async fn dripping_peer(full: Bytes) -> SocketAddr {
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
                for byte in full.iter() {
                    if conn.write_all(&[*byte]).await.is_err() {
                        return;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            });
        }
    });
    addr
}

/// A peer that drips its body (a byte every 100 ms, never silent for the idle timeout) is given
/// up after a window of twice the idle timeout and charged; the next provider serves the blob,
/// verified whole or streamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dripping_peer_is_given_up_and_the_next_provider_serves() {
    let tmp = tempfile::tempdir().unwrap();
    let network = MemoryNetwork::new();
    let (good, layer, bytes) = good_node(tmp.path(), &network).await;
    let drip = dripping_peer(bytes.clone()).await;
    for (id, addr) in [("a-drip", drip), ("b-good", good.peer)] {
        advertise(&network, id, addr, &layer).await;
    }
    for (limit, path) in [(4 << 20, "verified whole"), (1 << 20, "streamed")] {
        let dir = tmp.path().join(format!("asker-{limit}"));
        let asker = asker(&dir, &network, |fetch| {
            fetch.verify_before_serving = limit;
            fetch.idle_timeout = Duration::from_millis(500);
        })
        .await;
        let (status, body, _) = get(
            &format!("http://{}/v2/team/app/blobs/{layer}", asker.mirror),
            None,
        )
        .await;
        assert_eq!(status, 200, "{path}");
        assert_eq!(sha(&body), layer, "{path}: the good provider's bytes");
        assert!(
            metric(asker.ops, "ferry_peer_failures_total{stage=\"body\"}").await >= 1,
            "{path}: the dripping peer is charged"
        );
        asker.stop().await;
    }
    good.stop().await;
}

/// Blobs verified whole before serving hold memory until their reader has them all: past the
/// buffer budget, a whole blob is streamed instead (hashed on the way, its last chunk held
/// until the digest checks out) and a range, which could not be checked, goes to the registry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_buffer_budget_a_blob_is_streamed_and_a_range_left_to_the_registry() {
    let tmp = tempfile::tempdir().unwrap();
    let network = MemoryNetwork::new();
    let (good, layer, bytes) = good_node(tmp.path(), &network).await;
    advertise(&network, "b-good", good.peer, &layer).await;
    // The 3 MiB blob is within the verify limit (4 MiB) but not the budget (1 MiB).
    let asker = asker(&tmp.path().join("asker"), &network, |fetch| {
        fetch.verify_before_serving = 4 << 20;
        fetch.buffer_budget = 1 << 20;
    })
    .await;
    let url = format!("http://{}/v2/team/app/blobs/{layer}", asker.mirror);
    let (status, body, _) = get(&url, None).await;
    assert_eq!(status, 200);
    assert_eq!(sha(&body), layer, "streamed whole, byte-identical");
    let (status, _, _) = get(&url, Some("bytes=10-19")).await;
    assert_eq!(status, 404, "an unchecked range is the registry's");
    assert_eq!(bytes.len(), 3 * 1024 * 1024);
    for n in [good, asker] {
        n.stop().await;
    }
}

/// A peer that answers every range `bytes=N-` with a 206 of the right length and bytes that
/// are not the blob's.
async fn lying_range_peer(total: u64) -> SocketAddr {
    let listener = bind().await;
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let n = conn.read(&mut buf).await.unwrap_or(0);
                let request = String::from_utf8_lossy(&buf[..n]).to_lowercase();
                let from: u64 = request
                    .split("range: bytes=")
                    .nth(1)
                    .and_then(|r| r.split('-').next())
                    .and_then(|v| v.trim().parse().ok())
                    .unwrap_or(0);
                let len = total - from;
                let head = format!(
                    "HTTP/1.1 206 Partial Content\r\ncontent-length: {len}\r\ncontent-range: bytes {from}-{}/{total}\r\ncontent-type: application/octet-stream\r\nconnection: close\r\n\r\n",
                    total - 1
                );
                let _ = conn.write_all(head.as_bytes()).await;
                let _ = conn.write_all(&vec![0x5a; len as usize]).await;
            });
        }
    });
    addr
}

/// containerd resuming a large blob asks for its tail (`Range: bytes=N-`), its partial download
/// holding the first N bytes: a peer's tail is checked with that prefix against the blob's
/// digest, so a peer that lies is cut before its last chunk and charged, never completing
/// containerd's download with wrong bytes, and the next try gets the real tail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_blobs_tail_from_a_peer_is_checked_with_the_partial_download() {
    let tmp = tempfile::tempdir().unwrap();
    let network = MemoryNetwork::new();
    let (good, layer, bytes) = good_node(tmp.path(), &network).await;
    let total = bytes.len() as u64;
    let liar = lying_range_peer(total).await;
    advertise(&network, "a-liar", liar, &layer).await;
    advertise(&network, "b-good", good.peer, &layer).await;
    let store = Arc::new(MemoryStore::new());
    let from = 1_000_000;
    let partial = store.start_download(&layer.parse().unwrap(), total);
    partial.append(&bytes[..from]);
    // Streamed, not verified whole: the blob is past the 1 MiB limit.
    let asker = run_node(&tmp.path().join("asker"), store, |http| {
        memory_peering_verifying(&network, "c-asker", http, 1 << 20)
    })
    .await;
    let url = format!("http://{}/v2/team/app/blobs/{layer}", asker.mirror);
    let range = format!("bytes={from}-");
    let (status, body, _) = get(&url, Some(&range)).await;
    assert_eq!(status, 206);
    assert!(
        (body.len() as u64) < total - from as u64,
        "the lying tail is cut before its end"
    );
    assert_eq!(
        metric(asker.ops, "ferry_peer_failures_total{stage=\"verify\"}").await,
        1
    );
    let (status, body, _) = get(&url, Some(&range)).await;
    assert_eq!(status, 206);
    assert!(body == bytes[from..], "the real tail from the good peer");
    drop(partial);
    for n in [good, asker] {
        n.stop().await;
    }
}

/// L10: a blob HEAD answered by a peer names the digest asked for; a peer that names another
/// is charged and the next provider answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blob_head_from_a_peer_names_the_digest_asked_for() {
    let tmp = tempfile::tempdir().unwrap();
    let network = MemoryNetwork::new();
    let (good, layer, bytes) = good_node(tmp.path(), &network).await;
    let liar = typed_peer(
        Bytes::from_static(b"other bytes"),
        "application/octet-stream",
    )
    .await;
    for (id, addr) in [("a-liar", liar), ("b-good", good.peer)] {
        advertise(&network, id, addr, &layer).await;
    }
    let asker = asker(&tmp.path().join("asker"), &network, |_| {}).await;
    let url = format!("http://{}/v2/team/app/blobs/{layer}", asker.mirror);
    let r = reqwest::Client::new().head(&url).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["docker-content-digest"].to_str().unwrap(),
        layer
    );
    assert_eq!(
        r.headers()["content-length"].to_str().unwrap(),
        bytes.len().to_string()
    );
    assert_eq!(
        metric(asker.ops, "ferry_peer_failures_total{stage=\"verify\"}").await,
        1,
        "the peer naming another digest is charged"
    );
    for n in [good, asker] {
        n.stop().await;
    }
}
