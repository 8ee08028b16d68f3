//! Where to find the first peers. A narrow trait, so the Kubernetes source can plug in later
//! without touching the swarm.

use std::net::IpAddr;

use libp2p::Multiaddr;
use libp2p::multiaddr::Protocol;

#[async_trait::async_trait]
pub trait Bootstrap: Send + Sync + 'static {
    /// Addresses to dial (without peer IDs: they are learned on connect).
    async fn peers(&self) -> Vec<Multiaddr>;
}

/// A fixed list from `--bootstrap-peers`.
#[derive(Debug, Clone, Default)]
pub struct StaticBootstrap {
    pub addrs: Vec<Multiaddr>,
}

#[async_trait::async_trait]
impl Bootstrap for StaticBootstrap {
    async fn peers(&self) -> Vec<Multiaddr> {
        self.addrs.clone()
    }
}

/// Every A/AAAA record of `--bootstrap-dns`, at the p2p port.
#[derive(Debug, Clone)]
pub struct DnsBootstrap {
    pub name: String,
    pub port: u16,
}

#[async_trait::async_trait]
impl Bootstrap for DnsBootstrap {
    async fn peers(&self) -> Vec<Multiaddr> {
        match tokio::net::lookup_host((self.name.as_str(), self.port)).await {
            Ok(addrs) => addrs.map(|a| tcp_multiaddr(a.ip(), a.port())).collect(),
            Err(e) => {
                tracing::warn!(name = %self.name, error = %e, "bootstrap DNS lookup failed");
                Vec::new()
            }
        }
    }
}

#[derive(Default)]
pub struct Bootstraps(pub Vec<Box<dyn Bootstrap>>);

impl std::fmt::Debug for Bootstraps {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bootstraps({} sources)", self.0.len())
    }
}

#[async_trait::async_trait]
impl Bootstrap for Bootstraps {
    async fn peers(&self) -> Vec<Multiaddr> {
        let mut all = Vec::new();
        for source in &self.0 {
            all.extend(source.peers().await);
        }
        all
    }
}

pub fn tcp_multiaddr(ip: IpAddr, port: u16) -> Multiaddr {
    Multiaddr::empty().with(ip.into()).with(Protocol::Tcp(port))
}

/// `host:port`, `ip:port` (an IPv6 address with or without brackets: the part after the last
/// colon is the port) or a multiaddr (`/ip4/10.0.0.1/tcp/5482`, `/dns/node-1/tcp/5482`).
pub fn parse_peer(s: &str) -> Result<Multiaddr, String> {
    if s.starts_with('/') {
        return s.parse().map_err(|e| format!("{s:?}: {e}"));
    }
    if let Ok(sa) = s.parse::<std::net::SocketAddr>() {
        return Ok(tcp_multiaddr(sa.ip(), sa.port()));
    }
    let (host, port) = s
        .rsplit_once(':')
        .ok_or_else(|| format!("{s:?}: expected host:port or a multiaddr"))?;
    let port: u16 = port.parse().map_err(|_| format!("{s:?}: bad port"))?;
    if let Ok(v6) = host.parse::<std::net::Ipv6Addr>() {
        return Ok(tcp_multiaddr(v6.into(), port));
    }
    if host.is_empty()
        || !host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'-')
    {
        return Err(format!("{s:?}: bad host name"));
    }
    Ok(Multiaddr::empty()
        .with(Protocol::Dns(host.to_string().into()))
        .with(Protocol::Tcp(port)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_parse_in_three_forms() {
        assert_eq!(
            parse_peer("10.0.0.1:5482").unwrap().to_string(),
            "/ip4/10.0.0.1/tcp/5482"
        );
        assert_eq!(
            parse_peer("[::1]:5482").unwrap().to_string(),
            "/ip6/::1/tcp/5482"
        );
        assert_eq!(
            parse_peer("node-1.example:5482").unwrap().to_string(),
            "/dns/node-1.example/tcp/5482"
        );
        assert_eq!(
            parse_peer("fd00::5:5482").unwrap().to_string(),
            "/ip6/fd00::5/tcp/5482"
        );
        assert_eq!(
            parse_peer("[fd00::5]:5482").unwrap().to_string(),
            "/ip6/fd00::5/tcp/5482"
        );
        assert_eq!(
            parse_peer("/ip4/1.2.3.4/tcp/1").unwrap().to_string(),
            "/ip4/1.2.3.4/tcp/1"
        );
        for bad in ["node", "node:x", "/nope", "a b:1", ":1"] {
            assert!(parse_peer(bad).is_err(), "{bad}");
        }
    }
}
