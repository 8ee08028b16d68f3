//! Wiring. Start-up runs in fixed steps, in the order that makes Ferry useful soonest:
//!
//! 1. bind the mirror address;
//! 2. write the hosts.toml entries (containerd now pulls through Ferry; a miss is a fast 404);
//! 3. bind the ops address;
//! 4. spawn the servers and the containerd watcher, which never gives up;
//! 5. on shutdown, drain within a grace period.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use std::net::IpAddr;

use crate::coalesce::{CoalesceConfig, Coalescer};
use crate::config::{Config, DEFAULT_PEER_PORT, P2pSettings};
use crate::containerd_config::hosts::Ipv6Hosts;
use crate::containerd_config::{self, Action, Outcome, preflight};
use crate::kubernetes::{self, bootstrap::KubernetesBootstrap, taint::TaintConfig};
use crate::limits::{LimitedListener, MAX_CONNECTIONS, MAX_IN_FLIGHT};
use crate::metrics::Metrics;
use crate::oci::registry::Registries;
use crate::ops::{self, Readiness};
use crate::problems::Problems;
use crate::registry::integrity::Integrity;
use crate::registry::peer::PeerFetchConfig;
use crate::registry::recent::RecentPulls;
use crate::registry::upstream::{PROBE_INTERVAL, PROBE_TIMEOUT};
use crate::registry::{
    self, MirrorState, PeerApiState, PeerFetcher, ResolveTags, UpstreamConfig, UpstreamWatch,
};
use crate::routing::Router;
use crate::routing::bootstrap::{Bootstrap, Bootstraps, DnsBootstrap, StaticBootstrap};
use crate::routing::p2p::{IDLE_CONNECTION_TIMEOUT, P2pConfig, P2pRouter, ProvideTiming, REPLICAS};
use crate::routing::sync::{self, SyncConfig};
use crate::store::ContentStore;
use crate::store::containerd::ContainerdStore;
use crate::trust::secret::ClusterSecret;

/// How long in-flight requests may run on after SIGTERM before they are cut off.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
/// How long readiness waits for a first peer when a bootstrap source names other nodes: long
/// enough for the nodes of a new pool to find each other (they dial again within tens of
/// milliseconds), short enough that the first node of a cluster, which has no one to find,
/// is ready soon anyway.
pub const FIRST_PEER_WAIT: Duration = Duration::from_secs(15);
/// How often a reachable containerd is probed; a restart is noticed within this.
const HEALTH_INTERVAL: Duration = Duration::from_secs(2);
/// Reconnect backoff while containerd is down: starts small (containerd usually comes up
/// within a second of Ferry on boot) and is capped so recovery is noticed quickly.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// The hosts dir is re-merged this often, so host directories created after start get the
/// mirror too. A merge that changes nothing writes nothing.
const HOSTS_REFRESH_INTERVAL: Duration = Duration::from_secs(60);

