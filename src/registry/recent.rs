//! The last pulls this node's containerd made through the mirror and where each answer came
//! from, for `ferry status`. Invariant: a bounded ring, whatever a node pulled.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

pub(crate) const KEPT: usize = 32;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pull {
    /// Seconds since the Unix epoch.
    pub at: u64,
    /// `manifest` or `blob`.
    pub kind: String,
    /// `<registry>/<repository>@<digest>` or `...:<tag>`.
    pub what: String,
    /// A `Source` label.
    pub source: String,
    /// None for a HEAD or a miss.
    pub bytes: Option<u64>,
}

#[derive(Debug, Default)]
pub struct RecentPulls {
    pulls: Mutex<VecDeque<Pull>>,
}

impl RecentPulls {
    pub fn record(&self, kind: &str, what: String, source: &str, bytes: Option<u64>) {
        let at = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let pull = Pull {
            at,
            kind: kind.to_string(),
            what,
            source: source.to_string(),
            bytes,
        };
        // A panic while holding this lock left a complete ring behind: keep using it.
        let mut pulls = self.pulls.lock().unwrap_or_else(|e| e.into_inner());
        if pulls.len() == KEPT {
            pulls.pop_front();
        }
        pulls.push_back(pull);
    }

    /// Newest first.
    pub fn list(&self) -> Vec<Pull> {
        let pulls = self.pulls.lock().unwrap_or_else(|e| e.into_inner());
        pulls.iter().rev().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_newest_first_and_at_most_kept() {
        let recent = RecentPulls::default();
        for i in 0..KEPT + 5 {
            recent.record("blob", format!("r/a@{i}"), "peer", Some(i as u64));
        }
        let list = recent.list();
        assert_eq!(list.len(), KEPT);
        assert_eq!(list[0].what, format!("r/a@{}", KEPT + 4));
        assert_eq!(list[KEPT - 1].what, "r/a@5");
    }
}
