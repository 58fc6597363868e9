//! The control plane's configuration: where it listens and keeps its journal, and how it
//! authenticates callers (bearer tokens, TLS) under the bind policy.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use crate::Error;

/// Where the control plane listens and keeps its journal, and how it authenticates callers.
#[derive(Debug, Clone)]
pub struct ControlPlaneConfig {
    /// Listen address; port 0 picks a free port (see [`spawn`]).
    pub listen: SocketAddr,
    /// The journal file (created if missing, replayed if present).
    pub journal_path: PathBuf,
    /// Authentication and transport security (see [`Security`] for the bind policy).
    pub security: Security,
    /// When the journal is compacted into a snapshot, and how much refit detail is kept.
    pub compaction: crate::snapshot::Compaction,
}

/// How the control plane authenticates callers and protects the wire.
///
/// The bind policy ([`Security::check`]): without tokens the control plane serves only a
/// loopback address and only with `insecure_loopback` set (a warning is logged at start);
/// bearer tokens on a non-loopback address need TLS (a token sent in plaintext over a network
/// is a token given away).
#[derive(Debug, Clone, Default)]
pub struct Security {
    /// Bearer tokens and their roles ([`crate::auth`]); `None`: no authentication.
    pub tokens: Option<Arc<crate::auth::TokenTable>>,
    /// The server's TLS certificate chain and key (PEM); `None`: plaintext HTTP/2.
    pub tls: Option<TlsIdentity>,
    /// Serve without tokens (loopback addresses only).
    pub insecure_loopback: bool,
    /// Bearer token sent on every engine call (the workers' engine routes require it).
    pub engine_token: Option<String>,
}

/// A TLS server identity: certificate chain and private key, PEM.
#[derive(Clone)]
pub struct TlsIdentity {
    pub(super) cert_pem: Vec<u8>,
    pub(super) key_pem: Vec<u8>,
}

impl std::fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the key.
        write!(
            f,
            "TlsIdentity({} B certificate chain)",
            self.cert_pem.len()
        )
    }
}

impl TlsIdentity {
    /// Reads a PEM certificate chain and its PEM private key.
    ///
    /// # Errors
    /// [`Error::Config`] naming the file that cannot be read or holds no PEM block.
    pub fn load(cert: &std::path::Path, key: &std::path::Path) -> Result<TlsIdentity, Error> {
        let read = |p: &std::path::Path, what: &str| {
            let b = std::fs::read(p).map_err(|e| Error::Config {
                what: format!("TLS {what} {}", p.display()),
                reason: e.to_string(),
            })?;
            if !String::from_utf8_lossy(&b).contains("-----BEGIN ") {
                return Err(Error::Config {
                    what: format!("TLS {what} {}", p.display()),
                    reason: "no PEM block".into(),
                });
            }
            Ok(b)
        };
        Ok(TlsIdentity {
            cert_pem: read(cert, "certificate")?,
            key_pem: read(key, "key")?,
        })
    }
}

impl Security {
    /// The security of `mx control`'s flags: a token file (`--tokens`), a TLS certificate
    /// chain and key (`--tls-cert`, `--tls-key`, both or neither), `--insecure-loopback` and
    /// the engine token file (`--engine-token-file`). The bind policy is checked when the
    /// server starts ([`Security::check`]).
    ///
    /// # Errors
    /// [`Error::Config`] naming the file that cannot be read or parsed, or a certificate given
    /// without its key (or the other way round).
    pub fn from_files(
        tokens: Option<&std::path::Path>,
        tls_cert: Option<&std::path::Path>,
        tls_key: Option<&std::path::Path>,
        insecure_loopback: bool,
        engine_token_file: Option<&std::path::Path>,
    ) -> Result<Security, Error> {
        let tls = match (tls_cert, tls_key) {
            (Some(c), Some(k)) => Some(TlsIdentity::load(c, k)?),
            (None, None) => None,
            _ => {
                return Err(Error::Config {
                    what: "TLS".into(),
                    reason: "a certificate chain and its key go together (tls_cert, tls_key)"
                        .into(),
                })
            }
        };
        Ok(Security {
            tokens: tokens
                .map(|f| crate::auth::TokenTable::load(f).map(Arc::new))
                .transpose()?,
            tls,
            insecure_loopback,
            engine_token: engine_token_file
                .map(crate::auth::read_token_file)
                .transpose()?,
        })
    }

    /// No authentication, plaintext: loopback only, by explicit choice (tests, one machine).
    pub fn insecure_loopback() -> Security {
        Security {
            insecure_loopback: true,
            ..Security::default()
        }
    }

    /// Checks the bind policy for `listen` (see [`Security`]).
    ///
    /// # Errors
    /// [`Error::Config`] saying what is missing.
    pub fn check(&self, listen: SocketAddr) -> Result<(), Error> {
        let loopback = listen.ip().is_loopback();
        let refuse = |reason: &str| {
            Err(Error::Config {
                what: format!("control plane on {listen}"),
                reason: reason.into(),
            })
        };
        match (&self.tokens, loopback) {
            (None, false) => refuse(
                "authentication is required on a non-loopback address: give a token file (--tokens FILE) and a TLS certificate (--tls-cert, --tls-key)",
            ),
            (None, true) if !self.insecure_loopback => refuse(
                "no token file given: serving without authentication needs the explicit --insecure-loopback (every local process could then refit the fleet)",
            ),
            (Some(_), false) if self.tls.is_none() => refuse(
                "bearer tokens over plaintext on a non-loopback address: give --tls-cert and --tls-key",
            ),
            _ => Ok(()),
        }
    }
}