#[derive(Debug, thiserror::Error)]
pub enum AppError {
    #[error("cannot listen on {addr}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write the containerd hosts config")]
    Hosts(#[from] containerd_config::dir::DirError),
}

/// Runs the daemon until `shutdown` resolves.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), AppError> {
    let started = Instant::now();
    let mirror = bind(config.mirror_addr).await?;
    if !config.mirror_addr.ip().is_loopback() {
        tracing::warn!(
            mirror = %config.mirror_addr,
            "the mirror address is not loopback (mirror-allow-remote): anyone who reaches it can read this node's images"
        );
    }
    let store: Arc<dyn ContentStore> = Arc::new(ContainerdStore::new(
        config.containerd_socket.clone(),
        config.containerd_namespace.clone(),
        config.containerd_content_dir.clone(),
    ));
    let outcomes = configure_hosts(&config, store.as_ref()).await?;
    report(&outcomes);
    tracing::info!(
        mirror = %config.mirror_url(),
        hosts_dir = %config.hosts_dir.display(),
        elapsed_us = started.elapsed().as_micros() as u64,
        "mirror listening and containerd hosts config written"
    );
    let ops = bind(config.metrics_addr).await?;
    let peers = match &config.p2p {
        Some(settings) => PeerSetup::from_settings(&config, settings),
        None => None,
    };
    // Peer-to-peer is an addition to the mirror: if its listener cannot be bound, this node
    // serves its own content alone rather than not at all.
    let (peers, peer) = match peers {
        Some(p) => match bind(p.p2p.peer_http_addr).await {
            Ok(listener) => {
                if config.cluster_secret.is_some() {
                    tracing::info!(peer_addr = %p.p2p.peer_http_addr, "private peer network: peers need the cluster secret");
                } else {
                    tracing::warn!(
                        peer_addr = %p.p2p.peer_http_addr,
                        "NO CLUSTER SECRET: the peer address serves this node's shared images to anyone who can reach it, and anyone can join the peer network; set --cluster-secret-file"
                    );
                }
                (Some(p), Some(listener))
            }
            Err(e) => {
                tracing::error!(error = %e, "peer-to-peer is off: serving this node's content only");
                (None, None)
            }
        },
        None => (None, None),
    };
    let listeners = Listeners { mirror, peer, ops };
    let peering = peers.map_or(Peering::Off, |p| Peering::P2p(Box::new(p)));
    serve(config, store, listeners, peering, shutdown).await;
    Ok(())
}

/// The bound sockets, so that tests can bind port 0 and start-up order stays explicit.
#[derive(Debug)]
pub struct Listeners {
    /// containerd pulls through this (loopback).
    pub mirror: TcpListener,
    /// Other nodes fetch this node's content here; `None` without peer-to-peer.
    pub peer: Option<TcpListener>,
    /// `/metrics`, `/healthz`, `/readyz`.
    pub ops: TcpListener,
}

/// How this node finds content on other nodes.
pub enum Peering {
    /// This node's content only.
    Off,
    /// The libp2p DHT.
    P2p(Box<PeerSetup>),
    /// Any other router (tests: the in-memory one).
    Router {
        router: Arc<dyn Router>,
        fetch: PeerFetchConfig,
        tags: ResolveTags,
        /// `Some(follow timeout)`: coordinate simultaneous misses.
        coalesce: Option<Duration>,
        sync: SyncConfig,
    },
}

impl std::fmt::Debug for Peering {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Peering::Off => f.write_str("Off"),
            Peering::P2p(setup) => f.debug_tuple("P2p").field(setup).finish(),
            Peering::Router { fetch, .. } => f
                .debug_struct("Router")
                .field("fetch", fetch)
                .finish_non_exhaustive(),
        }
    }
}

/// Everything peer-to-peer needs, resolved from the settings.
pub struct PeerSetup {
    pub p2p: P2pConfig,
    /// Static and DNS sources; the Kubernetes source is added in `serve`, where its watch
    /// can be tied to the shutdown token.
    pub bootstrap: Bootstraps,
    pub bootstrap_configured: bool,
    pub fetch: PeerFetchConfig,
    pub tags: ResolveTags,
    pub coalesce: Option<Duration>,
    pub sync: SyncConfig,
}

impl std::fmt::Debug for PeerSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerSetup")
            .field("p2p", &self.p2p)
            .finish_non_exhaustive()
    }
}

