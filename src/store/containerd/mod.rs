//! The containerd [`ContentStore`]: image and content metadata over containerd's gRPC API,
//! blob bytes straight from the content directory when it is readable.

mod channel;
pub mod files;
mod ingest;
pub mod lease;

pub use files::blob_path;

use std::path::PathBuf;
use std::time::Duration;

use containerd_client::events::ContentDelete;
use containerd_client::services::v1::content_client::ContentClient;
use containerd_client::services::v1::events_client::EventsClient;
use containerd_client::services::v1::images_client::ImagesClient;
use containerd_client::services::v1::version_client::VersionClient;
use containerd_client::services::v1::{
    AbortRequest, GetImageRequest, ImageCreate, ImageDelete, ImageUpdate, InfoRequest,
    ListImagesRequest, ListStatusesRequest, ReadContentRequest, SubscribeRequest,
};
use containerd_client::tonic::transport::Channel;
use containerd_client::tonic::{Code, Request, Status};
use containerd_client::types::Envelope;
use containerd_client::with_namespace;
use futures::StreamExt;
use prost::Message;

use super::downloads::{InFlight, Scope};
use super::{ByteStream, Change, ChangeStream, ContentStore, Descriptor, ImageRecord, StoreError};
use crate::oci::{ByteRange, Digest};

/// Changes not yet taken by the follower; beyond this containerd's stream waits (and may drop
/// the subscription: the follower then walks everything).
const CHANGE_BUFFER: usize = 1024;

const HEALTH_TIMEOUT: Duration = Duration::from_secs(1);

/// containerd as a content store, scoped to one namespace.
#[derive(Debug, Clone)]
pub struct ContainerdStore {
    channel: Channel,
    /// For the event subscription only: its calls have no timeout.
    events: Channel,
    namespace: String,
    content_dir: PathBuf,
}

impl ContainerdStore {
    pub fn new(socket: PathBuf, namespace: String, content_dir: PathBuf) -> Self {
        Self {
            channel: channel::lazy_unix_channel(socket.clone()),
            events: channel::lazy_unix_channel_for_streams(socket),
            namespace,
            content_dir,
        }
    }

    fn request<T>(&self, message: T) -> Request<T> {
        with_namespace!(message, self.namespace.as_str())
    }

    /// Size of committed content in our namespace. Also gates the direct file read: the files are
    /// shared by every namespace, the metadata is not.
    async fn info(&self, digest: &Digest) -> Result<u64, StoreError> {
        let request = self.request(InfoRequest {
            digest: digest.to_string(),
        });
        let info = ContentClient::new(self.channel.clone())
            .info(request)
            .await
            .map_err(status_error)?
            .into_inner()
            .info
            .ok_or(StoreError::NotFound)?;
        u64::try_from(info.size).map_err(|_| StoreError::NotFound)
    }

    /// The fallback when the content directory is not readable.
    fn grpc_read(&self, digest: &Digest, offset: u64, len: u64) -> ByteStream {
        let request = self.request(ReadContentRequest {
            digest: digest.to_string(),
            offset: offset as i64,
            size: len as i64,
        });
        let client = ContentClient::new(self.channel.clone());
        let stream = futures::stream::once(async move {
            let mut client = client;
            client.read(request).await
        })
        .flat_map(|response| match response {
            Ok(r) => r
                .into_inner()
                .map(|m| {
                    m.map(|m| bytes::Bytes::from(m.data))
                        .map_err(std::io::Error::other)
                })
                .boxed(),
            Err(status) => {
                futures::stream::once(async move { Err(std::io::Error::other(status)) }).boxed()
            }
        });
        Box::pin(stream)
    }
}

#[async_trait::async_trait]
impl ContentStore for ContainerdStore {
    async fn resolve(
        &self,
        registry: &str,
        repository: &str,
        tag: &str,
    ) -> Result<Descriptor, StoreError> {
        let request = self.request(GetImageRequest {
            name: format!("{registry}/{repository}:{tag}"),
        });
        let image = ImagesClient::new(self.channel.clone())
            .get(request)
            .await
            .map_err(status_error)?
            .into_inner()
            .image
            .ok_or(StoreError::NotFound)?;
        let target = image.target.ok_or(StoreError::NotFound)?;
        let digest = target.digest.parse().map_err(|_| StoreError::NotFound)?;
        // The image record can outlive its content (GC, a partial pull): report what is there.
        let size = self.info(&digest).await?;
        Ok(Descriptor {
            digest,
            size,
            media_type: Some(target.media_type),
        })
    }

    async fn descriptor(&self, digest: &Digest) -> Result<Descriptor, StoreError> {
        let size = self.info(digest).await?;
        Ok(Descriptor {
            digest: digest.clone(),
            size,
            media_type: None,
        })
    }

