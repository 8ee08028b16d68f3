use super::*;
use crate::cli::{Cli, LoadError, settings};

/// The key a bad value is reported under.
fn bad_key(args: &[&str]) -> String {
    match settings(args.iter().copied()) {
        Err(LoadError::Config(e)) => e.key,
        other => panic!("{args:?}: {other:?}"),
    }
}

#[test]
fn defaults() {
    let c = settings([]).unwrap();
    assert_eq!(c.mirror_addr, "127.0.0.1:5480".parse().unwrap());
    assert_eq!(c.metrics_addr, "[::]:5483".parse().unwrap());
    assert_eq!(c.registries, Registries::All);
    assert_eq!(c.containerd_namespace, "k8s.io");
    assert_eq!(c.hosts_dir, PathBuf::from("/etc/containerd/certs.d"));
    assert_eq!(c.mirror_url(), "http://127.0.0.1:5480");
    assert_eq!(c.ready_taint.as_deref(), Some("ferry.dev/not-ready"));
    assert_eq!(c.peer_upload_limit, None);
    assert_eq!(c.coalescing(), Some(Duration::from_secs(3)));
}

#[test]
fn flag_beats_file_beats_default() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ferry.toml");
    std::fs::write(
        &file,
        "hosts-dir = \"/from/file\"\ndata-dir = \"/data/file\"\nregistries = [\"docker.io\", \"ghcr.io\"]\nrelay-fanout = 5\ncoalesce = \"false\"\nzero-copy = false\n",
    )
    .unwrap();
    let c = settings([
        "--config",
        file.to_str().unwrap(),
        "--hosts-dir",
        "/from/flag",
    ])
    .unwrap();
    assert_eq!(c.hosts_dir, PathBuf::from("/from/flag"));
    assert_eq!(c.data_dir, PathBuf::from("/data/file"));
    assert_eq!(
        c.registries,
        Registries::Only(vec!["docker.io".into(), "ghcr.io".into()])
    );
    assert_eq!(c.relay_fanout, 5, "an integer in the file");
    assert_eq!(c.coalescing(), None, "a boolean as a string");
    assert!(!c.zero_copy, "a boolean");
    assert_eq!(c.log_level, "info");
}

#[test]
fn the_last_of_a_repeated_flag_wins_and_the_subcommand_may_come_first() {
    let c = Cli::load(["ferry", "--data-dir", "/a", "configure", "--data-dir", "/b"]).unwrap();
    assert_eq!(c.settings.data_dir, PathBuf::from("/b"));
    assert_eq!(c.command, crate::cli::Command::Configure);
}

#[test]
fn empty_text_unsets_an_optional_setting() {
    let c = settings(["--ready-taint", "", "--peer-upload-limit", "0"]).unwrap();
    assert_eq!(c.ready_taint, None);
    assert_eq!(c.peer_upload_limit, None);
    let c = settings(["--peer-upload-limit", "50MiB", "--node-name", "n-1"]).unwrap();
    assert_eq!(c.peer_upload_limit, Some(50 << 20));
    assert_eq!(c.node_name.as_deref(), Some("n-1"));
    assert!(c.uses_kubernetes());
}

#[test]
fn bad_values_name_their_key() {
    for (args, key) in [
        (&["--mirror-addr", "localhost"][..], "mirror-addr"),
        (&["--registries", "docker.io,../etc"], "registries"),
        (&["--registries", "r:99999"], "registries"),
        (&["--log-format", "xml"], "log-format"),
        (&["--log-level", "[["], "log-level"),
        (&["--containerd-namespace", "a/b"], "containerd-namespace"),
        (&["--hosts-dir", ""], "hosts-dir"),
        (&["--coalesce", "yes"], "coalesce"),
        (&["--relay-fanout", "65"], "relay-fanout"),
        (&["--node-name", "Upper"], "node-name"),
        (&["--ready-taint", "a b"], "ready-taint"),
        (&["--bootstrap-peers", "nope"], "bootstrap-peers"),
        (&["--resolve-latest", "true"], "resolve-latest"),
    ] {
        assert_eq!(bad_key(args), key, "{args:?}");
    }
}

#[test]
fn bad_files_name_their_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ferry.toml");
    let path = file.to_str().unwrap();
    for (text, key) in [
        ("mirror-port = \"1\"", "mirror-port"),
        ("hosts-dir = 1.5", "hosts-dir"),
        ("hosts-dir = [\"a\", \"b\"]", "hosts-dir"),
        ("hosts-dir = ", "config"),
        ("log-format = \"yaml\"", "log-format"),
        ("resolve-latest = true", "resolve-latest"),
    ] {
        std::fs::write(&file, text).unwrap();
        assert_eq!(bad_key(&["--config", path]), key, "{text}");
    }
    let missing = dir.path().join("missing.toml");
    assert_eq!(bad_key(&["--config", missing.to_str().unwrap()]), "config");
}

