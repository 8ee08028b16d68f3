//! Kubernetes: peer bootstrap from the pods of Ferry's DaemonSet, the node-ready taint, events
//! on the node (ready; each configuration problem with its fix), and the uninstall hook's wait
//! (`ferry wait-cleanup`).
//!
//! The API server is reached the standard way (in-cluster service account, or `KUBECONFIG`),
//! never through cluster DNS, which runs in the pod network and waits for the CNI like
//! everything else. Nothing here is on the mirror's path: the API server being down or slow
//! delays neither the hosts.toml entries nor a single pull.

pub(crate) mod bootstrap;
pub mod cleanup_wait;
pub(crate) mod events;
pub(crate) mod misconfigured;
pub(crate) mod taint;

/// A client from the in-cluster configuration or `KUBECONFIG`. Reads local files only.
pub async fn client() -> Result<kube::Client, kube::Error> {
    // rustls needs one process-wide crypto provider and cannot pick one from the features the
    // dependency tree enables, so choose ring (libp2p already builds it). Twice is harmless.
    let _ = rustls::crypto::ring::default_provider().install_default();
    kube::Client::try_default().await
}

/// The namespace to look for Ferry's pods in: configured, else the client's default (the
/// pod's own namespace in-cluster, the context's with a kubeconfig).
pub fn namespace(configured: Option<&str>, client: &kube::Client) -> String {
    configured.map_or_else(|| client.default_namespace().to_string(), str::to_string)
}
