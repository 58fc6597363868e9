//! Manifests (and snapshots) of a highly available control plane kept out of etcd: etcd's
//! requests are at most 1.5 MiB and its storage 2-8 GiB, while one version's manifests reach
//! hundreds of megabytes at the scale of the largest models. With a blob store, the journal in
//! etcd holds [`Record::PublishRef`] and [`Record::PeerRef`]: the manifest's BLAKE3 digest and
//! length, its body a zstd-compressed JSON object at `<prefix>/manifests/<digest>` in object
//! storage (an S3-compatible bucket, [`mx_artifact::Store`]), written before the record is
//! journaled and verified when it is read back. Snapshots go the same way
//! (`<prefix>/snapshots/<digest>`). Objects are content-addressed, so a write is idempotent
//! and a replica never reads a body other than the one journaled.

use mx_artifact::{ArtifactUrl, Store, StoreOptions};
use mx_layout::SourceManifest;
use object_store::ObjectStoreExt as _;
use serde::{Deserialize, Serialize};

use crate::record::Record;
use crate::Error;

/// A blob's identity in the journal: the BLAKE3 digest (64 lowercase hex) of its stored bytes
/// and their length.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BlobRef {
    /// BLAKE3 of the stored (compressed) bytes, 64 lowercase hex digits.
    pub blake3: String,
    /// Length of the stored bytes.
    pub bytes: u64,
}

/// Largest blob read back (4 GiB): a reference naming more is refused rather than read.
pub const MAX_BLOB_BYTES: u64 = 4 << 30;

/// A bucket and prefix for the control plane's blobs, with its S3 client.
#[derive(Debug, Clone)]
pub struct BlobStore {
    store: Store,
    url: ArtifactUrl,
}

fn store_err(url: &str, op: &str, e: impl std::fmt::Display) -> Error {
    Error::Config {
        what: format!("blob store {url}"),
        reason: format!("{op}: {e}"),
    }
}

impl BlobStore {
    /// A store at `url` (`s3://bucket/prefix`), its client configured from the standard AWS
    /// variables ([`Store::from_env`]).
    ///
    /// # Errors
    /// [`Error::Config`] naming the URL when it does not parse or the environment does not
    /// configure a client.
    pub fn from_env(url: &str) -> Result<BlobStore, Error> {
        let parsed: ArtifactUrl = url
            .parse()
            .map_err(|e| store_err(url, "parsing the URL", e))?;
        let store = Store::from_env(&parsed, StoreOptions::default())
            .map_err(|e| store_err(url, "configuring the client", e))?;
        Ok(BlobStore { store, url: parsed })
    }

    /// A store over `store` at `url` (tests, other clouds).
    pub fn new(store: Store, url: ArtifactUrl) -> BlobStore {
        BlobStore { store, url }
    }

    /// The store's URL.
    pub fn url(&self) -> &ArtifactUrl {
        &self.url
    }

    fn key(&self, kind: &str, r: &BlobRef) -> object_store::path::Path {
        self.url.key(&format!("{kind}/{}", r.blake3))
    }

    /// Stores `bytes` under `kind` (`manifests`, `snapshots`) and returns its reference.
    ///
    /// # Errors
    /// [`Error::Config`] naming the object when the write fails.
    pub async fn put(&self, kind: &str, bytes: Vec<u8>) -> Result<BlobRef, Error> {
        let r = BlobRef {
            blake3: blake3::hash(&bytes).to_hex().to_string(),
            bytes: bytes.len() as u64,
        };
        let key = self.key(kind, &r);
        self.store
            .object_store()
            .put(&key, bytes.into())
            .await
            .map_err(|e| store_err(&format!("{}/{key}", self.url), "put", e))?;
        Ok(r)
    }

