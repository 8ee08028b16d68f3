//! One value of a setting, parsed from its text: durations, sizes, addresses, paths, names.
//! Each error names the key, as every configuration error does.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use crate::oci::registry::{Registries, registry_host};

use super::{ConfigError, LogFormat, err};

/// `http://host:port`: what containerd's hosts.toml names as the mirror.
pub(super) fn mirror_target(v: &str) -> Result<Option<String>, ConfigError> {
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

pub(super) fn boolean(key: &str, v: &str) -> Result<bool, ConfigError> {
    match v {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(err(key, format!("{v:?}: expected true or false"))),
    }
}

pub(super) fn path(key: &str, v: &str) -> Result<PathBuf, ConfigError> {
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
pub(super) fn addr(key: &str, v: &str) -> Result<SocketAddr, ConfigError> {
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

pub(super) fn namespace(v: &str) -> Result<String, ConfigError> {
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

pub(super) fn registries(v: &str) -> Result<Registries, ConfigError> {
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

pub(super) fn log_format(v: &str) -> Result<LogFormat, ConfigError> {
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
pub(super) fn log_level(v: &str) -> Result<String, ConfigError> {
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
