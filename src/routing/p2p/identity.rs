//! The node key: created once in the data dir (mode 0600) and reused, so a node's peer ID
//! survives restarts and other nodes' records of it stay valid.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use libp2p::identity::Keypair;

pub(crate) const KEY_FILE: &str = "node.key";

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a ferry node key ({reason}); move it away to create a new one")]
    Corrupt { path: String, reason: String },
}

/// Loads the key from `<data_dir>/node.key`, creating it when missing.
pub(crate) fn load_or_create(data_dir: &Path) -> Result<Keypair, IdentityError> {
    let path = data_dir.join(KEY_FILE);
    let shown = path.display().to_string();
    let io = |source| IdentityError::Io {
        path: shown.clone(),
        source,
    };
    match std::fs::read(&path) {
        Ok(bytes) => Keypair::from_protobuf_encoding(&bytes).map_err(|e| IdentityError::Corrupt {
            path: shown.clone(),
            reason: e.to_string(),
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let key = Keypair::generate_ed25519();
            let bytes = key
                .to_protobuf_encoding()
                .map_err(|e| IdentityError::Corrupt {
                    path: shown.clone(),
                    reason: e.to_string(),
                })?;
            std::fs::create_dir_all(data_dir).map_err(io)?;
            // Written under a temp name with 0600 from the start, then renamed: the key is
            // never readable by others, and never half-written.
            let tmp = data_dir.join(format!("{KEY_FILE}.tmp"));
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(io)?;
            file.write_all(&bytes).map_err(io)?;
            file.sync_all().map_err(io)?;
            std::fs::rename(&tmp, &path).map_err(io)?;
            Ok(key)
        }
        Err(e) => Err(io(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_key_is_created_once_with_mode_0600_and_reused() {
        let dir = tempfile::tempdir().unwrap();
        let first = load_or_create(dir.path()).unwrap();
        let mode = std::fs::metadata(dir.path().join(KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let again = load_or_create(dir.path()).unwrap();
        assert_eq!(first.public().to_peer_id(), again.public().to_peer_id());
    }

    #[test]
    fn a_corrupt_key_is_an_error_not_a_new_identity() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(KEY_FILE), b"garbage").unwrap();
        assert!(matches!(
            load_or_create(dir.path()),
            Err(IdentityError::Corrupt { .. })
        ));
    }
}
