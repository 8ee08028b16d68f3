//! Manifests' media types read from their own JSON, since containerd's store keeps none.
//! Invariant: anything that is not a manifest is refused, so a layer is never served as one.

use serde::Deserialize;
use serde::de::IgnoredAny;

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";

/// The spec's recommended minimum, and containerd's own maximum.
pub const MAX_MANIFEST_BYTES: u64 = 4 * 1024 * 1024;

const KNOWN: [&str; 4] = [OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST];

pub fn is_manifest_media_type(media_type: &str) -> bool {
    KNOWN.contains(&media_type)
}

#[derive(Deserialize)]
struct Probe {
    #[serde(rename = "mediaType")]
    media_type: Option<String>,
    #[serde(rename = "schemaVersion")]
    schema_version: Option<u32>,
    // Only whether they are there: crafted JSON (millions of tiny values) must not become a
    // tree in memory for each request.
    manifests: Option<IgnoredAny>,
    config: Option<IgnoredAny>,
    layers: Option<IgnoredAny>,
}

/// The media type of a manifest or index, or `None` when the bytes are not one.
pub fn sniff_media_type(bytes: &[u8]) -> Option<&'static str> {
    let probe: Probe = serde_json::from_slice(bytes).ok()?;
    if probe.schema_version != Some(2) {
        return None;
    }
    if let Some(declared) = probe.media_type.as_deref() {
        return KNOWN.iter().copied().find(|k| *k == declared);
    }
    // OCI manifests may omit mediaType; the shape decides.
    match (&probe.manifests, &probe.config, &probe.layers) {
        (Some(_), None, None) => Some(OCI_INDEX),
        (None, Some(_), Some(_)) => Some(OCI_MANIFEST),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declared_types() {
        let m = br#"{"schemaVersion":2,"mediaType":"application/vnd.docker.distribution.manifest.v2+json","config":{},"layers":[]}"#;
        assert_eq!(sniff_media_type(m), Some(DOCKER_MANIFEST));
        let i = br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[]}"#;
        assert_eq!(sniff_media_type(i), Some(OCI_INDEX));
    }

    #[test]
    fn undeclared_types_by_shape() {
        assert_eq!(
            sniff_media_type(br#"{"schemaVersion":2,"config":{},"layers":[]}"#),
            Some(OCI_MANIFEST)
        );
        assert_eq!(
            sniff_media_type(br#"{"schemaVersion":2,"manifests":[]}"#),
            Some(OCI_INDEX)
        );
    }

    #[test]
    fn not_manifests() {
        for bad in [
            &b""[..],
            b"\x1f\x8b\x08\x00",
            b"{}",
            br#"{"schemaVersion":1,"fsLayers":[]}"#,
            br#"{"schemaVersion":2,"mediaType":"application/vnd.oci.image.config.v1+json"}"#,
            br#"{"architecture":"amd64","os":"linux","rootfs":{}}"#,
        ] {
            assert_eq!(sniff_media_type(bad), None);
        }
    }
}
