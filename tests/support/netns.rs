//! Several hosts on one machine: network namespaces joined by a bridge. Everything created
//! here is deleted when the guard drops, also when the test fails.

use std::net::Ipv4Addr;
use std::process::Command;

/// A bridge and its namespaces. The root namespace gets an address on the bridge too, so the
/// test can reach the hosts (metrics, the registry) directly.
#[derive(Debug)]
pub struct Net {
    pub bridge: String,
    pub namespaces: Vec<String>,
    /// `10.<octet>.0.0/24`, unique per test process so concurrent runs never collide.
    octet: u8,
    tag: String,
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
        };
        ip(&["link", "add", &net.bridge, "type", "bridge"]);
        ip(&[
            "addr",
            "add",
            &format!("{}/24", net.host_ip(254)),
            "dev",
            &net.bridge,
        ]);
        ip(&["link", "set", &net.bridge, "up"]);
        net
    }

    /// `10.<octet>.0.<host>`
    pub fn host_ip(&self, host: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, self.octet, 0, host)
    }

    /// A namespace with loopback up and one interface on the bridge at `10.<octet>.0.<host>`.
    pub fn add_host(&mut self, name: &str, host: u8) -> String {
        let ns = format!("f{name}{}", self.tag);
        let outside = format!("v{name}{}", self.tag);
        ip(&["netns", "add", &ns]);
        self.namespaces.push(ns.clone());
        ip(&[
            "link", "add", &outside, "type", "veth", "peer", "name", "eth0", "netns", &ns,
        ]);
        ip(&["link", "set", &outside, "master", &self.bridge]);
        ip(&["link", "set", &outside, "up"]);
        ip(&["-n", &ns, "link", "set", "lo", "up"]);
        ip(&[
            "-n",
            &ns,
            "addr",
            "add",
            &format!("{}/24", self.host_ip(host)),
            "dev",
            "eth0",
        ]);
        ip(&["-n", &ns, "link", "set", "eth0", "up"]);
        ns
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
