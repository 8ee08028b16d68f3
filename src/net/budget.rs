//! How many connections and requests each listener and libp2p may hold, from the open-file
//! limit Ferry actually has. Every connection and every file being sent is a descriptor, and
//! running out stops every accept loop at once, the probes' included.
//! Invariant: the budgets and the headroom together never exceed the limit, except that each
//! keeps a small floor to stay useful (a limit that low is reported).

/// Descriptors kept for everything that is not a counted connection: containerd's gRPC
/// channel, files read through it, the Kubernetes client, Ferry's own files, the runtime.
const HEADROOM: u64 = 256;

/// One listener's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Listener {
    /// Open connections; at the limit the longest idle make room.
    pub connections: usize,
    /// Requests answered at once, bodies included (each may hold a file open).
    pub in_flight: usize,
}

impl Listener {
    fn descriptors(&self) -> u64 {
        (self.connections + self.in_flight) as u64
    }
}

/// libp2p's connection limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct P2p {
    /// Incoming connections still in their handshake, from all addresses together.
    pub pending_incoming: usize,
    /// Established connections, both directions.
    pub established: usize,
}

/// Every budget, for one open-file limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budgets {
    /// The soft `RLIMIT_NOFILE` the budgets were made for.
    pub open_files: u64,
    pub mirror: Listener,
    pub peer: Listener,
    /// `/metrics`, `/healthz`, `/readyz`: the kubelet's probes never wait behind pulls.
    pub ops: Listener,
    pub p2p: P2p,
    /// The limit was too low for the full budgets: each was scaled down.
    pub cut: bool,
}

const FULL: Budgets = Budgets {
    open_files: u64::MAX,
    mirror: Listener {
        connections: 2048,
        in_flight: 1024,
    },
    peer: Listener {
        connections: 2048,
        in_flight: 1024,
    },
    ops: Listener {
        connections: 256,
        in_flight: 64,
    },
    p2p: P2p {
        pending_incoming: 128,
        established: 2048,
    },
    cut: false,
};

const FLOOR: Budgets = Budgets {
    open_files: 0,
    mirror: Listener {
        connections: 64,
        in_flight: 32,
    },
    peer: Listener {
        connections: 64,
        in_flight: 32,
    },
    ops: Listener {
        connections: 32,
        in_flight: 16,
    },
    p2p: P2p {
        pending_incoming: 16,
        established: 64,
    },
    cut: true,
};

impl Budgets {
    /// The budgets for a soft limit of `open_files` descriptors (`None`: unlimited).
    pub fn for_limit(open_files: Option<u64>) -> Budgets {
        let open_files = open_files.unwrap_or(u64::MAX);
        let full = FULL.descriptors();
        let spare = open_files.saturating_sub(HEADROOM);
        if spare >= full {
            return Budgets { open_files, ..FULL };
        }
        let scale = |value: usize, floor: usize| {
            let scaled = (value as u64).saturating_mul(spare) / full;
            (scaled as usize).max(floor)
        };
        let listener = |f: Listener, m: Listener| Listener {
            connections: scale(f.connections, m.connections),
            in_flight: scale(f.in_flight, m.in_flight),
        };
        Budgets {
            open_files,
            mirror: listener(FULL.mirror, FLOOR.mirror),
            peer: listener(FULL.peer, FLOOR.peer),
            ops: listener(FULL.ops, FLOOR.ops),
            p2p: P2p {
                pending_incoming: scale(FULL.p2p.pending_incoming, FLOOR.p2p.pending_incoming),
                established: scale(FULL.p2p.established, FLOOR.p2p.established),
            },
            cut: true,
        }
    }

    /// The budgets for this process's soft limit now.
    pub fn for_this_process() -> Budgets {
        Budgets::for_limit(open_file_limit().current)
    }

    /// Descriptors the budgets may use at most, headroom excluded.
    pub fn descriptors(&self) -> u64 {
        self.mirror.descriptors()
            + self.peer.descriptors()
            + self.ops.descriptors()
            + (self.p2p.pending_incoming + self.p2p.established) as u64
    }

    /// What an operator reads when the budgets were cut; `None` when they were not.
    pub fn shortfall(&self) -> Option<String> {
        self.cut.then(|| {
            format!(
                "the open-file limit is {} (soft and hard): connection budgets cut to {} on the mirror, {} on the peer address and {} for libp2p; raise LimitNOFILE (the unit sets 1048576) or the container runtime's limit to at least {}",
                self.open_files,
                self.mirror.connections,
                self.peer.connections,
                self.p2p.established,
                FULL.descriptors() + HEADROOM
            )
        })
    }
}

/// The soft and hard `RLIMIT_NOFILE`.
pub fn open_file_limit() -> rustix::process::Rlimit {
    rustix::process::getrlimit(rustix::process::Resource::Nofile)
}

/// Raises the soft open-file limit to the hard one, as Go programs and containerd do: the
/// soft default (1,024) predates servers holding thousands of connections.
pub fn raise_open_file_limit() {
    let limit = open_file_limit();
    if limit.current != limit.maximum {
        let raised = rustix::process::Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        };
        if let Err(e) = rustix::process::setrlimit(rustix::process::Resource::Nofile, raised) {
            tracing::warn!(error = %e, "cannot raise the open-file limit to the hard limit");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_high_limit_gets_the_full_budgets() {
        for limit in [None, Some(1 << 20), Some(FULL.descriptors() + HEADROOM)] {
            let b = Budgets::for_limit(limit);
            assert!(!b.cut, "{limit:?}");
            assert_eq!(b.mirror, FULL.mirror);
            assert_eq!(b.shortfall(), None);
        }
    }

    #[test]
    fn a_low_limit_scales_every_budget_within_it() {
        let b = Budgets::for_limit(Some(4096));
        assert!(b.cut);
        assert!(b.descriptors() + HEADROOM <= 4096, "{b:?}");
        assert!(b.mirror.connections > FLOOR.mirror.connections);
        assert!(b.shortfall().unwrap().contains("4096"));
        // The systemd default: every budget at least its floor, a little over the limit.
        let b = Budgets::for_limit(Some(1024));
        assert!(b.mirror.connections >= FLOOR.mirror.connections);
        assert!(b.ops.in_flight >= FLOOR.ops.in_flight);
        assert!(b.descriptors() <= 1024, "{b:?}");
        let b = Budgets::for_limit(Some(10));
        assert_eq!(b.mirror, FLOOR.mirror);
    }
}
