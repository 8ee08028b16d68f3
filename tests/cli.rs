//! The `ferry` binary's contract: configure and cleanup on a real hosts directory, exit codes,
//! and configuration precedence. No containerd needed.

#![allow(clippy::unwrap_used)] // test helpers panic by design

mod support;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output};

use support::{Ferry, snapshot};

fn ferry(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(Ferry::bin());
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    // Keep the machine's real containerd config out of these tests.
    cmd.env("FERRY_CONTAINERD_CONFIG", "/nonexistent/containerd.toml");
    cmd.output().expect("run ferry")
}

fn golden(case: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden/hosts")
        .join(case)
        .join("input.toml");
    std::fs::read_to_string(p).expect("golden input")
}

/// A hosts dir as operators have them: several registries with their own files, one file
/// ferry cannot parse, a legacy certificate directory, an empty directory.
fn operator_hosts_dir(root: &Path) {
    let write = |host: &str, text: &str| {
        std::fs::create_dir_all(root.join(host)).unwrap();
        std::fs::write(root.join(host).join("hosts.toml"), text).unwrap();
    };
    write("docker.io", &golden("dockerhub-operator-mirror"));
    write(
        "registry.corp.example:5000",
        &golden("private-ca-client-header"),
    );
    write("ghcr.io", &golden("comments-above-first-host"));
    write("quay.io", &golden("crlf"));
    write("10.0.0.5:5000", &golden("server-only-no-newline"));
    write("broken.example", &golden("unparseable"));
    std::fs::set_permissions(
        root.join("registry.corp.example:5000/hosts.toml"),
        std::fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    std::fs::create_dir_all(root.join("legacy.example")).unwrap();
    std::fs::write(
        root.join("legacy.example/ca.crt"),
        "-----BEGIN CERTIFICATE-----\n",
    )
    .unwrap();
    std::fs::create_dir_all(root.join("empty.example")).unwrap();
}

#[test]
fn configure_then_cleanup_leaves_the_hosts_dir_byte_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let hosts = tmp.path().join("certs.d");
    operator_hosts_dir(&hosts);
    let before = snapshot(&hosts);
    let dir = hosts.to_str().unwrap();

    let out = ferry(&["configure", "--hosts-dir", dir], &[]);
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("broken.example/hosts.toml: SKIPPED"),
        "{stdout}"
    );
    assert!(
        stdout.contains("legacy.example/hosts.toml: SKIPPED"),
        "{stdout}"
    );
    assert_eq!(
        std::fs::read_to_string(hosts.join("broken.example/hosts.toml")).unwrap(),
        golden("unparseable"),
        "a file ferry cannot parse is left untouched"
    );
    assert!(!hosts.join("legacy.example/hosts.toml").exists());

    // The mirror is first in every file containerd will read.
    for host in [
        "_default",
        "docker.io",
        "registry.corp.example:5000",
        "ghcr.io",
        "quay.io",
        "10.0.0.5:5000",
        "empty.example",
    ] {
        let text = std::fs::read_to_string(hosts.join(host).join("hosts.toml")).unwrap();
        let first = text
            .lines()
            .find(|l| l.starts_with("[host."))
            .unwrap_or_default();
        assert_eq!(
            first.trim_end(),
            "[host.\"http://127.0.0.1:5480\"]",
            "{host}:\n{text}"
        );
    }
    let mode = std::fs::metadata(hosts.join("registry.corp.example:5000/hosts.toml"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "the file's mode is kept");

    // Twice: nothing changes.
    let configured = snapshot(&hosts);
    let out = ferry(&["configure", "--hosts-dir", dir], &[]);
    assert!(out.status.success());
    assert_eq!(
        snapshot(&hosts),
        configured,
        "a second configure changed files"
    );

    let out = ferry(&["cleanup", "--hosts-dir", dir], &[]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        snapshot(&hosts),
        before,
        "cleanup must restore the hosts dir exactly"
    );
}

