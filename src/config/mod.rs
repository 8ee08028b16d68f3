//! Configuration: defaults < `--config` file < environment < flags, then validation. No side
//! effects here: loading a config never touches the disk beyond reading the file.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::cli::Flags;
pub use crate::oci::registry::{Registries, RegistryFilters, registry_host};
use crate::registry::ResolveTags;
use crate::trust::ClusterSecret;

/// Every key, with its default. The TOML file uses these names; flags are `--<key>`.
pub const KEYS: [(&str, &str); 41] = [
    ("containerd-socket", "/run/containerd/containerd.sock"),
    ("containerd-namespace", "k8s.io"),
    (
        "containerd-content-dir",
        "/var/lib/containerd/io.containerd.content.v1.content",
    ),
    ("containerd-config", "/etc/containerd/config.toml"),
    ("hosts-dir", "/etc/containerd/certs.d"),
    ("registries", ""),
    ("mirror-addr", "127.0.0.1:5480"),
    ("mirror-target", ""),
    ("metrics-addr", "[::]:5483"),
    ("debug-page", "false"),
    ("data-dir", "/var/lib/ferry"),
    ("peer-addr", ""),
    ("p2p-addr", "0.0.0.0:5482"),
    ("advertise-addr", ""),
    ("bootstrap-peers", ""),
    ("bootstrap-dns", ""),
    ("bootstrap-dials", "3"),
    ("resolve-timeout", "20ms"),
    ("resolve-timeout-max", "100ms"),
    ("resolve-tags", "when-upstream-fails"),
    ("coalesce", "true"),
    ("follow-timeout", "3s"),
    ("relay-fanout", "2"),
    ("peer-upload-limit", ""),
    ("provide-ttl", "30m"),
    ("reprovide-interval", "10m"),
    ("p2p", "true"),
    ("cluster-secret-file", ""),
    ("registry-filters", ""),
    ("mirror-allow-remote", "false"),
    ("peer-connect-timeout", "500ms"),
    ("peer-first-byte-timeout", "2s"),
    ("peer-idle-timeout", "5s"),
    ("verify-before-serving", "4MiB"),
    ("zero-copy", "true"),
    ("bootstrap-kubernetes", ""),
    ("kubernetes-namespace", ""),
    ("node-name", ""),
    ("ready-taint", "ferry.dev/not-ready"),
    ("log-format", "text"),
    ("log-level", "info"),
];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub containerd_socket: PathBuf,
    pub containerd_namespace: String,
    pub containerd_content_dir: PathBuf,
    pub containerd_config: PathBuf,
    pub hosts_dir: PathBuf,
    pub registries: Registries,
    pub mirror_addr: SocketAddr,
    /// What hosts.toml points containerd at; `None`: `http://<mirror-addr>` (wildcard as
    /// loopback). Set when the mirror is reached another way (the chart's pod-network mode).
    pub mirror_target: Option<String>,
    pub metrics_addr: SocketAddr,
    /// `/debug` on the metrics address (this host's clients only).
    pub debug_page: bool,
    pub data_dir: PathBuf,
    pub p2p: Option<P2pSettings>,
    pub cluster_secret: Option<ClusterSecret>,
    /// Where `cluster_secret` was read from: watched for changes (see `app::watch_secret`).
    pub cluster_secret_file: Option<PathBuf>,
    pub registry_filters: RegistryFilters,
    pub kubernetes: KubernetesSettings,
    pub log_format: LogFormat,
    pub log_level: String,
}

/// Kubernetes: where Ferry's pods are, which node this is, which taint to lift.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KubernetesSettings {
    /// Label selector of Ferry's pods, for peer bootstrap.
    pub bootstrap_selector: Option<String>,
    pub namespace: Option<String>,
    pub node_name: Option<String>,
    /// `None`: leave taints alone.
    pub ready_taint: Option<String>,
}

impl KubernetesSettings {
    /// Whether Ferry talks to the Kubernetes API at all.
    pub fn enabled(&self) -> bool {
        self.bootstrap_selector.is_some() || self.node_name.is_some()
    }
}