    /// The bytes `r` names under `kind`, verified against its length and digest.
    ///
    /// # Errors
    /// [`Error::Config`] naming the object when it cannot be read, or when its bytes are not
    /// the ones journaled (length or digest).
    pub async fn get(&self, kind: &str, r: &BlobRef) -> Result<Vec<u8>, Error> {
        let name = format!("{}/{kind}/{}", self.url, r.blake3);
        if r.blake3.len() != 64 || !r.blake3.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(store_err(
                &name,
                "reference",
                "not a 64-hex-digit BLAKE3 digest",
            ));
        }
        if r.bytes > MAX_BLOB_BYTES {
            return Err(store_err(
                &name,
                "reference",
                format!("{} bytes, at most {MAX_BLOB_BYTES}", r.bytes),
            ));
        }
        let got = self
            .store
            .object_store()
            .get(&self.key(kind, r))
            .await
            .map_err(|e| store_err(&name, "get", e))?
            .bytes()
            .await
            .map_err(|e| store_err(&name, "read", e))?;
        let digest = blake3::hash(&got).to_hex().to_string();
        if got.len() as u64 != r.bytes || digest != r.blake3 {
            return Err(store_err(
                &name,
                "verify",
                format!(
                    "{} bytes hashing to {digest}; the journal names {} bytes",
                    got.len(),
                    r.bytes
                ),
            ));
        }
        Ok(got.to_vec())
    }

    /// Stores `manifest` (zstd-compressed JSON) and returns its reference.
    ///
    /// # Errors
    /// As [`BlobStore::put`].
    pub async fn put_manifest(&self, manifest: &SourceManifest) -> Result<BlobRef, Error> {
        let json = serde_json::to_vec(manifest).map_err(|e| Error::InvalidField {
            field: "manifest".into(),
            reason: e.to_string(),
        })?;
        let z = zstd::encode_all(json.as_slice(), 3)
            .map_err(|e| store_err(&self.url.to_string(), "compress", e))?;
        self.put("manifests", z).await
    }

    /// The manifest `r` names, verified and strictly parsed.
    ///
    /// # Errors
    /// As [`BlobStore::get`]; [`Error::InvalidField`] when it does not decompress or parse.
    pub async fn get_manifest(&self, r: &BlobRef) -> Result<SourceManifest, Error> {
        let z = self.get("manifests", r).await?;
        let bad = |reason: String| Error::InvalidField {
            field: format!("manifest {}", r.blake3),
            reason,
        };
        let json = zstd::decode_all(z.as_slice()).map_err(|e| bad(e.to_string()))?;
        mx_layout::strict_json::from_slice(&json).map_err(|e| bad(e.to_string()))
    }

    /// `rec` as journaled in etcd: a [`Record::Publish`] or [`Record::Peer`] becomes its
    /// reference, its manifest stored first; any other record is itself.
    ///
    /// # Errors
    /// As [`BlobStore::put_manifest`].
    pub async fn offload(&self, rec: &Record) -> Result<Option<Record>, Error> {
        Ok(match rec {
            Record::Publish { label, manifest } => Some(Record::PublishRef {
                label: label.clone(),
                slot: manifest.slot,
                manifest: self.put_manifest(manifest).await?,
            }),
            Record::Peer {
                label,
                worker_id,
                manifest,
            } => Some(Record::PeerRef {
                label: label.clone(),
                worker_id: worker_id.clone(),
                manifest: self.put_manifest(manifest).await?,
            }),
            _ => None,
        })
    }

    /// `rec` as replayed: a [`Record::PublishRef`] or [`Record::PeerRef`] becomes the record it
    /// stands for, its manifest read back and verified; any other record is itself.
    ///
    /// # Errors
    /// As [`BlobStore::get_manifest`]; [`Error::InvalidField`] when a publish's manifest is not
    /// of the slot its reference names.
    pub async fn resolve(&self, rec: Record) -> Result<Record, Error> {
        Ok(match rec {
            Record::PublishRef {
                label,
                slot,
                manifest,
            } => {
                let m = self.get_manifest(&manifest).await?;
                if m.slot != slot {
                    return Err(Error::InvalidField {
                        field: format!("manifest {}", manifest.blake3),
                        reason: format!(
                            "of slot {}, the journal names slot {slot} of {label}",
                            m.slot
                        ),
                    });
                }
                Record::Publish { label, manifest: m }
            }
            Record::PeerRef {
                label,
                worker_id,
                manifest,
            } => Record::Peer {
                label,
                worker_id,
                manifest: self.get_manifest(&manifest).await?,
            },
            other => other,
        })
    }
}
