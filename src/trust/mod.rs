//! Who may talk to Ferry: the cluster secret, the private-network key derived from it, and
//! the short-lived request tokens peers sign with it.

pub(crate) mod secret;
pub mod token;

pub use secret::{ClusterSecret, SecretError};
pub use token::{TOKEN_VALIDITY, TokenError};
