//! The cluster secret: one file shared by every node (the chart keeps it in a Secret). Two
//! independent keys are derived from it, so neither use can leak the other.

use std::path::Path;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

/// A secret shorter than this is refused: it would be guessable offline from one token.
pub(crate) const MIN_SECRET_BYTES: usize = 16;
const PNET_LABEL: &[u8] = b"ferry pnet v1";
const TOKEN_LABEL: &[u8] = b"ferry peer token v1";

#[derive(Clone)]
pub struct ClusterSecret {
    pnet: [u8; 32],
    token: [u8; 32],
}

/// Never print key material.
impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterSecret(..)")
    }
}

impl PartialEq for ClusterSecret {
    fn eq(&self, other: &Self) -> bool {
        self.token == other.token
    }
}

impl Eq for ClusterSecret {}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SecretError {
    #[error("cannot read {0}")]
    Unreadable(String),
    #[error("{path} holds {len} bytes; a cluster secret needs at least {MIN_SECRET_BYTES}")]
    TooShort { path: String, len: usize },
}

impl ClusterSecret {
    /// Reads the file; surrounding whitespace (a trailing newline) is not part of the secret.
    pub fn load(path: &Path) -> Result<ClusterSecret, SecretError> {
        let shown = path.display().to_string();
        let raw =
            std::fs::read(path).map_err(|e| SecretError::Unreadable(format!("{shown}: {e}")))?;
        let trimmed = raw.trim_ascii();
        if trimmed.len() < MIN_SECRET_BYTES {
            return Err(SecretError::TooShort {
                path: shown,
                len: trimmed.len(),
            });
        }
        Ok(ClusterSecret::from_bytes(trimmed))
    }

    pub fn from_bytes(secret: &[u8]) -> ClusterSecret {
        ClusterSecret {
            pnet: derive(secret, PNET_LABEL),
            token: derive(secret, TOKEN_LABEL),
        }
    }

    /// The libp2p private-network pre-shared key.
    pub fn pnet_key(&self) -> [u8; 32] {
        self.pnet
    }

    pub(crate) fn token_key(&self) -> &[u8; 32] {
        &self.token
    }
}

fn derive(secret: &[u8], label: &[u8]) -> [u8; 32] {
    let mut mac =
        <Hmac<Sha256> as KeyInit>::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(label);
    mac.finalize().into_bytes().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_derived_and_distinct() {
        let a = ClusterSecret::from_bytes(b"0123456789abcdef-cluster");
        let b = ClusterSecret::from_bytes(b"0123456789abcdef-cluster");
        let c = ClusterSecret::from_bytes(b"0123456789abcdef-other");
        assert_eq!(a.pnet_key(), b.pnet_key());
        assert_ne!(a.pnet_key(), c.pnet_key());
        assert_ne!(a.pnet_key(), *a.token_key());
        assert_eq!(format!("{a:?}"), "ClusterSecret(..)");
    }

    #[test]
    fn files_are_trimmed_and_short_ones_refused() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good");
        std::fs::write(&good, b"0123456789abcdef-cluster\n").unwrap();
        assert_eq!(
            ClusterSecret::load(&good).unwrap(),
            ClusterSecret::from_bytes(b"0123456789abcdef-cluster")
        );
        let short = dir.path().join("short");
        std::fs::write(&short, b"tiny\n").unwrap();
        assert!(matches!(
            ClusterSecret::load(&short),
            Err(SecretError::TooShort { len: 4, .. })
        ));
        assert!(matches!(
            ClusterSecret::load(&dir.path().join("missing")),
            Err(SecretError::Unreadable(_))
        ));
    }
}
