//! Wiring. Start-up runs in fixed steps, in the order that makes Ferry useful soonest: bind the
//! mirror, write the hosts.toml entries, bind ops, start peering, serve, drain. Invariant: this
//! module only builds values from the settings; each loop lives in the room owning its state.

mod hosts;
mod node;
mod setup;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use hosts::{configure_hosts, report};
pub use setup::{Listeners, PeerSetup, Peering, Stores};

use crate::config::Config;
use crate::containerd_config;
use crate::keep::Keeper;
use crate::metrics::Metrics;
use crate::net::budget::Budgets;
use crate::net::listen;
use crate::net::pace::Pace;
use crate::ops::problems::Problems;
use crate::ops::{self, Readiness};
use crate::registry::integrity::Integrity;
use crate::registry::recent::RecentPulls;
use crate::registry::{self, MirrorState, PeerApiState, ResolveTags, UpstreamWatch};
use crate::routing::sync;
use crate::store::containerd::ContainerdStore;
use crate::store::{ContentStore, Holder};
use crate::trust::{ClusterSecret, SecretError};
use node::Node;

/// How long in-flight requests may run on after SIGTERM before they are cut off.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

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
    /// Named like a configuration error: the file is a setting's value.
    #[error("cluster-secret-file: {0}")]
    Secret(#[from] SecretError),
}

/// Runs the daemon until `shutdown` resolves.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), AppError> {
    let started = Instant::now();
    let secret = match &config.cluster_secret_file {
        Some(path) => {
            let secret = ClusterSecret::load(path)?;
            warn_if_shared(path);
            Some(secret)
        }
        None => None,
    };
    let mirror = bind(config.mirror_addr)?;
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
    report(&configure_hosts(&config, store.as_ref()).await?);
    tracing::info!(
        mirror = %config.mirror_url(),
        hosts_dir = %config.hosts_dir.display(),
        elapsed_us = started.elapsed().as_micros() as u64,
        "mirror listening and containerd hosts config written"
    );
    let ops = bind(config.metrics_addr)?;
    let (peering, peer) = bind_peers(&config, secret);
    let listeners = Listeners { mirror, peer, ops };
    let holder: Arc<dyn Holder> = Arc::new(ContainerdStore::new(
        config.containerd_socket.clone(),
        config.containerd_namespace.clone(),
        config.containerd_content_dir.clone(),
    ));
    let stores = Stores {
        content: store,
        holder: Some(holder),
    };
    serve(config, stores, listeners, peering, shutdown).await;
    Ok(())
}

fn bind(addr: SocketAddr) -> Result<TcpListener, AppError> {
    listen::bind(addr).map_err(|source| AppError::Bind { addr, source })
}

/// If the peer listener cannot be bound, this node serves its own content rather than nothing.
fn bind_peers(config: &Config, secret: Option<ClusterSecret>) -> (Peering, Option<TcpListener>) {
    let setup = config.p2p.then(|| PeerSetup::from_settings(config, secret));
    let Some(setup) = setup.flatten() else {
        return (Peering::Off, None);
    };
    let addr = setup.p2p.peer_http_addr;
    match bind(addr) {
        Ok(listener) => {
            if setup.secret.is_some() {
                tracing::info!(peer_addr = %addr, "private peer network: peers need the cluster secret");
            } else {
                tracing::warn!(
                    peer_addr = %addr,
                    "NO CLUSTER SECRET: the peer address serves this node's shared images to anyone who can reach it, and anyone can join the peer network; set --cluster-secret-file"
                );
            }
            (Peering::P2p(Box::new(setup)), Some(listener))
        }
        Err(e) => {
            tracing::error!(error = %e, "peer-to-peer is off: serving this node's content only");
            (Peering::Off, None)
        }
    }
}

