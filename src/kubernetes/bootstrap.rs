//! Peers from the Kubernetes API: the DaemonSet's pods by label, dialled at the p2p port (with
//! host networking a pod's IP is its node's). Invariant: listed only while this node has no
//! peer, never watched, since a watch on every node sends every pod change to every node.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use libp2p::Multiaddr;

use crate::routing::bootstrap::{Bootstrap, tcp_multiaddr};

/// A list naming other nodes stands this long for redials; a node still alone lists again.
const LIST_FRESH: Duration = Duration::from_secs(30);
/// A list naming no other node (the others may have no IP yet), or a failed one, is retried
/// after this long.
const LIST_RETRY: Duration = Duration::from_secs(5);
/// A list that takes longer is given up: bootstrap has other sources.
const LIST_TIMEOUT: Duration = Duration::from_secs(10);

/// The DaemonSet's pods, listed only when asked, at most once per [`LIST_FRESH`].
pub(crate) struct KubernetesBootstrap {
    api: Api<Pod>,
    selector: String,
    port: u16,
    /// The last list (when, answered, IPs); held across a list so concurrent callers wait.
    last: tokio::sync::Mutex<Option<(Instant, bool, Vec<IpAddr>)>>,
}

impl std::fmt::Debug for KubernetesBootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubernetesBootstrap")
            .field("selector", &self.selector)
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

impl KubernetesBootstrap {
    /// Asks the API nothing yet.
    pub(crate) fn new(client: kube::Client, namespace: &str, selector: &str, port: u16) -> Self {
        KubernetesBootstrap {
            api: Api::namespaced(client, namespace),
            selector: selector.to_string(),
            port,
            last: tokio::sync::Mutex::new(None),
        }
    }

    pub(crate) async fn pod_ips(&self) -> Vec<IpAddr> {
        let mut last = self.last.lock().await;
        if let Some((at, answered, ips)) = last.as_ref() {
            let stands = if *answered && ips.len() > 1 {
                LIST_FRESH
            } else {
                LIST_RETRY
            };
            if at.elapsed() < stands {
                return ips.clone();
            }
        }
        // `resourceVersion=0`: served from the API server's cache, not from etcd.
        let params = ListParams::default().labels(&self.selector).match_any();
        let listed = tokio::time::timeout(LIST_TIMEOUT, self.api.list(&params)).await;
        let previous = last.take().map(|(_, _, ips)| ips).unwrap_or_default();
        let (answered, ips) = match listed {
            Ok(Ok(list)) => (true, pod_ips(&list.items)),
            Ok(Err(e)) => {
                tracing::warn!(selector = %self.selector, error = %e, "listing ferry pods failed; retrying in 5 s");
                (false, previous)
            }
            Err(_) => {
                tracing::warn!(selector = %self.selector, "listing ferry pods timed out; retrying in 5 s");
                (false, previous)
            }
        };
        *last = Some((Instant::now(), answered, ips.clone()));
        ips
    }
}

fn pod_ips(pods: &[Pod]) -> Vec<IpAddr> {
    let mut ips: Vec<IpAddr> = pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| p.status.as_ref()?.pod_ip.as_deref()?.parse().ok())
        .collect();
    ips.sort();
    ips.dedup();
    ips
}

#[async_trait::async_trait]
impl Bootstrap for KubernetesBootstrap {
    async fn peers(&self) -> Vec<Multiaddr> {
        self.pod_ips()
            .await
            .into_iter()
            .map(|ip| tcp_multiaddr(ip, self.port))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_being_deleted_or_without_an_ip_are_not_dialled() {
        let pods: Vec<Pod> = serde_json::from_value(serde_json::json!([
            {"metadata": {"name": "a"}, "status": {"podIP": "10.0.0.7"}},
            {"metadata": {"name": "b"}, "status": {"podIP": "10.0.0.7"}},
            {"metadata": {"name": "c", "deletionTimestamp": "2026-01-01T00:00:00Z"},
             "status": {"podIP": "10.0.0.8"}},
            {"metadata": {"name": "d"}, "status": {}},
            {"metadata": {"name": "e"}, "status": {"podIP": "not an ip"}},
            {"metadata": {"name": "f"}, "status": {"podIP": "10.0.0.2"}}
        ]))
        .unwrap();
        let want: Vec<IpAddr> = vec!["10.0.0.2".parse().unwrap(), "10.0.0.7".parse().unwrap()];
        assert_eq!(pod_ips(&pods), want);
    }
}
