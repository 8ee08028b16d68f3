//! The address other nodes reach this one at when `--advertise-addr` is not given: one of the
//! interface carrying the default route, since the first non-loopback address is often a
//! bridge's (docker0, cni0) or link-local one that no other node can reach.

use std::net::IpAddr;

/// An address picked for this node, with why (for the log line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Chosen {
    pub ip: IpAddr,
    pub interface: String,
    pub why: &'static str,
}

pub(crate) fn reachable_ip() -> Option<Chosen> {
    let addrs: Vec<(String, IpAddr)> = if_addrs::get_if_addrs()
        .ok()?
        .into_iter()
        .map(|i| {
            let ip = i.ip();
            (i.name, ip)
        })
        .collect();
    let v4 = std::fs::read_to_string("/proc/net/route").unwrap_or_default();
    let v6 = std::fs::read_to_string("/proc/net/ipv6_route").unwrap_or_default();
    choose(&addrs, &default_routes_v4(&v4), &default_routes_v6(&v6))
}

/// Interfaces with an IPv4 default route in `/proc/net/route`, lowest metric first.
fn default_routes_v4(table: &str) -> Vec<String> {
    let mut routes: Vec<(u32, String)> = table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            // Iface Destination Gateway Flags RefCnt Use Metric Mask ...
            let (iface, dest, metric, mask) = (f.first()?, f.get(1)?, f.get(6)?, f.get(7)?);
            (*dest == "00000000" && *mask == "00000000")
                .then(|| Some((metric.parse().ok()?, iface.to_string())))?
        })
        .collect();
    routes.sort();
    routes.into_iter().map(|(_, iface)| iface).collect()
}

/// Interfaces with an IPv6 default route, lowest metric first; the kernel's unreachable `::/0`
/// on `lo` is left out.
fn default_routes_v6(table: &str) -> Vec<String> {
    let mut routes: Vec<(u32, String)> = table
        .lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            // dest dest_len src src_len next_hop metric refcnt use flags iface
            let (dest, len, metric, iface) = (f.first()?, f.get(1)?, f.get(5)?, f.get(9)?);
            let default = dest.bytes().all(|b| b == b'0') && *len == "00" && *iface != "lo";
            default.then(|| Some((u32::from_str_radix(metric, 16).ok()?, iface.to_string())))?
        })
        .collect();
    routes.sort();
    routes.into_iter().map(|(_, iface)| iface).collect()
}

/// Interfaces of container runtimes, CNI plugins and hypervisors: never reachable from others.
const VIRTUAL_PREFIXES: &[&str] = &[
    "docker",
    "cni",
    "veth",
    "virbr",
    "br-",
    "flannel",
    "cali",
    "cilium",
    "kube-",
    "tunl",
    "vxlan",
    "weave",
    "lxc",
    "podman",
    "cbr",
    "genev",
    "nodelocaldns",
];

