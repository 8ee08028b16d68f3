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
pub const KEYS: [(&str, &str); 39] = [
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

/// `http://host:port`: what containerd's hosts.toml names as the mirror.
fn mirror_target(v: &str) -> Result<Option<String>, ConfigError> {
    if v.is_empty() {
        return Ok(None);
    }
    let bad = || {
        err(
            "mirror-target",
            format!("{v:?} is not a URL such as http://10.0.0.5:5480"),
        )
    };
    let rest = v
        .strip_prefix("http://")
        .or_else(|| v.strip_prefix("https://"))
        .ok_or_else(bad)?;
    let scheme = &v[..v.len() - rest.len()];
    // An IPv6 address with a port, unbracketed (the chart's `http://$(HOST_IP):port` on an
    // IPv6 node): containerd could not parse it; write it the way URLs need it.
    if rest.matches(':').count() > 1
        && !rest.starts_with('[')
        && let Ok(addr) = addr("mirror-target", rest)
    {
        return Ok(Some(format!("{scheme}{addr}")));
    }
    let valid_host = !rest.is_empty()
        && !rest.contains('/')
        && rest
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b));
    if valid_host {
        Ok(Some(v.to_string()))
    } else {
        Err(bad())
    }
}

/// `20ms`, `5s`, `30m`, `2h`.
pub fn duration(key: &str, v: &str) -> Result<Duration, ConfigError> {
    let bad = || {
        err(
            key,
            format!("{v:?} is not a duration such as 20ms, 5s, 30m or 2h"),
        )
    };
    let split = v.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
    let (n, unit) = v.split_at(split);
    let n: u64 = n.parse().map_err(|_| bad())?;
    let d = match unit {
        "ms" => Duration::from_millis(n),
        "s" => Duration::from_secs(n),
        "m" => Duration::from_secs(n.saturating_mul(60)),
        "h" => Duration::from_secs(n.saturating_mul(3600)),
        _ => return Err(bad()),
    };
    if d.is_zero() {
        return Err(err(key, "must be more than zero"));
    }
    Ok(d)
}

/// `4194304`, `512KiB`, `4MiB`, `1GiB`.
pub fn size(key: &str, v: &str) -> Result<u64, ConfigError> {
    let bad = || {
        err(
            key,
            format!("{v:?} is not a size such as 4194304, 512KiB or 4MiB"),
        )
    };
    let split = v.find(|c: char| !c.is_ascii_digit()).unwrap_or(v.len());
    let (n, unit) = v.split_at(split);
    let n: u64 = n.parse().map_err(|_| bad())?;
    let factor: u64 = match unit {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return Err(bad()),
    };
    n.checked_mul(factor).ok_or_else(bad)
}

fn boolean(key: &str, v: &str) -> Result<bool, ConfigError> {
    match v {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(err(key, format!("{v:?}: expected true or false"))),
    }
}

fn path(key: &str, v: &str) -> Result<PathBuf, ConfigError> {
    if v.is_empty() {
        return Err(err(key, "must not be empty"));
    }
    if v.contains('\0') {
        return Err(err(key, "must not contain NUL"));
    }
    Ok(PathBuf::from(v))
}

/// `ip:port`, `[ipv6]:port`, or an IPv6 address and a port without the brackets
/// (`fd00::5:5481`: the part after the last colon is the port), which is what the chart's
/// `$(NODE_IP):port` becomes on an IPv6 node, where no template can add them.
fn addr(key: &str, v: &str) -> Result<SocketAddr, ConfigError> {
    let unbracketed = || {
        let (ip, port) = v.rsplit_once(':')?;
        Some(SocketAddr::new(
            IpAddr::V6(ip.parse().ok()?),
            port.parse().ok()?,
        ))
    };
    v.parse().ok().or_else(unbracketed).ok_or_else(|| {
        err(
            key,
            format!("{v:?} is not an address such as 127.0.0.1:5480 or [::1]:5480"),
        )
    })
}

fn namespace(v: &str) -> Result<String, ConfigError> {
    let ok = !v.is_empty()
        && v.len() <= 76
        && v.split(['.', '_', '-'])
            .all(|part| !part.is_empty() && part.bytes().all(|b| b.is_ascii_alphanumeric()));
    if ok {
        Ok(v.to_string())
    } else {
        Err(err(
            "containerd-namespace",
            format!("{v:?} is not a containerd namespace name"),
        ))
    }
}

fn registries(v: &str) -> Result<Registries, ConfigError> {
    let list: Vec<String> = v
        .split([',', '\n'])
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    if list.is_empty() {
        return Ok(Registries::All);
    }
    for host in &list {
        registry_host(host).map_err(|m| err("registries", format!("{host:?}: {m}")))?;
    }
    Ok(Registries::Only(list))
}

fn log_format(v: &str) -> Result<LogFormat, ConfigError> {
    match v {
        "text" => Ok(LogFormat::Text),
        "json" => Ok(LogFormat::Json),
        _ => Err(err("log-format", format!("{v:?}: expected text or json"))),
    }
}

/// A bare level applies to Ferry's own logs; libraries stay at `info` at most, because their
/// debug output (HTTP/2 frames, gRPC internals) drowns the one line per request. A full
/// filter directive (`ferry=debug,h2=trace`) is used as given.
pub fn log_filter(level: &str) -> String {
    match level {
        "trace" | "debug" => format!("info,ferry={level}"),
        "info" | "warn" | "error" | "off" => level.to_string(),
        directive => directive.to_string(),
    }
}

/// A level name, or a filter directive (`info,ferry=debug`). A bare word that is not a level
/// would parse as a filter for a target of that name and silence every line (`verbose`,
/// `warning`): refused, except `warning`, taken as `warn`.
fn log_level(v: &str) -> Result<String, ConfigError> {
    const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
    let v = match v.trim().to_ascii_lowercase().as_str() {
        "warning" => "warn".to_string(),
        level if LEVELS.contains(&level) => level.to_string(),
        _ if !v.contains('=') && !v.contains(',') => {
            return Err(err(
                "log-level",
                format!(
                    "{v:?}: expected one of {}, or a filter such as info,ferry=debug",
                    LEVELS.join(", ")
                ),
            ));
        }
        _ => v.to_string(),
    };
    tracing_subscriber::EnvFilter::try_new(&v)
        .map(|_| v.clone())
        .map_err(|e| err("log-level", format!("{v:?}: {e}")))
}

#[cfg(test)]
mod tests {
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
        let f = RegistryFilters::parse("docker\\.io/.*,ghcr\\.io/org/.*,!docker\\.io/private/.*")
            .unwrap();
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
            duration("k", "0s").is_err()
                && duration("k", "5").is_err()
                && duration("k", "1d").is_err()
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
}
