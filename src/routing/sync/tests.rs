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
    start_sync_holding(store, router, None)
}

fn start_sync_holding(
    store: Arc<dyn ContentStore>,
    router: Arc<dyn ContentRouting>,
    held: Option<watch::Receiver<Held>>,
) -> Running {
    let metrics = Arc::new(Metrics::new());
    let config = SyncConfig {
        registries: Registries::All,
        filters: RegistryFilters::default(),
        interval: Duration::from_secs(3600),
        held,
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

/// A store that counts the calls walks make, to show what a change costs.
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
    async fn landed_within(&self, digest: &Digest, within: std::time::Duration) -> bool {
        self.inner.landed_within(digest, within).await
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

/// A pull, a deleted image and a deleted blob each cost calls for the images they touch:
/// 200 images are walked once at start, never again on a change.
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

/// A held blob stays advertised and served when the image that named it goes (the kubelet's
/// image garbage collection), goes when the hold does, and is not advertised once deleted
/// (until the next count says what is held).
#[tokio::test]
async fn held_blobs_outlive_their_image_and_go_with_their_hold() {
    let store = Arc::new(MemoryStore::new());
    let network = MemoryNetwork::new();
    let me = network.node(Peer {
        id: "me".into(),
        addr: "127.0.0.1:1".parse().unwrap(),
    });
    let (held_tx, held) = watch::channel(Held::default());
    let Running {
        metrics,
        exposed,
        token,
        task,
    } = start_sync_holding(store.clone(), Arc::new(me), Some(held));
    let (index, manifest, config, layer) = image(&store);
    advertised(&metrics, 5).await;
    held_tx.send_replace(Arc::new([layer.clone(), config.clone()].into()));
    advertised(&metrics, 5).await;
    store.untag("docker.io", "library/app", "1.0");
    advertised(&metrics, 2).await;
    let keys = exposed.borrow().clone();
    assert!(keys.contains(&digest_key(&layer)) && keys.contains(&digest_key(&config)));
    assert!(!keys.contains(&digest_key(&manifest)) && !keys.contains(&digest_key(&index)));
    store.remove(&config);
    advertised(&metrics, 1).await;
    held_tx.send_replace(Arc::new([layer.clone()].into()));
    advertised(&metrics, 1).await;
    held_tx.send_replace(Held::default());
    advertised(&metrics, 0).await;
    token.cancel();
    task.await.unwrap();
}
