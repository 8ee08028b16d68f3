//! Applying the `hosts.toml` merge to a containerd hosts directory (`certs.d`). Invariant: every
//! write is atomic, and one bad registry directory never stops the others.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use super::hosts::{self, Cleaned, Ipv6Hosts, Merged};
use crate::oci::registry::Registries;

const HOSTS_FILE: &str = "hosts.toml";
/// The temp files next to `hosts.toml` start so; one is renamed over it, so containerd never
/// reads half a file.
const TEMP_PREFIX: &str = "hosts.toml.ferry-tmp";
/// A temp file this old is a crashed write's, not a running Ferry's: cleanup removes it.
const STALE_TEMP: std::time::Duration = std::time::Duration::from_secs(60);
/// containerd's directory for registries without one of their own.
pub const DEFAULT_DIR: &str = "_default";
/// Files containerd reads as certificates when a host directory has no `hosts.toml`.
const LEGACY_CERT_SUFFIXES: [&str; 3] = [".crt", ".cert", ".key"];

/// What happened to one `hosts.toml`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    pub path: PathBuf,
    pub action: Action,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Created,
    Updated,
    Unchanged,
    /// The operator's file already lists Ferry's mirror URL.
    OperatorEntry,
    Restored,
    Removed,
    /// Left untouched, with the reason.
    Skipped(String),
    /// Could not be read or written: left as it was, the others still done.
    Failed(String),
}

impl DirError {
    fn outcome(self) -> Outcome {
        Outcome {
            action: Action::Failed(self.source.to_string()),
            path: self.path,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("{path}: {source}")]
pub struct DirError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DirError + '_ {
    move |source| DirError {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes Ferry's entry into every `hosts.toml` the registries need. A file that fails is
/// reported in its outcome; only an unusable hosts directory is an error.
pub fn configure(
    hosts_dir: &Path,
    registries: &Registries,
    mirror_url: &str,
    ipv6: Ipv6Hosts,
) -> Result<Vec<Outcome>, DirError> {
    fs::create_dir_all(hosts_dir).map_err(io_err(hosts_dir))?;
    let targets: Vec<String> = match registries {
        Registries::Only(list) => list.clone(),
        Registries::All => {
            // containerd ignores `_default` for a host with its own directory.
            let mut dirs = existing_host_dirs(hosts_dir)?;
            dirs.retain(|d| d != DEFAULT_DIR);
            dirs.insert(0, DEFAULT_DIR.to_string());
            dirs
        }
    };
    Ok(targets
        .iter()
        .map(|host| {
            configure_one(hosts_dir, host, mirror_url, ipv6).unwrap_or_else(DirError::outcome)
        })
        .collect())
}

fn configure_one(
    hosts_dir: &Path,
    host: &str,
    mirror_url: &str,
    ipv6: Ipv6Hosts,
) -> Result<Outcome, DirError> {
    let dir = hosts_dir.join(host);
    let path = dir.join(HOSTS_FILE);
    let server_host = (host != DEFAULT_DIR).then_some(host);
    let outcome = |action| {
        Ok(Outcome {
            path: path.clone(),
            action,
        })
    };
    if let Some(reason) = symlinked(&dir, &path) {
        return outcome(Action::Skipped(reason));
    }

    if !dir.exists() {
        fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        write_atomic(&path, &hosts::new_file(server_host, mirror_url, ipv6, true))?;
        return outcome(Action::Created);
    }
    let existing = match fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if has_legacy_certs(&dir)? {
                // A hosts.toml would make containerd stop reading these certificates.
                return outcome(Action::Skipped(
                    "certificate files and no hosts.toml: adding one would drop them".into(),
                ));
            }
            write_atomic(
                &path,
                &hosts::new_file(server_host, mirror_url, ipv6, false),
            )?;
            return outcome(Action::Created);
        }
        Err(e) => return Err(io_err(&path)(e)),
    };
    let Ok(text) = String::from_utf8(existing) else {
        return outcome(Action::Skipped("not UTF-8 text; left untouched".into()));
    };
    match hosts::merge(&text, mirror_url, ipv6) {
        Ok(Merged::Unchanged) => outcome(Action::Unchanged),
        Ok(Merged::OperatorEntry) => outcome(Action::OperatorEntry),
        Ok(Merged::Updated(new)) => {
            write_atomic(&path, &new)?;
            outcome(Action::Updated)
        }
        Err(e) => outcome(Action::Skipped(e.to_string())),
    }
}

/// The API roots containerd resolves a tag of `registry` at after Ferry's entry, with its
/// directory lookup; a bad file leaves the default server, as in containerd.
pub fn upstream_roots(hosts_dir: &Path, registry: &str, mirror_url: &str) -> Vec<String> {
    let default = || hosts::api_root(&default_upstream(registry), false);
    let mut candidates = Vec::new();
    if let Some((name, port)) = registry.rsplit_once(':') {
        candidates.push(hosts_dir.join(format!("{name}_{port}_")));
    }
    candidates.push(hosts_dir.join(registry));
    candidates.push(hosts_dir.join(DEFAULT_DIR));
    let Some(dir) = candidates.into_iter().find(|d| d.exists()) else {
        return vec![default()];
    };
    let text = fs::read_to_string(dir.join(HOSTS_FILE)).unwrap_or_default();
    match hosts::upstreams(&text, mirror_url) {
        Ok((mut roots, server)) => {
            roots.push(server.unwrap_or_else(default));
            roots.dedup();
            roots
        }
        Err(_) => vec![default()],
    }
}

/// containerd's server for a registry without one configured: plain HTTP for localhost.
fn default_upstream(registry: &str) -> String {
    let host = registry.rsplit_once(':').map_or(registry, |(h, _)| h);
    let local = host == "localhost" || host.starts_with("127.") || host == "[::1]";
    if local {
        format!("http://{registry}")
    } else {
        hosts::default_server(registry)
    }
}

/// Removes what Ferry added under `hosts_dir`, from the files alone.
pub fn cleanup(hosts_dir: &Path) -> Result<Vec<Outcome>, DirError> {
    if !hosts_dir.exists() {
        return Ok(Vec::new());
    }
    let mut outcomes = Vec::new();
    for host in existing_host_dirs(hosts_dir)? {
        match cleanup_one(&hosts_dir.join(&host)) {
            Ok(Some(outcome)) => outcomes.push(outcome),
            Ok(None) => {}
            Err(e) => outcomes.push(e.outcome()),
        }
    }
    Ok(outcomes)
}

fn cleanup_one(dir: &Path) -> Result<Option<Outcome>, DirError> {
    let path = dir.join(HOSTS_FILE);
    if symlinked(dir, &path).is_some() {
        return Ok(None);
    }
    remove_stale_temps(dir);
    let text = match fs::read(&path) {
        Ok(bytes) => match String::from_utf8(bytes) {
            Ok(text) => text,
            Err(_) => return Ok(None),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(&path)(e)),
    };
    let action = match hosts::cleanup(&text) {
        Cleaned::Untouched => return Ok(None),
        Cleaned::Broken(reason) => Action::Skipped(reason),
        Cleaned::Restored(original) => {
            write_atomic(&path, &original)?;
            Action::Restored
        }
        Cleaned::Delete { dir: created_dir } => {
            fs::remove_file(&path).map_err(io_err(&path))?;
            if created_dir {
                // Fails, and is meant to, if the operator has since put files there.
                let _ = fs::remove_dir(dir);
            }
            Action::Removed
        }
    };
    Ok(Some(Outcome { path, action }))
}

/// Why a host directory or its `hosts.toml` is left alone: a symbolic link is someone else's
/// file (configuration management), which Ferry would replace with a copy or write through.
fn symlinked(dir: &Path, path: &Path) -> Option<String> {
    let is_link = |p: &Path| fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink());
    if is_link(dir) {
        Some("the host directory is a symbolic link; left untouched".into())
    } else if is_link(path) {
        Some("hosts.toml is a symbolic link; left untouched".into())
    } else {
        None
    }
}