impl PeerSetup {
    /// `None` (with a warning) when this host has no address other nodes could reach.
    pub fn from_settings(config: &Config, settings: &P2pSettings) -> Option<PeerSetup> {
        let data_dir = &config.data_dir;
        let picked = || {
            let chosen = crate::host_addr::reachable_ip()?;
            tracing::info!(ip = %chosen.ip, interface = %chosen.interface, why = chosen.why, "advertise address picked; set --advertise-addr to choose another");
            Some(chosen.ip)
        };
        let Some(advertise) = settings.advertise_addr.or_else(picked) else {
            tracing::warn!(
                "no address other nodes could reach (only loopback or link-local): peer-to-peer is off; set --advertise-addr"
            );
            return None;
        };
        if advertise.is_loopback() {
            tracing::warn!(%advertise, "advertising a loopback address: only peers on this host can reach it");
        }
        let peer_http_addr = settings
            .peer_addr
            .unwrap_or(SocketAddr::new(advertise, DEFAULT_PEER_PORT));
        let mut sources: Vec<Box<dyn Bootstrap>> = vec![Box::new(StaticBootstrap {
            addrs: settings.bootstrap_peers.clone(),
        })];
        if let Some(name) = &settings.bootstrap_dns {
            sources.push(Box::new(DnsBootstrap {
                name: name.clone(),
                port: settings.p2p_addr.port(),
            }));
        }
        Some(PeerSetup {
            p2p: P2pConfig {
                data_dir: data_dir.to_path_buf(),
                // A wildcard listen would make Kademlia announce every local address,
                // loopback included: listen on the advertised address instead.
                listen: if settings.p2p_addr.ip().is_unspecified() {
                    SocketAddr::new(advertise, settings.p2p_addr.port())
                } else {
                    settings.p2p_addr
                },
                advertise: Some(advertise),
                peer_http_addr,
                timing: ProvideTiming {
                    ttl: settings.provide_ttl,
                    interval: settings.reprovide_interval,
                    replicas: REPLICAS,
                },
                psk: config.cluster_secret.as_ref().map(|s| s.pnet_key()),
                simulated_latency: None,
                bootstrap_dials: settings.bootstrap_dials,
                idle_timeout: IDLE_CONNECTION_TIMEOUT,
            },
            bootstrap: Bootstraps(sources),
            bootstrap_configured: !settings.bootstrap_peers.is_empty()
                || settings.bootstrap_dns.is_some()
                || config.kubernetes.bootstrap_selector.is_some(),
            fetch: PeerFetchConfig {
                resolve_timeout: settings.resolve_timeout,
                resolve_timeout_max: settings.resolve_timeout_max,
                connect_timeout: settings.peer_connect_timeout,
                first_byte_timeout: settings.peer_first_byte_timeout,
                idle_timeout: settings.peer_idle_timeout,
                verify_before_serving: settings.verify_before_serving,
                zero_copy: settings.zero_copy,
            },
            tags: settings.resolve_tags,
            coalesce: settings.coalesce,
            sync: SyncConfig {
                registries: config.registries.clone(),
                filters: config.registry_filters.clone(),
                interval: settings.reprovide_interval,
            },
        })
    }
}