#[test]
fn listed_registries_get_new_directories_that_cleanup_removes() {
    let tmp = tempfile::tempdir().unwrap();
    let hosts = tmp.path().join("certs.d");
    std::fs::create_dir_all(&hosts).unwrap();
    let dir = hosts.to_str().unwrap();
    let out = ferry(
        &[
            "configure",
            "--hosts-dir",
            dir,
            "--registries",
            "docker.io,registry.local:5000",
            "--mirror-addr",
            "127.0.0.1:6000",
        ],
        &[],
    );
    assert!(out.status.success(), "{out:?}");
    let docker = std::fs::read_to_string(hosts.join("docker.io/hosts.toml")).unwrap();
    assert!(
        docker.contains("server = \"https://registry-1.docker.io\""),
        "{docker}"
    );
    assert!(
        docker.contains("[host.\"http://127.0.0.1:6000\"]"),
        "{docker}"
    );
    let local = std::fs::read_to_string(hosts.join("registry.local:5000/hosts.toml")).unwrap();
    assert!(
        local.contains("server = \"https://registry.local:5000\""),
        "{local}"
    );
    assert!(
        !hosts.join("_default").exists(),
        "only the listed registries"
    );

    let out = ferry(&["cleanup", "--hosts-dir", dir], &[]);
    assert!(out.status.success());
    assert_eq!(snapshot(&hosts), vec![], "ferry's directories are gone");
}

#[test]
fn bad_values_exit_64_with_one_line_naming_the_key() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("ferry.toml");
    std::fs::write(&file, "log-format = \"yaml\"\n").unwrap();
    let short_secret = tmp.path().join("secret");
    std::fs::write(&short_secret, "short").unwrap();
    type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (
            vec!["configure", "--mirror-addr", "nope"],
            vec![],
            "mirror-addr",
        ),
        (
            vec!["configure"],
            vec![("FERRY_METRICS_ADDR", "1.2.3.4")],
            "metrics-addr",
        ),
        (
            vec!["configure", "--config", file.to_str().unwrap()],
            vec![],
            "log-format",
        ),
        (vec!["run", "--registries", "a/b"], vec![], "registries"),
        (
            vec!["run", "--resolve-tags", "true"],
            vec![],
            "resolve-tags",
        ),
        // The flag it replaced says what replaced it, on the command line and in the file.
        (
            vec!["run", "--resolve-latest", "true"],
            vec![],
            "resolve-latest",
        ),
        (
            vec!["run"],
            vec![("FERRY_RESOLVE_LATEST", "false")],
            "resolve-latest",
        ),
        // Bare words that are no level used to be taken as a target filter: no line at all.
        (vec!["run", "--log-level", "verbose"], vec![], "log-level"),
        (vec!["run", "--log-level", "inf"], vec![], "log-level"),
        (
            vec!["run", "--registries", "https://docker.io"],
            vec![],
            "registries",
        ),
        // Read at start-up, not while parsing, and still reported as a bad value.
        (
            vec![
                "run",
                "--cluster-secret-file",
                short_secret.to_str().unwrap(),
            ],
            vec![],
            "cluster-secret-file",
        ),
        (
            vec!["configure"],
            vec![("FERRY_RELAY_FANOUT", "lots")],
            "relay-fanout",
        ),
        (
            vec!["wait-cleanup", "--daemonset", "x", "--timeout", "soon"],
            vec![],
            "timeout",
        ),
    ];
    for (args, env, key) in cases {
        let out = ferry(&args, &env);
        assert_eq!(out.status.code(), Some(64), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(stderr.contains(&format!("{key}:")), "{args:?}: {stderr}");
        assert!(!stderr.contains("port must be"), "{args:?}: {stderr}");
    }
}

/// `warning` (what operators of other tools type) logs warnings: it used to be taken as a
/// filter for a target named "warning", and Ferry then logged nothing at all.
#[test]
fn log_level_warning_logs_warnings() {
    for level in ["warning", "WARN"] {
        let tmp = tempfile::tempdir().unwrap();
        let (mirror, metrics, peer) = (
            support::free_addr(),
            support::free_addr(),
            support::free_addr(),
        );
        let mut cmd = Command::new(Ferry::bin());
        cmd.args(["run", "--log-level", level, "--hosts-dir"])
            .arg(tmp.path().join("certs.d"))
            .args(["--mirror-addr", &mirror.to_string()])
            .args(["--metrics-addr", &metrics.to_string()])
            .args(["--peer-addr", &peer.to_string()])
            .args(["--p2p-addr", "127.0.0.1:0", "--advertise-addr", "127.0.0.1"])
            .args(["--containerd-socket", "/nonexistent/containerd.sock"])
            .args(["--containerd-config", "/nonexistent/containerd.toml"])
            .arg("--data-dir")
            .arg(tmp.path().join("data"));
        let log = tmp.path().join("ferry.log");
        let run = support::Proc::spawn(cmd, log.clone());
        // Without a cluster secret, Ferry warns at start.
        support::wait_for("the no-secret warning", || {
            std::fs::read_to_string(&log).is_ok_and(|t| t.contains("NO CLUSTER SECRET"))
        });
        let text = std::fs::read_to_string(&log).unwrap();
        assert!(
            !text.contains(" INFO "),
            "{level}: info lines at warn level: {text}"
        );
        drop(run);
    }
}

