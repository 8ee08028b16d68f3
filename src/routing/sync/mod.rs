//! Store -> router: advertise every key this node can serve, withdraw what it no longer can.
//! One task owns what is advertised, image by image. A full walk at start and on the
//! re-announcement timer is the safety net; a debounced burst of containerd events walks only
//! the images it touched. containerd going away ends the events: the task reconnects with
//! backoff and walks everything again.
//!
//! Invariant: the peer address serves exactly the keys this task has published.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde::Deserialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{ContentRouting, digest_key, tag_key};
use crate::metrics::{Metrics, ReasonLabels};
use crate::oci::Digest;
use crate::oci::manifest::MAX_MANIFEST_BYTES;
use crate::oci::registry::{Registries, RegistryFilters};
use crate::store::{Change, ContentStore, ImageRecord};

/// Events come in bursts (one pull creates content, then the image): wait this long for the
/// burst to end.
const DEBOUNCE: Duration = Duration::from_millis(200);
const RETRY_MIN: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(10);
/// containerd unreachable this long: withdraw everything and stop serving it to peers, until
/// containerd is back. Not shorter: a containerd busy unpacking a storm can time out Ferry's
/// calls for seconds, and that is no reason to withdraw (`docs/design/announcements.md`).
pub const WITHDRAW_GRACE: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct SyncConfig {
    pub registries: Registries,
    /// Which images are shared with peers at all.
    pub filters: RegistryFilters,
    /// Full reconcile interval, whatever the events say.
    pub interval: Duration,
    /// Blobs this node holds for its peers (`keep/`), advertised and served also once no image
    /// names them; `None`: nothing is held.
    pub held: Option<watch::Receiver<Held>>,
}

/// Held blobs that have landed.
pub type Held = Arc<BTreeSet<Digest>>;

/// The keys this node advertises, published by the sync task (their one owner) for the peer
/// address, which serves exactly these.
pub type Exposed = Arc<BTreeSet<String>>;

/// The sender goes to [`run`], receivers to the peer listener.
pub fn exposure() -> (watch::Sender<Exposed>, watch::Receiver<Exposed>) {
    watch::channel(Arc::new(BTreeSet::new()))
}

/// Runs until `token` is cancelled.
pub async fn run(
    store: Arc<dyn ContentStore>,
    router: Arc<dyn ContentRouting>,
    config: SyncConfig,
    metrics: Arc<Metrics>,
    exposed: watch::Sender<Exposed>,
    token: CancellationToken,
) {
    let mut sync = Reconciler {
        store: &*store,
        router: &*router,
        config: &config,
        metrics: &metrics,
        exposed: &exposed,
        advertised: Advertised::default(),
        gone: BTreeSet::new(),
    };
    let mut held = config.held.clone();
    let mut retry = RETRY_MIN;
    let mut unreachable_since: Option<crate::routing::clock::Instant> = None;
    loop {
        let subscribed = crate::routing::clock::Instant::now();
        let changes = match store.changes().await {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::debug!(error = %e, "cannot follow store events yet; retrying");
                None
            }
        };
        // Reachable means the store can be listed: following its events can fail alone
        // (a subscription timing out on a loaded node), and that must not withdraw anything.
        if sync.reconcile(None).await {
            unreachable_since = None;
        } else {
            let since = *unreachable_since.get_or_insert_with(crate::routing::clock::Instant::now);
            if since.elapsed() >= WITHDRAW_GRACE {
                sync.withdraw_all().await;
            }
        }
        let Some(mut changes) = changes else {
            tokio::select! {
                _ = token.cancelled() => return,
                _ = tokio::time::sleep(retry) => {}
            }
            retry = (retry * 2).min(RETRY_MAX);
            continue;
        };
        let mut tick = tokio::time::interval(config.interval);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = token.cancelled() => return,
                _ = tick.tick() => {
                    sync.reconcile(None).await;
                }
                Ok(()) = changed(&mut held) => {
                    // A new count says what has landed: deletions since are in it.
                    sync.gone.clear();
                    sync.reconcile(Some(&Burst::default())).await;
                }
                event = changes.next() => {
                    let Some(first) = event else {
                        tracing::debug!("store events ended; reconnecting");
                        break;
                    };
                    let mut burst = Burst::default();
                    burst.add(first);
                    let _ = tokio::time::timeout(DEBOUNCE, async {
                        while let Some(change) = changes.next().await {
                            burst.add(change);
                        }
                    })
                    .await;
                    if burst.everything {
                        sync.reconcile(None).await;
                    } else {
                        sync.reconcile(Some(&burst)).await;
                    }
                }
            }
        }
        // Every reconnection walks the whole store: one that ends quickly waits longer
        // each time; one that lasted starts afresh.
        if subscribed.elapsed() < RETRY_MAX {
            tokio::select! {
                _ = token.cancelled() => return,
                _ = tokio::time::sleep(retry) => {}
            }
            retry = (retry * 2).min(RETRY_MAX);
        } else {
            retry = RETRY_MIN;
        }
    }
}