/// Serves on already-bound listeners until `shutdown`, then drains. The hosts.toml entries
/// are already written; they stay after shutdown (see the README: a stopped Ferry on
/// loopback is an instant connection refused, and containerd falls back at once).
pub async fn serve(
    config: Config,
    store: Arc<dyn ContentStore>,
    listeners: Listeners,
    peering: Peering,
    shutdown: impl Future<Output = ()>,
) {
    let metrics = Arc::new(Metrics::new());
    let readiness = Arc::new(Readiness::default());
    let problems = Arc::new(Problems::new(metrics.clone()));
    check_containerd_config(&config, &problems);
    readiness.listening.store(true, Ordering::Relaxed);
    readiness.hosts_written.store(true, Ordering::Relaxed);
    metrics.hosts_config_written.set(1);

    let token = CancellationToken::new();
    let tracker = TaskTracker::new();
    // Local files only (service account or KUBECONFIG): no request to the API server yet.
    let kube = if config.kubernetes.enabled() {
        match kubernetes::client().await {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::error!(error = %e, "no Kubernetes API client: no Kubernetes bootstrap, no ready taint removal");
                None
            }
        }
    } else {
        None
    };
    if let (Some(client), Some(node)) = (&kube, &config.kubernetes.node_name) {
        let taint = TaintConfig {
            node: node.clone(),
            key: config.kubernetes.ready_taint.clone(),
        };
        tracker.spawn(kubernetes::taint::remove_when_ready(
            client.clone(),
            taint,
            readiness.clone(),
            token.clone(),
        ));
        tracker.spawn(kubernetes::misconfigured::report(
            client.clone(),
            node.clone(),
            problems.clone(),
            token.clone(),
        ));
    }
    let peers = match peering {
        Peering::Off => None,
        Peering::P2p(mut setup) => {
            let kubernetes = kubernetes_bootstrap(&config, kube.as_ref(), &setup);
            let reporting = (&metrics, &problems);
            start_router(&mut setup, kubernetes, reporting, &token, &tracker).map(|router| {
                (
                    router,
                    setup.fetch,
                    (setup.tags, setup.coalesce),
                    setup.sync,
                )
            })
        }
        Peering::Router {
            router,
            fetch,
            tags,
            coalesce,
            sync,
        } => Some((router, fetch, (tags, coalesce), sync)),
    };
    let secret = config.cluster_secret.clone();
    // A client that cannot be built (it never happens in practice) leaves this node serving
    // its own content, said loudly, rather than silently with default timeouts.
    let lookup_times = config.data_dir.join(LOOKUP_TIMES_FILE);
    let fetcher = peers.as_ref().and_then(|(router, fetch, _, _)| {
        match PeerFetcher::new(
            router.clone(),
            *fetch,
            secret.clone(),
            metrics.clone(),
            store.clone(),
        ) {
            Ok(f) => Some(Arc::new(f.remembering(&lookup_times))),
            Err(e) => {
                tracing::error!(error = %e, "cannot build the peer HTTP client: peer-to-peer fetching is off");
                None
            }
        }
    });
    if let Some(fetcher) = &fetcher {
        tracker.spawn(keep_learnt(fetcher.clone(), lookup_times, token.clone()));
    }
    let (exposed_tx, exposed) = sync::exposure();
    let exposed_view = exposed.clone();
    let tags = peers
        .as_ref()
        .map_or(ResolveTags::Never, |(_, _, (tags, _), _)| *tags);
    let coalesce = match (&peers, &fetcher) {
        (Some((router, _, (_, Some(follow_timeout)), _)), Some(fetcher)) => {
            Some(Arc::new(Coalescer::new(
                router.clone(),
                store.clone(),
                CoalesceConfig {
                    follow_timeout: *follow_timeout,
                },
                metrics.clone(),
                fetcher.clone(),
            )))
        }
        _ => None,
    };
    let upstream = (fetcher.is_some() && tags == ResolveTags::WhenUpstreamFails)
        .then(|| watch_upstream(&config, &metrics, &token))
        .flatten();
    let recent = Arc::new(RecentPulls::default());
    let mirror = MirrorState {
        store: store.clone(),
        registries: config.registries.clone(),
        metrics: metrics.clone(),
        peers: fetcher.clone(),
        tags,
        upstream,
        filters: config.registry_filters.clone(),
        coalesce: coalesce.clone(),
        recent: recent.clone(),
    };
    spawn_server(
        &tracker,
        &token,
        "mirror",
        listeners.mirror,
        registry::mirror::router(mirror),
    );
    if let Some(listener) = listeners.peer {
        let peer_api = PeerApiState {
            store: store.clone(),
            registries: config.registries.clone(),
            metrics: metrics.clone(),
            secret,
            exposed,
            coalesce,
            integrity: peers.as_ref().map(|(router, _, _, _)| {
                Arc::new(Integrity::new(
                    store.clone(),
                    router.clone(),
                    metrics.clone(),
                ))
            }),
            zero_copy: peers
                .as_ref()
                .is_some_and(|(_, fetch, _, _)| fetch.zero_copy),
        };
        spawn_server(
            &tracker,
            &token,
            "peer",
            listener,
            registry::peer_api::router(peer_api),
        );
    }
    spawn_server(
        &tracker,
        &token,
        "ops",
        listeners.ops,
        ops::router(ops::Sources {
            readiness: readiness.clone(),
            metrics: metrics.clone(),
            problems: problems.clone(),
            recent,
            peers: peers.as_ref().map(|(router, _, _, _)| router.clone()),
            fetcher,
            exposed: peers.as_ref().map(|_| exposed_view),
            debug_page: config.debug_page,
            node: config.kubernetes.node_name.clone(),
        }),
    );
    if let Some((router, _, _, _)) = &peers {
        readiness
            .waiting_for_peers
            .store(!router.ready(), Ordering::Relaxed);
        tracker.spawn(watch_peers(
            router.clone(),
            readiness.clone(),
            problems.clone(),
            token.clone(),
        ));
    }
    if let (Some(path), Some(secret)) = (&config.cluster_secret_file, &config.cluster_secret) {
        tracker.spawn(watch_secret(
            path.clone(),
            secret.clone(),
            problems.clone(),
            token.clone(),
        ));
    }
    if let Some((router, _, _, sync_config)) = peers {
        tracker.spawn(sync::run(
            store.clone(),
            router,
            sync_config,
            metrics.clone(),
            exposed_tx,
            token.clone(),
        ));
    }
    tracker.spawn(refresh_hosts(
        config,
        store.clone(),
        problems.clone(),
        token.clone(),
    ));
    tracker.spawn(watch_containerd(
        store,
        readiness,
        metrics.clone(),
        token.clone(),
    ));
    tracker.close();

    shutdown.await;
    tracing::info!(
        grace_s = SHUTDOWN_GRACE.as_secs(),
        "shutting down: draining in-flight requests"
    );
    token.cancel();
    if tokio::time::timeout(SHUTDOWN_GRACE, tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!("grace period over; remaining requests are cut off");
    }
}

