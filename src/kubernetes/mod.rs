//! Kubernetes: peer bootstrap from the DaemonSet's pods, the node-ready taint, node events and
//! the uninstall hook's wait. The API server is reached without cluster DNS (which waits for
//! the CNI). Invariant: nothing here is on the mirror's path; a slow API server delays no pull.

pub(crate) mod bootstrap;
pub mod cleanup_wait;
pub(crate) mod events;
pub(crate) mod misconfigured;
pub(crate) mod taint;

/// A client from the in-cluster configuration or `KUBECONFIG`. Reads local files only.
pub async fn client() -> Result<kube::Client, kube::Error> {
    // rustls cannot pick a provider from the enabled features; ring is already built for libp2p.
    let _ = rustls::crypto::ring::default_provider().install_default();
    kube::Client::try_default().await
}

/// The namespace of Ferry's pods: configured, else the client's default.
pub fn namespace(configured: Option<&str>, client: &kube::Client) -> String {
    configured.map_or_else(|| client.default_namespace().to_string(), str::to_string)
}
