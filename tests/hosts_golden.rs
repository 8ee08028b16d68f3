//! Golden files for the hosts.toml merge: real-world configs in, exact bytes out, and cleanup
//! back to the input byte-for-byte. See tests/golden/hosts/README.md.

#![allow(clippy::unwrap_used)] // test helpers panic by design

use std::fs;
use std::path::{Path, PathBuf};

use ferry::containerd_config::hosts::{self, Cleaned, Ipv6Hosts, Merged};

const MIRROR: &str = "http://127.0.0.1:5480";

fn cases() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/hosts");
    let mut dirs: Vec<PathBuf> = fs::read_dir(root)
        .expect("golden dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.is_dir())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 8, "golden cases are missing");
    dirs
}

#[test]
fn merge_matches_golden_files_and_cleanup_restores_the_input() {
    let update = std::env::var_os("UPDATE_GOLDEN").is_some();
    for case in cases() {
        let name = case.file_name().unwrap().to_string_lossy().to_string();
        let input = fs::read_to_string(case.join("input.toml")).unwrap();
        let result = hosts::merge(&input, MIRROR, Ipv6Hosts::Dotted);

        if let Ok(fragment) = fs::read_to_string(case.join("expected.error")) {
            let err = result.expect_err(&format!("{name}: must be refused"));
            assert!(
                err.to_string().contains(fragment.trim()),
                "{name}: error {err} should mention {fragment:?}"
            );
            assert!(
                matches!(
                    hosts::cleanup(&input),
                    Cleaned::Untouched | Cleaned::Broken(_)
                ),
                "{name}: cleanup must leave a refused file alone"
            );
            continue;
        }

        let merged = match result.unwrap_or_else(|e| panic!("{name}: {e}")) {
            Merged::Updated(text) => text,
            Merged::Unchanged | Merged::OperatorEntry => input.clone(),
        };
        let expected_path = case.join("expected.toml");
        if update {
            fs::write(&expected_path, &merged).unwrap();
        }
        let expected = fs::read_to_string(&expected_path).unwrap();
        assert_eq!(
            merged, expected,
            "{name}: merge differs from the golden file"
        );

        // Run twice: nothing changes.
        let again = hosts::merge(&merged, MIRROR, Ipv6Hosts::Dotted).unwrap();
        assert!(
            matches!(again, Merged::Unchanged | Merged::OperatorEntry),
            "{name}: second merge changed the file: {again:?}"
        );

        // Cleanup gives back the operator's bytes exactly.
        let original = fs::read_to_string(case.join("original.toml")).unwrap_or(input.clone());
        let restored = match hosts::cleanup(&merged) {
            Cleaned::Restored(text) => text,
            Cleaned::Untouched => merged.clone(),
            Cleaned::Delete { .. } => panic!("{name}: an operator file must never be deleted"),
            Cleaned::Broken(reason) => panic!("{name}: {reason}"),
        };
        assert_eq!(restored, original, "{name}: cleanup is not byte-identical");
    }
}

#[test]
fn ferry_entry_is_the_first_host_in_every_merged_file() {
    for case in cases() {
        let Ok(expected) = fs::read_to_string(case.join("expected.toml")) else {
            continue;
        };
        // A file that already lists the mirror itself is the operator's choice, left as is.
        if fs::read_to_string(case.join("input.toml")).ok() == Some(expected.clone()) {
            continue;
        }
        // `[host."url"]`, or `host."url".key = ...` (how IPv6 hosts are written).
        let first_host = expected
            .lines()
            .map(str::trim_start)
            .find(|l| l.starts_with("[host.") || l.starts_with("host."))
            .unwrap_or_default()
            .to_string();
        assert!(
            first_host.contains("127.0.0.1:5480"),
            "{}: first host table is {first_host:?}",
            case.display()
        );
    }
}

#[test]
fn new_files_are_deleted_by_cleanup() {
    for (host, created_dir) in [
        (Some("docker.io"), true),
        (Some("ghcr.io"), false),
        (None, true),
    ] {
        let text = hosts::new_file(host, MIRROR, Ipv6Hosts::Dotted, created_dir);
        if host == Some("docker.io") {
            assert!(
                text.contains("server = \"https://registry-1.docker.io\""),
                "{text}"
            );
        }
        if host.is_none() {
            assert!(
                !text.contains("server"),
                "_default must not pin a server: {text}"
            );
        }
        assert!(text.contains(&format!("[host.\"{MIRROR}\"]")));
        assert_eq!(
            hosts::merge(&text, MIRROR, Ipv6Hosts::Dotted),
            Ok(Merged::Unchanged)
        );
        assert_eq!(hosts::cleanup(&text), Cleaned::Delete { dir: created_dir });
    }
}

#[test]
fn a_file_ferry_created_and_the_operator_edited_is_kept() {
    let text = hosts::new_file(Some("ghcr.io"), MIRROR, Ipv6Hosts::Dotted, false);
    let edited =
        format!("{text}\n[host.\"https://ops-added.example\"]\n  capabilities = [\"pull\"]\n");
    match hosts::cleanup(&edited) {
        Cleaned::Restored(rest) => assert!(rest.contains("ops-added.example")),
        other => panic!("edited file must be kept, got {other:?}"),
    }
}

#[test]
fn mirror_url_change_replaces_the_block_in_place() {
    let input = fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/golden/hosts/dockerhub-operator-mirror/input.toml"),
    )
    .unwrap();
    let Merged::Updated(first) = hosts::merge(&input, MIRROR, Ipv6Hosts::Dotted).unwrap() else {
        panic!("first merge must update");
    };
    let Merged::Updated(second) =
        hosts::merge(&first, "http://127.0.0.1:7000", Ipv6Hosts::Dotted).unwrap()
    else {
        panic!("a new mirror URL must update");
    };
    assert!(!second.contains("5480") && second.contains("7000"));
    assert_eq!(hosts::cleanup(&second), Cleaned::Restored(input));
}

