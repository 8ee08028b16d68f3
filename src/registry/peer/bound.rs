//! How long a pull waits for a lookup's first provider before the miss goes upstream, learnt
//! from this node's recent lookups and kept across restarts (`docs/design/lookup-wait.md`).
//!
//! Invariant: the wait is never below `--resolve-timeout` nor above `--resolve-timeout-max`.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;

/// First-provider times kept; not aged out, on purpose (`docs/design/how-it-works.md`).
const WINDOW: usize = 100;
/// With fewer times, the floor stands.
const MIN_SAMPLES: usize = 10;
/// The bound covers this share of recent lookups, never the slowest one alone...
const PERCENTILE: f64 = 0.95;
/// ...with this much headroom.
const HEADROOM: f64 = 1.5;

#[derive(Debug)]
pub struct ResolveBound {
    floor: Duration,
    ceiling: Duration,
    /// Recent first-provider times, oldest first, and the bound they give.
    recent: Mutex<(VecDeque<Duration>, Duration)>,
    /// Where the bound is shown, set under the lock so it never shows an older bound.
    shown: Option<Gauge<f64, AtomicU64>>,
}

impl ResolveBound {
    /// A ceiling below the floor is the floor (no adapting).
    pub fn new(floor: Duration, ceiling: Duration) -> Self {
        ResolveBound {
            floor,
            ceiling: ceiling.max(floor),
            recent: Mutex::new((VecDeque::with_capacity(WINDOW), floor)),
            shown: None,
        }
    }

    /// Goes by `times` from an earlier run (the last [`WINDOW`] count).
    pub fn remember(&self, times: Vec<Duration>) {
        self.update(|recent| {
            let skip = times.len().saturating_sub(WINDOW);
            *recent = times.into_iter().skip(skip).collect();
        });
    }

    pub fn times(&self) -> Vec<Duration> {
        let recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        recent.0.iter().copied().collect()
    }

    pub fn shown_in(mut self, gauge: Gauge<f64, AtomicU64>) -> Self {
        gauge.set(self.current().as_secs_f64());
        self.shown = Some(gauge);
        self
    }

    pub fn current(&self) -> Duration {
        self.recent.lock().unwrap_or_else(|e| e.into_inner()).1
    }

    /// A lookup found its first provider after `took`; returns the new bound.
    pub fn found_after(&self, took: Duration) -> Duration {
        self.update(|times| {
            if times.len() == WINDOW {
                times.pop_front();
            }
            times.push_back(took);
        })
    }

    /// Changes the times, then the bound and where it is shown, under one lock.
    fn update(&self, change: impl FnOnce(&mut VecDeque<Duration>)) -> Duration {
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        let (times, bound) = &mut *recent;
        change(times);
        *bound = self.bound_of(times);
        if let Some(gauge) = &self.shown {
            gauge.set(bound.as_secs_f64());
        }
        *bound
    }

    fn bound_of(&self, times: &VecDeque<Duration>) -> Duration {
        if times.len() < MIN_SAMPLES {
            return self.floor;
        }
        let mut sorted: Vec<Duration> = times.iter().copied().collect();
        sorted.sort_unstable();
        // The nearest-rank percentile: at least PERCENTILE of the times are at or below it.
        let rank = ((sorted.len() as f64 * PERCENTILE).ceil() as usize).clamp(1, sorted.len() - 1);
        // Any time, however long, gives a bound: the ceiling.
        Duration::try_from_secs_f64(sorted[rank - 1].as_secs_f64() * HEADROOM)
            .unwrap_or(self.ceiling)
            .clamp(self.floor, self.ceiling)
    }
}

