//! The names Ferry puts on the wire between nodes. Invariant: every `x-ferry-*` header and
//! `/_ferry/` path is named here and nowhere else.

/// On requests between nodes: the receiver answers from its own store only, so nodes never loop.
pub const HOP_HEADER: &str = "x-ferry-hop";
/// On a follower's request: the leader may answer from a download in progress.
pub const FOLLOW_HEADER: &str = "x-ferry-follow";
/// Carries the signed token on requests to a peer address.
pub const TOKEN_HEADER: &str = "x-ferry-token";
/// The claim endpoint: `POST <CLAIM_PATH><digest>?peer=&addr=`.
pub const CLAIM_PATH: &str = "/_ferry/v1/claim/";
/// The `Upgrade` protocol for a blob sent with `sendfile` (`registry::zero_copy`).
pub const ZERO_COPY_PROTOCOL: &str = "ferry-blob/1";
/// On a zero-copy 101: the status the answer would have had (200 or 206).
pub const ZERO_COPY_STATUS_HEADER: &str = "x-ferry-status";
/// On a zero-copy 101: how many bytes follow it.
pub const ZERO_COPY_LENGTH_HEADER: &str = "x-ferry-length";