/// Resolves when the held set changes; never without one.
async fn changed(held: &mut Option<watch::Receiver<Held>>) -> Result<(), watch::error::RecvError> {
    match held {
        Some(h) => h.changed().await,
        None => std::future::pending().await,
    }
}

#[derive(Debug, Default)]
struct Burst {
    /// Events were missed or unreadable: look at everything.
    everything: bool,
    /// Images created, updated or deleted. An update may keep the target and still matter:
    /// containerd updates an image after fetching more of its content.
    images: BTreeSet<String>,
    deleted: BTreeSet<String>,
}

impl Burst {
    fn add(&mut self, change: Change) {
        tracing::debug!(?change, "store change");
        match change {
            Change::Image(name) => {
                self.images.insert(name);
            }
            Change::ContentDeleted(digest) => {
                self.deleted.insert(digest_key(&digest));
            }
            Change::Unknown => self.everything = true,
        }
    }
}

#[derive(Debug, Default)]
struct Advertised {
    images: HashMap<String, Walked>,
    /// The keys of held blobs, given as if by one more image.
    held: BTreeSet<String>,
    /// Every advertised key, with how many images give it.
    keys: BTreeMap<String, usize>,
}

/// One image as last walked: the target it pointed at then, and the keys it gives.
#[derive(Debug)]
struct Walked {
    target: Digest,
    keys: BTreeSet<String>,
}

#[derive(Debug, Default)]
struct Diff {
    added: BTreeSet<String>,
    removed: BTreeSet<String>,
}

impl Advertised {
    /// Replaces what `name` gives (`None`: the image is gone).
    fn set(&mut self, name: &str, walked: Option<Walked>, diff: &mut Diff) {
        if let Some(old) = self.images.remove(name) {
            for key in old.keys {
                self.release(key, diff);
            }
        }
        if let Some(walked) = walked {
            for key in &walked.keys {
                self.retain(key, diff);
            }
            self.images.insert(name.to_string(), walked);
        }
    }

    /// Replaces the held blobs' keys.
    fn set_held(&mut self, keys: BTreeSet<String>, diff: &mut Diff) {
        let old = std::mem::take(&mut self.held);
        for key in keys.difference(&old) {
            self.retain(key, diff);
        }
        for key in old.difference(&keys) {
            self.release(key.clone(), diff);
        }
        self.held = keys;
    }

    fn retain(&mut self, key: &str, diff: &mut Diff) {
        let n = self.keys.entry(key.to_string()).or_default();
        *n += 1;
        if *n == 1 && !diff.removed.remove(key) {
            diff.added.insert(key.to_string());
        }
    }

    fn release(&mut self, key: String, diff: &mut Diff) {
        let Some(n) = self.keys.get_mut(&key) else {
            return;
        };
        *n -= 1;
        if *n == 0 {
            self.keys.remove(&key);
            if !diff.added.remove(&key) {
                diff.removed.insert(key);
            }
        }
    }

    fn stale(&self, image: &ImageRecord, burst: &Burst) -> bool {
        match self.images.get(&image.name) {
            None => true,
            Some(w) => {
                w.target != image.target.digest
                    || burst.images.contains(&image.name)
                    || burst.deleted.iter().any(|key| w.keys.contains(key))
            }
        }
    }
}

struct Reconciler<'a> {
    store: &'a dyn ContentStore,
    router: &'a dyn ContentRouting,
    config: &'a SyncConfig,
    metrics: &'a Metrics,
    exposed: &'a watch::Sender<Exposed>,
    advertised: Advertised,
    /// Held blobs deleted since the held set was last counted: not advertised meanwhile.
    gone: BTreeSet<String>,
}

