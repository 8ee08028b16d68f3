//! Ferry's holds as a containerd lease: content a lease references stays, whatever the
//! images' garbage-collection labels say (`discard_unpacked_layers` drops the layers' ones).
//!
//! Invariant: every lease Ferry creates carries [`OWNER`] and an expiry
//! (`containerd.io/gc.expire`), renewed at each open, so a lease left by a Ferry that never
//! comes back goes on its own.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use containerd_client::services::v1::content_client::ContentClient;
use containerd_client::services::v1::leases_client::LeasesClient;
use containerd_client::services::v1::{
    AddResourceRequest, CreateRequest, DeleteContentRequest, DeleteRequest, DeleteResourceRequest,
    InfoRequest, ListRequest, ListResourcesRequest, Resource, WriteAction, WriteContentRequest,
};
use containerd_client::tonic::{Code, Request};

use super::{ContainerdStore, status_error};
use crate::oci::Digest;
use crate::store::{ContentStore, HeldBlob, Holder, StoreError};

/// The label that marks a lease as Ferry's.
pub const OWNER: &str = "ferry.dev/holds";
const EXPIRE: &str = "containerd.io/gc.expire";
/// How long a lease outlives the last Ferry that renewed it.
pub const EXPIRY: Duration = Duration::from_secs(7 * 24 * 3600);
const GC_REF: &str = "containerd.io/gc.ref.content";
/// The throwaway blob whose deletion makes containerd sweep its content files.
const SWEEP: &[u8] = b"ferry: a blob written to be deleted, so that containerd sweeps its files\n";

fn content(digest: &str) -> Resource {
    Resource {
        id: digest.to_string(),
        r#type: "content".to_string(),
    }
}

impl ContainerdStore {
    fn leases(&self) -> LeasesClient<containerd_client::tonic::transport::Channel> {
        LeasesClient::new(self.channel.clone())
    }

    async fn own_leases(&self) -> Result<Vec<String>, StoreError> {
        let leases = self
            .leases()
            .list(self.request(ListRequest { filters: vec![] }))
            .await
            .map_err(status_error)?
            .into_inner()
            .leases;
        Ok(leases
            .into_iter()
            .filter(|l| l.labels.contains_key(OWNER))
            .map(|l| l.id)
            .collect())
    }

    async fn resources(&self, lease: &str) -> Result<Vec<String>, StoreError> {
        let resources = self
            .leases()
            .list_resources(self.request(ListResourcesRequest {
                id: lease.to_string(),
            }))
            .await
            .map_err(status_error)?
            .into_inner()
            .resources;
        Ok(resources
            .into_iter()
            .filter(|r| r.r#type == "content")
            .map(|r| r.id)
            .collect())
    }

    /// The content garbage collection keeps through the images: their targets and every
    /// `gc.ref.content` label below them.
    async fn referenced(&self) -> Result<HashSet<String>, StoreError> {
        let mut todo: Vec<String> = self
            .images()
            .await?
            .into_iter()
            .map(|i| i.target.digest.to_string())
            .collect();
        let mut seen = HashSet::new();
        let mut client = ContentClient::new(self.channel.clone());
        while let Some(digest) = todo.pop() {
            if !seen.insert(digest.clone()) {
                continue;
            }
            let info = match client.info(self.request(InfoRequest { digest })).await {
                Ok(r) => r.into_inner().info,
                Err(e) if e.code() == Code::NotFound => continue,
                Err(e) => return Err(status_error(e)),
            };
            let labels = info.map(|i| i.labels).unwrap_or_default();
            todo.extend(
                labels
                    .into_iter()
                    .filter(|(k, _)| k.starts_with(GC_REF))
                    .map(|(_, v)| v),
            );
        }
        Ok(seen)
    }
}

#[async_trait::async_trait]
impl Holder for ContainerdStore {
    async fn open(&self) -> Result<(String, Vec<Digest>), StoreError> {
        let old = self.own_leases().await?;
        let id = self.create_lease("ferry-holds", EXPIRY, true).await?;
        let mut held = HashSet::new();
        // Moved before the old lease goes, so nothing is ever unheld in between.
        for lease in old {
            for digest in self.resources(&lease).await? {
                if held.insert(digest.clone()) {
                    self.hold(&id, &digest.parse().map_err(|_| StoreError::NotFound)?)
                        .await?;
                }
            }
            self.delete_lease(&lease, false).await?;
        }
        Ok((
            id,
            held.into_iter().filter_map(|d| d.parse().ok()).collect(),
        ))
    }

