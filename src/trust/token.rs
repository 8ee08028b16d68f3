//! Request tokens between peers: `v1.<unix seconds>.<hex HMAC-SHA256(method, path, time)>`,
//! keyed by the cluster secret and valid for a short time, so a captured token is worth little.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use super::ClusterSecret;

/// How far a token's time may be from the receiver's clock, either way: clock skew, not replay.
pub const TOKEN_VALIDITY: Duration = Duration::from_secs(60);
const VERSION: &str = "v1";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TokenError {
    #[error("no token")]
    Missing,
    #[error("malformed token")]
    Malformed,
    #[error("token expired or from the future")]
    Expired,
    #[error("token signature does not match")]
    BadSignature,
}

impl TokenError {
    pub fn reason(&self) -> &'static str {
        match self {
            TokenError::Missing => "missing",
            TokenError::Malformed => "malformed",
            TokenError::Expired => "expired",
            TokenError::BadSignature => "invalid",
        }
    }
}

fn mac(secret: &ClusterSecret, method: &str, path_and_query: &str, time: u64) -> Hmac<Sha256> {
    let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(secret.token_key())
        .expect("HMAC takes keys of any length");
    mac.update(method.as_bytes());
    mac.update(b"\n");
    mac.update(path_and_query.as_bytes());
    mac.update(b"\n");
    mac.update(time.to_string().as_bytes());
    mac
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A token for `method` on `path_and_query`, made now.
pub fn sign(secret: &ClusterSecret, method: &str, path_and_query: &str) -> String {
    sign_at(secret, method, path_and_query, now())
}

pub fn sign_at(secret: &ClusterSecret, method: &str, path_and_query: &str, time: u64) -> String {
    let tag = mac(secret, method, path_and_query, time)
        .finalize()
        .into_bytes();
    format!("{VERSION}.{time}.{}", hex::encode(tag))
}

/// Checks a token for this request against the secret and the clock.
pub fn verify(
    secret: &ClusterSecret,
    method: &str,
    path_and_query: &str,
    token: Option<&str>,
) -> Result<(), TokenError> {
    verify_at(secret, method, path_and_query, token, now())
}

pub fn verify_at(
    secret: &ClusterSecret,
    method: &str,
    path_and_query: &str,
    token: Option<&str>,
    now: u64,
) -> Result<(), TokenError> {
    let token = token.ok_or(TokenError::Missing)?;
    let mut parts = token.splitn(3, '.');
    let (Some(VERSION), Some(time), Some(tag)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(TokenError::Malformed);
    };
    let time: u64 = time.parse().map_err(|_| TokenError::Malformed)?;
    let tag = hex::decode(tag).map_err(|_| TokenError::Malformed)?;
    if now.abs_diff(time) > TOKEN_VALIDITY.as_secs() {
        return Err(TokenError::Expired);
    }
    // Constant-time comparison.
    mac(secret, method, path_and_query, time)
        .verify_slice(&tag)
        .map_err(|_| TokenError::BadSignature)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> ClusterSecret {
        ClusterSecret::from_bytes(b"0123456789abcdef-cluster")
    }

    const PATH: &str = "/v2/a/blobs/sha256:00?ns=docker.io";

    #[test]
    fn a_fresh_token_verifies_for_its_request_only() {
        let t = sign_at(&secret(), "GET", PATH, 1_000_000);
        assert_eq!(
            verify_at(&secret(), "GET", PATH, Some(&t), 1_000_030),
            Ok(())
        );
        assert_eq!(
            verify_at(&secret(), "HEAD", PATH, Some(&t), 1_000_030),
            Err(TokenError::BadSignature)
        );
        assert_eq!(
            verify_at(
                &secret(),
                "GET",
                "/v2/other/blobs/sha256:00",
                Some(&t),
                1_000_030
            ),
            Err(TokenError::BadSignature)
        );
        let other = ClusterSecret::from_bytes(b"another secret of enough length");
        assert_eq!(
            verify_at(&other, "GET", PATH, Some(&t), 1_000_030),
            Err(TokenError::BadSignature)
        );
    }

    #[test]
    fn expired_missing_and_malformed() {
        let t = sign_at(&secret(), "GET", PATH, 1_000_000);
        assert_eq!(
            verify_at(&secret(), "GET", PATH, Some(&t), 1_000_061),
            Err(TokenError::Expired)
        );
        assert_eq!(
            verify_at(&secret(), "GET", PATH, Some(&t), 999_900),
            Err(TokenError::Expired)
        );
        assert_eq!(
            verify_at(&secret(), "GET", PATH, None, 1_000_000),
            Err(TokenError::Missing)
        );
        for bad in [
            "",
            "v1",
            "v1.x.00",
            "v2.1000000.00",
            "v1.1000000.zz",
            "v1.1000000",
        ] {
            assert!(
                verify_at(&secret(), "GET", PATH, Some(bad), 1_000_000).is_err(),
                "{bad}"
            );
        }
    }
}
