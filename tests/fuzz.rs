//! Property-based fuzzing of everything that parses untrusted input: the `/v2/` path parser,
//! digests and names, the Range parser, and the hosts.toml merge. Each target first replays its
//! committed corpus (`tests/fuzz/corpus/<target>/`), then generates inputs for
//! `FERRY_FUZZ_SECONDS` (default 5; the test script runs 60). A failure is shrunk to a minimal
//! input and printed: fix the bug, then add that input to the corpus so it is replayed forever.

#![allow(clippy::unwrap_used)] // test helpers panic by design

use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use ferry::containerd_config::hosts::{self, BLOCK_BEGIN, Cleaned, Ipv6Hosts, Merged};
use ferry::oci::Digest;
use ferry::oci::path::{ApiPath, Reference, parse};
use ferry::oci::range;
use ferry::oci::reference::{validate_name, validate_tag};
use ferry::store::containerd::blob_path;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

fn budget() -> Duration {
    let secs = std::env::var("FERRY_FUZZ_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    Duration::from_secs(secs)
}

fn corpus(target: &str) -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fuzz/corpus")
        .join(target);
    let mut inputs = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        if path.extension().is_some_and(|e| e == "txt") {
            inputs.extend(text.lines().map(str::to_string));
        } else {
            inputs.push(text);
        }
    }
    assert!(!inputs.is_empty(), "empty corpus for {target}");
    inputs
}

/// Replays the corpus, then runs generated cases until the time budget is spent.
fn fuzz<S: Strategy<Value = String>>(
    target: &str,
    strategy: S,
    check: impl Fn(&str) -> Result<(), TestCaseError>,
) {
    for input in corpus(target) {
        check(&input).unwrap_or_else(|e| panic!("{target}: corpus input {input:?}: {e}"));
    }
    let config = Config {
        // The corpus is the memory of past failures; proptest's own files are not used.
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let deadline = Instant::now() + budget();
    let mut cases = 0u64;
    while Instant::now() < deadline {
        let tree = strategy.new_tree(&mut runner).unwrap();
        if let Err(e) = runner.run_one(tree, |input| check(&input)) {
            panic!("{target}: {e}");
        }
        cases += 1;
    }
    eprintln!("{target}: {cases} generated cases");
}

/// Strings built from the pieces that matter to a parser, plus arbitrary characters.
fn pieces(parts: &'static [&'static str]) -> impl Strategy<Value = String> {
    let part = prop_oneof![
        4 => proptest::sample::select(parts).prop_map(str::to_string),
        1 => any::<char>().prop_map(|c| c.to_string()),
        1 => "[a-z0-9]{1,8}",
    ];
    proptest::collection::vec(part, 0..24).prop_map(|v| v.concat())
}

const HEX64: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

#[test]
fn fuzz_path_parser_never_escapes_the_content_dir() {
    let parts: &'static [&'static str] = &[
        "/v2",
        "/",
        "/",
        "manifests",
        "blobs",
        "uploads",
        "tags",
        "list",
        "sha256:",
        "sha512:",
        HEX64,
        "..",
        ".",
        "%2f",
        "%2e",
        "%00",
        "\0",
        ":",
        "latest",
        "a",
        "b-c",
        "d__e",
        "A",
        "@",
        "?",
        "#",
        "\\",
    ];
    let content_dir = PathBuf::from("/var/lib/containerd/io.containerd.content.v1.content");
    fuzz("path", pieces(parts), |input| {
        let Ok(parsed) = parse(input) else {
            return Ok(());
        };
        let (name, digest) = match parsed {
            ApiPath::Base => return Ok(()),
            ApiPath::Manifest {
                name,
                reference: Reference::Digest(d),
            } => (name, Some(d)),
            ApiPath::Manifest {
                name,
                reference: Reference::Tag(t),
            } => {
                prop_assert!(validate_tag(&t).is_ok());
                (name, None)
            }
            ApiPath::Blob { name, digest } => (name, Some(digest)),
            ApiPath::Upload { name } | ApiPath::TagsList { name } => (name, None),
        };
        prop_assert!(validate_name(&name).is_ok(), "accepted name {name:?}");
        prop_assert!(!name.contains("..") && !name.contains('%') && !name.contains('\0'));
        if let Some(d) = digest {
            let path = blob_path(&content_dir, &d);
            prop_assert!(path.starts_with(content_dir.join("blobs")), "{path:?}");
            prop_assert!(
                path.components()
                    .all(|c| matches!(c, Component::Normal(_) | Component::RootDir))
            );
            prop_assert_eq!(d.to_string().parse::<Digest>().ok(), Some(d));
        }
        Ok(())
    });
}