/// The hosts containerd tries for a tag after Ferry's entry: what the upstream probe asks.
#[test]
fn upstreams_are_the_operators_resolving_hosts_then_the_server() {
    use ferry::containerd_config::dir::upstream_roots;
    use ferry::containerd_config::hosts::upstreams;
    let mirror = "http://127.0.0.1:5480";
    let text = r#"server = "https://registry.corp"

[host."http://127.0.0.1:5480"]
  capabilities = ["pull", "resolve"]

[host."https://pull-only.corp"]
  capabilities = ["pull"]

[host."https://cache.corp/prefix"]
  capabilities = ["pull", "resolve"]

[host."https://raw.corp/api"]
  override_path = true
"#;
    let (hosts, server) = upstreams(text, mirror).unwrap();
    assert_eq!(
        hosts,
        ["https://cache.corp/prefix/v2", "https://raw.corp/api"],
        "Ferry's own entry and pull-only hosts are not asked to resolve"
    );
    assert_eq!(server.as_deref(), Some("https://registry.corp/v2"));
    let (hosts, server) = upstreams("[host.\"http://10.0.0.1:5000\"]\n", mirror).unwrap();
    assert_eq!(
        (hosts, server),
        (vec!["http://10.0.0.1:5000/v2".to_string()], None)
    );

    // Found where containerd finds them: `<host>_<port>_`, `<host>`, `_default`; without
    // a file, the registry's default server (plain HTTP for localhost).
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    assert_eq!(
        upstream_roots(d, "docker.io", mirror),
        ["https://registry-1.docker.io/v2"]
    );
    assert_eq!(
        upstream_roots(d, "localhost:5000", mirror),
        ["http://localhost:5000/v2"]
    );
    std::fs::create_dir_all(d.join("_default")).unwrap();
    std::fs::write(
        d.join("_default/hosts.toml"),
        "[host.\"https://global-cache.corp\"]\n",
    )
    .unwrap();
    assert_eq!(
        upstream_roots(d, "ghcr.io", mirror),
        ["https://global-cache.corp/v2", "https://ghcr.io/v2"]
    );
    std::fs::create_dir_all(d.join("reg.corp_5000_")).unwrap();
    std::fs::write(
        d.join("reg.corp_5000_/hosts.toml"),
        "server = \"http://reg.corp:5000\"\n",
    )
    .unwrap();
    assert_eq!(
        upstream_roots(d, "reg.corp:5000", mirror),
        ["http://reg.corp:5000/v2"]
    );
}

/// L5: a `hosts.toml` or host directory that is a symbolic link (configuration management's)
/// is left as it is, by configure and cleanup, and a file planted where Ferry writes its temp
/// file is never written through.
#[test]
fn symbolic_links_and_planted_temp_files_are_left_alone() {
    use ferry::containerd_config::dir::{Action, cleanup, configure};
    use ferry::oci::registry::Registries;
    use std::os::unix::fs::symlink;

    let root = tempfile::tempdir().unwrap();
    let hosts = root.path().join("certs.d");
    let managed = root.path().join("cm");
    fs::create_dir_all(hosts.join("docker.io")).unwrap();
    fs::create_dir_all(managed.join("quay.io")).unwrap();
    let original = "server = \"https://registry-1.docker.io\"\n";
    fs::write(managed.join("hosts.toml"), original).unwrap();
    fs::write(managed.join("quay.io/hosts.toml"), original).unwrap();
    symlink(
        managed.join("hosts.toml"),
        hosts.join("docker.io/hosts.toml"),
    )
    .unwrap();
    symlink(managed.join("quay.io"), hosts.join("quay.io")).unwrap();
    // Whoever can write a host directory plants a link where a fixed temp name would be.
    fs::create_dir_all(hosts.join("ghcr.io")).unwrap();
    let canary = root.path().join("canary");
    fs::write(&canary, "keep me").unwrap();
    symlink(&canary, hosts.join("ghcr.io/hosts.toml.ferry-tmp")).unwrap();

    // The links, what they point at and the canary are as they were.
    let untouched = || {
        let link = fs::symlink_metadata(hosts.join("docker.io/hosts.toml")).unwrap();
        assert!(link.file_type().is_symlink());
        for file in ["hosts.toml", "quay.io/hosts.toml"] {
            assert_eq!(fs::read_to_string(managed.join(file)).unwrap(), original);
        }
        assert_eq!(fs::read_to_string(&canary).unwrap(), "keep me");
    };

    let outcomes = configure(&hosts, &Registries::All, MIRROR, Ipv6Hosts::Dotted).unwrap();
    let action = |dir: &str| {
        outcomes
            .iter()
            .find(|o| o.path.starts_with(hosts.join(dir)))
            .map(|o| o.action.clone())
            .unwrap_or_else(|| panic!("no outcome for {dir}: {outcomes:?}"))
    };
    assert!(
        matches!(action("docker.io"), Action::Skipped(r) if r.contains("symbolic link")),
        "{outcomes:?}"
    );
    assert!(
        matches!(action("quay.io"), Action::Skipped(r) if r.contains("symbolic link")),
        "{outcomes:?}"
    );
    assert_eq!(action("ghcr.io"), Action::Created);
    untouched();
    assert!(
        fs::read_to_string(hosts.join("ghcr.io/hosts.toml"))
            .unwrap()
            .contains(MIRROR)
    );

    cleanup(&hosts).unwrap();
    untouched();
    assert!(!hosts.join("ghcr.io/hosts.toml").exists());
}
