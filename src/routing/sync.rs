//! Store -> router: advertise every key this node can serve, withdraw what it no longer can.
//!
//! One task owns what is advertised, image by image. At start and on a slow timer (the
//! re-announcement interval) it walks every image: the safety net. A change in the store (a
//! burst of containerd events, debounced) costs what changed: one call listing the image
//! records, then a walk of only the images the events named (created or updated), that point
//! somewhere new, or that lost a blob just deleted; a deleted image drops its keys without any
//! call. (On a node with
//! 2,500 images the whole walk is about 12,500 calls; a pull re-walks only its image.)
//! containerd going away ends the notifications, and the task reconnects with backoff and
//! walks everything again.

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

/// Events arrive in bursts (one pull creates content, then the image); wait this long for the
/// burst to end before looking.
const DEBOUNCE: Duration = Duration::from_millis(200);
const RETRY_MIN: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(10);
/// containerd unreachable for longer than this (a restart takes a few seconds): everything
/// this node advertised is withdrawn and no longer served to peers, so other nodes stop being
/// sent to a node that cannot read its store; it is advertised again once containerd is back.
/// Not shorter: a containerd busy unpacking a storm's layers on a loaded node can time out
/// Ferry's calls for several seconds in a row (7 s seen in the storm tests), and that is no
/// reason to withdraw.
pub const WITHDRAW_GRACE: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct SyncConfig {
    pub registries: Registries,
    /// Which images are shared with peers at all.
    pub filters: RegistryFilters,
    /// Full reconcile interval, whatever the events say.
    pub interval: Duration,
}

/// The keys this node advertises, published by the sync task (their one owner) for the peer
/// address, which serves exactly these and nothing else.
pub type Exposed = Arc<BTreeSet<String>>;