#[test]
fn fuzz_digest_and_reference_parsers() {
    let parts: &'static [&'static str] = &[
        "sha256", "sha512", "md5", ":", HEX64, "E3B0", "/", "..", "-", "_", "__", ".", "\0", "a",
        "Z", "9",
    ];
    fuzz("digest", pieces(parts), |input| {
        if let Ok(d) = input.parse::<Digest>() {
            prop_assert_eq!(d.to_string(), input);
            prop_assert!(
                d.hex()
                    .bytes()
                    .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase())
            );
        }
        if validate_name(input).is_ok() {
            prop_assert!(
                input
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-/".contains(&b))
            );
            prop_assert!(
                !input
                    .split('/')
                    .any(|c| c.is_empty() || c == ".." || c == ".")
            );
        }
        if validate_tag(input).is_ok() {
            prop_assert!(input.len() <= 128 && !input.contains('/') && !input.contains(':'));
        }
        Ok(())
    });
}

#[test]
fn fuzz_range_parser_stays_inside_the_blob() {
    let parts: &'static [&'static str] = &[
        "bytes=",
        "bytes",
        "=",
        "-",
        ",",
        " ",
        "0",
        "1",
        "9",
        "18446744073709551615",
        "99999999999999999999",
        "+",
    ];
    let sizes = [0u64, 1, 2, 100, 4096, u64::MAX];
    fuzz("range", pieces(parts), |input| {
        for size in sizes {
            if let Ok(r) = range::parse(input, size) {
                prop_assert!(
                    r.start <= r.end && r.end < size,
                    "{input:?} on {size}: {r:?}"
                );
                prop_assert_eq!(range::span(Some(r), size), (r.start, r.len()));
            }
        }
        Ok(())
    });
}

#[test]
fn fuzz_hosts_merge_is_correct_or_refused_never_corrupt() {
    let mirror = "http://127.0.0.1:5480";
    let line = prop_oneof![
        4 => proptest::sample::select(&[
            "server = \"https://registry-1.docker.io\"",
            "capabilities = [\"pull\", \"resolve\"]",
            "[host.\"https://mirror.example\"]",
            "[host.\"https://other.example\"]",
            "[host.\"http://127.0.0.1:5480\"]",
            "  capabilities = [\"pull\"]",
            "  skip_verify = true",
            "[header]",
            "  x-a = \"b\"",
            "[host.\"https://mirror.example\".header]",
            "# a comment",
            "",
            "[host]",
            "host.\"https://dotted.example\".capabilities = [\"pull\"]",
            "\"https://inline.example\" = { capabilities = [\"pull\"] }",
            "ca = [\"/etc/ca.pem\"]",
            BLOCK_BEGIN,
            "# <<< ferry mirror",
            "[[host]]",
            "key = 'unterminated",
        ][..])
        .prop_map(str::to_string),
        1 => "[ -~]{0,30}",
    ];
    let eol = prop_oneof![Just("\n"), Just("\r\n")];
    let doc = (proptest::collection::vec(line, 0..14), eol, any::<bool>()).prop_map(
        |(lines, eol, trailing)| {
            let mut s = lines.join(eol);
            if trailing {
                s.push_str(eol);
            }
            s
        },
    );
    fuzz("hosts", doc, |input| {
        match hosts::merge(input, mirror, Ipv6Hosts::Dotted) {
            // Refused: the caller leaves the file as it is.
            Err(_) => {}
            Ok(Merged::Unchanged) | Ok(Merged::OperatorEntry) => {
                prop_assert!(
                    input.parse::<toml::Table>().is_ok(),
                    "kept a file that is not TOML"
                );
            }
            Ok(Merged::Updated(out)) => {
                let table: toml::Table = out
                    .parse()
                    .map_err(|e| TestCaseError::fail(format!("corrupt output: {e}\n{out}")))?;
                prop_assert!(
                    table.get("host").and_then(|h| h.get(mirror)).is_some(),
                    "no mirror entry:\n{out}"
                );
                // Merging again changes nothing.
                let again = hosts::merge(&out, mirror, Ipv6Hosts::Dotted).ok();
                prop_assert!(
                    matches!(again, Some(Merged::Unchanged | Merged::OperatorEntry)),
                    "second merge: {again:?}"
                );
                if !out.contains(BLOCK_BEGIN) {
                    // The operator lists the mirror themselves; ferry only took its old block out.
                    return Ok(());
                }
                // A host is a `[host."url"]` table, or a dotted `host."url".key = ...` line
                // among the root keys, before any table header (how IPv6 hosts are written
                // for containerd 1.x; under a header it is that table's key, not a host).
                let mut root = true;
                let first = out
                    .lines()
                    .map(str::trim_start)
                    .find(|l| {
                        let host = l.starts_with("[host.") || (root && l.starts_with("host."));
                        root &= !l.starts_with('[');
                        host
                    })
                    .unwrap_or_default();
                prop_assert!(first.contains(mirror), "ferry is not first:\n{out}");
                // Cleanup gives the operator's bytes back, unless the input held an old block.
                if !input.contains(BLOCK_BEGIN) {
                    prop_assert_eq!(hosts::cleanup(&out), Cleaned::Restored(input.to_string()));
                }
            }
        }
        Ok(())
    });
}
