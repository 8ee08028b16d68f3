//! Pure OCI distribution domain code, no I/O. Invariant: it parses untrusted input and returns
//! an error for bad input, never panics.

pub mod digest;
pub(crate) mod error;
pub mod manifest;
pub mod path;
pub mod range;
pub mod reference;
pub mod registry;

pub use digest::{Digest, DigestError};
pub use error::{ErrorCode, error_body};
pub use path::{ApiPath, PathError, Reference};
pub use range::{ByteRange, RangeError};

/// Header carrying the digest of the served content.
pub const DOCKER_CONTENT_DIGEST: &str = "docker-content-digest";
/// Header a registry answers `/v2/` with.
pub const API_VERSION_HEADER: &str = "docker-distribution-api-version";
/// Query parameter containerd adds to mirror requests: the upstream registry host.
pub const NS_PARAM: &str = "ns";
