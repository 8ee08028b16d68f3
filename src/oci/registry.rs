//! Which registries Ferry mirrors and which images it shares, as domain values parsed by `config`.

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Registries {
    All,
    Only(Vec<String>),
}

impl Registries {
    pub fn includes(&self, registry: &str) -> bool {
        match self {
            Registries::All => true,
            Registries::Only(list) => list.iter().any(|r| r == registry),
        }
    }
}

/// Regexes on `registry/repo[:tag]`, `!` excluding: an image is shared when it matches some
/// inclusion (or there are none) and no exclusion.
#[derive(Debug, Clone, Default)]
pub struct RegistryFilters {
    filters: Vec<(bool, regex::Regex)>,
}

impl PartialEq for RegistryFilters {
    fn eq(&self, other: &Self) -> bool {
        let key = |f: &RegistryFilters| -> Vec<(bool, String)> {
            f.filters
                .iter()
                .map(|(n, r)| (*n, r.as_str().to_string()))
                .collect()
        };
        key(self) == key(other)
    }
}

impl Eq for RegistryFilters {}

impl RegistryFilters {
    /// Parses `a,b,!c` (or one per line, for regexes that contain commas).
    pub fn parse(v: &str) -> Result<RegistryFilters, String> {
        let separator = if v.contains('\n') { '\n' } else { ',' };
        let mut filters = Vec::new();
        for item in v.split(separator).map(str::trim).filter(|s| !s.is_empty()) {
            let (exclude, pattern) = match item.strip_prefix('!') {
                Some(p) => (true, p),
                None => (false, item),
            };
            // Anchored: a filter names whole image names, not fragments of them.
            let re = regex::Regex::new(&format!("^(?:{pattern})$"))
                .map_err(|e| format!("{item:?}: {e}"))?;
            filters.push((exclude, re));
        }
        Ok(RegistryFilters { filters })
    }

    /// Is the image `registry/repo[:tag]` shared with peers?
    pub fn allows(&self, name: &str) -> bool {
        let mut includes = self
            .filters
            .iter()
            .filter(|(exclude, _)| !exclude)
            .peekable();
        let included = includes.peek().is_none() || includes.any(|(_, re)| re.is_match(name));
        included
            && !self
                .filters
                .iter()
                .any(|(exclude, re)| *exclude && re.is_match(name))
    }
}

/// `host[:port]` or `[ipv6][:port]`; it names a directory in the hosts dir, so no path tricks.
pub fn registry_host(host: &str) -> Result<(), &'static str> {
    if host.contains("://") {
        return Err(
            "a registry is a host with an optional port, without a scheme: docker.io, not https://docker.io",
        );
    }
    let (name, port) = match host.strip_prefix('[').and_then(|r| r.split_once(']')) {
        Some((ip, rest)) => {
            if ip.parse::<std::net::Ipv6Addr>().is_err() {
                return Err("expected an IPv6 address between [ and ]");
            }
            match rest {
                "" => (None, None),
                _ => (
                    None,
                    Some(rest.strip_prefix(':').ok_or("expected :port after ]")?),
                ),
            }
        }
        None => match host.rsplit_once(':') {
            Some((n, p)) => (Some(n), Some(p)),
            None => (Some(host), None),
        },
    };
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            && !l.starts_with('-')
    };
    if let Some(name) = name
        && (name.len() > 253 || !name.split('.').all(label_ok))
    {
        return Err("expected a registry host[:port] such as docker.io or registry.local:5000");
    }
    if let Some(p) = port
        && p.parse::<u16>().map_or(true, |p| p == 0)
    {
        return Err("port must be 1-65535");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_hosts_are_names_or_ip_addresses_with_an_optional_port() {
        for ok in [
            "docker.io",
            "registry.local:5000",
            "10.0.0.5:5000",
            "[fd00::1]:5000",
            "[fd00::1]",
            "[::1]:5000",
        ] {
            assert_eq!(registry_host(ok), Ok(()), "{ok}");
        }
        for bad in [
            "https://docker.io",
            "[fd00::1",
            "[fd00::1]5000",
            "[not-v6]:5000",
            "[fd00::1]:0",
            "[fd00::1]:5000/../x",
            "fd00::1:5000",
            "../etc",
            "a/b",
            "",
        ] {
            assert!(registry_host(bad).is_err(), "{bad}");
        }
    }
}
