//! The Helm chart, linted by the real Helm library (helm-sdkpy bundles Helm v4), in both
//! networking modes. Lint errors and warnings fail the test; a deliberately broken copy proves
//! the linter is really looking.

#![allow(clippy::unwrap_used)] // test helpers panic by design

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

fn chart() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("charts/ferry")
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

/// (severity, path) of every lint message: 1 info, 2 warning, 3 error.
fn lint(chart: &Path) -> (Vec<(u64, String)>, bool) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/chart/lint.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(chart)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("ModuleNotFoundError"),
        "helm-sdkpy is required: pip install --ignore-requires-python helm-sdkpy (scripts/test.sh does)\n{stderr}"
    );
    if !out.status.success() {
        // A chart Helm cannot even load is reported as an exception.
        return (vec![(3, stderr.to_string())], true);
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let messages = v["Messages"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|m| {
            (
                m["Severity"].as_u64().unwrap_or(0),
                format!("{} {}", m["Path"], m["Err"]),
            )
        })
        .collect();
    (messages, !v["Errors"].is_null())
}

fn assert_clean(name: &str, chart: &Path) {
    let (messages, errors) = lint(chart);
    let bad: Vec<_> = messages.iter().filter(|(sev, _)| *sev >= 2).collect();
    assert!(!errors && bad.is_empty(), "{name}: helm lint: {messages:?}");
}

fn with_values(tmp: &Path, name: &str, edit: impl Fn(String) -> String) -> PathBuf {
    let dir = tmp.join(name).join("ferry");
    copy_dir(&chart(), &dir);
    let values = std::fs::read_to_string(dir.join("values.yaml")).unwrap();
    std::fs::write(dir.join("values.yaml"), edit(values)).unwrap();
    dir
}

#[test]
fn the_chart_lints_clean_with_host_networking_and_in_the_pod_network() {
    support::require("python3");
    let tmp = tempfile::tempdir().unwrap();
    assert_clean("defaults", &with_values(tmp.path(), "defaults", |v| v));
    let pod_network = with_values(tmp.path(), "pod-network", |v| {
        v.replace("hostNetwork: true", "hostNetwork: false")
    });
    assert!(
        std::fs::read_to_string(pod_network.join("values.yaml"))
            .unwrap()
            .contains("hostNetwork: false")
    );
    assert_clean("hostNetwork: false", &pod_network);
    let everything = with_values(tmp.path(), "everything", |v| {
        v.replace(
            "  enabled: false\n  interval",
            "  enabled: true\n  interval",
        )
        .replace(
            "  enabled: false\n  labels:\n    grafana_dashboard",
            "  enabled: true\n  labels:\n    grafana_dashboard",
        )
        .replace("registries: []", "registries: [docker.io, ghcr.io]")
        .replace(
            "registryFilters: []",
            "registryFilters: ['!registry\\.corp\\.example/.*']",
        )
    });
    assert_clean(
        "service monitor, dashboard, registries, filters",
        &everything,
    );
}

#[test]
fn a_broken_chart_fails_the_lint() {
    support::require("python3");
    let tmp = tempfile::tempdir().unwrap();
    let broken = with_values(tmp.path(), "broken", |v| v);
    std::fs::write(
        broken.join("templates/broken.yaml"),
        "kind: ConfigMap\n{{ .Values.nothing.here }}\n",
    )
    .unwrap();
    let (messages, errors) = lint(&broken);
    assert!(
        errors || messages.iter().any(|(sev, _)| *sev >= 3),
        "{messages:?}"
    );
}

#[test]
fn every_value_is_documented_in_the_chart_readme() {
    let values = std::fs::read_to_string(chart().join("values.yaml")).unwrap();
    let readme = std::fs::read_to_string(chart().join("README.md")).unwrap();
    let mut path: Vec<(usize, String)> = Vec::new();
    for line in values.lines() {
        let trimmed = line.trim_start();
        if trimmed.starts_with('#') || trimmed.starts_with('-') || trimmed.is_empty() {
            continue;
        }
        let Some((key, _)) = trimmed.split_once(':') else {
            continue;
        };
        let indent = line.len() - trimmed.len();
        path.retain(|(i, _)| *i < indent);
        path.push((indent, key.to_string()));
        let full: Vec<&str> = path.iter().map(|(_, k)| k.as_str()).collect();
        let full = full.join(".");
        assert!(
            readme.contains(&format!("`{full}`")),
            "charts/ferry/README.md does not document `{full}`"
        );
    }
}