/// The lookup times the wait for a lookup comes from (`registry::peer::bound`), in the data
/// directory: a restarted node waits as it had learnt to.
const LOOKUP_TIMES_FILE: &str = "lookup-times";
/// How often they are kept while running (and once more at shutdown): a node that loses
/// power loses at most this much of what it learnt.
const KEEP_LEARNT_EVERY: Duration = Duration::from_secs(600);

async fn keep_learnt(fetcher: Arc<PeerFetcher>, path: PathBuf, token: CancellationToken) {
    loop {
        tokio::select! {
            () = token.cancelled() => break,
            () = tokio::time::sleep(KEEP_LEARNT_EVERY) => fetcher.keep_learnt(&path),
        }
    }
    fetcher.keep_learnt(&path);
}

/// Starts probing the upstream registries (`--resolve-tags when-upstream-fails`). Without it
/// (it cannot fail in practice) every registry counts as answering: tags go upstream.
fn watch_upstream(
    config: &Config,
    metrics: &Arc<Metrics>,
    token: &CancellationToken,
) -> Option<UpstreamWatch> {
    let watched = match &config.registries {
        Registries::Only(list) => list.clone(),
        Registries::All => Vec::new(),
    };
    let upstream = UpstreamConfig {
        hosts_dir: config.hosts_dir.clone(),
        mirror_url: config.mirror_url(),
        watched,
        interval: PROBE_INTERVAL,
        timeout: PROBE_TIMEOUT,
    };
    match UpstreamWatch::start(upstream, metrics.clone(), token.clone()) {
        Ok(watch) => Some(watch),
        Err(e) => {
            tracing::error!(error = %e, "tags always resolve upstream: the registries cannot be probed");
            None
        }
    }
}

/// Ferry's pods as a bootstrap source, when `--bootstrap-kubernetes` is set and there is an
/// API client (listed only while no peer is connected; see `kubernetes::bootstrap`).
fn kubernetes_bootstrap(
    config: &Config,
    client: Option<&kube::Client>,
    setup: &PeerSetup,
) -> Option<KubernetesBootstrap> {
    let selector = config.kubernetes.bootstrap_selector.as_deref()?;
    let client = client?;
    let namespace = kubernetes::namespace(config.kubernetes.namespace.as_deref(), client);
    tracing::info!(%namespace, %selector, "bootstrapping peers from the Kubernetes API");
    Some(KubernetesBootstrap::new(
        client.clone(),
        &namespace,
        selector,
        setup.p2p.listen.port(),
    ))
}