/// Writes `times` to `path` (microseconds a line), whole or not at all.
pub(crate) fn save(path: &Path, times: &[Duration]) -> std::io::Result<()> {
    let text: String = times
        .iter()
        .map(|t| format!("{}\n", t.as_micros()))
        .collect();
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

/// The times [`save`] wrote; a line that is not a number is skipped.
pub(crate) fn load(path: &Path) -> Vec<Duration> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Vec::new(),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read the lookup times kept from the last run; the wait starts from --resolve-timeout");
            return Vec::new();
        }
    };
    let mut times = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        match line.trim().parse::<u64>() {
            Ok(us) => times.push(Duration::from_micros(us)),
            Err(_) => {
                tracing::warn!(path = %path.display(), line, "skipped a line that is not a lookup time");
            }
        }
    }
    times
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn fast_lookups_keep_the_floor_and_a_few_slow_ones_move_nothing() {
        let bound = ResolveBound::new(20 * MS, 100 * MS);
        assert_eq!(bound.current(), 20 * MS);
        for _ in 0..(MIN_SAMPLES - 1) {
            bound.found_after(90 * MS);
        }
        assert_eq!(bound.current(), 20 * MS, "too few lookups to go by");
        // A new node's first lookups, one past a dead node: the 9 fast ones set it.
        let new = ResolveBound::new(20 * MS, 100 * MS);
        for _ in 0..(MIN_SAMPLES - 1) {
            new.found_after(2 * MS);
        }
        new.found_after(Duration::from_secs(9));
        assert_eq!(new.current(), 20 * MS);
        // However long a time, it is bounded (no overflow).
        for _ in 0..WINDOW {
            new.found_after(Duration::MAX);
        }
        assert_eq!(new.current(), 100 * MS);
        for _ in 0..200 {
            bound.found_after(MS / 5);
        }
        assert_eq!(
            bound.current(),
            20 * MS,
            "fast lookups never lower it below the floor"
        );
        // Four slow lookups in the last hundred: 96% are fast.
        for _ in 0..4 {
            bound.found_after(3 * MS);
            bound.found_after(Duration::from_secs(9));
        }
        assert_eq!(bound.current(), 20 * MS);
    }

    #[test]
    fn slower_lookups_raise_it_to_cover_them_up_to_the_ceiling_and_it_comes_back() {
        let bound = ResolveBound::new(20 * MS, 100 * MS);
        // A node whose walks dial: most hits in 10-40 ms.
        for i in 0..WINDOW {
            bound.found_after(Duration::from_millis(10 + (i as u64 % 31)));
        }
        // The 95th percentile is 39 ms; half again is 58.5 ms.
        assert_eq!(bound.current(), Duration::from_micros(58_500));
        for _ in 0..WINDOW {
            bound.found_after(80 * MS);
        }
        assert_eq!(bound.current(), 100 * MS, "never past the ceiling");
        // Fast lookups again: a window later the floor is back.
        for _ in 0..WINDOW {
            bound.found_after(2 * MS);
        }
        assert_eq!(bound.current(), 20 * MS);
    }

    #[test]
    fn a_ceiling_below_the_floor_turns_adapting_off() {
        let bound = ResolveBound::new(Duration::from_secs(1), 100 * MS);
        for _ in 0..WINDOW {
            bound.found_after(Duration::from_secs(5));
        }
        assert_eq!(bound.current(), Duration::from_secs(1));
    }

    #[test]
    fn what_a_node_learnt_survives_a_restart_and_a_damaged_file_loses_only_itself() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let path = dir.path().join("lookup-times");
        assert!(load(&path).is_empty(), "no file: nothing learnt yet");
        let before = ResolveBound::new(20 * MS, 100 * MS);
        for _ in 0..30 {
            before.found_after(40 * MS);
        }
        save(&path, &before.times()).unwrap_or_else(|e| panic!("{e}"));
        let after = ResolveBound::new(20 * MS, 100 * MS);
        after.remember(load(&path));
        assert_eq!(
            after.current(),
            60 * MS,
            "the restarted node waits as it learnt"
        );
        assert_eq!(after.times(), before.times());
        // More than a window kept: the newest count.
        let many: Vec<Duration> = (0..150)
            .map(|i| if i < 50 { 90 * MS } else { MS })
            .collect();
        let trimmed = ResolveBound::new(20 * MS, 100 * MS);
        trimmed.remember(many);
        assert_eq!(trimmed.times().len(), WINDOW);
        assert_eq!(trimmed.current(), 20 * MS);
        // A damaged file: its numbers still count, the rest is skipped.
        std::fs::write(&path, "40000\nnot a time\n\u{0}\n40000\n")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(load(&path), vec![40 * MS, 40 * MS]);
    }
}
