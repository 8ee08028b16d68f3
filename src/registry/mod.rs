//! The registry API (the pull subset of the OCI distribution spec) that containerd pulls
//! through: one handler for everything under `/v2/`, errors translated in `error.rs`.

mod error;
mod handlers;
mod local;
pub mod peer_fetch;
mod resume;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use axum::Router;

use crate::config::Registries;
use crate::metrics::Metrics;
use crate::routing::sync::Exposed;
use crate::store::ContentStore;
use crate::trust::ClusterSecret;
use tokio::sync::watch;

pub use error::ApiError;
pub use peer_fetch::PeerFetcher;

/// Set on requests one Ferry makes to another: the receiver answers from its own store only,
/// so a request is never forwarded twice and two nodes can never loop.
pub const HOP_HEADER: &str = "x-ferry-hop";

/// What the handlers need; shared read-only by every request.
#[derive(Clone)]
pub struct RegistryState {
    pub store: Arc<dyn ContentStore>,
    pub registries: Registries,
    pub metrics: Arc<Metrics>,
    /// Other nodes, asked on a local miss. `None` on the peer address (local content only)
    /// and when peer-to-peer is off.
    pub peers: Option<Arc<PeerFetcher>>,
    /// Set on the peer address only: who may ask, and what may be served to them.
    pub guard: Option<PeerGuard>,
}

/// The peer address's rules: a valid token when the cluster has a secret, and only what this
/// node advertises (so `--registries` and `--registry-filters` hold for serving too).
#[derive(Debug, Clone)]
pub struct PeerGuard {
    pub secret: Option<ClusterSecret>,
    pub exposed: watch::Receiver<Exposed>,
}

impl std::fmt::Debug for RegistryState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegistryState")
            .field("registries", &self.registries)
            .finish_non_exhaustive()
    }
}

/// The mirror address's router. Every path goes to one handler that parses the raw path
/// itself: names contain slashes, and percent-decoding must not happen before validation.
pub fn router(state: RegistryState) -> Router {
    Router::new()
        .fallback(handlers::handle)
        .with_state(Arc::new(state))
}