/// The peer-to-peer settings; `None` when `p2p = false`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct P2pSettings {
    /// `None`: `<advertise-addr>:5481`.
    pub peer_addr: Option<SocketAddr>,
    pub p2p_addr: SocketAddr,
    /// `None`: an address of the interface with the default route (`host_addr.rs`).
    pub advertise_addr: Option<IpAddr>,
    pub bootstrap_peers: Vec<libp2p::Multiaddr>,
    pub bootstrap_dns: Option<String>,
    /// Bootstrap addresses dialled at once; Kademlia finds the rest of the network.
    pub bootstrap_dials: usize,
    pub resolve_timeout: Duration,
    /// The longest a pull waits for a lookup where this node's lookups are slow.
    pub resolve_timeout_max: Duration,
    pub resolve_tags: ResolveTags,
    /// `Some(follow timeout)` when simultaneous misses are coordinated (`coalesce`).
    pub coalesce: Option<Duration>,
    /// Followers one node streams a blob to at once; 0: all follow the leader.
    pub relay_fanout: usize,
    /// Bytes per second this node sends other nodes at most; `None`: no limit.
    pub peer_upload_limit: Option<u64>,
    pub provide_ttl: Duration,
    pub reprovide_interval: Duration,
    pub peer_connect_timeout: Duration,
    pub peer_first_byte_timeout: Duration,
    pub peer_idle_timeout: Duration,
    /// Blobs from peers up to this many bytes are verified whole before serving.
    pub verify_before_serving: u64,
    /// Large stored blobs go to other nodes with `sendfile` (`registry::zero_copy`).
    pub zero_copy: bool,
}

/// The default port of the peer address, next to the mirror's 5480.
pub const DEFAULT_PEER_PORT: u16 = 5481;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

/// A bad configuration value: printed as one line, `<key>: <what is wrong>`; exit status 64.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{key}: {message}")]
pub struct ConfigError {
    pub key: String,
    pub message: String,
}

fn err(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        key: key.to_string(),
        message: message.into(),
    }
}

impl Config {
    /// Merges the sources and validates every value.
    pub fn load(flags: &Flags) -> Result<Config, ConfigError> {
        let file = match &flags.config {
            Some(path) => read_file(path)?,
            None => HashMap::new(),
        };
        if flags.resolve_latest.is_some() {
            return Err(err(REPLACED.0, REPLACED.1));
        }
        let given: HashMap<&str, &str> = flags.given().into_iter().collect();
        let value = &|key: &str| -> String {
            given
                .get(key)
                .map(|v| v.to_string())
                .or_else(|| file.get(key).cloned())
                .or_else(|| {
                    KEYS.iter()
                        .find(|(k, _)| *k == key)
                        .map(|(_, d)| d.to_string())
                })
                .unwrap_or_default()
        };
        let mirror_addr = addr("mirror-addr", &value("mirror-addr"))?;
        if !mirror_addr.ip().is_loopback()
            && !boolean("mirror-allow-remote", &value("mirror-allow-remote"))?
        {
            return Err(err(
                "mirror-addr",
                format!(
                    "{mirror_addr} is not a loopback address; the mirror serves this node's images to whoever reaches it: set mirror-allow-remote = true to bind it there anyway"
                ),
            ));
        }
        Ok(Config {
            containerd_socket: path("containerd-socket", &value("containerd-socket"))?,
            containerd_namespace: namespace(&value("containerd-namespace"))?,
            containerd_content_dir: path(
                "containerd-content-dir",
                &value("containerd-content-dir"),
            )?,
            containerd_config: path("containerd-config", &value("containerd-config"))?,
            hosts_dir: path("hosts-dir", &value("hosts-dir"))?,
            registries: registries(&value("registries"))?,
            mirror_addr,
            mirror_target: mirror_target(&value("mirror-target"))?,
            metrics_addr: addr("metrics-addr", &value("metrics-addr"))?,
            debug_page: boolean("debug-page", &value("debug-page"))?,
            data_dir: path("data-dir", &value("data-dir"))?,
            p2p: p2p_settings(value)?,
            cluster_secret: match value("cluster-secret-file").as_str() {
                "" => None,
                file => Some(
                    ClusterSecret::load(Path::new(file))
                        .map_err(|e| err("cluster-secret-file", e.to_string()))?,
                ),
            },
            cluster_secret_file: match value("cluster-secret-file").as_str() {
                "" => None,
                file => Some(PathBuf::from(file)),
            },
            registry_filters: RegistryFilters::parse(&value("registry-filters"))
                .map_err(|m| err("registry-filters", m))?,
            kubernetes: kubernetes_settings(value)?,
            log_format: log_format(&value("log-format"))?,
            log_level: log_level(&value("log-level"))?,
        })
    }