#[test]
fn flag_beats_env_beats_file() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("ferry.toml");
    let from = |name: &str| tmp.path().join(name).to_str().unwrap().to_string();
    std::fs::write(&file, format!("hosts-dir = \"{}\"\n", from("file"))).unwrap();
    let cfg = file.to_str().unwrap();
    let only_file = ferry(&["configure", "--config", cfg], &[]);
    assert!(only_file.status.success());
    assert!(tmp.path().join("file/_default/hosts.toml").exists());
    let env = from("env");
    let with_env = ferry(
        &["configure", "--config", cfg],
        &[("FERRY_HOSTS_DIR", &env)],
    );
    assert!(with_env.status.success());
    assert!(tmp.path().join("env/_default/hosts.toml").exists());
    let flag = from("flag");
    let with_flag = ferry(
        &["configure", "--config", cfg, "--hosts-dir", &flag],
        &[("FERRY_HOSTS_DIR", &env)],
    );
    assert!(with_flag.status.success());
    assert!(tmp.path().join("flag/_default/hosts.toml").exists());
}

#[test]
fn version_prints_the_crate_version() {
    let out = ferry(&["version"], &[]);
    assert!(out.status.success());
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("ferry {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn documented_config_file_parses_and_lists_every_key() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/ferry.toml");
    let text = std::fs::read_to_string(&path).unwrap();
    let keys = ferry::config::Config::keys();
    for (key, default) in &keys {
        assert!(
            text.contains(&format!("# {key} = \"{default}\"")),
            "config/ferry.toml does not document {key} with its default {default:?}"
        );
    }
    let tmp = tempfile::tempdir().unwrap();
    let hosts = tmp.path().join("certs.d");
    let out = ferry(
        &[
            "configure",
            "--config",
            path.to_str().unwrap(),
            "--hosts-dir",
            hosts.to_str().unwrap(),
        ],
        &[],
    );
    assert!(out.status.success(), "{out:?}");
    // Uncommenting every key gives the defaults, which must load too.
    let uncommented: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("# ").filter(|l| l.contains(" = \"")))
        .filter(|l| keys.iter().any(|(k, _)| l.starts_with(&format!("{k} ="))))
        .map(|l| format!("{l}\n"))
        .collect();
    let all = tmp.path().join("all.toml");
    std::fs::write(&all, uncommented).unwrap();
    let out = ferry(
        &[
            "configure",
            "--config",
            all.to_str().unwrap(),
            "--hosts-dir",
            hosts.to_str().unwrap(),
        ],
        &[],
    );
    assert!(out.status.success(), "{out:?}");
}

#[test]
#[cfg_attr(
    not(feature = "system-tests"),
    ignore = "needs root or systemd: ./scripts/test.sh runs it"
)]
fn the_systemd_unit_verifies() {
    support::require("systemd-analyze");
    let tmp = tempfile::tempdir().unwrap();
    let unit =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("config/ferry.service"))
            .unwrap();
    assert!(unit.contains("ExecStart=/usr/local/bin/ferry run --config /etc/ferry/ferry.toml"));
    assert!(
        unit.contains("Before=kubelet.service") && unit.contains("After=network-online.target")
    );
    // Verify it as installed, with the binary this build produced in place of /usr/local/bin.
    let local = unit.replace("/usr/local/bin/ferry", Ferry::bin().to_str().unwrap());
    let path = tmp.path().join("ferry.service");
    std::fs::write(&path, local).unwrap();
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(&path)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let problems: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("ferry.service"))
        // Units this one orders itself against need not exist on a test machine.
        .filter(|l| !l.contains("kubelet.service") && !l.contains("containerd.service"))
        .collect();
    assert!(problems.is_empty(), "systemd-analyze verify: {stderr}");
}

