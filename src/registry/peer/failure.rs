//! Why a peer could not serve: one typed reason per stage, so the metric label, the log line
//! and the backoff come from one place.

use std::time::Duration;

use axum::http::StatusCode;

/// A peer that just failed is tried last for this long.
pub(crate) const FAILED_PEER_BACKOFF: Duration = Duration::from_secs(30);
/// A peer that served wrong bytes is not asked at all for this long.
pub(crate) const QUARANTINE: Duration = Duration::from_secs(600);

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerFailure {
    #[error("cannot connect: {0}")]
    Connect(String),
    #[error("no response headers in time")]
    FirstByte,
    #[error("answered {0}")]
    Status(StatusCode),
    #[error("the response has no usable length or range")]
    Extent,
    #[error("body: {0}")]
    Body(String),
    #[error("bytes do not match {0}")]
    Verify(String),
}

/// Why no peer served, for the mirror's log: containerd gets the same 404.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerMiss {
    #[error("no node advertises it")]
    NoProvider,
    #[error(
        "the buffer budget is spent: a range that could not be checked is left to the registry"
    )]
    Busy,
    #[error("a tag cannot be looked up without its registry (?ns=)")]
    NoRegistry,
    #[error("{advertised} node(s) advertise it, none served it (gone, or quarantined)")]
    Gone { advertised: usize },
    #[error("{advertised} node(s) advertise it, the last asked failed: {last}")]
    Failed {
        advertised: usize,
        last: PeerFailure,
    },
    #[error("the answer could not be built")]
    Unbuildable,
}

impl PeerMiss {
    pub fn after(advertised: usize, last: Option<PeerFailure>) -> PeerMiss {
        match (advertised, last) {
            (0, _) => PeerMiss::NoProvider,
            (advertised, Some(last)) => PeerMiss::Failed { advertised, last },
            (advertised, None) => PeerMiss::Gone { advertised },
        }
    }
}

impl PeerFailure {
    /// The `stage` label of `ferry_peer_failures_total`.
    pub fn stage(&self) -> &'static str {
        match self {
            PeerFailure::Connect(_) => "connect",
            PeerFailure::FirstByte => "first_byte",
            PeerFailure::Status(_) | PeerFailure::Extent => "status",
            PeerFailure::Body(_) => "body",
            PeerFailure::Verify(_) => "verify",
        }
    }

    /// A liar is quarantined; any other failure goes last.
    pub fn backoff(&self) -> Duration {
        match self {
            PeerFailure::Verify(_) => QUARANTINE,
            _ => FAILED_PEER_BACKOFF,
        }
    }
}