impl Reconciler<'_> {
    /// Makes the router's view match the store; with a `burst`, walks only the images it may
    /// have changed. `false`, changing nothing, when the store cannot be listed.
    async fn reconcile(&mut self, burst: Option<&Burst>) -> bool {
        let Ok(images) = self.store.images().await else {
            return false;
        };
        let mut diff = Diff::default();
        let listed: BTreeSet<&str> = images.iter().map(|i| i.name.as_str()).collect();
        let gone: Vec<String> = (self.advertised.images.keys())
            .filter(|name| !listed.contains(name.as_str()))
            .cloned()
            .collect();
        for name in gone {
            self.advertised.set(&name, None, &mut diff);
        }
        let mut walker = Walker::new(self.store);
        let mut walked = 0;
        for image in &images {
            if burst.is_some_and(|b| !self.advertised.stale(image, b)) {
                continue;
            }
            let keys = image_keys(
                &mut walker,
                image,
                &self.config.registries,
                &self.config.filters,
            )
            .await;
            let target = image.target.digest.clone();
            let w = Walked { target, keys };
            self.advertised.set(&image.name, Some(w), &mut diff);
            walked += 1;
        }
        if let Some(b) = burst {
            self.gone.extend(b.deleted.iter().cloned());
        }
        if let Some(held) = &self.config.held {
            let keys: BTreeSet<String> = (held.borrow().iter())
                .map(digest_key)
                .filter(|k| !self.gone.contains(k))
                .collect();
            self.advertised.set_held(keys, &mut diff);
        }
        let reason = if burst.is_some() { "change" } else { "full" };
        self.metrics
            .sync_images_walked
            .get_or_create(&ReasonLabels { reason })
            .inc_by(walked);
        self.apply(diff).await;
        true
    }

    async fn apply(&self, diff: Diff) {
        let count = self.advertised.keys.len() as i64;
        self.metrics.keys_advertised.set(count);
        if diff.added.is_empty() && diff.removed.is_empty() {
            return;
        }
        // Withdrawn keys stop being served before anything else happens.
        let keys: BTreeSet<String> = self.advertised.keys.keys().cloned().collect();
        self.exposed.send_replace(Arc::new(keys));
        if !diff.removed.is_empty() {
            tracing::debug!(count = diff.removed.len(), "withdrawing keys");
            if let Err(e) = self
                .router
                .withdraw(diff.removed.into_iter().collect())
                .await
            {
                tracing::warn!(error = %e, "withdraw failed");
            }
        }
        if !diff.added.is_empty() {
            tracing::debug!(count = diff.added.len(), "advertising keys");
            if let Err(e) = self
                .router
                .advertise(diff.added.into_iter().collect())
                .await
            {
                tracing::warn!(error = %e, "advertise failed");
            }
        }
    }

    /// Stops serving and advertising everything. Records other nodes hold expire on their own;
    /// until then this node answers them 404 at once.
    async fn withdraw_all(&mut self) {
        if self.advertised.keys.is_empty() {
            return;
        }
        tracing::warn!(
            count = self.advertised.keys.len(),
            grace_s = WITHDRAW_GRACE.as_secs(),
            "containerd unreachable: withdrawing what this node advertised until it is back"
        );
        self.exposed.send_replace(Arc::new(BTreeSet::new()));
        let all: Vec<String> = std::mem::take(&mut self.advertised)
            .keys
            .into_keys()
            .collect();
        if let Err(e) = self.router.withdraw(all).await {
            tracing::warn!(error = %e, "withdraw failed");
        }
        self.metrics.keys_advertised.set(0);
    }
}

/// Every key the store can serve for images of mirrored registries.
pub async fn inventory(
    store: &dyn ContentStore,
    images: &[ImageRecord],
    registries: &Registries,
    filters: &RegistryFilters,
) -> BTreeSet<String> {
    let mut walker = Walker::new(store);
    let mut keys = BTreeSet::new();
    for image in images {
        keys.extend(image_keys(&mut walker, image, registries, filters).await);
    }
    keys
}