/// Starts the libp2p node. A failure (unreadable key, port in use) leaves Ferry serving this
/// node's content alone: the mirror matters more than the peers.
fn start_router(
    peers: &mut PeerSetup,
    kubernetes: Option<KubernetesBootstrap>,
    (metrics, problems): (&Arc<Metrics>, &Arc<Problems>),
    token: &CancellationToken,
    tracker: &TaskTracker,
) -> Option<Arc<dyn Router>> {
    let mut sources = std::mem::take(&mut peers.bootstrap);
    if let Some(k) = kubernetes {
        sources.0.push(Box::new(k));
    }
    let bootstrap: Arc<dyn Bootstrap> = Arc::new(sources);
    match P2pRouter::start(
        peers.p2p.clone(),
        bootstrap,
        peers.bootstrap_configured,
        metrics.clone(),
        problems.clone(),
        token.clone(),
    ) {
        Ok((router, task)) => {
            tracker.spawn(async move {
                let _ = task.await;
            });
            Some(Arc::new(router))
        }
        Err(e) => {
            tracing::error!(error = %e, "peer-to-peer is off: serving this node's content only");
            None
        }
    }
}

fn spawn_server(
    tracker: &TaskTracker,
    token: &CancellationToken,
    name: &'static str,
    listener: TcpListener,
    router: axum::Router,
) {
    let stop = token.clone();
    let listener = LimitedListener::new(listener, MAX_CONNECTIONS);
    let bounds = crate::server::Bounds {
        head_deadline: crate::server::HEAD_DEADLINE,
        in_flight: MAX_IN_FLIGHT,
    };
    tracing::debug!("{name} listener serving");
    tracker.spawn(crate::server::serve(listener, router, bounds, stop));
}

/// The kernel's queue of connections not yet accepted (capped by `net.core.somaxconn`). The
/// default of 128 overflows under a burst of connections at the connection limit, and an
/// overflowing queue drops the handshake's last packet: the client believes it is connected
/// while the server retries for seconds.
const LISTEN_BACKLOG: i32 = 4096;

/// Binds `addr`. The IPv6 wildcard `[::]` takes IPv4 connections too (whatever the host's
/// `net.ipv6.bindv6only`), so one value (the chart's) works on IPv4, IPv6 and dual-stack
/// nodes; on a host whose kernel has IPv6 turned off it falls back to `0.0.0.0`.
async fn bind(addr: SocketAddr) -> Result<TcpListener, AppError> {
    let err = |source| AppError::Bind { addr, source };
    match listen_on(addr) {
        Err(e) if addr.ip() == IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED) => {
            let v4 = SocketAddr::new(std::net::Ipv4Addr::UNSPECIFIED.into(), addr.port());
            let listener = listen_on(v4).map_err(|_| err(e))?;
            tracing::info!(%addr, %v4, "no IPv6 on this host: listening on IPv4 only");
            Ok(listener)
        }
        other => other.map_err(err),
    }
}

