//! Repository names and tags, validated against the OCI distribution spec grammar.

/// The spec's cap on a name with its host, applied to the name alone (the path has no host).
pub const MAX_NAME_LEN: usize = 255;

/// Tags are `[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}`.
pub const MAX_TAG_LEN: usize = 128;

/// Checks `name` against `[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*(/[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*)*`.
pub fn validate_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("repository name is empty");
    }
    if name.len() > MAX_NAME_LEN {
        return Err("repository name is longer than 255 characters");
    }
    for component in name.split('/') {
        validate_component(component)?;
    }
    Ok(())
}

fn validate_component(component: &str) -> Result<(), &'static str> {
    const BAD: &str =
        "repository name components are lowercase alphanumerics joined by '.', '_', '__' or '-'";
    let bytes = component.as_bytes();
    let alnum = |b: u8| b.is_ascii_lowercase() || b.is_ascii_digit();
    if bytes.is_empty() || !alnum(bytes[0]) || !alnum(bytes[bytes.len() - 1]) {
        return Err(BAD);
    }
    let mut i = 0;
    while i < bytes.len() {
        if alnum(bytes[i]) {
            i += 1;
            continue;
        }
        // A separator run: ".", "_", "__" or one or more "-".
        let start = i;
        let sep = bytes[i];
        while i < bytes.len() && !alnum(bytes[i]) {
            i += 1;
        }
        let run = &bytes[start..i];
        let ok = match sep {
            b'.' => run == b".",
            b'_' => run == b"_" || run == b"__",
            b'-' => run.iter().all(|&b| b == b'-'),
            _ => false,
        };
        if !ok {
            return Err(BAD);
        }
    }
    Ok(())
}

/// Checks `tag` against `[a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}`.
pub fn validate_tag(tag: &str) -> Result<(), &'static str> {
    const BAD: &str = "tags are [a-zA-Z0-9_][a-zA-Z0-9._-]{0,127}";
    let bytes = tag.as_bytes();
    let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    if bytes.is_empty() || bytes.len() > MAX_TAG_LEN || !word(bytes[0]) {
        return Err(BAD);
    }
    if !bytes.iter().all(|&b| word(b) || b == b'.' || b == b'-') {
        return Err(BAD);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_real_names() {
        for ok in [
            "nginx",
            "library/nginx",
            "a/b/c",
            "my-org/my_app",
            "x__y/z.w",
            "a--b",
            "k8s.gcr.io-mirror/pause",
        ] {
            assert_eq!(validate_name(ok), Ok(()), "{ok}");
        }
    }

    #[test]
    fn rejects_bad_names() {
        let long = "a".repeat(256);
        for bad in [
            "",
            "/",
            "a//b",
            "A",
            "a/",
            "/a",
            "..",
            "a/../b",
            "a/./b",
            "a___b",
            "a.-b",
            "-a",
            "a b",
            "a%2fb",
            "a\0b",
            long.as_str(),
        ] {
            assert!(validate_name(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn tags() {
        for ok in ["latest", "v1.2.3", "_x", "A-b_c.d"] {
            assert_eq!(validate_tag(ok), Ok(()), "{ok}");
        }
        let long = "a".repeat(129);
        for bad in ["", ".x", "-x", "a:b", "a/b", "a\0", long.as_str()] {
            assert!(validate_tag(bad).is_err(), "{bad:?} should be rejected");
        }
    }
}
