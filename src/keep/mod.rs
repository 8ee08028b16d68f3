//! Keeps what this node pulled shareable: every digest its containerd asks the mirror for is
//! held in Ferry's own lease ([`Holder`]), and the least recently used held blobs are let go
//! when what only the lease keeps outgrows the budget (`docs/design/keep.md`).
//!
//! Invariant: one task owns the held set; a request never waits for it (a full queue drops
//! the hold, which only costs a later peer a fetch upstream).

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::metrics::Metrics;
use crate::oci::Digest;
use crate::store::{Change, ChangeStream, ContentStore, HeldBlob, Holder};

/// The held blobs that have landed, as last counted: served and advertised to peers, also
/// once no image on the node names them.
pub type Landed = Arc<BTreeSet<Digest>>;

/// Holds waiting for the task; beyond it a hold is dropped.
const QUEUE: usize = 4096;
/// Held digests at most, landed or not (a hold taken at a request may never land): beyond
/// it the least recently used go, so the lease cannot grow without end.
const MAX_HELD: usize = 50_000;
/// How soon a lost subscription to the store's changes is made again.
const RESUBSCRIBE: Duration = Duration::from_secs(5);
/// How long a deletion is remembered, against asks queued before it.
const STALE_ASKS: Duration = Duration::from_secs(60);
/// Deletions come in bursts (`ctr content rm` of a whole image): one collection after them.
const COLLECT_AFTER: Duration = Duration::from_millis(200);

/// Resolves at `at`; never without one.
async fn later(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

#[derive(Debug, Clone)]
pub struct KeepConfig {
    /// Bytes only the lease may keep.
    pub budget: u64,
    /// How often the budget is checked (and sizes counted).
    pub check_every: Duration,
    /// How soon after new holds: a pull's blobs land together, counted once.
    pub check_after_holds: Duration,
    /// How often the lease is renewed (its expiry pushed back).
    pub renew_every: Duration,
    /// Other nodes that should keep a blob, ahead of this one in its order, before this one
    /// lets it go ahead of its turn; 0: no one is asked.
    pub copies: usize,
}

impl KeepConfig {
    pub fn new(budget: u64) -> KeepConfig {
        KeepConfig {
            budget,
            copies: 0,
            check_every: Duration::from_secs(60),
            check_after_holds: Duration::from_secs(2),
            renew_every: Duration::from_secs(24 * 3600),
        }
    }
}

/// What `ferry status` and the debug page show.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KeepStatus {
    /// containerd deletes layers once unpacked: without the lease, none would be shareable.
    #[serde(default)]
    pub containerd_discards_layers: bool,
    pub lease: Option<String>,
    pub held: usize,
    /// Of the held blobs, those only the lease keeps, and their bytes.
    pub held_alone: usize,
    pub held_alone_bytes: u64,
    pub budget_bytes: u64,
    pub released: u64,
}

enum Use {
    /// containerd asked for it (then): hold it.
    Asked(Digest, Instant),
    /// A peer was served it: it is wanted, keep it longer.
    Served(Digest),
    Check(tokio::sync::oneshot::Sender<()>),
}

#[derive(Clone)]
pub struct Keeper {
    tx: mpsc::Sender<Use>,
    status: Arc<Mutex<KeepStatus>>,
    landed: watch::Receiver<Landed>,
}

impl std::fmt::Debug for Keeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keeper")
            .field("status", &self.status())
            .finish()
    }
}

impl Keeper {
    /// `store` tells of blobs deleted outright (`ctr content rm`): their holds end at once, so
    /// that containerd frees them.
    pub fn spawn(
        holder: Arc<dyn Holder>,
        store: Arc<dyn ContentStore>,
        copies: Option<Arc<dyn Copies>>,
        config: KeepConfig,
        metrics: Arc<Metrics>,
    ) -> Keeper {
        let (tx, rx) = mpsc::channel(QUEUE);
        let status = Arc::new(Mutex::new(KeepStatus {
            budget_bytes: config.budget,
            ..KeepStatus::default()
        }));
        metrics.keep_budget_bytes.set(config.budget as i64);
        let (landed_tx, landed) = watch::channel(Landed::default());
        let task = Task {
            holder,
            store,
            copies,
            config,
            metrics,
            status: status.clone(),
            lease: None,
            held: HashMap::new(),
            deleted_at: HashMap::new(),
            landed: landed_tx,
        };
        tokio::spawn(task.run(rx));
        Keeper { tx, status, landed }
    }

    /// The held blobs that have landed, updated at each count.
    pub fn landed(&self) -> watch::Receiver<Landed> {
        self.landed.clone()
    }

    pub fn asked(&self, digest: &Digest) {
        let _ = self.tx.try_send(Use::Asked(digest.clone(), Instant::now()));
    }

    pub fn served(&self, digest: &Digest) {
        let _ = self.tx.try_send(Use::Served(digest.clone()));
    }

    /// Checks the budget now and waits for it (tests, and the debug page).
    pub async fn check(&self) {
        let (done, wait) = tokio::sync::oneshot::channel();
        if self.tx.send(Use::Check(done)).await.is_ok() {
            let _ = wait.await;
        }
    }

