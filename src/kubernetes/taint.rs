//! The node-ready taint (`ferry.dev/not-ready=:NoSchedule`), removed from this node once Ferry
//! is ready, so workloads are scheduled only when the mirror is live.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use tokio_util::sync::CancellationToken;

use super::events::{self, NodeEvent};
use crate::ops::Readiness;

/// How often readiness is checked before the taint can go.
const READY_POLL: Duration = Duration::from_millis(100);
const RETRY_MIN: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub(crate) struct TaintConfig {
    pub node: String,
    /// The taint key to remove; `None` leaves taints alone (the Event is still recorded).
    pub key: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Removed,
    NotTainted,
}

/// Waits until Ferry is ready, then removes the taint (retrying with backoff) and records an
/// Event. Nothing waits for it.
pub(crate) async fn remove_when_ready(
    client: kube::Client,
    config: TaintConfig,
    readiness: Arc<Readiness>,
    token: CancellationToken,
) {
    while !readiness.is_ready() {
        tokio::select! {
            _ = token.cancelled() => return,
            _ = tokio::time::sleep(READY_POLL) => {}
        }
    }
    let mut retry = RETRY_MIN;
    let outcome = loop {
        let attempt = match &config.key {
            Some(key) => remove(&client, &config.node, key).await,
            None => Ok(Outcome::NotTainted),
        };
        match attempt {
            Ok(outcome) => break outcome,
            Err(e) => {
                tracing::warn!(node = %config.node, error = %e, "cannot lift the ready taint yet; retrying")
            }
        }
        tokio::select! {
            _ = token.cancelled() => return,
            _ = tokio::time::sleep(retry) => {}
        }
        retry = (retry * 2).min(RETRY_MAX);
    };
    match outcome {
        Outcome::Removed => {
            tracing::info!(node = %config.node, key = ?config.key, "ready: node taint removed")
        }
        Outcome::NotTainted => {
            tracing::info!(node = %config.node, "ready (the node had no ferry taint)")
        }
    }
    if let Err(e) = record_event(&client, &config.node, outcome).await {
        tracing::warn!(node = %config.node, error = %e, "cannot record the ready event");
    }
}

/// Removes taints with `key`. The patch carries the node's resourceVersion, so a concurrent
/// change is refused and no one else's taint is ever lost.
pub(crate) async fn remove(
    client: &kube::Client,
    node: &str,
    key: &str,
) -> Result<Outcome, kube::Error> {
    let nodes: Api<Node> = Api::all(client.clone());
    let current = nodes.get(node).await?;
    let taints = current
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    if !taints.iter().any(|t| t.key == key) {
        return Ok(Outcome::NotTainted);
    }
    let kept: Vec<_> = taints.into_iter().filter(|t| t.key != key).collect();
    let patch = serde_json::json!({
        "metadata": { "resourceVersion": current.metadata.resource_version },
        "spec": { "taints": kept },
    });
    nodes
        .patch(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(Outcome::Removed)
}

async fn record_event(
    client: &kube::Client,
    node: &str,
    outcome: Outcome,
) -> Result<(), kube::Error> {
    let message = match outcome {
        Outcome::Removed => "Ferry mirror is ready; node-ready taint removed",
        Outcome::NotTainted => "Ferry mirror is ready",
    };
    let event = NodeEvent {
        reason: "FerryReady",
        type_: "Normal",
        message,
    };
    events::record(client, node, event).await
}