fn listen_on(addr: SocketAddr) -> std::io::Result<TcpListener> {
    use socket2::{Domain, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    if addr.is_ipv6() && addr.ip().is_unspecified() {
        socket.set_only_v6(false)?;
    }
    // As std's and tokio's own `bind`: a restarted Ferry rebinds at once.
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    socket.listen(LISTEN_BACKLOG)?;
    socket.set_nonblocking(true)?;
    TcpListener::from_std(socket.into())
}

/// Holds readiness back until the first peer is connected, for at most [`FIRST_PEER_WAIT`];
/// then keeps `no_peers` (see `problems.rs`) current for as long as the node runs.
async fn watch_peers(
    router: Arc<dyn crate::routing::Router>,
    readiness: Arc<Readiness>,
    problems: Arc<Problems>,
    token: CancellationToken,
) {
    let started = std::time::Instant::now();
    while !router.ready() && started.elapsed() < FIRST_PEER_WAIT {
        tokio::select! {
            _ = token.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(20)) => {}
        }
    }
    if router.ready() {
        tracing::info!(
            waited_ms = started.elapsed().as_millis() as u64,
            "first peer connected"
        );
    } else {
        tracing::info!(
            waited_s = FIRST_PEER_WAIT.as_secs(),
            "no peer connected although bootstrap names other nodes; ready anyway (the first node of a cluster has no one to find)"
        );
    }
    readiness.waiting_for_peers.store(false, Ordering::Relaxed);
    // From now on, no peer for long while bootstrap names other nodes is a problem to show
    // (the first node of a new cluster has it until the second one starts).
    let mut alone_since = (!router.ready()).then_some(started);
    loop {
        tokio::select! {
            _ = token.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        match (router.ready(), alone_since) {
            (true, Some(_)) => {
                alone_since = None;
                problems.clear("no_peers");
            }
            (false, None) => alone_since = Some(std::time::Instant::now()),
            (false, Some(since)) if since.elapsed() >= FIRST_PEER_WAIT => problems.set(
                "no_peers",
                format!(
                    "no peer connected for {} s although bootstrap names other nodes: this node pulls everything upstream. Check that the peer-to-peer port is open between nodes and that every node has the same cluster secret",
                    since.elapsed().as_secs()
                ),
            ),
            _ => {}
        }
    }
}

/// How often the cluster secret's file is read again: the kubelet updates a mounted Secret
/// within about a minute of a change.
const SECRET_CHECK: Duration = Duration::from_secs(30);

/// Makes a cluster secret that changed under this node visible. The node keeps the secret it
/// started with (switching would cut it off from every node that has not switched yet); the
/// nodes started since use the new one, and the two groups never talk: a silent split, which
/// is what a GitOps tool re-rendering the chart's generated secret causes.
async fn watch_secret(
    path: PathBuf,
    started_with: ClusterSecret,
    problems: Arc<Problems>,
    token: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = token.cancelled() => return,
            _ = tokio::time::sleep(SECRET_CHECK) => {}
        }
        match ClusterSecret::load(&path) {
            Ok(now) if now != started_with => problems.set(
                "cluster_secret_changed",
                format!(
                    "the cluster secret in {} changed since this node started; it keeps the old one, nodes started since use the new one, and the two never share. Restart every Ferry pod (kubectl rollout restart daemonset) so all use the new one; with GitOps (helm template), set clusterSecret.existingSecret so the secret stops changing",
                    path.display()
                ),
            ),
            Ok(_) => problems.clear("cluster_secret_changed"),
            // Unreadable for a moment (the kubelet swaps the file atomically): look again later.
            Err(_) => {}
        }
    }
}