/// One registry directory Ferry cannot read or write (here a directory where `hosts.toml`
/// should be, which even root cannot write over) never stops the others: `configure` and
/// `cleanup` do every other file and then exit 1 naming it, and `ferry run` starts, serves
/// and configures the rest.
#[test]
fn one_unwritable_registry_directory_never_stops_the_others() {
    let tmp = tempfile::tempdir().unwrap();
    let hosts = tmp.path().join("certs.d");
    std::fs::create_dir_all(hosts.join("bad.example/hosts.toml")).unwrap();
    std::fs::create_dir_all(hosts.join("docker.io")).unwrap();
    std::fs::write(
        hosts.join("docker.io/hosts.toml"),
        golden("dockerhub-operator-mirror"),
    )
    .unwrap();
    let before = snapshot(&hosts);
    let dir = hosts.to_str().unwrap();

    let out = ferry(&["configure", "--hosts-dir", dir], &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(stderr.contains("bad.example/hosts.toml"), "{stderr}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("FAILED"), "{stdout}");
    for done in ["_default/hosts.toml", "docker.io/hosts.toml"] {
        let text = std::fs::read_to_string(hosts.join(done)).unwrap();
        assert!(text.contains("127.0.0.1:5480"), "{done}: {text}");
    }

    let out = ferry(&["cleanup", "--hosts-dir", dir], &[]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(snapshot(&hosts), before, "everything else restored");

    // `ferry run`: no containerd here, which it waits for while serving.
    let (mirror, metrics) = (support::free_addr(), support::free_addr());
    let mut cmd = Command::new(Ferry::bin());
    cmd.args(["run", "--p2p", "false", "--hosts-dir", dir])
        .args(["--mirror-addr", &mirror.to_string()])
        .args(["--metrics-addr", &metrics.to_string()])
        .args(["--containerd-socket", "/nonexistent/containerd.sock"])
        .args(["--containerd-config", "/nonexistent/containerd.toml"])
        .arg("--data-dir")
        .arg(tmp.path().join("data"));
    let run = support::Proc::spawn(cmd, tmp.path().join("ferry.log"));
    support::wait_for("ferry run to serve despite the bad directory", || {
        support::http_status(&format!("http://{metrics}/healthz")) == Some(200)
    });
    let text = std::fs::read_to_string(hosts.join("_default/hosts.toml")).unwrap();
    assert!(text.contains(&format!("http://{mirror}")), "{text}");
    assert_eq!(
        support::http_status(&format!("http://{mirror}/v2/")),
        Some(200)
    );
    drop(run);
    let out = ferry(&["cleanup", "--hosts-dir", dir], &[]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(snapshot(&hosts), before, "restored after run too");
}

/// On a host where `/etc/containerd/certs.d` does not exist yet, the unit must still start.
/// No systemd runs as PID 1 here, so this is checked against systemd's documented behaviour:
/// systemd.exec(5), `ReadWritePaths=`: a listed path that does not exist makes the namespace
/// setup fail (the unit fails with 226/NAMESPACE) unless it is prefixed with `-` (then it is
/// skipped, and Ferry could not write there at all under `ProtectSystem=strict`);
/// `StateDirectory=` directories are created before the namespace is set up;
/// systemd.service(5): an `ExecStartPre=` command prefixed with `+` runs with full privileges,
/// outside the sandbox, and each command gets its namespace when it starts. So every
/// `ReadWritePaths=` entry is either a `StateDirectory=` or created by a `+` `ExecStartPre=`.
#[test]
#[cfg_attr(
    not(feature = "system-tests"),
    ignore = "needs root or systemd: ./scripts/test.sh runs it"
)]
fn the_systemd_unit_starts_on_a_host_without_the_hosts_dir() {
    let unit =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("config/ferry.service"))
            .unwrap();
    let value = |key: &str| -> Vec<String> {
        unit.lines()
            .filter_map(|l| l.strip_prefix(&format!("{key}=")))
            .flat_map(|v| v.split_whitespace().map(str::to_string))
            .collect()
    };
    let state: Vec<String> = value("StateDirectory")
        .iter()
        .map(|d| format!("/var/lib/{d}"))
        .collect();
    let pre: Vec<&str> = unit
        .lines()
        .filter_map(|l| l.strip_prefix("ExecStartPre=+/bin/mkdir -p "))
        .collect();
    let paths = value("ReadWritePaths");
    assert!(paths.contains(&"/etc/containerd/certs.d".to_string()));
    for path in paths {
        assert!(
            state.contains(&path) || pre.iter().any(|p| p.split_whitespace().any(|q| q == path)),
            "{path}: in ReadWritePaths= but neither a StateDirectory= nor created by a privileged ExecStartPre="
        );
    }
    // The sandbox this is about; ExecStartPre= always runs before ExecStart=.
    assert!(unit.contains("ProtectSystem=strict"));
}

/// The chart's `extraArgs` come after the flags it sets: a repeated flag takes its last value
/// instead of failing ("cannot be used multiple times" made the pod crash-loop).
#[test]
fn a_flag_given_twice_takes_its_last_value() {
    let tmp = tempfile::tempdir().unwrap();
    let (first, last) = (tmp.path().join("first"), tmp.path().join("last"));
    let out = ferry(
        &[
            "configure",
            "--hosts-dir",
            first.to_str().unwrap(),
            "--registries",
            "docker.io",
            "--hosts-dir",
            last.to_str().unwrap(),
        ],
        &[],
    );
    assert!(out.status.success(), "{out:?}");
    assert!(last.join("docker.io/hosts.toml").exists());
    assert!(!first.exists(), "the first value was used");
}

/// Without `--advertise-addr` (the systemd install; the chart passes the node's IP), Ferry
/// advertises an address of the interface that carries the default route, not the first one
/// listed: in a network namespace whose first interface (`eth0`) has no default route and a
/// later one (`uplink0`) has it, the peer address is `uplink0`'s. (The first address listed
/// is often docker0's or a CNI bridge's, which no other node can reach.) Needs root.
#[test]
#[cfg_attr(
    not(feature = "system-tests"),
    ignore = "needs root or systemd: ./scripts/test.sh runs it"
)]
fn without_an_advertise_address_the_default_routes_interface_is_advertised() {
    let mut net = support::netns::Net::new();
    let ns = net.add_host("adv", 5);
    let ip = |args: &[&str]| {
        let status = Command::new("ip")
            .args(["-n", &ns])
            .args(args)
            .status()
            .unwrap();
        assert!(status.success(), "ip {args:?}");
    };
    // A veth pair inside the namespace (this kernel has no `dummy` interfaces).
    ip(&[
        "link", "add", "uplink0", "type", "veth", "peer", "name", "uplink1",
    ]);
    ip(&["addr", "add", "192.168.77.7/24", "dev", "uplink0"]);
    ip(&["link", "set", "uplink1", "up"]);
    ip(&["link", "set", "uplink0", "up"]);
    ip(&["route", "add", "default", "dev", "uplink0"]);

    let tmp = tempfile::tempdir().unwrap();
    let mut cmd = support::in_netns(Some(&ns), Ferry::bin().to_str().unwrap());
    cmd.args(["run", "--hosts-dir"])
        .arg(tmp.path().join("certs.d"))
        .args(["--containerd-socket", "/nonexistent/containerd.sock"])
        .args(["--containerd-config", "/nonexistent/containerd.toml"])
        .arg("--data-dir")
        .arg(tmp.path().join("data"));
    let log = tmp.path().join("ferry.log");
    let run = support::Proc::spawn(cmd, log.clone());
    support::wait_for("the peer-to-peer node to start", || {
        std::fs::read_to_string(&log).is_ok_and(|t| t.contains("peer-to-peer node started"))
    });
    let text = std::fs::read_to_string(&log).unwrap();
    let picked = text
        .lines()
        .find(|l| l.contains("advertise address picked"))
        .unwrap_or_else(|| panic!("no pick logged: {text}"));
    assert!(
        picked.contains("ip=192.168.77.7") && picked.contains("interface=uplink0"),
        "{picked}"
    );
    let started = text
        .lines()
        .find(|l| l.contains("peer-to-peer node started"))
        .unwrap();
    assert!(started.contains("peer_addr=192.168.77.7:5481"), "{started}");
    drop(run);
    drop(tmp);
    drop(net);
}