    async fn open(
        &self,
        digest: &Digest,
        range: Option<ByteRange>,
    ) -> Result<ByteStream, StoreError> {
        let size = self.info(digest).await?;
        let (offset, len) = crate::oci::range::span(range, size);
        if len == 0 {
            return Ok(Box::pin(futures::stream::empty()));
        }
        match files::open(&self.content_dir, digest, size, offset, len).await {
            Ok(stream) => Ok(stream),
            Err(e) => {
                tracing::debug!(%digest, error = %e, "content file not readable, reading through containerd");
                Ok(self.grpc_read(digest, offset, len))
            }
        }
    }

    fn blob_file(&self, digest: &Digest) -> Option<PathBuf> {
        Some(files::blob_path(&self.content_dir, digest))
    }

    async fn downloads(&self, digest: &Digest, scope: Scope) -> Vec<InFlight> {
        let (dir, d) = (self.content_dir.clone(), digest.clone());
        let prefix = format!("{}/", self.namespace);
        let found = tokio::task::spawn_blocking(move || {
            ingest::Ingest::scan(&dir, &d)
                .into_iter()
                .filter(|(r, ingest)| match scope {
                    Scope::Namespace => r.starts_with(&prefix),
                    Scope::AnyFresh(fresh) => ingest.fresh(fresh),
                })
                .map(|(_, ingest)| std::sync::Arc::new(ingest) as InFlight)
                .collect()
        });
        found.await.unwrap_or_default()
    }

    async fn landed(&self, digest: &Digest) -> Option<u64> {
        let path = files::blob_path(&self.content_dir, digest);
        tokio::fs::metadata(path).await.ok().map(|m| m.len())
    }

    async fn landed_within(&self, digest: &Digest, within: Duration) -> bool {
        // containerd renames the finished download into place: its last write is the landing.
        let path = files::blob_path(&self.content_dir, digest);
        let modified = tokio::fs::metadata(path).await.and_then(|m| m.modified());
        modified.is_ok_and(|t| t.elapsed().is_ok_and(|age| age < within))
    }

    async fn open_landed(
        &self,
        digest: &Digest,
        offset: u64,
    ) -> Result<(ByteStream, u64), StoreError> {
        let path = files::blob_path(&self.content_dir, digest);
        let size = match tokio::fs::metadata(&path).await {
            Ok(meta) => meta.len(),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(StoreError::NotFound),
            Err(e) => return Err(StoreError::Io(e)),
        };
        let offset = offset.min(size);
        let stream = files::open(&self.content_dir, digest, size, offset, size - offset).await?;
        Ok((stream, size))
    }

    async fn healthy(&self) -> bool {
        let mut client = VersionClient::new(self.channel.clone());
        matches!(
            tokio::time::timeout(HEALTH_TIMEOUT, client.version(())).await,
            Ok(Ok(_))
        )
    }

    /// `1` for 1.7.24, `2` for v2.1.9; `None` while containerd does not answer within a second.
    async fn containerd_major(&self) -> Option<u32> {
        let mut client = VersionClient::new(self.channel.clone());
        let reply = tokio::time::timeout(HEALTH_TIMEOUT, client.version(()))
            .await
            .ok()?
            .ok()?;
        parse_major(&reply.into_inner().version)
    }

    async fn images(&self) -> Result<Vec<ImageRecord>, StoreError> {
        let request = self.request(ListImagesRequest {
            filters: Vec::new(),
        });
        let images = ImagesClient::new(self.channel.clone())
            .list(request)
            .await
            .map_err(status_error)?
            .into_inner()
            .images;
        Ok(images
            .into_iter()
            .filter_map(|image| {
                let target = image.target?;
                Some(ImageRecord {
                    name: image.name,
                    target: Descriptor {
                        digest: target.digest.parse().ok()?,
                        size: u64::try_from(target.size).ok()?,
                        media_type: Some(target.media_type),
                    },
                })
            })
            .collect())
    }

