//! Reads containerd's own config (never edits it) and says what would stop Ferry from working.

use std::path::Path;

/// One finding: its `problem` label of `ferry_config_problems` and its text, with the fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    pub problem: &'static str,
    pub text: String,
}

/// Every `problem` a warning can name.
pub const PROBLEMS: [&str; 6] = [
    "no_containerd_config",
    "containerd_config_unreadable",
    "cri_config_path_unset",
    "cri_config_path_elsewhere",
    "cri_registry_mirrors",
    "discard_unpacked_layers",
];

impl Warning {
    fn new(problem: &'static str, text: impl Into<String>) -> Self {
        Warning {
            problem,
            text: text.into(),
        }
    }
}

impl std::fmt::Display for Warning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::ops::Deref for Warning {
    type Target = str;
    fn deref(&self) -> &str {
        &self.text
    }
}

/// containerd deletes layers once unpacked: only a problem when Ferry holds nothing.
pub const DISCARD: &str = "discard_unpacked_layers";

/// CRI plugin tables: config version 2, and version 3 (containerd 2.x).
const CRI_V2: &str = "io.containerd.grpc.v1.cri";
const CRI_V3_IMAGES: &str = "io.containerd.cri.v1.images";

/// At most this many files are read through `imports`.
const MAX_IMPORTS: usize = 64;

/// Checks `config_file` and its `imports` against what Ferry needs. A missing file is a
/// warning, never a failure.
pub fn check(config_file: &Path, hosts_dir: &Path) -> Vec<Warning> {
    match load(config_file) {
        Ok(doc) => check_table(&doc, hosts_dir)
            .into_iter()
            .map(|w| {
                let text = format!("containerd config {}: {w}", config_file.display());
                Warning::new(w.problem, text)
            })
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => vec![Warning::new(
            "no_containerd_config",
            format!(
                "no containerd config at {}: containerd runs on its defaults, where (before 2.0) CRI's config_path is unset and kubelet's pulls do not use Ferry; point --containerd-config at the config containerd uses, or set config_path = \"{}\" in it",
                config_file.display(),
                hosts_dir.display()
            ),
        )],
        Err(e) => vec![Warning::new("containerd_config_unreadable", e.to_string())],
    }
}

/// The config as containerd sees it: each import (recursively, each once) merged over it in
/// order, as containerd's `mergeConfig` does: tables key by key, arrays appended, else replaced.
fn load(config_file: &Path) -> std::io::Result<toml::Table> {
    let read = |path: &Path| -> std::io::Result<toml::Table> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            let what = format!("cannot read containerd config {}: {e}", path.display());
            std::io::Error::new(e.kind(), what)
        })?;
        text.parse().map_err(|e: toml::de::Error| {
            let what = format!(
                "containerd config {} is not valid TOML: {}",
                path.display(),
                e.message()
            );
            std::io::Error::new(std::io::ErrorKind::InvalidData, what)
        })
    };
    let mut merged = read(config_file)?;
    let mut seen = vec![config_file.to_path_buf()];
    let mut pending = imports(&merged, config_file);
    while let Some(path) = pending.first().cloned() {
        pending.remove(0);
        if seen.contains(&path) || seen.len() > MAX_IMPORTS {
            continue;
        }
        seen.push(path.clone());
        // containerd fails to start on an import it cannot read; so would this check.
        let doc = read(&path)?;
        pending.extend(imports(&doc, &path));
        merge_into(&mut merged, doc);
    }
    Ok(merged)
}

/// The files `doc` (read from `path`) imports, globs expanded in sorted order.
fn imports(doc: &toml::Table, path: &Path) -> Vec<std::path::PathBuf> {
    let dir = path.parent().unwrap_or(Path::new("/"));
    let listed = doc.get("imports").and_then(|v| v.as_array());
    let mut out = Vec::new();
    for entry in listed.into_iter().flatten().filter_map(|v| v.as_str()) {
        let full = dir.join(entry);
        if entry.contains('*') {
            out.extend(glob(&full));
        } else {
            out.push(full);
        }
    }
    out
}

