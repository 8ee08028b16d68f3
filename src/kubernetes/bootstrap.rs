//! Peers from the Kubernetes API: list and watch the pods of Ferry's DaemonSet by label, and
//! dial their IPs at the p2p port. With host networking a pod's IP is its node's.

use std::net::IpAddr;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use libp2p::Multiaddr;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::routing::bootstrap::{Bootstrap, tcp_multiaddr};

/// A live view of the DaemonSet's pods, kept by a list-then-watch that reconnects with
/// backoff on its own.
#[derive(Clone)]
pub struct KubernetesBootstrap {
    pods: Store<Pod>,
    port: u16,
}

impl std::fmt::Debug for KubernetesBootstrap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubernetesBootstrap")
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

impl KubernetesBootstrap {
    /// Starts watching pods matching `selector` in `namespace`; stops when `token` is cancelled.
    pub fn start(
        client: kube::Client,
        namespace: &str,
        selector: &str,
        port: u16,
        token: CancellationToken,
    ) -> (KubernetesBootstrap, JoinHandle<()>) {
        let api: Api<Pod> = Api::namespaced(client, namespace);
        let (pods, writer) = reflector::store();
        let config = watcher::Config::default().labels(selector);
        // Only what `pod_ips` reads is kept (name, deletion, IP): the rest of a pod (its spec,
        // managed fields, annotations) is several KiB, times every node of the cluster.
        let stream = watcher(api, config)
            .modify(slim)
            .reflect(writer)
            .default_backoff();
        let selector = selector.to_string();
        let task = tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            loop {
                tokio::select! {
                    _ = token.cancelled() => return,
                    event = stream.next() => match event {
                        Some(Ok(_)) => {}
                        Some(Err(e)) => tracing::warn!(%selector, error = %e, "watching ferry pods failed; retrying"),
                        None => return,
                    },
                }
            }
        });
        (KubernetesBootstrap { pods, port }, task)
    }

    /// The pod IPs known now.
    pub fn pod_ips(&self) -> Vec<IpAddr> {
        let mut ips: Vec<IpAddr> = self
            .pods
            .state()
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter_map(|p| p.status.as_ref()?.pod_ip.as_deref()?.parse().ok())
            .collect();
        ips.sort();
        ips.dedup();
        ips
    }
}

/// A pod reduced to what bootstrap reads.
fn slim(pod: &mut Pod) {
    pod.spec = None;
    pod.metadata.managed_fields = None;
    pod.metadata.annotations = None;
    pod.metadata.owner_references = None;
    if let Some(status) = pod.status.as_mut() {
        let ip = status.pod_ip.take();
        *status = Default::default();
        status.pod_ip = ip;
    }
}

#[async_trait::async_trait]
impl Bootstrap for KubernetesBootstrap {
    async fn peers(&self) -> Vec<Multiaddr> {
        self.pod_ips()
            .into_iter()
            .map(|ip| tcp_multiaddr(ip, self.port))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slim_pod_keeps_its_ip_and_drops_the_rest() {
        let mut pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "ferry-abc", "annotations": {"a": "b"}},
            "spec": {"containers": [{"name": "ferry", "image": "ferry"}]},
            "status": {"podIP": "10.0.0.7", "phase": "Running"}
        }))
        .unwrap();
        slim(&mut pod);
        assert_eq!(pod.metadata.name.as_deref(), Some("ferry-abc"));
        assert!(pod.spec.is_none() && pod.metadata.annotations.is_none());
        let status = pod.status.unwrap();
        assert_eq!(status.pod_ip.as_deref(), Some("10.0.0.7"));
        assert!(status.phase.is_none());
    }
}
