//! Content digests (`sha256:<64 hex>`), validated so that a digest can be used as a file name.

use std::fmt;
use std::str::FromStr;

use sha2::Digest as _;

/// A content digest of an algorithm containerd stores under `blobs/<alg>/`, in lowercase hex of
/// the exact length, so it can never form a path outside the content directory.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Digest {
    algorithm: Algorithm,
    hex: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Algorithm {
    Sha256,
    Sha512,
}

impl Algorithm {
    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::Sha256 => "sha256",
            Algorithm::Sha512 => "sha512",
        }
    }

    fn hex_len(self) -> usize {
        match self {
            Algorithm::Sha256 => 64,
            Algorithm::Sha512 => 128,
        }
    }
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum DigestError {
    #[error("digest has no ':' separating algorithm and hex")]
    MissingSeparator,
    #[error("unsupported digest algorithm {0:?}")]
    UnsupportedAlgorithm(String),
    #[error("digest hex must be {expected} lowercase hex characters")]
    BadHex { expected: usize },
}

impl Digest {
    pub fn sha256_of(data: &[u8]) -> Self {
        Digest {
            algorithm: Algorithm::Sha256,
            hex: hex::encode(sha2::Sha256::digest(data)),
        }
    }

    pub fn algorithm(&self) -> Algorithm {
        self.algorithm
    }

    /// The encoded part, lowercase hex.
    pub fn hex(&self) -> &str {
        &self.hex
    }

    /// Does `data` hash to this digest?
    pub fn matches(&self, data: &[u8]) -> bool {
        let actual = match self.algorithm {
            Algorithm::Sha256 => hex::encode(sha2::Sha256::digest(data)),
            Algorithm::Sha512 => hex::encode(sha2::Sha512::digest(data)),
        };
        actual == self.hex
    }
}

/// Hashes bytes as they stream by, for checking against a [`Digest`] at the end.
#[derive(Debug, Clone)]
pub enum Hasher {
    Sha256(sha2::Sha256),
    Sha512(sha2::Sha512),
}

impl Hasher {
    pub fn update(&mut self, data: &[u8]) {
        match self {
            Hasher::Sha256(h) => h.update(data),
            Hasher::Sha512(h) => h.update(data),
        }
    }

    /// Do the bytes seen so far hash to `digest`?
    pub fn matches(self, digest: &Digest) -> bool {
        let actual = match self {
            Hasher::Sha256(h) => hex::encode(h.finalize()),
            Hasher::Sha512(h) => hex::encode(h.finalize()),
        };
        actual == digest.hex
    }
}

impl Digest {
    pub fn hasher(&self) -> Hasher {
        match self.algorithm {
            Algorithm::Sha256 => Hasher::Sha256(sha2::Sha256::new()),
            Algorithm::Sha512 => Hasher::Sha512(sha2::Sha512::new()),
        }
    }
}

impl FromStr for Digest {
    type Err = DigestError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (alg, hex) = s.split_once(':').ok_or(DigestError::MissingSeparator)?;
        let algorithm = match alg {
            "sha256" => Algorithm::Sha256,
            "sha512" => Algorithm::Sha512,
            other => return Err(DigestError::UnsupportedAlgorithm(other.to_string())),
        };
        let valid = hex.len() == algorithm.hex_len()
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !valid {
            return Err(DigestError::BadHex {
                expected: algorithm.hex_len(),
            });
        }
        Ok(Digest {
            algorithm,
            hex: hex.to_string(),
        })
    }
}

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.algorithm.as_str(), self.hex)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EMPTY: &str = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn parses_and_displays_round_trip() {
        let d: Digest = EMPTY.parse().unwrap();
        assert_eq!(d.to_string(), EMPTY);
        assert_eq!(d, Digest::sha256_of(b""));
        assert!(d.matches(b""));
        assert!(!d.matches(b"x"));
    }

    #[test]
    fn streaming_hasher_agrees_with_matches() {
        let d = Digest::sha256_of(b"hello world");
        let mut h = d.hasher();
        h.update(b"hello ");
        h.update(b"world");
        assert!(h.matches(&d));
        let mut h = d.hasher();
        h.update(b"hello");
        assert!(!h.matches(&d));
    }

    #[test]
    fn rejects_bad_digests() {
        for bad in [
            "",
            "sha256",
            "sha256:",
            "md5:abc",
            "sha256:E3B0C44298FC1C149AFBF4C8996FB92427AE41E4649B934CA495991B7852B855",
            "sha256:../../../../etc/passwd",
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b85",
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855a",
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b85\0",
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b8/5",
        ] {
            assert!(bad.parse::<Digest>().is_err(), "{bad:?} should be rejected");
        }
    }
}