/// Every object `helm template` renders (a real Helm 3 binary: `FERRY_HELM`, installed by
/// `scripts/test.sh`), as JSON, with `--set` values.
fn render(set: &[&str]) -> Vec<serde_json::Value> {
    render_with(set, None)
}

/// As [`render`] with the default values, for a cluster of Kubernetes `version`.
fn render_for_kubernetes(version: &str) -> Vec<serde_json::Value> {
    render_with(&[], Some(version))
}

fn render_with(set: &[&str], kube_version: Option<&str>) -> Vec<serde_json::Value> {
    let helm = std::env::var("FERRY_HELM").unwrap_or_else(|_| {
        panic!("FERRY_HELM must name a Helm 3 binary: ./scripts/test.sh installs one (scripts/lib.sh ensure_helm_binary)")
    });
    let mut cmd = Command::new(helm);
    cmd.args(["template", "ferry"]).arg(chart());
    for s in set {
        cmd.args(["--set", s]);
    }
    if let Some(v) = kube_version {
        cmd.args(["--kube-version", v]);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "helm template: {out:?}");
    let yaml_to_json = "import sys, json, yaml; print(json.dumps([d for d in yaml.safe_load_all(sys.stdin) if d]))";
    let mut py = Command::new("python3")
        .args(["-c", yaml_to_json])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    py.stdin.take().unwrap().write_all(&out.stdout).unwrap();
    let json = py.wait_with_output().unwrap();
    assert!(json.status.success(), "yaml: {json:?}");
    serde_json::from_slice(&json.stdout).unwrap()
}

fn ferry_daemonset(objects: &[serde_json::Value]) -> &serde_json::Value {
    objects
        .iter()
        .find(|o| o["kind"] == "DaemonSet" && o["metadata"]["name"] == "ferry")
        .unwrap_or_else(|| panic!("no ferry DaemonSet in {objects:?}"))
}

