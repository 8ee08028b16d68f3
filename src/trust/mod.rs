//! Who may talk to Ferry: the cluster secret, the private-network key and the request tokens
//! derived from it.

pub(crate) mod secret;
pub mod token;

pub use secret::{ClusterSecret, SecretError};
pub use token::{TOKEN_VALIDITY, TokenError};
