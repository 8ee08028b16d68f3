use super::*;

#[test]
fn defaults() {
    let c = Config::load(&Flags::default()).unwrap();
    assert_eq!(c.mirror_addr, "127.0.0.1:5480".parse().unwrap());
    assert_eq!(c.metrics_addr, "[::]:5483".parse().unwrap());
    assert_eq!(c.registries, Registries::All);
    assert_eq!(c.containerd_namespace, "k8s.io");
    assert_eq!(c.hosts_dir, PathBuf::from("/etc/containerd/certs.d"));
    assert_eq!(c.mirror_url(), "http://127.0.0.1:5480");
}

#[test]
fn flag_beats_file_beats_default() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ferry.toml");
    std::fs::write(
        &file,
        "hosts-dir = \"/from/file\"\ndata-dir = \"/data/file\"\nregistries = [\"docker.io\", \"ghcr.io\"]\n",
    )
    .unwrap();
    let flags = Flags {
        config: Some(file),
        hosts_dir: Some("/from/flag".into()),
        ..Flags::default()
    };
    let c = Config::load(&flags).unwrap();
    assert_eq!(c.hosts_dir, PathBuf::from("/from/flag"));
    assert_eq!(c.data_dir, PathBuf::from("/data/file"));
    assert_eq!(
        c.registries,
        Registries::Only(vec!["docker.io".into(), "ghcr.io".into()])
    );
    assert_eq!(c.log_level, "info");
}

#[test]
fn bad_values_name_their_key() {
    let cases = [
        (
            Flags {
                mirror_addr: Some("localhost".into()),
                ..Flags::default()
            },
            "mirror-addr",
        ),
        (
            Flags {
                registries: Some("docker.io,../etc".into()),
                ..Flags::default()
            },
            "registries",
        ),
        (
            Flags {
                registries: Some("r:99999".into()),
                ..Flags::default()
            },
            "registries",
        ),
        (
            Flags {
                log_format: Some("xml".into()),
                ..Flags::default()
            },
            "log-format",
        ),
        (
            Flags {
                log_level: Some("[[".into()),
                ..Flags::default()
            },
            "log-level",
        ),
        (
            Flags {
                containerd_namespace: Some("a/b".into()),
                ..Flags::default()
            },
            "containerd-namespace",
        ),
        (
            Flags {
                hosts_dir: Some("".into()),
                ..Flags::default()
            },
            "hosts-dir",
        ),
    ];
    for (flags, key) in cases {
        assert_eq!(Config::load(&flags).unwrap_err().key, key);
    }
}

#[test]
fn bad_files_name_their_key() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("ferry.toml");
    for (text, key) in [
        ("mirror-port = \"1\"", "mirror-port"),
        ("hosts-dir = 5", "hosts-dir"),
        ("hosts-dir = ", "config"),
    ] {
        std::fs::write(&file, text).unwrap();
        let flags = Flags {
            config: Some(file.clone()),
            ..Flags::default()
        };
        assert_eq!(Config::load(&flags).unwrap_err().key, key, "{text}");
    }
    let flags = Flags {
        config: Some(dir.path().join("missing.toml")),
        ..Flags::default()
    };
    assert_eq!(Config::load(&flags).unwrap_err().key, "config");
}

#[test]
fn ipv6_addresses_are_taken_with_or_without_brackets() {
    let v6: SocketAddr = "[fd00::5]:5481".parse().unwrap();
    assert_eq!(addr("peer-addr", "[fd00::5]:5481").unwrap(), v6);
    assert_eq!(addr("peer-addr", "fd00::5:5481").unwrap(), v6);
    assert_eq!(
        addr("peer-addr", "10.0.0.5:5481").unwrap(),
        "10.0.0.5:5481".parse::<SocketAddr>().unwrap()
    );
    for bad in ["fd00::5", "fd00::5:99999", "[fd00::5]", "10.0.0.5"] {
        assert!(addr("peer-addr", bad).is_err(), "{bad}");
    }
    assert_eq!(
        mirror_target("http://fd00::5:30480").unwrap().unwrap(),
        "http://[fd00::5]:30480"
    );
    assert_eq!(
        mirror_target("http://[fd00::5]:30480").unwrap().unwrap(),
        "http://[fd00::5]:30480"
    );
}

#[test]
fn mirror_target_overrides_the_url_written_to_hosts_toml() {
    let flags = Flags {
        mirror_target: Some("http://10.1.2.3:30480".into()),
        ..Flags::default()
    };
    assert_eq!(
        Config::load(&flags).unwrap().mirror_url(),
        "http://10.1.2.3:30480"
    );
    for bad in [
        "10.1.2.3:30480",
        "http://",
        "http://a/b",
        "ftp://x",
        "http://a\"b",
    ] {
        let flags = Flags {
            mirror_target: Some(bad.into()),
            ..Flags::default()
        };
        assert_eq!(
            Config::load(&flags).unwrap_err().key,
            "mirror-target",
            "{bad}"
        );
    }
}

#[test]
fn a_non_loopback_mirror_needs_the_explicit_flag() {
    let flags = Flags {
        mirror_addr: Some("10.0.0.1:5480".into()),
        ..Flags::default()
    };
    assert_eq!(Config::load(&flags).unwrap_err().key, "mirror-addr");
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
    assert_eq!(size("k", "4MiB"), Ok(4 << 20));
    assert_eq!(size("k", "512KiB"), Ok(512 << 10));
    assert_eq!(size("k", "123"), Ok(123));
    assert!(size("k", "4MB").is_err() && size("k", "").is_err() && size("k", "-1").is_err());
    assert_eq!(duration("k", "20ms"), Ok(Duration::from_millis(20)));
    assert_eq!(duration("k", "30m"), Ok(Duration::from_secs(1800)));
    assert!(
        duration("k", "0s").is_err() && duration("k", "5").is_err() && duration("k", "1d").is_err()
    );
}

#[test]
fn bad_secret_files_and_filters_name_their_key() {
    let dir = tempfile::tempdir().unwrap();
    let short = dir.path().join("secret");
    std::fs::write(&short, "short").unwrap();
    for (flags, key) in [
        (
            Flags {
                cluster_secret_file: Some(short.to_str().unwrap().into()),
                ..Flags::default()
            },
            "cluster-secret-file",
        ),
        (
            Flags {
                registry_filters: Some("(unclosed".into()),
                ..Flags::default()
            },
            "registry-filters",
        ),
        (
            Flags {
                reprovide_interval: Some("1h".into()),
                ..Flags::default()
            },
            "reprovide-interval",
        ),
        (
            Flags {
                verify_before_serving: Some("lots".into()),
                ..Flags::default()
            },
            "verify-before-serving",
        ),
    ] {
        assert_eq!(Config::load(&flags).unwrap_err().key, key);
    }
}

#[test]
fn wildcard_mirror_is_reached_over_loopback() {
    let flags = Flags {
        mirror_addr: Some("0.0.0.0:6000".into()),
        mirror_allow_remote: Some("true".into()),
        ..Flags::default()
    };
    assert_eq!(
        Config::load(&flags).unwrap().mirror_url(),
        "http://127.0.0.1:6000"
    );
    let flags = Flags {
        mirror_addr: Some("[::]:6000".into()),
        mirror_allow_remote: Some("true".into()),
        ..Flags::default()
    };
    assert_eq!(
        Config::load(&flags).unwrap().mirror_url(),
        "http://[::1]:6000"
    );
}