/// containerd recreates its socket when it restarts or is upgraded: a bind mount of the socket
/// file keeps pointing at the old one, so the socket's directory is mounted. A missing
/// containerd config must not become a directory the kubelet creates in its place (that
/// stops containerd's next start): the config's directory is mounted, never the file, and
/// nothing is created on the node but the hosts dir, the data dir and their parents.
#[test]
fn the_chart_mounts_containerd_by_directory_and_never_creates_its_config() {
    for set in [
        &[][..],
        &[
            "containerd.socket=/run/k3s/containerd/containerd.sock",
            "containerd.config=/var/lib/rancher/k3s/agent/etc/containerd/config.toml",
            "containerd.hostsDir=/var/lib/rancher/k3s/agent/etc/containerd/certs.d",
        ][..],
    ] {
        let objects = render(set);
        let pod = &ferry_daemonset(&objects)["spec"]["template"]["spec"];
        let volumes = pod["volumes"].as_array().unwrap();
        let host_paths: Vec<(String, String)> = volumes
            .iter()
            .filter_map(|v| {
                let hp = &v["hostPath"];
                Some((
                    hp["path"].as_str()?.to_string(),
                    hp["type"].as_str().unwrap_or("").to_string(),
                ))
            })
            .collect();
        let socket = set.first().map_or("/run/containerd/containerd.sock", |s| {
            s.split('=').nth(1).unwrap()
        });
        let config = set.get(1).map_or("/etc/containerd/config.toml", |s| {
            s.split('=').nth(1).unwrap()
        });
        let dir_of = |p: &str| p.rsplit_once('/').unwrap().0.to_string();
        for (path, kind) in &host_paths {
            assert_ne!(
                kind, "Socket",
                "{set:?}: the socket file is mounted: {host_paths:?}"
            );
            assert_ne!(path, socket, "{set:?}: {host_paths:?}");
            assert_ne!(
                path, config,
                "{set:?}: the config file is mounted: {host_paths:?}"
            );
            assert!(
                !kind.is_empty(),
                "{set:?}: {path} has no type (the kubelet creates a directory)"
            );
        }
        assert!(
            host_paths.contains(&(dir_of(socket), "Directory".to_string())),
            "{set:?}: {host_paths:?}"
        );
        assert!(
            host_paths.iter().any(|(p, _)| *p == dir_of(config)),
            "{set:?}: {host_paths:?}"
        );
        // The container reaches both at the paths Ferry is told.
        let container = &pod["containers"][0];
        let args = container["args"].to_string();
        assert!(
            args.contains(&format!("--containerd-socket={socket}")),
            "{args}"
        );
        assert!(
            args.contains(&format!("--containerd-config={config}")),
            "{args}"
        );
        let mounts: Vec<&str> = container["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|m| m["mountPath"].as_str())
            .collect();
        assert!(mounts.contains(&dir_of(socket).as_str()), "{mounts:?}");
        assert!(mounts.contains(&dir_of(config).as_str()), "{mounts:?}");
    }
}

/// Every object the chart renders (for that version), in both network modes and the main value
/// combinations, is valid for Kubernetes 1.28 (the oldest we support) and 1.37 (the newest
/// the validator ships), strictly (an unknown field is an error): `kubernetes-validate --strict`, which
/// `./scripts/test.sh` installs from PyPI. The ServiceMonitor is a Prometheus Operator custom
/// resource with no schema there: it is checked for its fields here instead.
#[test]
fn every_rendered_object_is_valid_for_kubernetes_1_28_and_the_newest() {
    let validate = || {
        let mut cmd = Command::new("python3");
        cmd.args(["-m", "kubernetes_validate"]);
        cmd
    };
    let installed = validate().arg("--version").output().unwrap();
    assert!(
        installed.status.success(),
        "kubernetes-validate is required: pip install kubernetes-validate (scripts/test.sh does)"
    );
    for version in ["1.28.0", "1.37.0"] {
        validate_for(version, &validate);
    }
}

fn validate_for(version: &str, validate: &dyn Fn() -> Command) {
    let dir = tempfile::tempdir().unwrap();
    let mut files = Vec::new();
    for (i, set) in [
        &[][..],
        &["hostNetwork=false"][..],
        &[
            "clusterSecret.existingSecret=ferry-secret",
            "serviceMonitor.enabled=true",
            "grafanaDashboard.enabled=true",
        ][..],
        &[
            "clusterSecret.create=false",
            "cleanup.enabled=false",
            "registries={docker.io,ghcr.io}",
            "registryFilters={^docker\\.io/library/}",
        ][..],
    ]
    .iter()
    .enumerate()
    {
        for (j, object) in render_with(set, Some(version)).iter().enumerate() {
            if object["kind"] == "ServiceMonitor" {
                assert_eq!(object["apiVersion"], "monitoring.coreos.com/v1");
                assert!(object["spec"]["endpoints"][0]["port"].is_string());
                continue;
            }
            let file = dir.path().join(format!("{i}-{j}.json"));
            std::fs::write(&file, object.to_string()).unwrap();
            files.push(file);
        }
    }
    assert!(files.len() > 10, "rendered only {} objects", files.len());
    let out = validate()
        .args(["--strict", "--quiet", "--kubernetes-version", version])
        .args(&files)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kubernetes {version}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Everything the chart runs, the uninstall hook included, is Ferry's own image (the hook's
/// wait used `bitnami/kubectl`, no longer published under that name), and the hook may only
/// read and delete its own cleanup DaemonSet.
#[test]
fn everything_the_chart_runs_is_ferrys_image_and_the_hook_touches_only_its_daemonset() {
    let objects = render(&["image.repository=registry.example/ferry", "image.tag=1.2.3"]);
    let mut images = Vec::new();
    for o in &objects {
        let spec = &o["spec"]["template"]["spec"];
        for list in ["initContainers", "containers"] {
            for c in spec[list].as_array().into_iter().flatten() {
                images.push((o["kind"].to_string(), c["image"].to_string()));
            }
        }
    }
    let kinds: Vec<&str> = images.iter().map(|(k, _)| k.as_str()).collect();
    assert!(kinds.contains(&"\"Job\""), "{images:?}");
    for (kind, image) in &images {
        assert_eq!(image, "\"registry.example/ferry:1.2.3\"", "{kind}");
    }
    let job = objects.iter().find(|o| o["kind"] == "Job").unwrap();
    let args = job["spec"]["template"]["spec"]["containers"][0]["args"].to_string();
    assert!(
        args.contains("wait-cleanup") && args.contains("--daemonset=ferry-cleanup"),
        "{args}"
    );
    let role = objects
        .iter()
        .find(|o| o["kind"] == "Role" && o["metadata"]["name"] == "ferry-cleanup")
        .unwrap();
    assert_eq!(
        role["rules"],
        serde_json::json!([{"apiGroups": ["apps"], "resources": ["daemonsets"], "resourceNames": ["ferry-cleanup"], "verbs": ["get", "delete"]}])
    );
}

/// Review L6: every pod runs under the runtime's default seccomp profile, the cleanup
/// DaemonSet gets no service account token and the chart's pull settings, and Ferry may create
/// events only in the namespace node events go to.
#[test]
fn every_pod_is_confined_and_events_are_granted_in_one_namespace() {
    let objects = render(&["imagePullSecrets[0].name=pull"]);
    let pods: Vec<&serde_json::Value> = objects
        .iter()
        .filter(|o| o["spec"]["template"]["spec"].is_object())
        .collect();
    assert!(pods.len() >= 3, "the DaemonSets and the Job");
    for o in &pods {
        let spec = &o["spec"]["template"]["spec"];
        let name = &o["metadata"]["name"];
        assert_eq!(
            spec["securityContext"]["seccompProfile"]["type"], "RuntimeDefault",
            "{name}"
        );
        assert_eq!(spec["imagePullSecrets"][0]["name"], "pull", "{name}");
        for list in ["initContainers", "containers"] {
            for c in spec[list].as_array().into_iter().flatten() {
                assert!(c["imagePullPolicy"].is_string(), "{name}: {}", c["name"]);
            }
        }
    }
    let cleanup = objects
        .iter()
        .find(|o| o["kind"] == "DaemonSet" && o["metadata"]["name"] == "ferry-cleanup")
        .unwrap();
    assert_eq!(
        cleanup["spec"]["template"]["spec"]["automountServiceAccountToken"],
        false
    );
    let cluster_wide_events = objects
        .iter()
        .any(|o| o["kind"] == "ClusterRole" && o["rules"].to_string().contains("\"events\""));
    assert!(!cluster_wide_events, "events are not granted cluster-wide");
    let events = objects
        .iter()
        .find(|o| o["kind"] == "Role" && o["metadata"]["name"] == "ferry-events")
        .unwrap();
    assert_eq!(events["metadata"]["namespace"], "default");
    assert_eq!(
        events["rules"],
        serde_json::json!([{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}])
    );
}

/// The node patch policy (Kubernetes 1.30+): Ferry's service account may change the ready
/// taint of the node its token names, and nothing else. No API server runs here: the policy's
/// CEL is evaluated with cel-python (tests/support/vap_check.py) on the admission requests
/// that matter. Rendered only where the API exists.
#[test]
fn the_node_policy_lets_ferry_lift_only_its_own_nodes_taint() {
    let objects = render(&[]);
    let policy = objects
        .iter()
        .find(|o| o["kind"] == "ValidatingAdmissionPolicy")
        .expect("the policy is rendered by default (helm's own capabilities: 1.30+)")
        .clone();
    assert!(
        objects
            .iter()
            .any(|o| o["kind"] == "ValidatingAdmissionPolicyBinding"
                && o["spec"]["policyName"] == policy["metadata"]["name"]
                && o["spec"]["validationActions"] == serde_json::json!(["Deny"]))
    );
    for (set, rendered) in [
        (&["nodePatchPolicy.enabled=false"][..], false),
        (&["nodePatchPolicy.enabled=true"][..], true),
    ] {
        let has = render(set)
            .iter()
            .any(|o| o["kind"] == "ValidatingAdmissionPolicy");
        assert_eq!(has, rendered, "{set:?}");
    }
    assert!(
        !render_for_kubernetes("1.29.0")
            .iter()
            .any(|o| o["kind"] == "ValidatingAdmissionPolicy"),
        "not before 1.30"
    );

    use serde_json::json;
    let node = |name: &str, taints: serde_json::Value, labels: serde_json::Value| {
        json!({"apiVersion": "v1", "kind": "Node",
               "metadata": {"name": name, "labels": labels},
               "spec": {"taints": taints, "podCIDRs": ["10.0.1.0/24"], "providerID": "aws:///i-1"}})
    };
    let ours = json!({"key": "ferry.dev/not-ready", "effect": "NoSchedule"});
    let other = json!({"key": "dedicated", "value": "gpu", "effect": "NoSchedule"});
    let labels = json!({"kubernetes.io/hostname": "node-a"});
    let user = |name: &str, node: Option<&str>| {
        // A token not bound to a pod has no `extra` at all.
        match node {
            Some(n) => {
                json!({"userInfo": {"username": name, "extra": {"authentication.kubernetes.io/node-name": [n]}}, "operation": "UPDATE"})
            }
            None => json!({"userInfo": {"username": name}, "operation": "UPDATE"}),
        }
    };
    let ferry = "system:serviceaccount:default:ferry";
    let before = node("node-a", json!([ours, other]), labels.clone());
    let lifted = node("node-a", json!([other]), labels.clone());
    let cases = json!([
        {"name": "lift own taint", "request": user(ferry, Some("node-a")), "oldObject": before, "object": lifted},
        {"name": "another node", "request": user(ferry, Some("node-b")), "oldObject": before, "object": lifted},
        {"name": "no node in token", "request": user(ferry, None), "oldObject": before, "object": lifted},
        {"name": "another taint", "request": user(ferry, Some("node-a")), "oldObject": before,
         "object": node("node-a", json!([ours]), labels.clone())},
        {"name": "a label", "request": user(ferry, Some("node-a")), "oldObject": before,
         "object": node("node-a", json!([other]), json!({"kubernetes.io/hostname": "node-a", "x": "y"}))},
        {"name": "cordon", "request": user(ferry, Some("node-a")), "oldObject": before,
         "object": {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-a", "labels": labels},
                    "spec": {"taints": [other], "podCIDRs": ["10.0.1.0/24"], "providerID": "aws:///i-1", "unschedulable": true}}},
        {"name": "someone else", "request": user("system:node:node-a", Some("node-a")), "oldObject": before,
         "object": node("node-a", json!([]), json!({}))},
    ]);
    let input = json!({"policy": policy, "cases": cases});
    let mut py = Command::new("python3")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/vap_check.py"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    py.stdin
        .take()
        .unwrap()
        .write_all(input.to_string().as_bytes())
        .unwrap();
    let out = py.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "cel-python is required (pip install cel-python; scripts/test.sh does): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let verdicts: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let verdict = |name: &str| verdicts[name].as_str().unwrap().to_string();
    assert_eq!(verdict("lift own taint"), "allowed");
    assert_eq!(verdict("someone else"), "not matched");
    for (name, says) in [
        ("another node", "only the node it runs on"),
        ("no node in token", "only the node it runs on"),
        ("another taint", "only its own taint"),
        ("a label", "labels or annotations"),
        ("cordon", "only its own taint"),
    ] {
        let v = verdict(name);
        assert!(v.starts_with("denied") && v.contains(says), "{name}: {v}");
    }
}

/// The Grafana dashboard is valid JSON and every series its queries use is one Ferry exports
/// (a renamed metric would leave an empty panel, silently).
#[test]
fn the_dashboard_queries_only_metrics_ferry_exports() {
    let objects = render(&["grafanaDashboard.enabled=true"]);
    let map = objects
        .iter()
        .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == "ferry-dashboard")
        .expect("the dashboard ConfigMap");
    let dashboard: serde_json::Value =
        serde_json::from_str(map["data"]["ferry.json"].as_str().unwrap()).unwrap();
    // Families with no series yet (no failure so far) are not in the exposition: the
    // registered names come from the one place every family is registered.
    let source =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/metrics/mod.rs"))
            .unwrap();
    let registered: Vec<String> = regex::Regex::new(r#"register\(\s*"([a-z_]+)""#)
        .unwrap()
        .captures_iter(&source)
        .map(|c| format!("ferry_{}", &c[1]))
        .collect();
    assert!(registered.len() > 20, "{registered:?}");
    let process = ferry::metrics::Metrics::new().encode();
    let names = regex::Regex::new(r"\b(?:ferry|process)_[a-z_]+").unwrap();
    let mut checked = 0;
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().unwrap() {
            let expr = target["expr"].as_str().unwrap();
            for name in names.find_iter(expr) {
                let name = name.as_str();
                // A family's series are its name, plus _total for a counter, _bucket, _sum and
                // _count for a histogram, _info for an info metric.
                let family = ["_total", "_bucket", "_sum", "_count", "_info"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s))
                    .unwrap_or(name);
                assert!(
                    registered.iter().any(|r| r == family)
                        || process.lines().any(|l| l.starts_with(name)),
                    "panel {:?} queries {name}, which Ferry does not export",
                    panel["title"]
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 10, "{checked} metric names checked");
}

/// The relay values reach Ferry's flags, 0 included (a `default` would turn it into 2), and
/// Ferry takes the flags as the chart renders them.
#[test]
fn relay_fanout_and_the_upload_limit_reach_ferrys_flags() {
    let args = |set: &[&str]| -> Vec<String> {
        let objects = render(set);
        let ds = ferry_daemonset(&objects);
        ds["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_string())
            .collect()
    };
    let defaults = args(&[]);
    assert!(
        defaults.contains(&"--relay-fanout=2".to_string()),
        "{defaults:?}"
    );
    assert!(
        !defaults
            .iter()
            .any(|a| a.starts_with("--peer-upload-limit"))
    );
    let set = args(&["relayFanout=0", "peerUploadLimit=50MiB"]);
    assert!(set.contains(&"--relay-fanout=0".to_string()), "{set:?}");
    assert!(
        set.contains(&"--peer-upload-limit=50MiB".to_string()),
        "{set:?}"
    );
    let tmp = tempfile::tempdir().unwrap();
    let hosts = tmp.path().join("certs.d");
    let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
        .args(["configure", "--hosts-dir", hosts.to_str().unwrap()])
        .args(["--relay-fanout=0", "--peer-upload-limit=50MiB"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

/// Every flag and variable the chart gives Ferry is one Ferry takes, in each mode: the
/// rendered arguments (with the downward API's values filled in) pass `ferry configure`.
#[test]
fn the_daemonsets_arguments_are_settings_ferry_accepts() {
    for set in [
        &[][..],
        &["hostNetwork=false"],
        &[
            "relayFanout=0",
            "peerUploadLimit=50MiB",
            "debugPage.enabled=true",
        ],
    ] {
        for ip in ["10.0.0.5", "fd00::5"] {
            let objects = render(set);
            let container = &ferry_daemonset(&objects)["spec"]["template"]["spec"]["containers"][0];
            let mut env: Vec<(String, String)> = Vec::new();
            for var in container["env"].as_array().into_iter().flatten() {
                let name = var["name"].as_str().unwrap().to_string();
                let value = match var["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                    Some("spec.nodeName") => "node-1".to_string(),
                    Some("metadata.namespace") => "ferry".to_string(),
                    Some(_) => ip.to_string(),
                    None => var["value"].as_str().unwrap_or_default().to_string(),
                };
                env.push((name, value));
            }
            let expand = |arg: &str| {
                env.iter().fold(arg.to_string(), |a, (k, v)| {
                    a.replace(&format!("$({k})"), v)
                })
            };
            let args: Vec<String> = container["args"]
                .as_array()
                .unwrap()
                .iter()
                .skip(1)
                .map(|a| expand(a.as_str().unwrap()))
                .collect();
            let tmp = tempfile::tempdir().unwrap();
            let hosts = tmp.path().join("certs.d");
            let out = Command::new(env!("CARGO_BIN_EXE_ferry"))
                .arg("configure")
                .args(&args)
                .args(["--hosts-dir", hosts.to_str().unwrap()])
                .args(["--containerd-socket", "/nonexistent/containerd.sock"])
                .envs(env.iter().map(|(k, v)| (k, v)))
                .output()
                .unwrap();
            assert!(out.status.success(), "{set:?} {ip}: {args:?}: {out:?}");
        }
    }
}
