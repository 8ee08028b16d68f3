//! OCI distribution error codes and their JSON bodies.

use serde::Serialize;

/// The subset of the spec's error codes a pull mirror can answer with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorCode {
    BlobUnknown,
    ManifestUnknown,
    NameInvalid,
    NameUnknown,
    DigestInvalid,
    ManifestInvalid,
    Unsupported,
    Unauthorized,
}

impl ErrorCode {
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BlobUnknown => "BLOB_UNKNOWN",
            ErrorCode::ManifestUnknown => "MANIFEST_UNKNOWN",
            ErrorCode::NameInvalid => "NAME_INVALID",
            ErrorCode::NameUnknown => "NAME_UNKNOWN",
            ErrorCode::DigestInvalid => "DIGEST_INVALID",
            ErrorCode::ManifestInvalid => "MANIFEST_INVALID",
            ErrorCode::Unsupported => "UNSUPPORTED",
            ErrorCode::Unauthorized => "UNAUTHORIZED",
        }
    }
}

#[derive(Serialize)]
struct Body<'a> {
    errors: [Entry<'a>; 1],
}

#[derive(Serialize)]
struct Entry<'a> {
    code: &'a str,
    message: &'a str,
}

/// `{"errors":[{"code":"...","message":"..."}]}` as the spec defines it.
pub fn error_body(code: ErrorCode, message: &str) -> String {
    let body = Body {
        errors: [Entry {
            code: code.as_str(),
            message,
        }],
    };
    // Serializing two strings cannot fail; fall back to a fixed body rather than panic.
    serde_json::to_string(&body).unwrap_or_else(|_| r#"{"errors":[]}"#.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn body_matches_the_spec_shape() {
        let v: serde_json::Value =
            serde_json::from_str(&error_body(ErrorCode::BlobUnknown, "nope \"x\"")).unwrap();
        assert_eq!(v["errors"][0]["code"], "BLOB_UNKNOWN");
        assert_eq!(v["errors"][0]["message"], "nope \"x\"");
    }
}