/// `*` and `?` in the last path component (`conf.d/*.toml`).
fn glob(pattern: &Path) -> Vec<std::path::PathBuf> {
    let (Some(dir), Some(name)) = (pattern.parent(), pattern.file_name()) else {
        return Vec::new();
    };
    let name = name.to_string_lossy();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut found: Vec<_> = entries
        .filter_map(Result::ok)
        .filter(|e| matches(&name, &e.file_name().to_string_lossy()))
        .map(|e| e.path())
        .collect();
    found.sort();
    found
}

fn matches(pattern: &str, name: &str) -> bool {
    match (pattern.chars().next(), name.chars().next()) {
        (None, None) => true,
        (Some('*'), _) => {
            matches(&pattern[1..], name)
                || (!name.is_empty()
                    && matches(
                        pattern,
                        &name[name.chars().next().map_or(0, char::len_utf8)..],
                    ))
        }
        (Some('?'), Some(c)) => matches(&pattern[1..], &name[c.len_utf8()..]),
        (Some(p), Some(c)) if p == c => matches(&pattern[p.len_utf8()..], &name[c.len_utf8()..]),
        _ => false,
    }
}

fn merge_into(to: &mut toml::Table, from: toml::Table) {
    for (key, value) in from {
        match (to.get_mut(&key), value) {
            (Some(toml::Value::Table(a)), toml::Value::Table(b)) => merge_into(a, b),
            (Some(toml::Value::Array(a)), toml::Value::Array(b)) => {
                a.extend(b.into_iter().filter(|v| !a.contains(v)).collect::<Vec<_>>());
            }
            (_, value) => {
                to.insert(key, value);
            }
        }
    }
}

fn check_table(doc: &toml::Table, hosts_dir: &Path) -> Vec<Warning> {
    let version = doc.get("version").and_then(|v| v.as_integer()).unwrap_or(1);
    let plugins = doc.get("plugins").and_then(|p| p.as_table());
    let get = |plugin: &str, path: &[&str]| -> Option<&toml::Value> {
        let mut v = plugins?.get(plugin)?;
        for key in path {
            v = v.as_table()?.get(*key)?;
        }
        Some(v)
    };
    let (registry, discard) = if version >= 3 {
        (
            get(CRI_V3_IMAGES, &["registry"]),
            get(CRI_V3_IMAGES, &["discard_unpacked_layers"]),
        )
    } else {
        (
            get(CRI_V2, &["registry"]),
            get(CRI_V2, &["containerd", "discard_unpacked_layers"]),
        )
    };
    let mut warnings = Vec::new();
    let config_path = registry
        .and_then(|r| r.get("config_path"))
        .and_then(|p| p.as_str())
        .unwrap_or("");
    if config_path.is_empty() {
        warnings.push(Warning::new(
            "cri_config_path_unset",
            format!(
                "CRI registry config_path is not set, so kubelet's pulls will not use Ferry; set config_path = \"{}\" in the CRI plugin's registry section and restart containerd",
                hosts_dir.display()
            ),
        ));
    } else if !config_path.split(':').any(|p| Path::new(p) == hosts_dir) {
        warnings.push(Warning::new(
            "cri_config_path_elsewhere",
            format!(
                "CRI registry config_path is \"{config_path}\" but Ferry writes to \"{}\"; kubelet's pulls will not use Ferry; run Ferry with --hosts-dir \"{config_path}\" (chart: containerd.hostsDir), or add Ferry's dir to config_path (a colon-separated list)",
                hosts_dir.display()
            ),
        ));
    }
    let has_mirrors = registry
        .and_then(|r| r.get("mirrors"))
        .and_then(|m| m.as_table())
        .is_some_and(|m| !m.is_empty());
    if has_mirrors {
        warnings.push(Warning::new(
            "cri_registry_mirrors",
            "deprecated registry.mirrors is set; containerd does not combine it with config_path: move each mirror into a hosts.toml under config_path, remove registry.mirrors and restart containerd",
        ));
    }
    if discard.and_then(|d| d.as_bool()) == Some(true) {
        warnings.push(Warning::new(
            "discard_unpacked_layers",
            "discard_unpacked_layers = true: containerd deletes layers after unpacking, so Ferry cannot serve them to anyone; set discard_unpacked_layers = false and restart containerd (images pulled before keep no layers until pulled again)",
        ));
    }
    warnings
}