    /// The URL containerd is pointed at. A wildcard bind is reached over loopback.
    pub fn mirror_url(&self) -> String {
        if let Some(target) = &self.mirror_target {
            return target.clone();
        }
        let ip = match self.mirror_addr.ip() {
            IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
            IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        format!("http://{}", SocketAddr::new(ip, self.mirror_addr.port()))
    }
}

/// Reads the TOML file into `key -> text`; unknown keys and wrong types are errors.
fn read_file(path: &Path) -> Result<HashMap<String, String>, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| err("config", format!("cannot read {}: {e}", path.display())))?;
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        let msg = e.message().to_string();
        err(
            "config",
            format!("{} is not valid TOML: {msg}", path.display()),
        )
    })?;
    let mut values = HashMap::new();
    for (key, value) in table {
        if key == REPLACED.0 {
            return Err(err(&key, REPLACED.1));
        }
        if !KEYS.iter().any(|(k, _)| *k == key) {
            return Err(err(&key, format!("unknown key in {}", path.display())));
        }
        let text = match value {
            toml::Value::String(s) => s,
            toml::Value::Boolean(b) => b.to_string(),
            toml::Value::Array(items)
                if matches!(
                    key.as_str(),
                    "registries" | "bootstrap-peers" | "registry-filters"
                ) =>
            {
                items
                    .into_iter()
                    .map(|i| match i {
                        toml::Value::String(s) => Ok(s),
                        other => Err(err(
                            &key,
                            format!("expected strings, found {}", other.type_str()),
                        )),
                    })
                    .collect::<Result<Vec<_>, _>>()?
                    // Newlines, not commas: a regex may contain commas.
                    .join("\n")
            }
            other => {
                return Err(err(
                    &key,
                    format!("expected a string, found {}", other.type_str()),
                ));
            }
        };
        values.insert(key, text);
    }
    Ok(values)
}

fn p2p_settings(value: &dyn Fn(&str) -> String) -> Result<Option<P2pSettings>, ConfigError> {
    if !boolean("p2p", &value("p2p"))? {
        return Ok(None);
    }
    let optional = |key: &str| Some(value(key)).filter(|v| !v.is_empty());
    let peer_addr = optional("peer-addr")
        .map(|v| addr("peer-addr", &v))
        .transpose()?;
    let advertise_addr = optional("advertise-addr")
        .map(|v| {
            v.parse::<IpAddr>()
                .map_err(|_| err("advertise-addr", format!("{v:?} is not an IP address")))
        })
        .transpose()?;
    let bootstrap_peers = value("bootstrap-peers")
        .split([',', '\n'])
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|p| crate::routing::bootstrap::parse_peer(p).map_err(|m| err("bootstrap-peers", m)))
        .collect::<Result<Vec<_>, _>>()?;
    let bootstrap_dns = optional("bootstrap-dns");
    if let Some(name) = &bootstrap_dns
        && !name
            .split('.')
            .all(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'))
    {
        return Err(err("bootstrap-dns", format!("{name:?} is not a DNS name")));
    }
    let dials = value("bootstrap-dials");
    let bootstrap_dials = dials
        .parse::<usize>()
        .ok()
        .filter(|n| (1..=1000).contains(n))
        .ok_or_else(|| err("bootstrap-dials", format!("{dials:?}: expected 1 to 1000")))?;
    let provide_ttl = duration("provide-ttl", &value("provide-ttl"))?;
    let reprovide_interval = duration("reprovide-interval", &value("reprovide-interval"))?;
    if reprovide_interval >= provide_ttl {
        return Err(err(
            "reprovide-interval",
            "must be shorter than provide-ttl, or records expire before they are renewed",
        ));
    }
    Ok(Some(P2pSettings {
        peer_addr,
        p2p_addr: addr("p2p-addr", &value("p2p-addr"))?,
        advertise_addr,
        bootstrap_peers,
        bootstrap_dns,
        bootstrap_dials,
        resolve_timeout: duration("resolve-timeout", &value("resolve-timeout"))?,
        resolve_timeout_max: duration("resolve-timeout-max", &value("resolve-timeout-max"))?,
        resolve_tags: resolve_tags(value)?,
        coalesce: boolean("coalesce", &value("coalesce"))?
            .then(|| duration("follow-timeout", &value("follow-timeout")))
            .transpose()?,
        relay_fanout: relay_fanout(&value("relay-fanout"))?,
        peer_upload_limit: match value("peer-upload-limit").as_str() {
            "" | "0" => None,
            v => Some(size("peer-upload-limit", v)?),
        },
        provide_ttl,
        reprovide_interval,
        peer_connect_timeout: duration("peer-connect-timeout", &value("peer-connect-timeout"))?,
        peer_first_byte_timeout: duration(
            "peer-first-byte-timeout",
            &value("peer-first-byte-timeout"),
        )?,
        peer_idle_timeout: duration("peer-idle-timeout", &value("peer-idle-timeout"))?,
        verify_before_serving: size("verify-before-serving", &value("verify-before-serving"))?,
        zero_copy: boolean("zero-copy", &value("zero-copy"))?,
    }))
}

