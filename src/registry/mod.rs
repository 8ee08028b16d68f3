//! The registry API (the pull subset of the OCI distribution spec) on two routers, each with
//! its own explicit list of answers: the mirror (`mirror.rs`, this node's containerd) and the
//! peer address (`peer_api.rs`, other nodes). Invariant: errors become HTTP in `error.rs` only.

mod error;
mod in_flight;
pub(crate) mod integrity;
mod local;
pub(crate) mod mirror;
pub mod peer;
pub(crate) mod peer_api;
pub(crate) mod recent;
mod request;
pub(crate) mod source;
pub(crate) mod tags;
#[cfg(test)]
mod tests;
pub(crate) mod upstream;
pub mod zero_copy;

pub use error::ApiError;
pub use mirror::MirrorState;
pub use peer::PeerFetcher;
pub use peer_api::PeerApiState;
pub use source::Source;
pub use tags::ResolveTags;
pub use upstream::{UpstreamConfig, UpstreamWatch};
