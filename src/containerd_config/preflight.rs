//! Reads containerd's own config (never edits it) and says what would stop Ferry from working.

use std::path::Path;

/// One finding, worded for the operator's log.
pub type Warning = String;

/// CRI plugin tables: containerd 1.x/2.x config version 2, and version 3 (containerd 2.x).
const CRI_V2: &str = "io.containerd.grpc.v1.cri";
const CRI_V3_IMAGES: &str = "io.containerd.cri.v1.images";

/// Checks `config_file` against what Ferry needs. A missing file yields nothing: containerd
/// runs on defaults, and plain `ctr --hosts-dir` pulls work regardless.
pub fn check(config_file: &Path, hosts_dir: &Path) -> Vec<Warning> {
    let text = match std::fs::read_to_string(config_file) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            return vec![format!(
                "cannot read containerd config {}: {e}",
                config_file.display()
            )];
        }
    };
    let doc: toml::Table = match text.parse() {
        Ok(d) => d,
        Err(e) => {
            return vec![format!(
                "containerd config {} is not valid TOML: {}",
                config_file.display(),
                e.message()
            )];
        }
    };
    check_table(&doc, hosts_dir)
        .into_iter()
        .map(|w| format!("containerd config {}: {w}", config_file.display()))
        .collect()
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
        warnings.push(format!(
            "CRI registry config_path is not set, so kubelet's pulls will not use Ferry; set it to \"{}\"",
            hosts_dir.display()
        ));
    } else if !config_path.split(':').any(|p| Path::new(p) == hosts_dir) {
        warnings.push(format!(
            "CRI registry config_path is \"{config_path}\" but Ferry writes to \"{}\"; kubelet's pulls will not use Ferry",
            hosts_dir.display()
        ));
    }
    let has_mirrors = registry
        .and_then(|r| r.get("mirrors"))
        .and_then(|m| m.as_table())
        .is_some_and(|m| !m.is_empty());
    if has_mirrors {
        warnings.push(
            "deprecated registry.mirrors is set; containerd does not combine it with config_path"
                .into(),
        );
    }
    if discard.and_then(|d| d.as_bool()) == Some(true) {
        warnings.push(
            "discard_unpacked_layers = true: containerd deletes layers after unpacking, so Ferry cannot serve them to anyone".into(),
        );
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
    fn missing_file_is_silent() {
        assert!(check(Path::new("/nonexistent/config.toml"), Path::new("/x")).is_empty());
    }
}