fn relay_fanout(v: &str) -> Result<usize, ConfigError> {
    v.parse::<usize>().ok().filter(|n| *n <= 64).ok_or_else(|| {
        err(
            "relay-fanout",
            format!("{v:?}: expected 0 (no relays) to 64"),
        )
    })
}

/// A key that no longer exists, named so that an old config gets a useful error.
const REPLACED: (&str, &str) = (
    "resolve-latest",
    "replaced by resolve-tags = never | when-upstream-fails | always (latest is no longer special)",
);

fn resolve_tags(value: &dyn Fn(&str) -> String) -> Result<ResolveTags, ConfigError> {
    let v = value("resolve-tags");
    v.parse().map_err(|_| {
        err(
            "resolve-tags",
            format!("{v:?}: expected never, when-upstream-fails or always"),
        )
    })
}

fn kubernetes_settings(value: &dyn Fn(&str) -> String) -> Result<KubernetesSettings, ConfigError> {
    let optional = |key: &str| Some(value(key)).filter(|v| !v.is_empty());
    let dns_label = |key: &str, v: &str| -> Result<(), ConfigError> {
        let ok = v.len() <= 253
            && v.split('.').all(|l| {
                !l.is_empty()
                    && l.bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            });
        if ok {
            Ok(())
        } else {
            Err(err(key, format!("{v:?} is not a Kubernetes name")))
        }
    };
    let selector = optional("bootstrap-kubernetes");
    if let Some(s) = &selector
        && (s.contains(char::is_whitespace) || s.contains(['\'', '"']))
    {
        return Err(err(
            "bootstrap-kubernetes",
            format!("{s:?} is not a label selector such as app.kubernetes.io/name=ferry"),
        ));
    }
    let namespace = optional("kubernetes-namespace");
    if let Some(ns) = &namespace {
        dns_label("kubernetes-namespace", ns)?;
    }
    let node_name = optional("node-name");
    if let Some(n) = &node_name {
        dns_label("node-name", n)?;
    }
    let ready_taint = optional("ready-taint");
    if let Some(t) = &ready_taint {
        let (prefix, name) = t.rsplit_once('/').unwrap_or(("", t));
        let name_ok = !name.is_empty()
            && name.len() <= 63
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
        if !name_ok || (!prefix.is_empty() && dns_label("ready-taint", prefix).is_err()) {
            return Err(err(
                "ready-taint",
                format!("{t:?} is not a taint key such as ferry.dev/not-ready"),
            ));
        }
    }
    Ok(KubernetesSettings {
        bootstrap_selector: selector,
        namespace,
        node_name,
        ready_taint,
    })
}

mod values;

use values::*;
pub use values::{duration, log_filter, size};

#[cfg(test)]
mod tests;