    async fn discard_partial(
        &self,
        digest: &Digest,
        started_before: std::time::SystemTime,
    ) -> Result<usize, StoreError> {
        let mut client = ContentClient::new(self.channel.clone());
        let statuses = client
            .list_statuses(self.request(ListStatusesRequest {
                filters: Vec::new(),
            }))
            .await
            .map_err(status_error)?
            .into_inner()
            .statuses;
        let digest = digest.to_string();
        let cutoff = started_before
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i128);
        let mut aborted = 0;
        for status in statuses {
            // containerd's local store does not keep `expected`; its pulls name the ingest
            // `<kind>-<digest>` (layer-, config-, manifest-, index-), for CRI pulls too.
            let ours = status.expected == digest || status.r#ref.ends_with(&format!("-{digest}"));
            let started = status.started_at.as_ref().map_or(0, |t| {
                i128::from(t.seconds) * 1_000_000_000 + i128::from(t.nanos)
            });
            if !ours || started > cutoff {
                continue;
            }
            match client
                .abort(self.request(AbortRequest {
                    r#ref: status.r#ref.clone(),
                }))
                .await
            {
                Ok(_) => aborted += 1,
                Err(e) if e.code() == Code::NotFound => {}
                Err(e) => return Err(status_error(e)),
            }
        }
        Ok(aborted)
    }

    async fn changes(&self) -> Result<ChangeStream, StoreError> {
        let request = SubscribeRequest {
            filters: vec![format!("namespace=={}", self.namespace)],
        };
        let mut client = EventsClient::new(self.events.clone());
        // containerd 1.6 sends the response headers only with the first event: subscribe
        // in a task of its own so the caller goes on (and walks the store) at once.
        let (tx, rx) = tokio::sync::mpsc::channel(CHANGE_BUFFER);
        tokio::spawn(async move {
            let follow = async {
                let Ok(response) = client.subscribe(request).await else {
                    return;
                };
                let mut events = response.into_inner();
                while let Some(Ok(event)) = events.next().await {
                    if let Some(change) = change_of(&event)
                        && tx.send(change).await.is_err()
                    {
                        return;
                    }
                }
            };
            tokio::select! {
                _ = follow => {}
                _ = tx.closed() => {}
            }
        });
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }
}

/// What an event changes in what a node can serve: image create, update and delete name an
/// image; `/content/delete` takes a blob away; anything else (new content too) changes
/// nothing until an image names it. An unreadable event of interest means "look at everything".
fn change_of(event: &Envelope) -> Option<Change> {
    let value = event
        .event
        .as_ref()
        .map_or(&[][..], |any| any.value.as_slice());
    let change = match event.topic.as_str() {
        "/images/create" => ImageCreate::decode(value).ok().map(|e| e.name),
        "/images/update" => ImageUpdate::decode(value).ok().map(|e| e.name),
        "/images/delete" => ImageDelete::decode(value).ok().map(|e| e.name),
        "/content/delete" => {
            let digest = ContentDelete::decode(value).ok();
            let digest = digest.and_then(|e| e.digest.parse::<Digest>().ok());
            return Some(digest.map_or(Change::Unknown, Change::ContentDeleted));
        }
        _ => return None,
    };
    Some(
        change
            .filter(|name| !name.is_empty())
            .map_or(Change::Unknown, Change::Image),
    )
}

fn status_error(status: Status) -> StoreError {
    match status.code() {
        Code::NotFound => StoreError::NotFound,
        _ => StoreError::Unavailable(Box::new(status)),
    }
}
/// `v2.1.9`, `2.1.9+unknown`, `1.6.20~ds1`: the number before the first dot.
fn parse_major(version: &str) -> Option<u32> {
    version
        .trim_start_matches('v')
        .split('.')
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn envelope(topic: &str, value: Vec<u8>) -> Envelope {
        let mut e = Envelope {
            topic: topic.to_string(),
            ..Default::default()
        };
        let mut any = e.event.take().unwrap_or_default();
        any.value = value;
        e.event = Some(any);
        e
    }

    #[test]
    fn events_are_read_as_what_they_change() {
        let digest = Digest::sha256_of(b"layer");
        let deleted = ContentDelete {
            digest: digest.to_string(),
        }
        .encode_to_vec();
        assert_eq!(
            change_of(&envelope("/content/delete", deleted)),
            Some(Change::ContentDeleted(digest))
        );
        assert_eq!(
            change_of(&envelope("/content/delete", vec![0xff, 0x01])),
            Some(Change::Unknown),
            "an unreadable deletion means look at everything"
        );
        let name = "docker.io/library/app:1";
        let created = ImageCreate {
            name: name.to_string(),
            labels: [("io.cri-containerd.image".to_string(), "managed".to_string())].into(),
        };
        let updated = ImageUpdate {
            name: name.to_string(),
            ..Default::default()
        };
        let deleted = ImageDelete {
            name: name.to_string(),
        };
        for (topic, value) in [
            ("/images/create", created.encode_to_vec()),
            ("/images/update", updated.encode_to_vec()),
            ("/images/delete", deleted.encode_to_vec()),
        ] {
            assert_eq!(
                change_of(&envelope(topic, value)),
                Some(Change::Image(name.to_string()))
            );
            assert_eq!(
                change_of(&envelope(topic, vec![])),
                Some(Change::Unknown),
                "an image event without a name"
            );
        }
        assert_eq!(change_of(&envelope("/content/create", vec![])), None);
        assert_eq!(change_of(&envelope("/tasks/start", vec![])), None);
    }

    #[test]
    fn the_major_version_is_read_from_every_spelling_containerd_uses() {
        assert_eq!(parse_major("v2.1.9"), Some(2));
        assert_eq!(parse_major("2.1.9+unknown"), Some(2));
        assert_eq!(parse_major("1.6.20~ds1"), Some(1));
        assert_eq!(parse_major(""), None);
    }
}
