//! Several hosts on one machine: network namespaces joined by a bridge. Everything created
//! here is deleted when the guard drops, also when the test fails.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::process::Command;

/// A bridge and its namespaces. The root namespace gets an address on the bridge too, so the
/// test can reach the hosts (metrics, the registry) directly.
#[derive(Debug)]
pub struct Net {
    pub bridge: String,
    pub namespaces: Vec<String>,
    /// `10.<octet>.0.0/24` (or `fd00:<octet>::/64`), unique per test process so concurrent
    /// runs never collide.
    octet: u8,
    tag: String,
    /// Hosts get IPv6 addresses only (no IPv4 on their interface).
    v6: bool,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Network namespaces need root: fail loudly (never skip) without it.
pub fn require_root() {
    let uid = Command::new("id").arg("-u").output().expect("id -u");
    assert_eq!(
        String::from_utf8_lossy(&uid.stdout).trim(),
        "0",
        "multi-node tests create network namespaces and must run as root"
    );
    super::require("ip");
}

impl Net {
    pub fn new() -> Net {
        Self::with_family(false)
    }

    /// An IPv6-only network: `fd00:<octet>::<host>/64`, no IPv4 address on any host.
    pub fn new_v6() -> Net {
        Self::with_family(true)
    }

    fn with_family(v6: bool) -> Net {
        require_root();
        // Unique per process and per network within it, so parallel tests never collide.
        static COUNT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let pid = std::process::id();
        let tag = format!("{:x}{n}", pid % 0xffff);
        let octet = 100 + ((pid * 7 + n * 13) % 150) as u8;
        let net = Net {
            bridge: format!("fb{tag}"),
            namespaces: Vec::new(),
            octet,
            tag,
            v6,
        };
        ip(&["link", "add", &net.bridge, "type", "bridge"]);
        let bridge_addr = net.cidr(254);
        ip(&net.addr_args(&["addr", "add", &bridge_addr, "dev", &net.bridge]));
        if v6 {
            // The test itself also reaches hosts over IPv4 (see `add_ipv4`).
            let v4 = format!("{}/24", Ipv4Addr::new(10, net.octet, 0, 254));
            ip(&["addr", "add", &v4, "dev", &net.bridge]);
        }
        ip(&["link", "set", &net.bridge, "up"]);
        net
    }

    /// `10.<octet>.0.<host>`, or `fd00:<octet>::<host>` on an IPv6 network.
    pub fn host_ip(&self, host: u8) -> IpAddr {
        if self.v6 {
            Ipv6Addr::new(0xfd00, self.octet.into(), 0, 0, 0, 0, 0, host.into()).into()
        } else {
            Ipv4Addr::new(10, self.octet, 0, host).into()
        }
    }

    fn cidr(&self, host: u8) -> String {
        let len = if self.v6 { 64 } else { 24 };
        format!("{}/{len}", self.host_ip(host))
    }

    /// `ip addr add` arguments; an IPv6 address skips duplicate address detection, which
    /// would keep it unusable ("tentative") for a second or two.
    fn addr_args<'a>(&self, args: &[&'a str]) -> Vec<&'a str> {
        let mut all = args.to_vec();
        if self.v6 {
            all.push("nodad");
        }
        all
    }

    /// The bridge's end of namespace `ns`'s link (what it sends into `ns` leaves there).
    pub fn bridge_side(ns: &str) -> String {
        format!("v{}", ns.strip_prefix('f').unwrap_or(ns))
    }

    /// A namespace with loopback up and one interface on the bridge at [`Net::host_ip`].
    pub fn add_host(&mut self, name: &str, host: u8) -> String {
        let ns = format!("f{name}{}", self.tag);
        let outside = Net::bridge_side(&ns);
        ip(&["netns", "add", &ns]);
        self.namespaces.push(ns.clone());
        ip(&[
            "link", "add", &outside, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ]);
        ip(&["link", "set", &outside, "master", &self.bridge]);
        ip(&["link", "set", &outside, "up"]);
        ip(&["-n", &ns, "link", "set", "lo", "up"]);
        let addr = self.cidr(host);
        ip(&self.addr_args(&["-n", &ns, "addr", "add", &addr, "dev", "eth0"]));
        ip(&["-n", &ns, "link", "set", "eth0", "up"]);
        ns
    }
}

impl Net {
    /// Gives host `host` of an IPv6 network an IPv4 address too, `10.<octet>.0.<host>`, for
    /// tools of the test that cannot take an IPv6 address (skopeo's references).
    pub fn add_ipv4(&self, ns: &str, host: u8) -> Ipv4Addr {
        let v4 = Ipv4Addr::new(10, self.octet, 0, host);
        ip(&["-n", ns, "addr", "add", &format!("{v4}/24"), "dev", "eth0"]);
        v4
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Deleting a namespace deletes its veth end, and the bridge side with it.
        for ns in &self.namespaces {
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge])
            .status();
    }
}
