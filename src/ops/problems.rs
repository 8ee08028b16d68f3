//! Problems that make Ferry less useful on this node without making it unready: each is a line
//! in `/readyz`, a `ferry_config_problems` series and a log warning. Invariant: a problem never
//! changes readiness; one seen only at moments is set for a while and lapses on its own.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::containerd_config::preflight;
use crate::metrics::{Metrics, ProblemLabels};

/// The process's own: an open-file limit too low for the connection budgets.
pub const PROCESS: [&str; 1] = ["open_file_limit"];

/// The problems of the peer network (the containerd config's are `preflight::PROBLEMS`).
pub const PEER_NETWORK: [&str; 3] = [
    "no_peers",
    "peer_handshake_failing",
    "cluster_secret_changed",
];

#[derive(Debug)]
pub struct Problems {
    active: Mutex<BTreeMap<&'static str, Problem>>,
    metrics: Arc<Metrics>,
}

#[derive(Debug, Clone)]
struct Problem {
    detail: String,
    until: Option<Instant>,
}

impl Problems {
    /// Every problem's series starts at 0, so alerts see it from the first scrape.
    pub fn new(metrics: Arc<Metrics>) -> Self {
        let problems = Problems {
            active: Mutex::new(BTreeMap::new()),
            metrics,
        };
        for problem in PEER_NETWORK
            .iter()
            .chain(&PROCESS)
            .chain(&preflight::PROBLEMS)
        {
            problems.gauge(problem, 0);
        }
        problems
    }

    /// `problem` holds until [`Problems::clear`]; `detail` says what is wrong and the fix.
    pub fn set(&self, problem: &'static str, detail: impl Into<String>) {
        self.put(problem, detail.into(), None);
    }

    /// `problem` holds for `lasting` from now (again from each call), then lapses.
    pub fn set_for(&self, problem: &'static str, detail: impl Into<String>, lasting: Duration) {
        self.put(problem, detail.into(), Some(Instant::now() + lasting));
    }

    pub fn clear(&self, problem: &'static str) {
        if self.lock().remove(problem).is_some() {
            tracing::info!(problem, "configuration problem resolved");
            self.gauge(problem, 0);
        }
    }

    pub fn current(&self) -> Vec<(&'static str, String)> {
        let now = Instant::now();
        let mut active = self.lock();
        let lapsed: Vec<&'static str> = active
            .iter()
            .filter(|(_, p)| p.until.is_some_and(|t| t <= now))
            .map(|(name, _)| *name)
            .collect();
        for name in lapsed {
            active.remove(name);
            self.gauge(name, 0);
        }
        active
            .iter()
            .map(|(name, p)| (*name, p.detail.clone()))
            .collect()
    }

    fn put(&self, problem: &'static str, detail: String, until: Option<Instant>) {
        let mut active = self.lock();
        let new = !active.contains_key(problem);
        if new {
            tracing::warn!(problem, "{detail}");
        }
        active.insert(problem, Problem { detail, until });
        self.gauge(problem, 1);
    }

    fn gauge(&self, problem: &'static str, value: i64) {
        self.metrics
            .config_problems
            .get_or_create(&ProblemLabels { problem })
            .set(value);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<&'static str, Problem>> {
        // A panic under this lock leaves a complete map: keep using it.
        self.active.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_problem_shows_in_the_metric_until_cleared_or_lapsed() {
        let metrics = Arc::new(Metrics::new());
        let problems = Problems::new(metrics.clone());
        problems.set("cluster_secret_changed", "restart");
        problems.set_for("peer_handshake_failing", "check", Duration::ZERO);
        let names: Vec<_> = problems.current().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["cluster_secret_changed"], "the lapsed one is gone");
        let text = metrics.encode();
        assert!(text.contains(r#"ferry_config_problems{problem="cluster_secret_changed"} 1"#));
        assert!(text.contains(r#"ferry_config_problems{problem="peer_handshake_failing"} 0"#));
        problems.clear("cluster_secret_changed");
        assert!(problems.current().is_empty());
        assert!(
            metrics
                .encode()
                .contains(r#"ferry_config_problems{problem="cluster_secret_changed"} 0"#)
        );
    }
}
