//! The node's shared parts, and the steps of `serve` that build and start each one.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::SHUTDOWN_GRACE;
use super::setup::Peers;
use crate::coalesce::Coalescer;
use crate::config::Config;
use crate::kubernetes::{self, taint::TaintConfig};
use crate::metrics::Metrics;
use crate::net::{budget, listen};
use crate::ops::problems::Problems;
use crate::ops::{Readiness, watch};
use crate::registry::PeerFetcher;
use crate::registry::peer::LOOKUP_TIMES_FILE;
use crate::routing::sync;
use crate::store::ContentStore;

/// What every step shares.
pub(super) struct Node {
    pub store: Arc<dyn ContentStore>,
    pub metrics: Arc<Metrics>,
    pub readiness: Arc<Readiness>,
    pub problems: Arc<Problems>,
    pub token: CancellationToken,
    pub tracker: TaskTracker,
}

impl Node {
    /// The API client (no request yet), and the loops for the ready taint and Node events.
    pub(super) async fn kubernetes(&self, config: &Config) -> Option<kube::Client> {
        if !config.uses_kubernetes() {
            return None;
        }
        let client = match kubernetes::client().await {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, "no Kubernetes API client: no Kubernetes bootstrap, no ready taint removal");
                return None;
            }
        };
        if let Some(node) = &config.node_name {
            let taint = TaintConfig {
                node: node.clone(),
                key: config.ready_taint.clone(),
            };
            let (readiness, token) = (self.readiness.clone(), self.token.clone());
            let remove =
                kubernetes::taint::remove_when_ready(client.clone(), taint, readiness, token);
            self.tracker.spawn(remove);
            let (problems, token) = (self.problems.clone(), self.token.clone());
            let report =
                kubernetes::misconfigured::report(client.clone(), node.clone(), problems, token);
            self.tracker.spawn(report);
        }
        Some(client)
    }

    /// The peer client, with the lookup times an earlier run learnt. One that cannot be built
    /// leaves this node serving its own content, loudly, rather than with default timeouts.
    pub(super) fn fetcher(
        &self,
        config: &Config,
        peers: Option<&Peers>,
    ) -> Option<Arc<PeerFetcher>> {
        let peers = peers?;
        let secret = peers.secret.clone();
        let (metrics, store) = (self.metrics.clone(), self.store.clone());
        let fetcher = match PeerFetcher::new(
            peers.router.clone(),
            peers.fetch,
            secret,
            metrics,
            store,
        ) {
            Ok(f) => f,
            Err(e) => {
                tracing::error!(error = %e, "cannot build the peer HTTP client: peer-to-peer fetching is off");
                return None;
            }
        };
        let lookup_times = config.data_dir.join(LOOKUP_TIMES_FILE);
        let fetcher = Arc::new(fetcher.remembering(&lookup_times));
        let keep = fetcher
            .clone()
            .keep_learnt_until(lookup_times, self.token.clone());
        self.tracker.spawn(keep);
        Some(fetcher)
    }

    /// When `--coalesce` is on and peers can be asked.
    pub(super) fn coalescer(
        &self,
        peers: Option<&Peers>,
        fetcher: Option<&Arc<PeerFetcher>>,
    ) -> Option<Arc<Coalescer>> {
        let (peers, fetcher) = (peers?, fetcher?);
        let config = peers.coalesce.clone()?;
        let (store, metrics) = (self.store.clone(), self.metrics.clone());
        let claims = fetcher.clone();
        Some(Arc::new(Coalescer::new(
            peers.router.clone(),
            store,
            config,
            metrics,
            claims,
        )))
    }

    pub(super) fn spawn_server(
        &self,
        name: &'static str,
        listener: TcpListener,
        router: axum::Router,
        budget: (budget::Listener, axum::http::StatusCode),
    ) {
        listen::spawn(&self.tracker, &self.token, name, listener, router, budget);
    }

    /// The loops that keep readiness, problems and the DHT current.
    pub(super) fn spawn_loops(
        &self,
        config: &Config,
        peers: Option<Peers>,
        exposed: tokio::sync::watch::Sender<sync::Exposed>,
        held: Option<tokio::sync::watch::Receiver<sync::Held>>,
    ) {
        let (readiness, problems, token) = (&self.readiness, &self.problems, &self.token);
        if let Some(peers) = peers {
            if let (Some(path), Some(secret)) = (&config.cluster_secret_file, peers.secret) {
                let path = path.clone();
                let watched = watch::watch_secret(path, secret, problems.clone(), token.clone());
                self.tracker.spawn(watched);
            }
            let router = peers.router;
            readiness
                .waiting_for_peers
                .store(!router.ready(), Ordering::Relaxed);
            let first = watch::watch_peers(
                router.clone(),
                readiness.clone(),
                problems.clone(),
                token.clone(),
            );
            self.tracker.spawn(first);
            let store = self.store.clone();
            let metrics = self.metrics.clone();
            let config = sync::SyncConfig { held, ..peers.sync };
            let advertise = sync::run(store, router, config, metrics, exposed, token.clone());
            self.tracker.spawn(advertise);
        }
        let (store, metrics) = (self.store.clone(), self.metrics.clone());
        let health = watch::watch_containerd(store, readiness.clone(), metrics, token.clone());
        self.tracker.spawn(health);
    }

    /// Waits for `shutdown`, then lets in-flight requests finish for [`SHUTDOWN_GRACE`].
    pub(super) async fn drain(self, shutdown: impl Future<Output = ()>) {
        self.tracker.close();
        shutdown.await;
        tracing::info!(
            grace_s = SHUTDOWN_GRACE.as_secs(),
            "shutting down: draining in-flight requests"
        );
        self.token.cancel();
        if tokio::time::timeout(SHUTDOWN_GRACE, self.tracker.wait())
            .await
            .is_err()
        {
            tracing::warn!("grace period over; remaining requests are cut off");
        }
    }
}