/// A channel for [`Exposed`]: the sender goes to [`run`], receivers to the peer listener.
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
    };
    let mut retry = RETRY_MIN;
    let mut unreachable_since: Option<std::time::Instant> = None;
    loop {
        let subscribed = std::time::Instant::now();
        let changes = match store.changes().await {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::debug!(error = %e, "cannot follow store events yet; retrying");
                None
            }
        };
        // Reachable means the store can be listed: following its events can fail on its own
        // (a subscription timing out on a loaded node) while everything else works, and that
        // must not withdraw anything.
        if sync.reconcile(None).await {
            unreachable_since = None;
        } else {
            let since = *unreachable_since.get_or_insert_with(std::time::Instant::now);
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
                event = changes.next() => {
                    let Some(first) = event else {
                        tracing::debug!("store events ended; reconnecting");
                        break;
                    };
                    // Let the burst finish, then look once.
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
        // Every reconnection walks the whole store: one that ends quickly (containerd down,
        // the subscription refused) waits longer each time; one that lasted starts afresh.
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

/// What a burst of events said changed.
#[derive(Debug, Default)]
struct Burst {
    /// Events were missed or unreadable: look at everything.
    everything: bool,
    /// Images created, updated or deleted, by name. An update may keep the target and still
    /// matter: containerd updates an image after fetching more of its content (another
    /// platform, or a layer fetched again after it was deleted).
    images: BTreeSet<String>,
    /// Content deleted: images that had it lose it.
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

/// What this node advertises, image by image.
#[derive(Debug, Default)]
struct Advertised {
    images: HashMap<String, Walked>,
    /// Every advertised key, with how many images give it.
    keys: BTreeMap<String, usize>,
}

/// One image as last walked: the target it pointed at then, and the keys it gives.
#[derive(Debug)]
struct Walked {
    target: Digest,
    keys: BTreeSet<String>,
}

/// Keys that start or stop being advertised.
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

    /// Is this image's last walk out of date after `burst`?
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
}

impl Reconciler<'_> {
    /// Makes the router's view match the store: advertise new keys, withdraw gone ones. With
    /// a `burst`, only the images it may have changed are walked; without, all of them. If
    /// the store cannot be listed (containerd down), nothing changes and this says so
    /// (`false`).
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

    /// containerd has been unreachable for [`WITHDRAW_GRACE`]: stop serving and advertising
    /// everything (the reconcile after it is back advertises it again). Records other nodes
    /// already hold expire on their own; until then this node answers them 404 at once.
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

/// Every key the store can serve for images of mirrored registries: each tag, and every
/// digest (index, manifests, config, layers) that is present in the store.
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

/// The keys one image gives: its tag, and every digest reachable from its target that is
/// present. None for an image of a registry that is not mirrored or filtered out.
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

/// Reads what walks need from the store, each digest once per reconcile: images share
/// layers and manifests, and a call per digest is what a walk costs.
struct Walker<'a> {
    store: &'a dyn ContentStore,
    /// Size of each digest asked about; `None` when absent.
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

    /// Every present digest reachable from `root` (itself included when present).
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
mod tests {
    use super::*;
    use crate::oci::manifest::{OCI_INDEX, OCI_MANIFEST};
    use crate::routing::Peer;
    use crate::routing::memory::MemoryNetwork;
    use crate::store::memory::MemoryStore;

    #[test]
    fn image_names() {
        let n = ImageName::parse("docker.io/library/nginx:1.27").unwrap();
        assert_eq!(
            (n.registry.as_str(), n.repository.as_str(), n.tag.as_deref()),
            ("docker.io", "library/nginx", Some("1.27"))
        );
        let n = ImageName::parse("10.0.0.1:5000/a/b:v1").unwrap();
        assert_eq!(
            (n.registry.as_str(), n.repository.as_str(), n.tag.as_deref()),
            ("10.0.0.1:5000", "a/b", Some("v1"))
        );
        let n = ImageName::parse("ghcr.io/x/y@sha256:abc").unwrap();
        assert_eq!(n.tag, None);
        assert_eq!(ImageName::parse("plain"), None);
    }

    /// An index -> manifest -> config + layer, tagged; plus one layer of another platform that
    /// the node never pulled.
    fn image(store: &MemoryStore) -> (Digest, Digest, Digest, Digest) {
        let layer = store.put(vec![1u8; 1000]);
        let config = store.put(r#"{"architecture":"amd64"}"#);
        let manifest = store.put(format!(
            r#"{{"schemaVersion":2,"mediaType":"{OCI_MANIFEST}","config":{{"digest":"{config}"}},"layers":[{{"digest":"{layer}"}}]}}"#
        ));
        let absent = Digest::sha256_of(b"arm64 manifest never pulled");
        let index = store.put(format!(
            r#"{{"schemaVersion":2,"mediaType":"{OCI_INDEX}","manifests":[{{"digest":"{manifest}"}},{{"digest":"{absent}"}}]}}"#
        ));
        store.tag("docker.io", "library/app", "1.0", &index, OCI_INDEX);
        (index, manifest, config, layer)
    }

    #[tokio::test]
    async fn inventory_has_every_present_digest_and_the_tag() {
        let store = MemoryStore::new();
        let (index, manifest, config, layer) = image(&store);
        let images = store.images().await.unwrap();
        let keys = inventory(
            &store,
            &images,
            &Registries::All,
            &RegistryFilters::default(),
        )
        .await;
        let expected: BTreeSet<String> = [
            index.to_string(),
            manifest.to_string(),
            config.to_string(),
            layer.to_string(),
            "docker.io/library/app:1.0".to_string(),
        ]
        .into();
        assert_eq!(keys, expected);
        let only_ghcr = Registries::Only(vec!["ghcr.io".into()]);
        assert!(
            inventory(&store, &images, &only_ghcr, &RegistryFilters::default())
                .await
                .is_empty()
        );
        let private = RegistryFilters::parse("!docker\\.io/library/.*").unwrap();
        assert!(
            inventory(&store, &images, &Registries::All, &private)
                .await
                .is_empty()
        );
    }

    /// The sync task for `store`, advertising through `router` (no timer walks in a test).
    struct Running {
        metrics: Arc<Metrics>,
        exposed: watch::Receiver<Exposed>,
        token: CancellationToken,
        task: tokio::task::JoinHandle<()>,
    }

    fn start_sync(store: Arc<dyn ContentStore>, router: Arc<dyn ContentRouting>) -> Running {
        let metrics = Arc::new(Metrics::new());
        let config = SyncConfig {
            registries: Registries::All,
            filters: RegistryFilters::default(),
            interval: Duration::from_secs(3600),
        };
        let (exposed_tx, exposed) = exposure();
        let token = CancellationToken::new();
        let task = tokio::spawn(run(
            store,
            router,
            config,
            metrics.clone(),
            exposed_tx,
            token.clone(),
        ));
        Running {
            metrics,
            exposed,
            token,
            task,
        }
    }

    #[tokio::test]
    async fn sync_advertises_and_withdraws_as_the_store_changes() {
        let store = Arc::new(MemoryStore::new());
        let network = MemoryNetwork::new();
        let me = network.node(Peer {
            id: "me".into(),
            addr: "127.0.0.1:1".parse().unwrap(),
        });
        let other = network.node(Peer {
            id: "other".into(),
            addr: "127.0.0.1:2".parse().unwrap(),
        });
        let Running {
            metrics,
            exposed,
            token,
            task,
        } = start_sync(store.clone(), Arc::new(me));

        let (_, _, _, layer) = image(&store);
        let found = |key: String| {
            let other = other.clone();
            async move { other.lookup(&key).await.recv().await.is_some() }
        };
        for _ in 0..100 {
            if found(layer.to_string()).await {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            found(layer.to_string()).await,
            "layer advertised after the image appeared"
        );
        assert!(found("docker.io/library/app:1.0".into()).await);
        assert_eq!(metrics.keys_advertised.get(), 5);
        assert!(
            exposed.borrow().contains(&layer.to_string()),
            "what is advertised is exposed"
        );

        store.remove(&layer);
        store.untag("docker.io", "library/app", "1.0");
        for _ in 0..100 {
            if !found(layer.to_string()).await {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            !found(layer.to_string()).await,
            "deleted content is withdrawn"
        );
        assert!(
            !found("docker.io/library/app:1.0".into()).await,
            "deleted tag is withdrawn"
        );
        assert!(
            !exposed.borrow().contains(&layer.to_string()),
            "and no longer served to peers"
        );
        token.cancel();
        task.await.unwrap();
    }

    /// A store that counts the calls walks make (descriptor and read), to show what a change
    /// costs.
    struct Counting {
        inner: Arc<MemoryStore>,
        calls: std::sync::atomic::AtomicUsize,
    }

    impl Counting {
        fn calls(&self) -> usize {
            self.calls.load(std::sync::atomic::Ordering::SeqCst)
        }
        fn count(&self) {
            self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[async_trait::async_trait]
    impl ContentStore for Counting {
        async fn resolve(
            &self,
            registry: &str,
            repository: &str,
            tag: &str,
        ) -> Result<crate::store::Descriptor, crate::store::StoreError> {
            self.inner.resolve(registry, repository, tag).await
        }
        async fn descriptor(
            &self,
            digest: &Digest,
        ) -> Result<crate::store::Descriptor, crate::store::StoreError> {
            self.count();
            self.inner.descriptor(digest).await
        }
        async fn open(
            &self,
            digest: &Digest,
            range: Option<crate::oci::ByteRange>,
        ) -> Result<crate::store::ByteStream, crate::store::StoreError> {
            self.count();
            self.inner.open(digest, range).await
        }
        async fn healthy(&self) -> bool {
            true
        }
        async fn images(&self) -> Result<Vec<ImageRecord>, crate::store::StoreError> {
            self.inner.images().await
        }
        async fn changes(&self) -> Result<crate::store::ChangeStream, crate::store::StoreError> {
            self.inner.changes().await
        }
        async fn discard_partial(
            &self,
            digest: &Digest,
            started_before: std::time::SystemTime,
        ) -> Result<usize, crate::store::StoreError> {
            self.inner.discard_partial(digest, started_before).await
        }
        async fn downloads(
            &self,
            digest: &Digest,
            scope: crate::store::downloads::Scope,
        ) -> Vec<crate::store::downloads::InFlight> {
            self.inner.downloads(digest, scope).await
        }
        async fn landed(&self, digest: &Digest) -> Option<u64> {
            self.inner.landed(digest).await
        }
        async fn open_landed(
            &self,
            digest: &Digest,
            offset: u64,
        ) -> Result<(crate::store::ByteStream, u64), crate::store::StoreError> {
            self.inner.open_landed(digest, offset).await
        }
    }

    /// An image of `layers` layers of its own plus one every image shares, tagged `name`.
    fn small_image(store: &MemoryStore, name: &str, layers: usize) -> (Digest, Vec<Digest>) {
        let mut own: Vec<Digest> = (0..layers)
            .map(|i| store.put(format!("{name} layer {i}")))
            .collect();
        own.push(store.put("the base layer every image shares"));
        let config = store.put(format!(r#"{{"image":"{name}"}}"#));
        let links: Vec<String> = own
            .iter()
            .map(|l| format!(r#"{{"digest":"{l}"}}"#))
            .collect();
        let manifest = store.put(format!(
            r#"{{"schemaVersion":2,"mediaType":"{OCI_MANIFEST}","config":{{"digest":"{config}"}},"layers":[{}]}}"#,
            links.join(",")
        ));
        store.tag("docker.io", name, "1", &manifest, OCI_MANIFEST);
        (manifest, own)
    }

    async fn advertised(metrics: &Metrics, n: i64) {
        for _ in 0..500 {
            if metrics.keys_advertised.get() == n {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!(
            "{} keys advertised, expected {n}",
            metrics.keys_advertised.get()
        );
    }

    /// A pull, a deleted image and a deleted blob each cost calls for the images they touch,
    /// not for the store: 200 images are walked once at start, never again on a change.
    #[tokio::test]
    async fn a_change_costs_what_it_touches_not_the_whole_store() {
        let memory = Arc::new(MemoryStore::new());
        let images = 200;
        // Each: 3 own layers + the shared one, config, manifest, tag = 7 keys (the shared
        // layer once overall).
        for i in 0..images {
            small_image(&memory, &format!("app{i}"), 3);
        }
        let store = Arc::new(Counting {
            inner: memory.clone(),
            calls: Default::default(),
        });
        let network = MemoryNetwork::new();
        let me = network.node(Peer {
            id: "me".into(),
            addr: "127.0.0.1:1".parse().unwrap(),
        });
        let Running {
            metrics,
            exposed,
            token,
            task,
        } = start_sync(store.clone(), Arc::new(me));
        let per_image = 6;
        advertised(&metrics, images * per_image + 1).await;
        let walked = |reason| {
            metrics
                .sync_images_walked
                .get_or_create(&ReasonLabels { reason })
                .get()
        };
        assert_eq!(walked("full"), images as u64);
        let at_start = store.calls();
        assert!(at_start >= 5 * images as usize, "{at_start} calls at start");

        // A pull: one new image.
        let (manifest, own) = small_image(&memory, "new", 3);
        advertised(&metrics, (images + 1) * per_image + 1).await;
        let pull = store.calls() - at_start;
        // The manifest read and 6 descriptors; nothing of the other 200 images.
        assert!(pull <= 8, "a pull cost {pull} calls");
        assert_eq!((walked("full"), walked("change")), (images as u64, 1));
        assert!(exposed.borrow().contains(&own[0].to_string()));

        // A blob of it deleted: only the images that had it are walked again.
        let before = store.calls();
        memory.remove(&own[0]);
        advertised(&metrics, (images + 1) * per_image).await;
        assert!(store.calls() - before <= 8);
        assert!(!exposed.borrow().contains(&own[0].to_string()));
        assert_eq!(walked("change"), 2);

        // Fetched again: containerd updates the image to the same target, the layer is back.
        memory.put("new layer 0");
        memory.tag("docker.io", "new", "1", &manifest, OCI_MANIFEST);
        advertised(&metrics, (images + 1) * per_image + 1).await;
        assert!(exposed.borrow().contains(&own[0].to_string()));
        assert_eq!(walked("change"), 3);

        // The image deleted: its keys go without a single call; the shared layer stays.
        let before = store.calls();
        memory.untag("docker.io", "new", "1");
        advertised(&metrics, images * per_image + 1).await;
        assert_eq!(store.calls(), before);
        assert!(!exposed.borrow().contains(&manifest.to_string()));
        assert!(
            exposed.borrow().contains(&own[3].to_string()),
            "shared layer"
        );
        assert_eq!(walked("full"), images as u64);
        token.cancel();
        task.await.unwrap();
    }
}