/// Removes temp files a crashed write left, never one a running Ferry is writing.
fn remove_stale_temps(dir: &Path) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let stale = entry
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > STALE_TEMP));
        if stale && entry.file_name().to_string_lossy().starts_with(TEMP_PREFIX) {
            let _ = fs::remove_file(entry.path());
        }
    }
}

fn existing_host_dirs(hosts_dir: &Path) -> Result<Vec<String>, DirError> {
    let mut dirs = Vec::new();
    for entry in fs::read_dir(hosts_dir).map_err(io_err(hosts_dir))? {
        let entry = entry.map_err(io_err(hosts_dir))?;
        // A symbolic link to a directory is listed, so that it is reported as skipped.
        let is_dir = fs::metadata(entry.path()).is_ok_and(|m| m.is_dir());
        if let (true, Some(name)) = (is_dir, entry.file_name().to_str())
            && !name.starts_with('.')
        {
            dirs.push(name.to_string());
        }
    }
    dirs.sort();
    Ok(dirs)
}

fn has_legacy_certs(dir: &Path) -> Result<bool, DirError> {
    for entry in fs::read_dir(dir).map_err(io_err(dir))? {
        let name = entry.map_err(io_err(dir))?.file_name();
        let name = name.to_string_lossy();
        if LEGACY_CERT_SUFFIXES.iter().any(|s| name.ends_with(s)) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Temp file, fsync, rename: readers see the old file or the new one. The mode is kept. The
/// temp file is created new (`O_EXCL`: never a file or link planted there) under a new name.
fn write_atomic(path: &Path, text: &str) -> Result<(), DirError> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let tmp = dir.join(format!("{TEMP_PREFIX}.{}.{nanos}", std::process::id()));
    let result = (|| {
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        file.write_all(text.as_bytes())?;
        if let Ok(meta) = fs::metadata(path) {
            file.set_permissions(meta.permissions())?;
        }
        file.sync_all()?;
        fs::rename(&tmp, path)?;
        if let Ok(d) = fs::File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map_err(io_err(path))
}