#[cfg(test)]
mod tests {
    use super::*;

    fn warnings(text: &str) -> Vec<Warning> {
        check_table(&text.parse().unwrap(), Path::new("/etc/containerd/certs.d"))
    }

    #[test]
    fn a_good_v2_config_has_no_warnings() {
        let cfg = r#"
version = 2
[plugins."io.containerd.grpc.v1.cri".registry]
  config_path = "/etc/containerd/certs.d"
"#;
        assert!(warnings(cfg).is_empty());
    }

    #[test]
    fn missing_config_path_and_discard_are_reported() {
        let cfg = r#"
version = 2
[plugins."io.containerd.grpc.v1.cri".containerd]
  discard_unpacked_layers = true
"#;
        let w = warnings(cfg);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].contains("config_path is not set"));
        assert!(w[1].contains("discard_unpacked_layers"));
    }

    #[test]
    fn version_3_keys() {
        let cfg = r#"
version = 3
[plugins."io.containerd.cri.v1.images"]
  discard_unpacked_layers = true
[plugins."io.containerd.cri.v1.images".registry]
  config_path = "/other:/etc/containerd/certs.d"
"#;
        let w = warnings(cfg);
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("discard_unpacked_layers"));
    }

    #[test]
    fn other_dir_and_old_mirrors() {
        let cfg = r#"
version = 2
[plugins."io.containerd.grpc.v1.cri".registry]
  config_path = "/etc/docker/certs.d"
[plugins."io.containerd.grpc.v1.cri".registry.mirrors."docker.io"]
  endpoint = ["https://mirror.example"]
"#;
        let w = warnings(cfg);
        assert_eq!(w.len(), 2, "{w:?}");
    }

    #[test]
    fn a_missing_config_is_a_warning_that_says_what_to_do() {
        let w = check(Path::new("/nonexistent/config.toml"), Path::new("/x"));
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("no containerd config") && w[0].contains("config_path"));
    }

    /// `config_path` set in a drop-in gets no false warning; a drop-in can also undo it.
    #[test]
    fn imports_are_followed_and_merged_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let main = dir.path().join("config.toml");
        std::fs::create_dir(dir.path().join("conf.d")).unwrap();
        std::fs::write(
            &main,
            "version = 2\nimports = [\"conf.d/*.toml\"]\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  snapshotter = \"overlayfs\"\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("conf.d/10-registry.toml"),
            "[plugins.\"io.containerd.grpc.v1.cri\".registry]\n  config_path = \"/etc/containerd/certs.d\"\n",
        )
        .unwrap();
        let hosts = Path::new("/etc/containerd/certs.d");
        assert!(check(&main, hosts).is_empty(), "{:?}", check(&main, hosts));
        let merged = load(&main).unwrap();
        let cri = &merged["plugins"]["io.containerd.grpc.v1.cri"];
        assert_eq!(cri["containerd"]["snapshotter"].as_str(), Some("overlayfs"));

        // A later drop-in discards layers and imports one that moves config_path.
        std::fs::write(
            dir.path().join("conf.d/20-discard.toml"),
            "imports = [\"../other.toml\"]\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  discard_unpacked_layers = true\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("other.toml"),
            "[plugins.\"io.containerd.grpc.v1.cri\".registry]\n  config_path = \"/etc/docker/certs.d\"\n",
        )
        .unwrap();
        let w = check(&main, hosts);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w.iter().any(|w| w.contains("discard_unpacked_layers")));
        assert!(w.iter().any(|w| w.contains("/etc/docker/certs.d")));
    }

    #[test]
    fn glob_patterns_match_like_containerds() {
        assert!(matches("*.toml", "10-registry.toml"));
        assert!(matches("?0-*.toml", "10-a.toml"));
        assert!(!matches("*.toml", "registry.toml.bak"));
        assert!(matches("*", ""));
        assert!(!matches("a", ""));
    }
}