fn is_link_local(ip: &IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

fn usable(ip: &IpAddr) -> bool {
    !ip.is_loopback() && !ip.is_unspecified() && !is_link_local(ip)
}

/// In order: the IPv4, then IPv6, default route's interface; else the first usable address of
/// a non-virtual interface; else of any.
fn choose(
    addrs: &[(String, IpAddr)],
    v4_routes: &[String],
    v6_routes: &[String],
) -> Option<Chosen> {
    let on = |routes: &[String], want_v4: bool| {
        routes.iter().find_map(|iface| {
            addrs
                .iter()
                .find(|(name, ip)| name == iface && ip.is_ipv4() == want_v4 && usable(ip))
        })
    };
    let physical = |name: &str| !VIRTUAL_PREFIXES.iter().any(|p| name.starts_with(p));
    let first = |want_v4: bool, only_physical: bool| {
        addrs.iter().find(|(name, ip)| {
            ip.is_ipv4() == want_v4 && usable(ip) && (!only_physical || physical(name))
        })
    };
    let pick = |found: Option<&(String, IpAddr)>, why| {
        found.map(|(name, ip)| Chosen {
            ip: *ip,
            interface: name.clone(),
            why,
        })
    };
    pick(on(v4_routes, true), "the IPv4 default route's interface")
        .or_else(|| pick(on(v6_routes, false), "the IPv6 default route's interface"))
        .or_else(|| {
            pick(
                first(true, true),
                "no usable default route: the first IPv4 address",
            )
        })
        .or_else(|| {
            pick(
                first(false, true),
                "no usable default route: the first IPv6 address",
            )
        })
        .or_else(|| pick(first(true, false), "only on a bridge or virtual interface"))
        .or_else(|| pick(first(false, false), "only on a bridge or virtual interface"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROUTE_V4: &str =
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
docker0\t000011AC\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
ens5\t00000000\t0100000A\t0003\t0\t0\t100\t00000000\t0\t0\t0
ens6\t00000000\t0101000A\t0003\t0\t0\t200\t00000000\t0\t0\t0
ens5\t0000000A\t00000000\t0001\t0\t0\t100\t00FFFFFF\t0\t0\t0
";

    const ROUTE_V6: &str = "\
fe800000000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001     ens5
00000000000000000000000000000000 00 00000000000000000000000000000000 00 fd000000000000000000000000000001 00000400 00000002 00000000 00000003     ens5
00000000000000000000000000000000 00 00000000000000000000000000000000 00 00000000000000000000000000000000 ffffffff 00000001 00000000 00200200       lo
";

    fn addrs(list: &[(&str, &str)]) -> Vec<(String, IpAddr)> {
        list.iter()
            .map(|(n, ip)| (n.to_string(), ip.parse().unwrap()))
            .collect()
    }

    #[test]
    fn default_routes_are_read_lowest_metric_first_and_lo_left_out() {
        assert_eq!(default_routes_v4(ROUTE_V4), ["ens5", "ens6"]);
        assert_eq!(default_routes_v6(ROUTE_V6), ["ens5"]);
        assert!(default_routes_v4("").is_empty());
        assert!(default_routes_v6("garbage\n1 2 3\n").is_empty());
    }

    #[test]
    fn the_default_route_wins_over_a_bridge_listed_first() {
        let host = addrs(&[
            ("lo", "127.0.0.1"),
            ("docker0", "172.17.0.1"),
            ("ens6", "169.254.3.1"),
            ("ens6", "10.0.1.7"),
            ("ens5", "10.0.0.7"),
        ]);
        let chosen = choose(&host, &default_routes_v4(ROUTE_V4), &[]).unwrap();
        assert_eq!(chosen.ip, "10.0.0.7".parse::<IpAddr>().unwrap());
        assert_eq!(chosen.interface, "ens5");
    }

    #[test]
    fn an_ipv6_only_host_uses_its_ipv6_default_route() {
        let host = addrs(&[("lo", "::1"), ("ens5", "fe80::1"), ("ens5", "fd00::7")]);
        let chosen = choose(&host, &[], &default_routes_v6(ROUTE_V6)).unwrap();
        assert_eq!(chosen.ip, "fd00::7".parse::<IpAddr>().unwrap());
    }

    #[test]
    fn without_a_default_route_bridges_and_link_local_come_last() {
        let host = addrs(&[
            ("docker0", "172.17.0.1"),
            ("eth1", "169.254.0.2"),
            ("eth0", "192.168.10.4"),
        ]);
        assert_eq!(
            choose(&host, &[], &[]).unwrap().ip,
            "192.168.10.4".parse::<IpAddr>().unwrap()
        );
        let only_bridge = addrs(&[("lo", "127.0.0.1"), ("docker0", "172.17.0.1")]);
        let chosen = choose(&only_bridge, &[], &[]).unwrap();
        assert_eq!(chosen.interface, "docker0");
        assert_eq!(chosen.why, "only on a bridge or virtual interface");
        assert_eq!(choose(&addrs(&[("lo", "127.0.0.1")]), &[], &[]), None);
    }

    #[test]
    fn a_default_route_on_an_interface_without_an_address_falls_through() {
        let host = addrs(&[("eth0", "192.168.10.4")]);
        let chosen = choose(&host, &["wg0".to_string()], &[]).unwrap();
        assert_eq!(chosen.interface, "eth0");
    }
}
