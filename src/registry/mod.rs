//! The registry API (the pull subset of the OCI distribution spec) on two addresses with two
//! routers, each with its own explicit list of answers: the mirror (`mirror.rs`: what this
//! node's containerd may ask; the only place other nodes are asked) and the peer address
//! (`peer_api.rs`: what other nodes may ask; this node's own advertised content only). Both
//! share the request parsing (`request.rs`), the local store (`local.rs`) and the errors
//! (`error.rs`, translated to HTTP in that one place).

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
