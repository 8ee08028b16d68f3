use super::*;
use crate::store::memory::MemoryStore;

fn keeper(store: &Arc<MemoryStore>, budget: u64) -> Keeper {
    let mut config = KeepConfig::new(budget);
    config.check_every = Duration::from_secs(3600);
    config.check_after_holds = Duration::from_secs(3600);
    let metrics = Arc::new(Metrics::new());
    Keeper::spawn(store.clone(), store.clone(), None, config, metrics)
}

async fn settled(keeper: &Keeper) -> KeepStatus {
    keeper.check().await;
    keeper.status()
}

#[tokio::test(start_paused = true)]
async fn what_containerd_asks_for_is_held_even_before_it_lands() {
    let store = Arc::new(MemoryStore::new());
    let keep = keeper(&store, 1 << 20);
    let later = Digest::sha256_of(b"lands later");
    keep.asked(&later);
    let status = settled(&keep).await;
    assert_eq!(status.held, 1);
    assert_eq!(status.held_alone, 0, "nothing landed: it costs nothing");
    let landed = store.put(vec![7u8; 1000]);
    keep.asked(&landed);
    let status = settled(&keep).await;
    assert_eq!(
        (status.held, status.held_alone, status.held_alone_bytes),
        (2, 1, 1000)
    );
    let served: Vec<Digest> = keep.landed().borrow().iter().cloned().collect();
    assert_eq!(served, [landed], "only what has landed is offered to peers");
}

/// A pull slower than the check after its holds: its image landing counts again.
#[tokio::test(start_paused = true)]
async fn a_pulls_image_landing_counts_the_budget_again() {
    let store = Arc::new(MemoryStore::new());
    let mut config = KeepConfig::new(1500);
    config.check_every = Duration::from_secs(3600);
    let metrics = Arc::new(Metrics::new());
    let keep = Keeper::spawn(store.clone(), store.clone(), None, config, metrics);
    let blobs: Vec<Digest> = (0..2u8).map(|i| Digest::sha256_of(&[i; 1000])).collect();
    for d in &blobs {
        keep.asked(d);
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(keep.status().released, 0, "counted before anything landed");
    for i in 0..2u8 {
        store.put(vec![i; 1000]);
    }
    store.tag("r.example", "team/app", "v1", &blobs[0], "application/json");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let status = keep.status();
    assert_eq!((status.held, status.released), (1, 1));
}

#[tokio::test(start_paused = true)]
async fn over_the_budget_the_least_recently_used_go_first() {
    let store = Arc::new(MemoryStore::new());
    let keep = keeper(&store, 2500);
    let blobs: Vec<Digest> = (0..3u8).map(|i| store.put(vec![i; 1000])).collect();
    for d in &blobs {
        keep.asked(d);
        tokio::time::advance(Duration::from_secs(1)).await;
    }
    // The oldest is used again: the second is now the least recently used.
    keep.served(&blobs[0]);
    let status = settled(&keep).await;
    assert_eq!(
        (status.held, status.held_alone_bytes, status.released),
        (2, 2000, 1)
    );
    let (_, held) = Holder::open(&*store).await.unwrap();
    assert!(held.contains(&blobs[0]) && held.contains(&blobs[2]));
    assert!(!held.contains(&blobs[1]), "the least recently used went");
}

#[tokio::test(start_paused = true)]
async fn a_restart_takes_over_what_the_last_one_held() {
    let store = Arc::new(MemoryStore::new());
    let first = keeper(&store, 1 << 20);
    let d = store.put(vec![1u8; 10]);
    first.asked(&d);
    settled(&first).await;
    drop(first);
    let second = keeper(&store, 1 << 20);
    let status = settled(&second).await;
    assert_eq!(status.held, 1);
    assert_eq!(Holder::end(&*store).await.unwrap(), 1, "one lease to end");
}

#[tokio::test(start_paused = true)]
async fn a_blob_deleted_outright_is_held_no_longer() {
    let store = Arc::new(MemoryStore::new());
    let keep = keeper(&store, 1 << 20);
    let d = store.put(vec![3u8; 100]);
    keep.asked(&d);
    assert_eq!(settled(&keep).await.held, 1);
    // The keeper's subscription to the store's changes is made at its first turn.
    tokio::time::sleep(Duration::from_millis(10)).await;
    store.remove(&d);
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(settled(&keep).await.held, 0);
    assert!(keep.landed().borrow().is_empty());
    let (_, held) = Holder::open(&*store).await.unwrap();
    assert!(held.is_empty(), "released from the lease");
}

/// Two other nodes ahead of this one have these digests.
struct Spread(Vec<Digest>);

#[async_trait::async_trait]
impl Copies for Spread {
    async fn ahead(&self, digest: &Digest, enough: usize) -> usize {
        (2 * usize::from(self.0.contains(digest))).min(enough)
    }
}

#[tokio::test(start_paused = true)]
async fn the_last_copy_in_the_cluster_goes_last() {
    let store = Arc::new(MemoryStore::new());
    let blobs: Vec<Digest> = (0..3u8).map(|i| store.put(vec![i; 1000])).collect();
    let mut config = KeepConfig::new(2000);
    config.check_every = Duration::from_secs(3600);
    config.check_after_holds = Duration::from_secs(3600);
    config.copies = 2;
    // Only the newest is on another node too.
    let spread: Arc<dyn Copies> = Arc::new(Spread(vec![blobs[2].clone()]));
    let metrics = Arc::new(Metrics::new());
    let keep = Keeper::spawn(
        store.clone(),
        store.clone(),
        Some(spread),
        config,
        metrics.clone(),
    );
    for d in &blobs {
        keep.asked(d);
        tokio::time::advance(Duration::from_secs(1)).await;
    }
    let status = settled(&keep).await;
    assert_eq!((status.held, status.released), (2, 1));
    let (_, held) = Holder::open(&*store).await.unwrap();
    assert!(
        !held.contains(&blobs[2]),
        "the one another node has went first"
    );
    assert_eq!(
        metrics.keep_copy_lookups.get(),
        3,
        "one count per blob looked at"
    );
}