/// Keeps readiness and `containerd_up` current; never exits on its own, whatever containerd
/// does, because Ferry must outlive containerd restarts.
async fn watch_containerd(
    store: Arc<dyn ContentStore>,
    readiness: Arc<Readiness>,
    metrics: Arc<Metrics>,
    token: CancellationToken,
) {
    let mut backoff = BACKOFF_MIN;
    let mut was_up: Option<bool> = None;
    loop {
        let up = store.healthy().await;
        readiness.containerd_up.store(up, Ordering::Relaxed);
        metrics.containerd_up.set(i64::from(up));
        if was_up != Some(up) {
            if up {
                tracing::info!("containerd is reachable");
            } else {
                tracing::warn!(
                    "containerd is not reachable; serving 404s and retrying with backoff"
                );
            }
            was_up = Some(up);
        }
        let wait = if up {
            backoff = BACKOFF_MIN;
            HEALTH_INTERVAL
        } else {
            let w = backoff;
            backoff = (backoff * 2).min(BACKOFF_MAX);
            w
        };
        tokio::select! {
            _ = token.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

/// What in containerd's own config makes Ferry useless on this node (`preflight`): each a
/// problem (a warning logged once as it appears, a line in `/readyz`, a metric), never a
/// reason to be unready; cleared once the config is fixed (looked at again every minute).
fn check_containerd_config(config: &Config, problems: &Problems) {
    let found = preflight::check(&config.containerd_config, &config.hosts_dir);
    for name in preflight::PROBLEMS {
        match found.iter().find(|w| w.problem == name) {
            Some(w) => problems.set(name, w.text.clone()),
            None => problems.clear(name),
        }
    }
}

async fn refresh_hosts(
    config: Config,
    store: Arc<dyn ContentStore>,
    problems: Arc<Problems>,
    token: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = token.cancelled() => return,
            _ = tokio::time::sleep(HOSTS_REFRESH_INTERVAL) => {}
        }
        check_containerd_config(&config, &problems);
        match configure_hosts(&config, store.as_ref()).await {
            Ok(outcomes) => report(&outcomes),
            Err(e) => tracing::warn!(error = %e, "re-merging the containerd hosts config failed"),
        }
    }
}

/// Writes Ferry's entry into every hosts.toml the registries need (`containerd_config`), in
/// the form the containerd behind `store` reads.
pub async fn configure_hosts(
    config: &Config,
    store: &dyn ContentStore,
) -> Result<Vec<Outcome>, containerd_config::dir::DirError> {
    let mirror_url = config.mirror_url();
    let ipv6 = ipv6_hosts(store, &mirror_url).await;
    containerd_config::configure(&config.hosts_dir, &config.registries, &mirror_url, ipv6)
}

/// How to write Ferry's hosts.toml entry when its URL holds an IPv6 address (see
/// `hosts::Ipv6Hosts`): containerd is asked its version only then; while it does not answer,
/// the form that works on every version.
async fn ipv6_hosts(store: &dyn ContentStore, mirror_url: &str) -> Ipv6Hosts {
    if !mirror_url.contains('[') {
        return Ipv6Hosts::default();
    }
    store
        .containerd_major()
        .await
        .map_or(Ipv6Hosts::default(), Ipv6Hosts::for_containerd)
}

/// Logs what a configure or cleanup did: changes at info, skipped files as warnings.
pub fn report(outcomes: &[Outcome]) {
    for o in outcomes {
        let path = o.path.display();
        match &o.action {
            Action::Unchanged => tracing::debug!(%path, "hosts.toml already up to date"),
            Action::Skipped(reason) => tracing::warn!(%path, "hosts.toml skipped: {reason}"),
            Action::Failed(reason) => tracing::error!(
                %path,
                "hosts.toml could not be written, left as it was (the other registries are configured): {reason}"
            ),
            action => tracing::info!(%path, ?action, "hosts.toml"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_ipv6_wildcard_takes_ipv4_and_ipv6_connections() {
        let listener = bind("[::]:0".parse().unwrap()).await.unwrap();
        let port = listener.local_addr().unwrap().port();
        for client in ["127.0.0.1", "::1"] {
            let to = SocketAddr::new(client.parse().unwrap(), port);
            let (connected, accepted) =
                tokio::join!(tokio::net::TcpStream::connect(to), listener.accept());
            connected.unwrap_or_else(|e| panic!("{to}: {e}"));
            accepted.unwrap();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_cluster_secret_changed_on_disk_is_a_problem_until_it_is_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster-secret");
        std::fs::write(&path, "the secret this node started with\n").unwrap();
        let secret = ClusterSecret::load(&path).unwrap();
        let problems = Arc::new(Problems::new(Arc::new(Metrics::new())));
        let token = CancellationToken::new();
        let watch = tokio::spawn(watch_secret(
            path.clone(),
            secret,
            problems.clone(),
            token.clone(),
        ));
        let after_a_check = || tokio::time::sleep(SECRET_CHECK + Duration::from_secs(1));

        after_a_check().await;
        assert!(problems.current().is_empty());
        // A GitOps re-render: a new random secret in the mounted file.
        std::fs::write(&path, "a secret generated by another render\n").unwrap();
        after_a_check().await;
        let now = problems.current();
        assert_eq!(now.len(), 1);
        assert_eq!(now[0].0, "cluster_secret_changed");
        assert!(now[0].1.contains("existingSecret"), "{}", now[0].1);
        // Put back (a rollback): the problem is gone.
        std::fs::write(&path, "the secret this node started with").unwrap();
        after_a_check().await;
        assert!(problems.current().is_empty());
        token.cancel();
        watch.await.unwrap();
    }
}
