//! The loops that keep readiness and problems current: peers, the cluster secret's file,
//! containerd's health. Invariant: each runs until its token is cancelled, never giving up.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::Readiness;
use super::problems::Problems;
use crate::metrics::Metrics;
use crate::routing::ContentRouting;
use crate::store::ContentStore;
use crate::trust::secret::ClusterSecret;

/// How long readiness waits for a first peer: long enough for a new pool's nodes to find each
/// other, short enough for a cluster's first node, which has no one to find.
pub(crate) const FIRST_PEER_WAIT: Duration = Duration::from_secs(15);
/// How often a reachable containerd is probed; a restart is noticed within this.
const HEALTH_INTERVAL: Duration = Duration::from_secs(2);
/// Reconnect backoff while containerd is down, capped so recovery is noticed quickly.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Holds readiness back until the first peer, for at most [`FIRST_PEER_WAIT`]; then keeps
/// `no_peers` current.
pub(crate) async fn watch_peers(
    router: Arc<dyn ContentRouting>,
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

/// The kubelet updates a mounted Secret within about a minute of a change.
const SECRET_CHECK: Duration = Duration::from_secs(30);

/// Reports a cluster secret changed on disk. The node keeps the one it started with (switching
/// would cut it off from every node not yet switched), so the cluster is silently split.
pub(crate) async fn watch_secret(
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
            // Unreadable for a moment while the kubelet swaps the file: look again later.
            Err(_) => {}
        }
    }
}

/// Keeps readiness and `containerd_up` current; never exits, to outlive containerd restarts.
pub(crate) async fn watch_containerd(
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

#[cfg(test)]
mod tests {
    use super::*;

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
        std::fs::write(&path, "a secret generated by another render\n").unwrap();
        after_a_check().await;
        let now = problems.current();
        assert_eq!(now.len(), 1);
        assert_eq!(now[0].0, "cluster_secret_changed");
        assert!(now[0].1.contains("existingSecret"), "{}", now[0].1);
        // Put back: the problem is gone.
        std::fs::write(&path, "the secret this node started with").unwrap();
        after_a_check().await;
        assert!(problems.current().is_empty());
        token.cancel();
        watch.await.unwrap();
    }
}