    async fn hold(&self, lease: &str, digest: &Digest) -> Result<(), StoreError> {
        self.leases()
            .add_resource(self.request(AddResourceRequest {
                id: lease.to_string(),
                resource: Some(content(&digest.to_string())),
            }))
            .await
            .map_err(status_error)?;
        Ok(())
    }

    async fn release(&self, lease: &str, digest: &Digest) -> Result<(), StoreError> {
        self.leases()
            .delete_resource(self.request(DeleteResourceRequest {
                id: lease.to_string(),
                resource: Some(content(&digest.to_string())),
            }))
            .await
            .map_err(status_error)?;
        Ok(())
    }

    async fn landed_holds(&self, held: &[Digest]) -> Result<Vec<HeldBlob>, StoreError> {
        let referenced = self.referenced().await?;
        let mut landed = Vec::new();
        for digest in held {
            match self.info(digest).await {
                Ok(size) => landed.push(HeldBlob {
                    digest: digest.clone(),
                    size,
                    alone: !referenced.contains(&digest.to_string()),
                }),
                Err(StoreError::NotFound) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(landed)
    }

    async fn collect(&self) -> Result<(), StoreError> {
        // containerd sweeps its content files only after a content record went; a released
        // blob whose record was deleted while held has none left, so one is made and deleted.
        self.put_and_delete(SWEEP).await?;
        // containerd collects synchronously when a lease is deleted with `sync`.
        let id = (self.create_lease("ferry-collect", Duration::from_secs(60), false)).await?;
        self.delete_lease(&id, true).await
    }

    async fn end(&self) -> Result<usize, StoreError> {
        let leases = self.own_leases().await?;
        for lease in &leases {
            self.delete_lease(lease, true).await?;
        }
        Ok(leases.len())
    }
}

impl ContainerdStore {
    /// Writes `bytes` as content, then deletes it.
    async fn put_and_delete(&self, bytes: &[u8]) -> Result<(), StoreError> {
        let digest = Digest::sha256_of(bytes).to_string();
        let stamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let write = |action: WriteAction, offset: usize, data: &[u8]| WriteContentRequest {
            action: action as i32,
            r#ref: format!("ferry-sweep-{stamp}"),
            total: bytes.len() as i64,
            expected: digest.clone(),
            offset: offset as i64,
            data: data.to_vec(),
            labels: HashMap::new(),
        };
        let requests = vec![
            write(WriteAction::Write, 0, bytes),
            write(WriteAction::Commit, bytes.len(), &[]),
        ];
        let stream = futures::stream::iter(requests);
        let request = containerd_client::with_namespace!(stream, self.namespace.as_str());
        let mut client = ContentClient::new(self.channel.clone());
        let mut answers = client
            .write(request)
            .await
            .map_err(status_error)?
            .into_inner();
        while answers.message().await.map_err(status_error)?.is_some() {}
        let delete = self.request(DeleteContentRequest { digest });
        match client.delete(delete).await {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Code::NotFound => Ok(()),
            Err(e) => Err(status_error(e)),
        }
    }

    /// A new lease `<prefix>-<nanoseconds>` that expires after `expiry`; `owned`: Ferry's own
    /// (found again at the next start, ended by cleanup).
    async fn create_lease(
        &self,
        prefix: &str,
        expiry: Duration,
        owned: bool,
    ) -> Result<String, StoreError> {
        let now = SystemTime::now();
        let stamp = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let id = format!("{prefix}-{stamp}");
        let expire = humantime::format_rfc3339_seconds(now + expiry).to_string();
        let mut labels: HashMap<String, String> = [(EXPIRE.to_string(), expire)].into();
        if owned {
            labels.insert(OWNER.to_string(), "1".to_string());
        }
        self.leases()
            .create(self.request(CreateRequest {
                id: id.clone(),
                labels,
            }))
            .await
            .map_err(status_error)?;
        Ok(id)
    }

    async fn delete_lease(&self, lease: &str, sync: bool) -> Result<(), StoreError> {
        match self
            .leases()
            .delete(self.request(DeleteRequest {
                id: lease.to_string(),
                sync,
            }))
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.code() == Code::NotFound => Ok(()),
            Err(e) => Err(status_error(e)),
        }
    }
}
