//! Store -> router: advertise every key this node can serve, withdraw what it no longer can.
//!
//! One task owns the set of advertised keys. It reconciles the whole set against the store on
//! start, after every change notification (debounced: a pull is a burst of events), and on a
//! timer as a safety net; containerd going away ends the notifications, and the task
//! reconnects with backoff and reconciles again.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use serde::Deserialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{Router, digest_key, tag_key};
use crate::metrics::Metrics;
use crate::oci::Digest;
use crate::oci::manifest::MAX_MANIFEST_BYTES;
use crate::oci::registry::{Registries, RegistryFilters};
use crate::store::{ContentStore, ImageRecord};

/// Events arrive in bursts (one pull creates content, then the image); wait this long for the
/// burst to end before walking the store.
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
    router: Arc<dyn Router>,
    config: SyncConfig,
    metrics: Arc<Metrics>,
    exposed: watch::Sender<Exposed>,
    token: CancellationToken,
) {
    let sync = Sync {
        store: &*store,
        router: &*router,
        config: &config,
        metrics: &metrics,
        exposed: &exposed,
    };
    let mut advertised = BTreeSet::new();
    let mut retry = RETRY_MIN;
    let mut unreachable_since: Option<std::time::Instant> = None;
    loop {
        let changes = match store.changes().await {
            Ok(c) => {
                retry = RETRY_MIN;
                Some(c)
            }
            Err(e) => {
                tracing::debug!(error = %e, "cannot follow store events yet; retrying");
                None
            }
        };
        // Reachable means the store can be listed: following its events can fail on its own
        // (a subscription timing out on a loaded node) while everything else works, and that
        // must not withdraw anything.
        if sync.reconcile(&mut advertised).await {
            unreachable_since = None;
        } else {
            let since = *unreachable_since.get_or_insert_with(std::time::Instant::now);
            if since.elapsed() >= WITHDRAW_GRACE {
                sync.withdraw_all(&mut advertised).await;
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
                    sync.reconcile(&mut advertised).await;
                }
                event = changes.next() => {
                    if event.is_none() {
                        tracing::debug!("store events ended; reconnecting");
                        break;
                    }
                    // Let the burst finish, then walk once.
                    let _ = tokio::time::timeout(DEBOUNCE, async {
                        while changes.next().await.is_some() {}
                    })
                    .await;
                    sync.reconcile(&mut advertised).await;
                }
            }
        }
    }
}

struct Sync<'a> {
    store: &'a dyn ContentStore,
    router: &'a dyn Router,
    config: &'a SyncConfig,
    metrics: &'a Metrics,
    exposed: &'a watch::Sender<Exposed>,
}

impl Sync<'_> {
    /// Makes the router's view match the store: advertise new keys, withdraw gone ones. If the
    /// store cannot be listed (containerd down), nothing changes and this says so (`false`).
    async fn reconcile(&self, advertised: &mut BTreeSet<String>) -> bool {
        let Ok(images) = self.store.images().await else {
            return false;
        };
        let keys = inventory(
            self.store,
            &images,
            &self.config.registries,
            &self.config.filters,
        )
        .await;
        let added: Vec<String> = keys.difference(advertised).cloned().collect();
        let removed: Vec<String> = advertised.difference(&keys).cloned().collect();
        // Withdrawn keys stop being served before anything else happens.
        self.exposed.send_replace(Arc::new(keys.clone()));
        if !removed.is_empty() {
            tracing::debug!(count = removed.len(), "withdrawing keys");
            if let Err(e) = self.router.withdraw(removed).await {
                tracing::warn!(error = %e, "withdraw failed");
            }
        }
        if !added.is_empty() {
            tracing::debug!(count = added.len(), "advertising keys");
            if let Err(e) = self.router.advertise(added).await {
                tracing::warn!(error = %e, "advertise failed");
            }
        }
        *advertised = keys;
        self.metrics.keys_advertised.set(advertised.len() as i64);
        true
    }
}

impl Sync<'_> {
    /// containerd has been unreachable for [`WITHDRAW_GRACE`]: stop serving and advertising
    /// everything (the reconcile after it is back advertises it again). Records other nodes
    /// already hold expire on their own; until then this node answers them 404 at once.
    async fn withdraw_all(&self, advertised: &mut BTreeSet<String>) {
        if advertised.is_empty() {
            return;
        }
        tracing::warn!(
            count = advertised.len(),
            grace_s = WITHDRAW_GRACE.as_secs(),
            "containerd unreachable: withdrawing what this node advertised until it is back"
        );
        self.exposed.send_replace(Arc::new(BTreeSet::new()));
        let all: Vec<String> = std::mem::take(advertised).into_iter().collect();
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
    let mut keys = BTreeSet::new();
    let mut visited = BTreeSet::new();
    for image in images {
        let Some(name) = ImageName::parse(&image.name) else {
            continue;
        };
        let shown = image
            .name
            .split_once('@')
            .map_or(image.name.as_str(), |(n, _)| n);
        if !registries.includes(&name.registry) || !filters.allows(shown) {
            continue;
        }
        let mut present = walk(store, &image.target.digest, &mut visited, &mut keys).await;
        if let (Some(tag), true) = (&name.tag, present.remove(&image.target.digest)) {
            keys.insert(tag_key(&name.registry, &name.repository, tag));
        }
    }
    keys
}

/// Adds every present digest reachable from `root` to `keys`; returns the ones found now.
async fn walk(
    store: &dyn ContentStore,
    root: &Digest,
    visited: &mut BTreeSet<Digest>,
    keys: &mut BTreeSet<String>,
) -> BTreeSet<Digest> {
    let mut present = BTreeSet::new();
    let mut manifests = vec![root.clone()];
    while let Some(digest) = manifests.pop() {
        if !visited.insert(digest.clone()) {
            if keys.contains(&digest_key(&digest)) {
                present.insert(digest);
            }
            continue;
        }
        let Ok(desc) = store.descriptor(&digest).await else {
            continue;
        };
        keys.insert(digest_key(&digest));
        present.insert(digest.clone());
        if desc.size > MAX_MANIFEST_BYTES {
            continue;
        }
        let Some(children) = read_children(store, &digest).await else {
            continue;
        };
        manifests.extend(children.manifests);
        for blob in children.blobs {
            if visited.insert(blob.clone()) && store.descriptor(&blob).await.is_ok() {
                keys.insert(digest_key(&blob));
            }
        }
    }
    present
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
        let token = CancellationToken::new();
        let metrics = Arc::new(Metrics::new());
        let config = SyncConfig {
            registries: Registries::All,
            filters: RegistryFilters::default(),
            interval: Duration::from_secs(3600),
        };
        let (exposed_tx, exposed) = exposure();
        let task = tokio::spawn(run(
            store.clone(),
            Arc::new(me),
            config,
            metrics.clone(),
            exposed_tx,
            token.clone(),
        ));

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
}