    pub fn containerd_discards_layers(&self, discards: bool) {
        let mut s = self.status.lock().unwrap_or_else(|e| e.into_inner());
        s.containerd_discards_layers = discards;
    }

    pub fn status(&self) -> KeepStatus {
        self.status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

struct Task {
    holder: Arc<dyn Holder>,
    store: Arc<dyn ContentStore>,
    copies: Option<Arc<dyn Copies>>,
    config: KeepConfig,
    metrics: Arc<Metrics>,
    status: Arc<Mutex<KeepStatus>>,
    lease: Option<String>,
    /// Each held digest and when it was last used.
    held: HashMap<Digest, Instant>,
    /// Blobs deleted outright lately, and when (asks queued before then are stale).
    deleted_at: HashMap<Digest, Instant>,
    landed: watch::Sender<Landed>,
}

impl Task {
    async fn run(mut self, mut rx: mpsc::Receiver<Use>) {
        let mut check = tokio::time::interval(self.config.check_every);
        let mut renewed = Instant::now();
        let mut due: Option<Instant> = None;
        let mut changes: Option<ChangeStream> = None;
        let mut subscribed: Option<Instant> = None;
        let mut collect: Option<Instant> = None;
        loop {
            if self.lease.is_none() || renewed.elapsed() >= self.config.renew_every {
                self.open().await;
                renewed = Instant::now();
            }
            if changes.is_none() && subscribed.is_none_or(|at| at.elapsed() >= RESUBSCRIBE) {
                subscribed = Some(Instant::now());
                changes = self.store.changes().await.ok();
            }
            let resubscribe = later(
                subscribed
                    .filter(|_| changes.is_none())
                    .map(|at| at + RESUBSCRIBE),
            );
            let change = async {
                match changes.as_mut() {
                    Some(c) => c.next().await,
                    None => std::future::pending().await,
                }
            };
            let soon = later(due);

            tokio::select! {
                used = rx.recv() => match used {
                    // An ask queued before the blob was deleted outright would hold its file.
                    Some(Use::Asked(d, at)) if self.deleted_at.get(&d).is_some_and(|&gone| gone >= at) => {}
                    Some(Use::Asked(d, _)) => {
                        if self.hold(d).await && due.is_none() {
                            due = Some(Instant::now() + self.config.check_after_holds);
                        }
                    }
                    Some(Use::Served(d)) => {
                        if let Some(at) = self.held.get_mut(&d) {
                            *at = Instant::now();
                        }
                    }
                    Some(Use::Check(done)) => {
                        self.within_budget().await;
                        let _ = done.send(());
                    }
                    None => return,
                },
                change = change => match change {
                    Some(Change::ContentDeleted(d)) => {
                        // Once the burst is over: 200 ms after the last of them.
                        if self.deleted(&d).await {
                            collect = Some(Instant::now() + COLLECT_AFTER);
                        }
                    }
                    // A pull's image lands after its blobs (the holds' check may have come
                    // first), and an image removed leaves its blobs to the lease alone.
                    Some(Change::Image(_)) if due.is_none() && !self.held.is_empty() => {
                        due = Some(Instant::now() + self.config.check_after_holds);
                    }
                    Some(_) => {}
                    None => changes = None,
                },
                _ = later(collect) => {
                    collect = None;
                    match self.holder.collect().await {
                        Ok(()) => tracing::debug!("had containerd collect the blobs deleted outright"),
                        Err(e) => tracing::debug!(error = %e, "could not have containerd collect"),
                    }
                }
                _ = check.tick() => self.within_budget().await,
                // Only wakes the loop, which subscribes again at its top.
                _ = resubscribe => {}
                _ = soon => {
                    due = None;
                    self.within_budget().await;
                }
            }
        }
    }

    /// Takes over (and renews) the lease; retried at the next use while containerd is away.
    async fn open(&mut self) {
        match self.holder.open().await {
            Ok((lease, held)) => {
                let now = Instant::now();
                for d in held {
                    self.held.entry(d).or_insert(now);
                }
                tracing::info!(%lease, held = self.held.len(), "holding blobs for peers in a containerd lease");
                self.lease = Some(lease);
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not open Ferry's containerd lease; retrying");
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
        self.publish(None);
    }

    /// Deleted outright: held no longer, or containerd would keep its file for the lease.
    /// Whether it was held.
    async fn deleted(&mut self, digest: &Digest) -> bool {
        let now = Instant::now();
        self.deleted_at
            .retain(|_, at| now.duration_since(*at) < STALE_ASKS);
        self.deleted_at.insert(digest.clone(), now);
        if self.held.remove(digest).is_none() {
            return false;
        }
        if let Some(lease) = &self.lease {
            match self.holder.release(lease, digest).await {
                Ok(()) => tracing::debug!(%digest, "a held blob was deleted outright: released"),
                Err(e) => tracing::debug!(%digest, error = %e, "could not release a deleted blob"),
            }
        }
        self.landed.send_if_modified(|landed| {
            let had = landed.contains(digest);
            if had {
                let mut rest = (**landed).clone();
                rest.remove(digest);
                *landed = Arc::new(rest);
            }
            had
        });
        self.publish(None);
        true
    }

    /// Whether `digest` is newly held.
    async fn hold(&mut self, digest: Digest) -> bool {
        if let Some(at) = self.held.get_mut(&digest) {
            *at = Instant::now();
            return false;
        }
        let Some(lease) = &self.lease else {
            return false;
        };
        match self.holder.hold(lease, &digest).await {
            Ok(()) => {
                self.held.insert(digest, Instant::now());
                self.publish(None);
                true
            }
            // The lease went (cleanup, or expired): opened again at the next use.
            Err(e) => {
                tracing::debug!(%digest, error = %e, "could not hold a blob");
                self.lease = None;
                false
            }
        }
    }

    /// Lets the least recently used go while what only the lease keeps is over the budget.
    async fn within_budget(&mut self) {
        let Some(lease) = self.lease.clone() else {
            return;
        };
        let held: Vec<Digest> = self.held.keys().cloned().collect();
        let landed = match self.holder.landed_holds(&held).await {
            Ok(l) => l,
            Err(e) => {
                tracing::debug!(error = %e, "could not count the held blobs");
                return;
            }
        };
        let mut alone: Vec<&HeldBlob> = landed.iter().filter(|b| b.alone).collect();
        let mut total: u64 = alone.iter().map(|b| b.size).sum();
        alone.sort_by_key(|b| self.held.get(&b.digest).copied());
        // Blobs enough other nodes have go first, least recently used first; then, if the
        // budget still needs it, the last copies.
        let mut scarce = Vec::new();
        let mut order = Vec::new();
        let mut over = total.saturating_sub(self.config.budget);
        for blob in alone.iter().copied() {
            if over == 0 {
                break;
            }
            if self.enough_elsewhere(&blob.digest).await {
                over = over.saturating_sub(blob.size);
                order.push(blob);
            } else {
                scarce.push(blob);
            }
        }
        order.extend(scarce);
        let mut released = 0;
        for blob in order {
            if total <= self.config.budget {
                break;
            }
            if let Err(e) = self.holder.release(&lease, &blob.digest).await {
                tracing::debug!(digest = %blob.digest, error = %e, "could not release a blob");
                break;
            }
            self.held.remove(&blob.digest);
            total -= blob.size;
            released += 1;
        }
        let mut by_age: Vec<(Instant, Digest)> = Vec::new();
        if self.held.len() > MAX_HELD {
            by_age = self.held.iter().map(|(d, at)| (*at, d.clone())).collect();
            by_age.sort();
        }
        for (_, digest) in by_age.iter().take(self.held.len().saturating_sub(MAX_HELD)) {
            if self.holder.release(&lease, digest).await.is_ok() {
                self.held.remove(digest);
            }
        }
        if released > 0 {
            tracing::info!(
                released,
                kept_bytes = total,
                budget = self.config.budget,
                "released the least recently used blobs to stay within the keep budget"
            );
        }
        let count = alone.len() - released as usize;
        self.metrics.keep_released.inc_by(released);
        self.publish(Some((count, total, released)));
        let still: BTreeSet<Digest> = landed
            .into_iter()
            .map(|b| b.digest)
            .filter(|d| self.held.contains_key(d))
            .collect();
        self.landed.send_if_modified(|old| {
            let changed = **old != still;
            if changed {
                *old = Arc::new(still);
            }
            changed
        });
    }

    /// Whether `--keep-copies` other nodes keep `digest` ahead of this one.
    async fn enough_elsewhere(&self, digest: &Digest) -> bool {
        let Some(copies) = self.copies.as_ref().filter(|_| self.config.copies > 0) else {
            return true;
        };
        self.metrics.keep_copy_lookups.inc();
        copies.ahead(digest, self.config.copies).await >= self.config.copies
    }

    fn publish(&self, alone: Option<(usize, u64, u64)>) {
        let mut s = self.status.lock().unwrap_or_else(|e| e.into_inner());
        s.lease = self.lease.clone();
        s.held = self.held.len();
        if let Some((count, bytes, released)) = alone {
            s.held_alone = count;
            s.held_alone_bytes = bytes;
            s.released += released;
            self.metrics.kept_alone_bytes.set(bytes as i64);
        }
        self.metrics.kept_blobs.set(s.held as i64);
    }
}

impl KeepStatus {
    /// One line for `ferry status`.
    pub fn line(&self, human: impl Fn(u64) -> String) -> String {
        let mut line = format!(
            "kept for peers: {} blobs in Ferry's containerd lease, {} of them ({}) kept by it alone, budget {}",
            self.held,
            self.held_alone,
            human(self.held_alone_bytes),
            human(self.budget_bytes)
        );
        if self.released > 0 {
            line.push_str(&format!(", {} let go", self.released));
        }
        if self.containerd_discards_layers {
            line.push_str(" (containerd discards unpacked layers: these stay shareable)");
        }
        line
    }
}

mod copies;
pub use copies::{COUNT_WAIT, Copies, RoutedCopies};

#[cfg(test)]
mod tests;
