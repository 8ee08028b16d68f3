//! `ferry wait-cleanup`, the uninstall hook's Job: waits until the cleanup DaemonSet has run on
//! every node. Invariant: Helm deletes hook objects only on success, so a wait that ends any
//! other way deletes the DaemonSet itself.

use std::future::Future;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::DaemonSet;
use kube::Api;
use kube::api::DeleteParams;

#[derive(Debug, Clone)]
pub struct WaitSettings {
    pub namespace: String,
    pub daemonset: String,
    pub timeout: Duration,
    pub poll: Duration,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finished {
    /// Cleaned on every node it was scheduled on; Helm deletes the DaemonSet.
    Done,
    /// Not done in time, or told to stop: the DaemonSet was deleted here.
    GaveUp,
}

/// Waits until the DaemonSet has run on every scheduled node; at the timeout or `stop`, deletes
/// it. API errors are retried until the timeout.
pub async fn wait(
    client: kube::Client,
    settings: &WaitSettings,
    stop: impl Future<Output = ()>,
) -> Result<Finished, kube::Error> {
    let api: Api<DaemonSet> = Api::namespaced(client, &settings.namespace);
    let name = settings.daemonset.as_str();
    let deadline = Instant::now() + settings.timeout;
    tokio::pin!(stop);
    loop {
        match api.get(name).await {
            Ok(ds) if rolled_out(&ds) => {
                tracing::info!(daemonset = name, "cleanup has run on every node");
                return Ok(Finished::Done);
            }
            Ok(ds) => {
                tracing::info!(daemonset = name, progress = %progress(&ds), "waiting for cleanup")
            }
            Err(e) => {
                tracing::warn!(daemonset = name, error = %e, "cannot read the cleanup DaemonSet; retrying")
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            tracing::error!(
                daemonset = name,
                timeout_s = settings.timeout.as_secs(),
                "cleanup did not finish on every node in time"
            );
            break;
        }
        tokio::select! {
            () = &mut stop => {
                tracing::warn!(daemonset = name, "stopped before cleanup finished");
                break;
            }
            () = tokio::time::sleep(settings.poll.min(left)) => {}
        }
    }
    api.delete(name, &DeleteParams::background()).await?;
    tracing::info!(
        daemonset = name,
        "deleted the cleanup DaemonSet, so it does not stay on the nodes"
    );
    Ok(Finished::GaveUp)
}

/// Every scheduled node runs the current template and is ready (`ferry cleanup`, its init
/// container, has finished). A DaemonSet scheduled nowhere is done.
fn rolled_out(ds: &DaemonSet) -> bool {
    let Some(status) = &ds.status else {
        return false;
    };
    let current = status.observed_generation >= ds.metadata.generation;
    let desired = status.desired_number_scheduled;
    current
        && status.updated_number_scheduled.unwrap_or(0) >= desired
        && status.number_ready >= desired
}

fn progress(ds: &DaemonSet) -> String {
    ds.status.as_ref().map_or_else(
        || "no status yet".to_string(),
        |s| {
            format!(
                "{}/{} nodes cleaned",
                s.number_ready, s.desired_number_scheduled
            )
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::apps::v1::DaemonSetStatus;
    use kube::api::ObjectMeta;

    fn ds(generation: i64, observed: i64, desired: i32, updated: i32, ready: i32) -> DaemonSet {
        DaemonSet {
            metadata: ObjectMeta {
                generation: Some(generation),
                ..ObjectMeta::default()
            },
            status: Some(DaemonSetStatus {
                observed_generation: Some(observed),
                desired_number_scheduled: desired,
                updated_number_scheduled: Some(updated),
                number_ready: ready,
                ..DaemonSetStatus::default()
            }),
            ..DaemonSet::default()
        }
    }

    #[test]
    fn done_only_when_every_scheduled_node_is_ready_on_the_current_template() {
        assert!(rolled_out(&ds(1, 1, 3, 3, 3)));
        assert!(rolled_out(&ds(1, 1, 0, 0, 0)), "scheduled nowhere");
        assert!(!rolled_out(&ds(1, 1, 3, 3, 2)), "one node not cleaned");
        assert!(
            !rolled_out(&ds(2, 1, 3, 3, 3)),
            "status of an older template"
        );
        assert!(!rolled_out(&ds(1, 1, 3, 2, 3)), "one node on an old pod");
        assert!(!rolled_out(&DaemonSet::default()), "no status yet");
    }
}
