//! Wiring. Start-up runs in fixed steps, in the order that makes Ferry useful soonest:
//!
//! 1. bind the mirror address;
//! 2. write the hosts.toml entries (containerd now pulls through Ferry; a miss is a fast 404);
//! 3. bind the ops address;
//! 4. spawn the servers and the containerd watcher, which never gives up;
//! 5. on shutdown, drain within a grace period.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::containerd_config::{self, Action, Outcome, preflight};
use crate::metrics::Metrics;
use crate::ops::{self, Readiness};
use crate::registry::{self, RegistryState};
use crate::store::ContentStore;
use crate::store::containerd::ContainerdStore;

/// How long in-flight requests may run on after SIGTERM before they are cut off.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);
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
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write the containerd hosts config: {0}")]
    Hosts(#[from] containerd_config::dir::DirError),
}

/// Runs the daemon until `shutdown` resolves.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), AppError> {
    let started = Instant::now();
    let mirror = bind(config.mirror_addr).await?;
    let outcomes =
        containerd_config::configure(&config.hosts_dir, &config.registries, &config.mirror_url())?;
    report(&outcomes);
    tracing::info!(
        mirror = %config.mirror_url(),
        hosts_dir = %config.hosts_dir.display(),
        elapsed_us = started.elapsed().as_micros() as u64,
        "mirror listening and containerd hosts config written"
    );
    let ops_listener = bind(config.metrics_addr).await?;
    for warning in preflight::check(&config.containerd_config, &config.hosts_dir) {
        tracing::warn!("{warning}");
    }
    let store: Arc<dyn ContentStore> = Arc::new(ContainerdStore::new(
        config.containerd_socket.clone(),
        config.containerd_namespace.clone(),
        config.containerd_content_dir.clone(),
    ));
    serve(config, store, mirror, ops_listener, shutdown).await;
    Ok(())
}

/// Serves on already-bound listeners until `shutdown`, then drains. The hosts.toml entries
/// are already written; they stay after shutdown (see the README: a stopped Ferry on
/// loopback is an instant connection refused, and containerd falls back at once).
pub async fn serve(
    config: Config,
    store: Arc<dyn ContentStore>,
    mirror: TcpListener,
    ops_listener: TcpListener,
    shutdown: impl Future<Output = ()>,
) {
    let metrics = Arc::new(Metrics::new());
    let readiness = Arc::new(Readiness::default());
    readiness.listening.store(true, Ordering::Relaxed);
    readiness.hosts_written.store(true, Ordering::Relaxed);
    metrics.hosts_config_written.set(1);

    let token = CancellationToken::new();
    let tracker = TaskTracker::new();
    let registry = registry::router(RegistryState {
        store: store.clone(),
        registries: config.registries.clone(),
        metrics: metrics.clone(),
    });
    let stop = token.clone();
    tracker.spawn(async move {
        let server = axum::serve(mirror, registry).with_graceful_shutdown(stop.cancelled_owned());
        if let Err(e) = server.await {
            tracing::error!(error = %e, "mirror server failed");
        }
    });
    let stop = token.clone();
    let ops_router = ops::router(readiness.clone(), metrics.clone());
    tracker.spawn(async move {
        let server =
            axum::serve(ops_listener, ops_router).with_graceful_shutdown(stop.cancelled_owned());
        if let Err(e) = server.await {
            tracing::error!(error = %e, "ops server failed");
        }
    });
    tracker.spawn(watch_containerd(
        store,
        readiness,
        metrics.clone(),
        token.clone(),
    ));
    tracker.spawn(refresh_hosts(config, token.clone()));
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

async fn bind(addr: SocketAddr) -> Result<TcpListener, AppError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| AppError::Bind { addr, source })
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

async fn refresh_hosts(config: Config, token: CancellationToken) {
    loop {
        tokio::select! {
            _ = token.cancelled() => return,
            _ = tokio::time::sleep(HOSTS_REFRESH_INTERVAL) => {}
        }
        match containerd_config::configure(
            &config.hosts_dir,
            &config.registries,
            &config.mirror_url(),
        ) {
            Ok(outcomes) => report(&outcomes),
            Err(e) => tracing::warn!(error = %e, "re-merging the containerd hosts config failed"),
        }
    }
}

/// Logs what a configure or cleanup did: changes at info, skipped files as warnings.
pub fn report(outcomes: &[Outcome]) {
    for o in outcomes {
        let path = o.path.display();
        match &o.action {
            Action::Unchanged => tracing::debug!(%path, "hosts.toml already up to date"),
            Action::Skipped(reason) => tracing::warn!(%path, "hosts.toml skipped: {reason}"),
            action => tracing::info!(%path, ?action, "hosts.toml"),
        }
    }
}
