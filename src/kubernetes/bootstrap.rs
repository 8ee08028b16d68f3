//! Peers from the Kubernetes API: the pods of Ferry's DaemonSet by label, dialled at the p2p
//! port. With host networking a pod's IP is its node's.
//!
//! Listed when needed, never watched. Bootstrap needs addresses only while this node has no
//! peer (at start, or after losing every one), and then only a few of them
//! (`--bootstrap-dials`): Kademlia finds the rest. A watch on every node would send every
//! change of every Ferry pod to every node for as long as they run (at 1,000 nodes, a rollout
//! is a million pod events), for a list read a few seconds in a node's life. Pod metadata
//! alone (a metadata-only watch) would not do: a pod's IP is in its status.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use libp2p::Multiaddr;

use crate::routing::bootstrap::{Bootstrap, tcp_multiaddr};

/// A list naming other nodes stands this long: redials while no peer answers (backing off
/// from 50 ms, see the peer-to-peer event loop) use it, and a node that stays alone lists
/// again after it, for pods that came since.
const LIST_FRESH: Duration = Duration::from_secs(30);
/// A list naming no other node (the first pods of a new DaemonSet list before the others have
/// an IP), or a failed one, is asked again after this long.
const LIST_RETRY: Duration = Duration::from_secs(5);
/// A list that takes longer is given up (and retried after [`LIST_RETRY`]): a node without
/// the API server still serves its own content, and bootstrap has other sources.
const LIST_TIMEOUT: Duration = Duration::from_secs(10);

/// The DaemonSet's pods, listed at most once per [`LIST_FRESH`] (or [`LIST_RETRY`]), only
/// when asked.
pub(crate) struct KubernetesBootstrap {
    api: Api<Pod>,
    selector: String,
    port: u16,
    /// The last list: when it was asked, whether it answered, and the pod IPs it named. Held
    /// across a list, so that resolutions started while one is slow (the event loop looks
    /// again every 50 ms at first) wait for its answer instead of listing again.
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
    /// Pods matching `selector` in `namespace`, dialled at `port`. Asks the API nothing yet.
    pub(crate) fn new(client: kube::Client, namespace: &str, selector: &str, port: u16) -> Self {
        KubernetesBootstrap {
            api: Api::namespaced(client, namespace),
            selector: selector.to_string(),
            port,
            last: tokio::sync::Mutex::new(None),
        }
    }

    /// The pod IPs: the last list's while it stands, else a new list's.
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
        // `resourceVersion=0` ("any"): served from the API server's cache, not from etcd.
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

/// The IPs of pods not being deleted, sorted, each once.
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