#[test]
fn ipv6_addresses_are_taken_with_or_without_brackets() {
    let v6: SocketAddr = "[fd00::5]:5481".parse().unwrap();
    assert_eq!(addr("[fd00::5]:5481").unwrap(), v6);
    assert_eq!(addr("fd00::5:5481").unwrap(), v6);
    assert_eq!(
        addr("10.0.0.5:5481").unwrap(),
        "10.0.0.5:5481".parse::<SocketAddr>().unwrap()
    );
    for bad in ["fd00::5", "fd00::5:99999", "[fd00::5]", "10.0.0.5"] {
        assert!(addr(bad).is_err(), "{bad}");
    }
    assert_eq!(
        mirror_target("http://fd00::5:30480").unwrap(),
        "http://[fd00::5]:30480"
    );
    assert_eq!(
        mirror_target("http://[fd00::5]:30480").unwrap(),
        "http://[fd00::5]:30480"
    );
}

#[test]
fn mirror_target_overrides_the_url_written_to_hosts_toml() {
    let c = settings(["--mirror-target", "http://10.1.2.3:30480"]).unwrap();
    assert_eq!(c.mirror_url(), "http://10.1.2.3:30480");
    for bad in [
        "10.1.2.3:30480",
        "http://",
        "http://a/b",
        "ftp://x",
        "http://a\"b",
    ] {
        assert_eq!(bad_key(&["--mirror-target", bad]), "mirror-target", "{bad}");
    }
}

#[test]
fn a_non_loopback_mirror_needs_the_explicit_flag() {
    assert_eq!(bad_key(&["--mirror-addr", "10.0.0.1:5480"]), "mirror-addr");
}

#[test]
fn registry_filters_include_and_exclude() {
    let f =
        RegistryFilters::parse("docker\\.io/.*,ghcr\\.io/org/.*,!docker\\.io/private/.*").unwrap();
    assert!(f.allows("docker.io/library/nginx:1.27"));
    assert!(f.allows("ghcr.io/org/app:v1"));
    assert!(!f.allows("docker.io/private/secret:v1"));
    assert!(!f.allows("quay.io/x/y:z"));
    let only_exclude = RegistryFilters::parse("!registry\\.corp\\.example(:\\d+)?/.*").unwrap();
    assert!(only_exclude.allows("docker.io/library/nginx:1.27"));
    assert!(!only_exclude.allows("registry.corp.example:5000/payroll:v3"));
    assert!(RegistryFilters::parse("").unwrap().allows("anything"));
    // One per line, for regexes with commas.
    let lines = RegistryFilters::parse("a/b{1,2}\nc/.*").unwrap();
    assert!(lines.allows("a/bb") && lines.allows("c/d") && !lines.allows("a/bbb"));
}

#[test]
fn sizes_and_durations() {
    assert_eq!(size("4MiB"), Ok(4 << 20));
    assert_eq!(size("512KiB"), Ok(512 << 10));
    assert_eq!(size("123"), Ok(123));
    assert_eq!(size("4MB"), Ok(4_000_000), "decimal units are decimal");
    assert!(size("").is_err() && size("-1").is_err() && size("lots").is_err());
    assert_eq!(duration("20ms"), Ok(Duration::from_millis(20)));
    assert_eq!(duration("30m"), Ok(Duration::from_secs(1800)));
    assert_eq!(duration("1d"), Ok(Duration::from_secs(86_400)));
    assert!(duration("0s").is_err() && duration("5").is_err() && duration("soon").is_err());
}

#[test]
fn bad_filters_and_intervals_name_their_key() {
    for (args, key) in [
        (&["--registry-filters", "(unclosed"][..], "registry-filters"),
        (&["--reprovide-interval", "1h"], "reprovide-interval"),
        (
            &["--verify-before-serving", "lots"],
            "verify-before-serving",
        ),
        (&["--keep-budget", "150%"], "keep-budget"),
        (&["--keep-budget", "some"], "keep-budget"),
    ] {
        assert_eq!(bad_key(args), key, "{args:?}");
    }
}

#[test]
fn every_key_has_a_default_and_an_environment_variable() {
    let keys = Config::keys();
    assert_eq!(keys.len(), 43);
    assert!(keys.contains(&("relay-fanout".into(), "2".into())));
    assert!(keys.contains(&("peer-addr".into(), "".into())));
}

#[test]
fn wildcard_mirror_is_reached_over_loopback() {
    let c = settings([
        "--mirror-addr",
        "0.0.0.0:6000",
        "--mirror-allow-remote",
        "true",
    ])
    .unwrap();
    assert_eq!(c.mirror_url(), "http://127.0.0.1:6000");
    let c = settings([
        "--mirror-addr",
        "[::]:6000",
        "--mirror-allow-remote",
        "true",
    ])
    .unwrap();
    assert_eq!(c.mirror_url(), "http://[::1]:6000");
}

#[test]
fn a_keep_budget_is_a_size_or_a_share_of_the_filesystem() {
    let with = |v: &str| settings(["--keep-budget", v]).unwrap();
    assert_eq!(with("10%").keep_budget.bytes(1000), 100);
    assert_eq!(with("20GiB").keep_budget.bytes(1), 20 << 30);
    assert!(!with("0").keeps());
    assert!(!with("0%").keeps());
    assert!(settings([]).unwrap().keeps(), "on by default");
}
