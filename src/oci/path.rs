//! The `/v2/` request path parser. Repository names contain slashes, so the path is parsed
//! from the right: the last two segments say what is asked for, the rest is the name.

use std::fmt;

use super::digest::{Digest, DigestError};
use super::reference::{validate_name, validate_tag};

/// What a `/v2/...` request path asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiPath {
    /// `/v2/`: the API version check.
    Base,
    Manifest {
        name: String,
        reference: Reference,
    },
    Blob {
        name: String,
        digest: Digest,
    },
    /// `/v2/<name>/blobs/uploads/...`: push, which a pull mirror does not support.
    Upload {
        name: String,
    },
    /// `/v2/<name>/tags/list`: content discovery, which Ferry does not offer.
    TagsList {
        name: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reference {
    Tag(String),
    Digest(Digest),
}

impl fmt::Display for Reference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reference::Tag(t) => f.write_str(t),
            Reference::Digest(d) => d.fmt(f),
        }
    }
}

#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum PathError {
    #[error("not a registry API path")]
    UnknownEndpoint,
    #[error("invalid repository name: {0}")]
    NameInvalid(&'static str),
    #[error("invalid tag: {0}")]
    TagInvalid(&'static str),
    #[error("invalid digest: {0}")]
    DigestInvalid(#[from] DigestError),
}

/// Parses the raw request path. Valid names never need percent-encoding, so a `%` is rejected
/// rather than decoded: an encoded slash or NUL can never change how the path is split.
pub fn parse(raw_path: &str) -> Result<ApiPath, PathError> {
    let rest = match raw_path.strip_prefix("/v2") {
        Some("" | "/") => return Ok(ApiPath::Base),
        Some(rest) => rest.strip_prefix('/').ok_or(PathError::UnknownEndpoint)?,
        None => return Err(PathError::UnknownEndpoint),
    };
    if rest.contains('%') {
        return Err(PathError::NameInvalid(
            "percent-encoded characters are not allowed",
        ));
    }
    let segments: Vec<&str> = rest.split('/').collect();
    if let Some(name) = upload_name(&segments) {
        return Ok(ApiPath::Upload {
            name: valid_name(&name)?,
        });
    }
    let n = segments.len();
    if n < 3 {
        return Err(PathError::UnknownEndpoint);
    }
    let name = segments[..n - 2].join("/");
    match (segments[n - 2], segments[n - 1]) {
        ("manifests", reference) => {
            let name = valid_name(&name)?;
            let reference = if reference.contains(':') {
                Reference::Digest(reference.parse()?)
            } else {
                validate_tag(reference).map_err(PathError::TagInvalid)?;
                Reference::Tag(reference.to_string())
            };
            Ok(ApiPath::Manifest { name, reference })
        }
        ("blobs", digest) => {
            let name = valid_name(&name)?;
            Ok(ApiPath::Blob {
                name,
                digest: digest.parse()?,
            })
        }
        ("tags", "list") => Ok(ApiPath::TagsList {
            name: valid_name(&name)?,
        }),
        _ => Err(PathError::UnknownEndpoint),
    }
}

/// `<name>/blobs/uploads/` or `<name>/blobs/uploads/<id>`.
fn upload_name(segments: &[&str]) -> Option<String> {
    let pos = segments
        .windows(2)
        .rposition(|w| w[0] == "blobs" && w[1] == "uploads")?;
    let tail = &segments[pos + 2..];
    (pos > 0 && tail.len() <= 1).then(|| segments[..pos].join("/"))
}

fn valid_name(name: &str) -> Result<String, PathError> {
    validate_name(name).map_err(PathError::NameInvalid)?;
    Ok(name.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

    #[test]
    fn base() {
        assert_eq!(parse("/v2/"), Ok(ApiPath::Base));
        assert_eq!(parse("/v2"), Ok(ApiPath::Base));
    }

    #[test]
    fn manifests_by_tag_and_digest_with_slashes_in_name() {
        assert_eq!(
            parse("/v2/library/nginx/manifests/1.27"),
            Ok(ApiPath::Manifest {
                name: "library/nginx".into(),
                reference: Reference::Tag("1.27".into())
            })
        );
        assert_eq!(
            parse(&format!("/v2/a/b/c/manifests/{D}")),
            Ok(ApiPath::Manifest {
                name: "a/b/c".into(),
                reference: Reference::Digest(D.parse().unwrap())
            })
        );
    }

    #[test]
    fn a_repo_called_manifests_or_blobs_still_parses_from_the_right() {
        assert_eq!(
            parse(&format!("/v2/blobs/manifests/blobs/{D}")),
            Ok(ApiPath::Blob {
                name: "blobs/manifests".into(),
                digest: D.parse().unwrap()
            })
        );
    }

    #[test]
    fn uploads_and_tag_lists() {
        assert_eq!(
            parse("/v2/a/b/blobs/uploads/"),
            Ok(ApiPath::Upload { name: "a/b".into() })
        );
        assert_eq!(
            parse("/v2/a/blobs/uploads/1234-abcd"),
            Ok(ApiPath::Upload { name: "a".into() })
        );
        assert_eq!(
            parse("/v2/a/tags/list"),
            Ok(ApiPath::TagsList { name: "a".into() })
        );
    }

    #[test]
    fn bad_paths_are_errors_not_panics() {
        assert_eq!(parse("/v3/"), Err(PathError::UnknownEndpoint));
        assert_eq!(parse("/v2x"), Err(PathError::UnknownEndpoint));
        assert_eq!(parse("/v2/manifests/x"), Err(PathError::UnknownEndpoint));
        assert_eq!(parse("/v2/a/foo/x"), Err(PathError::UnknownEndpoint));
        assert!(matches!(
            parse("/v2/A/manifests/x"),
            Err(PathError::NameInvalid(_))
        ));
        assert!(matches!(
            parse("/v2/../../etc/blobs/sha256:00"),
            Err(PathError::NameInvalid(_))
        ));
        assert!(matches!(
            parse("/v2/a%2fb/manifests/x"),
            Err(PathError::NameInvalid(_))
        ));
        assert!(matches!(
            parse("/v2/a/manifests/bad:digest"),
            Err(PathError::DigestInvalid(_))
        ));
        assert!(matches!(
            parse("/v2/a/manifests/-x"),
            Err(PathError::TagInvalid(_))
        ));
        assert!(parse("/v2/a/blobs/sha256:../../x").is_err());
        assert!(matches!(
            parse("/v2/a/blobs/latest"),
            Err(PathError::DigestInvalid(_))
        ));
        assert!(parse("/v2//manifests/x").is_err());
    }
}
