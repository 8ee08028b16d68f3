//! The parser of each kind of value, shared by flags, the environment and the file. An error
//! is the message only: the caller names the key.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use crate::oci::registry::{Registries, RegistryFilters, registry_host};
use crate::registry::ResolveTags;

use super::LogFormat;

type Parsed<T> = Result<T, String>;

/// A setting that may be absent: empty text means none, so an environment variable set to ""
/// unsets it. (An alias, so that clap takes the value's parser as given.)
pub type Optional<T> = Option<T>;

/// `parse`, with empty text meaning none.
pub(super) fn optional<T: 'static>(
    parse: fn(&str) -> Parsed<T>,
) -> impl Fn(&str) -> Parsed<Option<T>> + Clone + Send + Sync + 'static {
    move |v: &str| match v.trim() {
        "" => Ok(None),
        v => parse(v).map(Some),
    }
}

/// `20ms`, `5s`, `30m`, `2h` (humantime's units); never zero.
pub fn duration(v: &str) -> Parsed<Duration> {
    let bad = || format!("{v:?} is not a duration such as 20ms, 5s, 30m or 2h");
    let d: Duration = humantime::parse_duration(v).map_err(|_| bad())?;
    if d.is_zero() {
        return Err("must be more than zero".into());
    }
    Ok(d)
}

/// `4194304`, `512KiB`, `4MiB`, `1GiB` (bytesize's units: `MB` is 10^6, `MiB` 2^20).
pub fn size(v: &str) -> Parsed<u64> {
    v.parse::<bytesize::ByteSize>()
        .map(|s| s.as_u64())
        .map_err(|_| format!("{v:?} is not a size such as 4194304, 512KiB or 4MiB"))
}

/// How much disk Ferry's lease may take (`keep/`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeepBudget {
    Bytes(u64),
    /// A share of the content filesystem's size, in percent.
    Share(u8),
}

impl KeepBudget {
    /// In bytes, on a filesystem of `fs_bytes`.
    pub fn bytes(self, fs_bytes: u64) -> u64 {
        match self {
            KeepBudget::Bytes(n) => n,
            KeepBudget::Share(p) => (u128::from(fs_bytes) * u128::from(p) / 100) as u64,
        }
    }
}

/// `10%` of the content filesystem, or a size; `0`: none.
pub(super) fn keep_budget(v: &str) -> Parsed<KeepBudget> {
    let v = v.trim();
    match v.strip_suffix('%') {
        Some(p) => match p.trim().parse::<u8>() {
            Ok(p) if p <= 100 => Ok(KeepBudget::Share(p)),
            _ => Err(format!(
                "{v:?} is not a share such as 10% (a whole 0 to 100)"
            )),
        },
        None => size(v).map(KeepBudget::Bytes),
    }
}

/// 0 to 16 nodes.
pub(super) fn keep_copies(v: &str) -> Parsed<usize> {
    count(v, 0, 16).map_err(|_| format!("{v:?}: expected 0 to 16 nodes"))
}

/// A rate in bytes per second; `0` (or empty) is no limit.
pub(super) fn upload_limit(v: &str) -> Parsed<Option<u64>> {
    Ok(optional(size)(v)?.filter(|&n| n > 0))
}

pub(super) fn boolean(v: &str) -> Parsed<bool> {
    match v {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(format!("{v:?}: expected true or false")),
    }
}

/// A count from `min` to `max`.
pub(super) fn count(v: &str, min: usize, max: usize) -> Parsed<usize> {
    v.parse::<usize>()
        .ok()
        .filter(|n| (min..=max).contains(n))
        .ok_or_else(|| format!("{v:?}: expected {min} to {max}"))
}

pub(super) fn bootstrap_dials(v: &str) -> Parsed<usize> {
    count(v, 1, 1000)
}

pub(super) fn relay_fanout(v: &str) -> Parsed<usize> {
    count(v, 0, 64).map_err(|_| format!("{v:?}: expected 0 (no relays) to 64"))
}

pub(super) fn path(v: &str) -> Parsed<PathBuf> {
    if v.is_empty() {
        return Err("must not be empty".into());
    }
    if v.contains(['\0', '\n']) {
        return Err("must be one path, without NUL".into());
    }
    Ok(PathBuf::from(v))
}

/// `ip:port`, `[ipv6]:port`, or an IPv6 address and a port without the brackets
/// (`fd00::5:5481`: the part after the last colon is the port), which is what the chart's
/// `$(NODE_IP):port` becomes on an IPv6 node, where no template can add them.
pub(super) fn addr(v: &str) -> Parsed<SocketAddr> {
    let unbracketed = || {
        let (ip, port) = v.rsplit_once(':')?;
        Some(SocketAddr::new(
            IpAddr::V6(ip.parse().ok()?),
            port.parse().ok()?,
        ))
    };
    v.parse()
        .ok()
        .or_else(unbracketed)
        .ok_or_else(|| format!("{v:?} is not an address such as 127.0.0.1:5480 or [::1]:5480"))
}