/// The keys one image gives: its tag and every present digest reachable from its target;
/// none for a registry not mirrored or filtered out.
async fn image_keys(
    walker: &mut Walker<'_>,
    image: &ImageRecord,
    registries: &Registries,
    filters: &RegistryFilters,
) -> BTreeSet<String> {
    let mut keys = BTreeSet::new();
    let Some(name) = ImageName::parse(&image.name) else {
        return keys;
    };
    let shown = image
        .name
        .split_once('@')
        .map_or(image.name.as_str(), |(n, _)| n);
    if !registries.includes(&name.registry) || !filters.allows(shown) {
        return keys;
    }
    let present = walker.present_from(&image.target.digest).await;
    if let Some(tag) = &name.tag
        && present.contains(&image.target.digest)
    {
        keys.insert(tag_key(&name.registry, &name.repository, tag));
    }
    keys.extend(present.iter().map(digest_key));
    keys
}

/// Reads what walks need, each digest once per reconcile: images share layers and manifests,
/// and calls per digest are what a walk costs.
struct Walker<'a> {
    store: &'a dyn ContentStore,
    sizes: HashMap<Digest, Option<u64>>,
    children: HashMap<Digest, Option<Arc<Children>>>,
}

impl<'a> Walker<'a> {
    fn new(store: &'a dyn ContentStore) -> Self {
        Walker {
            store,
            sizes: HashMap::new(),
            children: HashMap::new(),
        }
    }

    async fn size(&mut self, digest: &Digest) -> Option<u64> {
        if let Some(size) = self.sizes.get(digest) {
            return *size;
        }
        let size = self.store.descriptor(digest).await.ok().map(|d| d.size);
        self.sizes.insert(digest.clone(), size);
        size
    }

    async fn children(&mut self, digest: &Digest) -> Option<Arc<Children>> {
        if let Some(children) = self.children.get(digest) {
            return children.clone();
        }
        let children = read_children(self.store, digest).await.map(Arc::new);
        self.children.insert(digest.clone(), children.clone());
        children
    }

    async fn present_from(&mut self, root: &Digest) -> BTreeSet<Digest> {
        let mut present = BTreeSet::new();
        let mut seen = BTreeSet::new();
        let mut manifests = vec![root.clone()];
        while let Some(digest) = manifests.pop() {
            if !seen.insert(digest.clone()) {
                continue;
            }
            let Some(size) = self.size(&digest).await else {
                continue;
            };
            present.insert(digest.clone());
            if size > MAX_MANIFEST_BYTES {
                continue;
            }
            let Some(children) = self.children(&digest).await else {
                continue;
            };
            manifests.extend(children.manifests.iter().cloned());
            for blob in &children.blobs {
                if seen.insert(blob.clone()) && self.size(blob).await.is_some() {
                    present.insert(blob.clone());
                }
            }
        }
        present
    }
}

#[derive(Deserialize)]
struct Links {
    #[serde(default)]
    manifests: Vec<Link>,
    config: Option<Link>,
    #[serde(default)]
    layers: Vec<Link>,
}

#[derive(Deserialize)]
struct Link {
    digest: String,
}

struct Children {
    manifests: Vec<Digest>,
    blobs: Vec<Digest>,
}

async fn read_children(store: &dyn ContentStore, digest: &Digest) -> Option<Children> {
    let stream = store.open(digest, None).await.ok()?;
    let chunks: Vec<bytes::Bytes> = futures::TryStreamExt::try_collect(stream).await.ok()?;
    let links: Links = serde_json::from_slice(&chunks.concat()).ok()?;
    let parse = |l: Link| l.digest.parse::<Digest>().ok();
    Some(Children {
        manifests: links.manifests.into_iter().filter_map(parse).collect(),
        blobs: links
            .config
            .into_iter()
            .chain(links.layers)
            .filter_map(parse)
            .collect(),
    })
}

/// `<registry>/<repository>[:<tag>][@<digest>]`, as containerd names images.
#[derive(Debug, PartialEq, Eq)]
struct ImageName {
    registry: String,
    repository: String,
    tag: Option<String>,
}

impl ImageName {
    fn parse(name: &str) -> Option<ImageName> {
        let without_digest = name.split_once('@').map_or(name, |(n, _)| n);
        let (registry, rest) = without_digest.split_once('/')?;
        let (repository, tag) = match rest.rsplit_once(':') {
            Some((repo, tag)) if !tag.contains('/') => (repo, Some(tag.to_string())),
            _ => (rest, None),
        };
        let tag = if name.contains('@') { None } else { tag };
        Some(ImageName {
            registry: registry.to_string(),
            repository: repository.to_string(),
            tag,
        })
    }
}

#[cfg(test)]
mod tests;
