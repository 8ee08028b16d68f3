//! How many other nodes have a blob: asked before the budget lets one go, so that the last
//! copies in the cluster are let go last (`--keep-copies`).

use std::time::Duration;

use crate::oci::Digest;

/// The longest a count waits for the DHT: a slow answer counts what came.
pub const COUNT_WAIT: Duration = Duration::from_secs(2);

#[async_trait::async_trait]
pub trait Copies: Send + Sync + 'static {
    /// How many other nodes advertise `digest`, counted up to `enough`.
    async fn elsewhere(&self, digest: &Digest, enough: usize) -> usize;
}