/// Serves on already-bound listeners until `shutdown`, then drains. The hosts.toml entries stay:
/// a stopped Ferry on loopback is an instant refusal, and containerd falls back at once.
pub async fn serve(
    config: Config,
    stores: Stores,
    listeners: Listeners,
    peering: Peering,
    shutdown: impl Future<Output = ()>,
) {
    let metrics = Arc::new(Metrics::new());
    let holder = stores.holder;
    let node = Node {
        store: stores.content,
        problems: Arc::new(Problems::new(metrics.clone())),
        metrics,
        readiness: Arc::new(Readiness::default()),
        token: CancellationToken::new(),
        tracker: TaskTracker::new(),
    };
    hosts::check_containerd_config(&config, &node.problems);
    let budgets = Budgets::for_this_process();
    tracing::info!(open_files = budgets.open_files, "open-file limit");
    if let Some(detail) = budgets.shortfall() {
        node.problems.set("open_file_limit", detail);
    }
    node.readiness.listening.store(true, Ordering::Relaxed);
    node.readiness.hosts_written.store(true, Ordering::Relaxed);
    node.metrics.hosts_config_written.set(1);

    let kube = node.kubernetes(&config).await;
    let reporting = (&node.metrics, &node.problems);
    let peers = peering.start(
        &config,
        kube.as_ref(),
        reporting,
        &node.token,
        &node.tracker,
    );
    let copies = peers.as_ref().map(|p| setup::copies(p.router.clone()));
    let keep = setup::keeper(&config, holder, node.store.clone(), copies, &node.metrics);
    if let Some(keep) = &keep {
        keep.containerd_discards_layers(hosts::discards_layers(&config));
    }
    let fetcher = node.fetcher(&config, peers.as_ref());
    let recent = Arc::new(RecentPulls::default());
    let (exposed_tx, exposed) = sync::exposure();
    let coalesce = node.coalescer(peers.as_ref(), fetcher.as_ref());
    let tags = peers.as_ref().map_or(ResolveTags::Never, |p| p.tags);
    let upstream = (fetcher.is_some() && tags == ResolveTags::WhenUpstreamFails)
        .then(|| {
            let (hosts_dir, url) = (config.hosts_dir.clone(), config.mirror_url());
            let (metrics, token) = (node.metrics.clone(), node.token.clone());
            let store = node.store.clone();
            UpstreamWatch::watch(&config.registries, hosts_dir, url, store, metrics, token)
        })
        .flatten();
    let mirror = MirrorState {
        store: node.store.clone(),
        registries: config.registries.clone(),
        metrics: node.metrics.clone(),
        peers: fetcher.clone(),
        tags,
        upstream,
        filters: config.registry_filters.clone(),
        coalesce: coalesce.clone(),
        recent: recent.clone(),
        keep: keep.clone(),
    };
    // A request without a slot gets a 404: containerd and peers go to their next source.
    let mirror_router = registry::mirror::router(mirror);
    let mirror_budget = (budgets.mirror, StatusCode::NOT_FOUND);
    node.spawn_server("mirror", listeners.mirror, mirror_router, mirror_budget);
    if let Some(listener) = listeners.peer {
        let peer_api = PeerApiState {
            store: node.store.clone(),
            registries: config.registries.clone(),
            metrics: node.metrics.clone(),
            secret: peers.as_ref().and_then(|p| p.secret.clone()),
            exposed: exposed.clone(),
            coalesce: coalesce.clone(),
            integrity: peers.as_ref().map(|p| {
                let (store, metrics) = (node.store.clone(), node.metrics.clone());
                Arc::new(Integrity::new(store, p.router.clone(), metrics))
            }),
            zero_copy: peers.as_ref().is_some_and(|p| p.fetch.zero_copy),
            upload_limit: config
                .peer_upload_limit
                .map(|rate| Arc::new(Pace::new(rate))),
            keep: keep.clone(),
        };
        let peer_budget = (budgets.peer, StatusCode::NOT_FOUND);
        node.spawn_server(
            "peer",
            listener,
            registry::peer_api::router(peer_api),
            peer_budget,
        );
    }
    let sources = ops::Sources {
        keep: keep.clone(),
        readiness: node.readiness.clone(),
        metrics: node.metrics.clone(),
        problems: node.problems.clone(),
        recent,
        peers: peers.as_ref().map(|p| p.router.clone()),
        fetcher,
        exposed: peers.as_ref().map(|_| exposed),
        coalesce,
        debug_page: config.debug_page,
        node: config.node_name.clone(),
    };
    let ops_budget = (budgets.ops, StatusCode::SERVICE_UNAVAILABLE);
    node.spawn_server("ops", listeners.ops, ops::router(sources), ops_budget);
    let held = keep.as_ref().map(Keeper::landed);
    node.spawn_loops(&config, peers, exposed_tx, held);
    node.tracker.spawn(hosts::refresh_hosts(
        config,
        node.store.clone(),
        node.problems.clone(),
        node.token.clone(),
    ));
    node.drain(shutdown).await;
}

/// The secret file should be Ferry's alone (the chart mounts it 0400): anyone who reads it
/// joins the peer network and reads what every node shares.
fn warn_if_shared(path: &std::path::Path) {
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(path).map_or(0, |m| m.permissions().mode() & 0o777);
    if mode & 0o077 != 0 {
        tracing::warn!(
            path = %path.display(),
            mode = format!("{mode:o}"),
            "the cluster secret file is readable by other users: chmod 0600 it"
        );
    }
}