pub(super) fn ip(v: &str) -> Parsed<IpAddr> {
    v.parse().map_err(|_| format!("{v:?} is not an IP address"))
}

/// `http://host:port`: what containerd's hosts.toml names as the mirror.
pub(super) fn mirror_target(v: &str) -> Parsed<String> {
    let bad = || format!("{v:?} is not a URL such as http://10.0.0.5:5480");
    let rest = v
        .strip_prefix("http://")
        .or_else(|| v.strip_prefix("https://"))
        .ok_or_else(bad)?;
    let scheme = &v[..v.len() - rest.len()];
    // An IPv6 address with a port, unbracketed (the chart's `http://$(HOST_IP):port` on an
    // IPv6 node): containerd could not parse it; write it the way URLs need it.
    if rest.matches(':').count() > 1
        && !rest.starts_with('[')
        && let Ok(addr) = addr(rest)
    {
        return Ok(format!("{scheme}{addr}"));
    }
    let valid_host = !rest.is_empty()
        && !rest.contains('/')
        && rest
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b".-:[]".contains(&b));
    if valid_host {
        Ok(v.to_string())
    } else {
        Err(bad())
    }
}

pub(super) fn namespace(v: &str) -> Parsed<String> {
    let ok = !v.is_empty()
        && v.len() <= 76
        && v.split(['.', '_', '-'])
            .all(|part| !part.is_empty() && part.bytes().all(|b| b.is_ascii_alphanumeric()));
    if ok {
        Ok(v.to_string())
    } else {
        Err(format!("{v:?} is not a containerd namespace name"))
    }
}

/// Comma- or newline-separated items, trimmed, empty ones dropped.
fn items(v: &str) -> impl Iterator<Item = &str> {
    v.split([',', '\n'])
        .map(str::trim)
        .filter(|s| !s.is_empty())
}

pub(super) fn registries(v: &str) -> Parsed<Registries> {
    let list: Vec<String> = items(v).map(str::to_string).collect();
    if list.is_empty() {
        return Ok(Registries::All);
    }
    for host in &list {
        registry_host(host).map_err(|m| format!("{host:?}: {m}"))?;
    }
    Ok(Registries::Only(list))
}

pub(super) fn registry_filters(v: &str) -> Parsed<RegistryFilters> {
    RegistryFilters::parse(v)
}

pub(super) fn bootstrap_peers(v: &str) -> Parsed<Vec<libp2p::Multiaddr>> {
    items(v)
        .map(crate::routing::bootstrap::parse_peer)
        .collect()
}

pub(super) fn dns_name(v: &str) -> Parsed<String> {
    let ok = v
        .split('.')
        .all(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'));
    ok.then(|| v.to_string())
        .ok_or_else(|| format!("{v:?} is not a DNS name"))
}

pub(super) fn resolve_tags(v: &str) -> Parsed<ResolveTags> {
    v.parse()
        .map_err(|_| format!("{v:?}: expected never, when-upstream-fails or always"))
}

/// A Kubernetes object name (RFC 1123 subdomain).
pub(super) fn kubernetes_name(v: &str) -> Parsed<String> {
    let ok = v.len() <= 253
        && v.split('.').all(|l| {
            !l.is_empty()
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        });
    ok.then(|| v.to_string())
        .ok_or_else(|| format!("{v:?} is not a Kubernetes name"))
}

pub(super) fn label_selector(v: &str) -> Parsed<String> {
    if v.contains(char::is_whitespace) || v.contains(['\'', '"']) {
        return Err(format!(
            "{v:?} is not a label selector such as app.kubernetes.io/name=ferry"
        ));
    }
    Ok(v.to_string())
}

pub(super) fn taint_key(v: &str) -> Parsed<String> {
    let (prefix, name) = v.rsplit_once('/').unwrap_or(("", v));
    let name_ok = !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
    if name_ok && (prefix.is_empty() || kubernetes_name(prefix).is_ok()) {
        Ok(v.to_string())
    } else {
        Err(format!(
            "{v:?} is not a taint key such as ferry.dev/not-ready"
        ))
    }
}

pub(super) fn log_format(v: &str) -> Parsed<LogFormat> {
    match v {
        "text" => Ok(LogFormat::Text),
        "json" => Ok(LogFormat::Json),
        _ => Err(format!("{v:?}: expected text or json")),
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
pub(super) fn log_level(v: &str) -> Parsed<String> {
    const LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];
    let v = match v.trim().to_ascii_lowercase().as_str() {
        "warning" => "warn".to_string(),
        level if LEVELS.contains(&level) => level.to_string(),
        _ if !v.contains('=') && !v.contains(',') => {
            return Err(format!(
                "{v:?}: expected one of {}, or a filter such as info,ferry=debug",
                LEVELS.join(", ")
            ));
        }
        _ => v.to_string(),
    };
    tracing_subscriber::EnvFilter::try_new(&v)
        .map(|_| v.clone())
        .map_err(|e| format!("{v:?}: {e}"))
}
