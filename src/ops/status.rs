//! What `ferry status` prints and `/status` serves. Invariant: built on request from the same
//! in-process state as `/readyz` and `/metrics`, never a second source of truth.

use serde::{Deserialize, Serialize};

use crate::coalesce::InFlightPart;
use crate::keep::KeepStatus;
use crate::metrics::{self, Metrics, SourceLabels};
use crate::registry::recent::Pull;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Status {
    pub version: String,
    pub node: Option<String>,
    pub ready: bool,
    pub conditions: Vec<Condition>,
    pub problems: Vec<Problem>,
    /// `None` when peer-to-peer is off.
    pub this_node: Option<PeerView>,
    pub peers: Vec<PeerView>,
    /// Peers this node's fetches pass over now.
    #[serde(default)]
    pub passed_over: Vec<PassedOver>,
    /// Newest first.
    #[serde(default)]
    pub in_flight: Vec<InFlightPart>,
    pub advertised_keys: i64,
    /// The images (registry/repository:tag) among them; the rest are digests.
    #[serde(default)]
    pub advertised_tags: Vec<String>,
    /// What the mirror and the peer address served, by kind and source.
    pub served: Vec<Served>,
    /// The wait for a lookup's first provider now (`registry::peer::bound`).
    #[serde(default)]
    pub lookup_wait_ms: Option<u64>,
    #[serde(default)]
    pub lookups_found_late: u64,
    pub corrupt_blobs: u64,
    /// `None` without a lease (`--keep-budget 0`).
    #[serde(default)]
    pub keep: Option<KeepStatus>,
    /// Newest first.
    pub recent: Vec<Pull>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Condition {
    pub name: String,
    pub ok: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Problem {
    pub problem: String,
    pub detail: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeerView {
    pub id: String,
    pub addr: String,
    #[serde(default)]
    pub connected_s: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PassedOver {
    pub id: String,
    pub seconds_left: u64,
    /// It served wrong bytes, not only failed to answer.
    pub quarantined: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Served {
    pub listener: String,
    pub kind: String,
    pub source: String,
    pub requests: u64,
    pub bytes: u64,
}

/// The counters of `metrics` that `Status` shows, nonzero ones only.
pub fn served(metrics: &Metrics) -> Vec<Served> {
    let mut out = Vec::new();
    // These series exist from the start (`Metrics::new`): reading creates none.
    for listener in metrics::LISTENERS {
        for kind in metrics::SERVED_KINDS {
            for &source in metrics::sources(listener) {
                let labels = SourceLabels {
                    listener,
                    kind,
                    source,
                };
                let requests = metrics.served.get_or_create(&labels).get();
                let bytes = metrics.served_bytes.get_or_create(&labels).get();
                if requests > 0 || bytes > 0 {
                    out.push(Served {
                        listener: listener.to_string(),
                        kind: kind.to_string(),
                        source: source.to_string(),
                        requests,
                        bytes,
                    });
                }
            }
        }
    }
    out
}

impl Status {
    /// As `ferry status` prints it; `now` is seconds since the Unix epoch.
    pub fn text(&self, now: u64) -> String {
        let yes_no = |b: bool| if b { "yes" } else { "no" };
        let mut out = format!(
            "ferry {}{}: {}\n",
            self.version,
            self.node
                .as_deref()
                .map_or(String::new(), |n| format!(" on {n}")),
            if self.ready { "ready" } else { "NOT READY" }
        );
        for c in &self.conditions {
            out.push_str(&format!("  {}: {}\n", c.name, yes_no(c.ok)));
        }
        if self.problems.is_empty() {
            out.push_str("problems: none\n");
        } else {
            out.push_str("problems:\n");
            for p in &self.problems {
                out.push_str(&format!("  {}: {}\n", p.problem, p.detail));
            }
        }
        match &self.this_node {
            None => out.push_str("peer-to-peer: off\n"),
            Some(me) => {
                out.push_str(&format!("this node: {} at {}\n", me.id, me.addr));
                out.push_str(&format!("peers connected: {}\n", self.peers.len()));
                for p in self.peers.iter().take(10) {
                    let since = p
                        .connected_s
                        .map_or(String::new(), |s| format!(", connected {}", duration(s)));
                    out.push_str(&format!("  {} at {}{since}\n", p.id, p.addr));
                }
                if self.peers.len() > 10 {
                    out.push_str(&format!("  ... and {} more\n", self.peers.len() - 10));
                }
                out.push_str(&format!(
                    "keys advertised: {} ({} digests, {} image tags)\n",
                    self.advertised_keys,
                    (self.advertised_keys as usize).saturating_sub(self.advertised_tags.len()),
                    self.advertised_tags.len()
                ));
                if let Some(wait) = self.lookup_wait_ms {
                    out.push_str(&format!(
                        "lookup wait: {wait} ms ({} lookups cut by it found a provider later)\n",
                        self.lookups_found_late
                    ));
                }
                if !self.passed_over.is_empty() {
                    out.push_str("peers passed over (they failed recently):\n");
                    for p in &self.passed_over {
                        out.push_str(&format!(
                            "  {}: {} for {}\n",
                            p.id,
                            if p.quarantined {
                                "QUARANTINED (served bytes that did not match their digest)"
                            } else {
                                "asked last"
                            },
                            duration(p.seconds_left)
                        ));
                    }
                }
            }
        }
        if !self.in_flight.is_empty() {
            out.push_str("downloads in a rollout (this node's role, its source, its followers):\n");
            for p in &self.in_flight {
                out.push_str(&format!("  {}\n", in_flight_line(p)));
            }
        }
        if let Some(keep) = &self.keep {
            out.push_str(&keep.line(human));
            out.push('\n');
        }
        if self.corrupt_blobs > 0 {
            out.push_str(&format!(
                "corrupt blobs found in the store: {}\n",
                self.corrupt_blobs
            ));
        }
        for (listener, title) in [
            ("mirror", "served to this node's containerd (since start):"),
            ("peer", "served to other nodes (since start):"),
        ] {
            out.push_str(title);
            out.push('\n');
            let mine: Vec<&Served> = self
                .served
                .iter()
                .filter(|s| s.listener == listener)
                .collect();
            if mine.is_empty() {
                out.push_str("  nothing yet\n");
            }
            for s in mine {
                let bytes = if s.bytes > 0 {
                    format!(", {}", human(s.bytes))
                } else {
                    String::new()
                };
                out.push_str(&format!(
                    "  {} from {}: {} answers{bytes}\n",
                    s.kind,
                    source_name(&s.source),
                    s.requests
                ));
            }
        }
        let saved: u64 = self
            .served
            .iter()
            .filter(|s| s.listener == "mirror" && matches!(s.source.as_str(), "peer" | "inflight"))
            .map(|s| s.bytes)
            .sum();
        out.push_str(&format!(
            "not downloaded from registries thanks to peers: {}\n",
            human(saved)
        ));
        if !self.recent.is_empty() {
            out.push_str("recent pulls (newest first):\n");
            for p in &self.recent {
                out.push_str(&format!(
                    "  {:>6} ago  {:<8} {:<9} {:>10}  {}\n",
                    format!("{}s", now.saturating_sub(p.at)),
                    p.kind,
                    p.source,
                    p.bytes.map_or("-".to_string(), human),
                    p.what
                ));
            }
        }
        out
    }
}

/// One in-flight blob, as status and the debug page show it.
pub fn in_flight_line(p: &InFlightPart) -> String {
    let digest: String = p.digest.chars().take(19).collect();
    let from = p
        .source
        .as_deref()
        .map_or(String::new(), |s| format!(" from {s}"));
    let to = match p.followers.len() {
        0 => String::new(),
        n => format!(" to {n} followers ({})", p.followers.join(", ")),
    };
    format!("{digest}… {}{from}{to}, {} ago", p.role, duration(p.age_s))
}

fn source_name(source: &str) -> &str {
    match source {
        "local" => "this node's store",
        "peer" => "other nodes",
        "inflight" => "downloads in progress",
        "miss" => "nowhere (404: containerd asked the registry)",
        other => other,
    }
}

/// `3h 2m`, `5m 1s`, `42s`.
pub fn duration(seconds: u64) -> String {
    let (h, m, s) = (seconds / 3600, seconds / 60 % 60, seconds % 60);
    match (h, m) {
        (0, 0) => format!("{s}s"),
        (0, _) => format!("{m}m {s}s"),
        _ => format!("{h}h {m}m"),
    }
}

pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_says_readiness_problems_peers_and_where_pulls_came_from() {
        let status = Status {
            version: "0.1.0".into(),
            node: Some("node-a".into()),
            ready: true,
            conditions: vec![Condition {
                name: "containerd reachable".into(),
                ok: true,
            }],
            problems: vec![Problem {
                problem: "no_peers".into(),
                detail: "no peer connected".into(),
            }],
            this_node: Some(PeerView {
                id: "12D3me".into(),
                addr: "10.0.0.1:5481".into(),
                connected_s: None,
            }),
            peers: vec![PeerView {
                id: "12D3other".into(),
                addr: "10.0.0.2:5481".into(),
                connected_s: Some(3725),
            }],
            passed_over: vec![PassedOver {
                id: "12D3bad".into(),
                seconds_left: 290,
                quarantined: true,
            }],
            in_flight: vec![InFlightPart {
                digest: "sha256:0123456789abcdef0123".into(),
                role: "relay".into(),
                source: Some("12D3leader".into()),
                followers: vec!["12D3a".into(), "12D3b".into()],
                age_s: 2,
            }],
            advertised_keys: 7,
            advertised_tags: vec!["docker.io/library/app:1".into()],
            served: vec![Served {
                listener: "mirror".into(),
                kind: "blob".into(),
                source: "peer".into(),
                requests: 3,
                bytes: 3 << 20,
            }],
            lookup_wait_ms: Some(87),
            lookups_found_late: 3,
            corrupt_blobs: 0,
            keep: Some(KeepStatus {
                containerd_discards_layers: true,
                lease: Some("ferry-holds-1".into()),
                held: 9,
                held_alone: 3,
                held_alone_bytes: 12 << 20,
                budget_bytes: 20 << 30,
                released: 1,
            }),
            recent: vec![Pull {
                at: 100,
                kind: "blob".into(),
                what: "r/app@sha256:ab".into(),
                source: "peer".into(),
                bytes: Some(1 << 20),
            }],
        };
        let text = status.text(105);
        for part in [
            "ferry 0.1.0 on node-a: ready",
            "containerd reachable: yes",
            "no_peers: no peer connected",
            "peers connected: 1",
            "12D3other at 10.0.0.2:5481, connected 1h 2m",
            "12D3bad: QUARANTINED (served bytes that did not match their digest) for 4m 50s",
            "keys advertised: 7 (6 digests, 1 image tags)",
            "lookup wait: 87 ms (3 lookups cut by it found a provider later)",
            "sha256:0123456789ab… relay from 12D3leader to 2 followers (12D3a, 12D3b), 2s ago",
            "blob from other nodes: 3 answers, 3.0 MiB",
            "served to other nodes (since start):\n  nothing yet",
            "thanks to peers: 3.0 MiB",
            "5s ago",
            "1.0 MiB  r/app@sha256:ab",
            "kept for peers: 9 blobs in Ferry's containerd lease, 3 of them (12.0 MiB) kept by it alone, budget 20.0 GiB, 1 let go (containerd discards unpacked layers: these stay shareable)",
        ] {
            assert!(text.contains(part), "{part:?} in:\n{text}");
        }
        let json = serde_json::to_string(&status).unwrap();
        assert_eq!(serde_json::from_str::<Status>(&json).unwrap(), status);
    }
}
