//! Engine identity: what an engine answers about whose it is, so a control plane calls an
//! engine only after the engine itself said it serves the worker being refitted (issue 29: a
//! URL string proves nothing; `http://localhost:7711`, `http://127.1:7711` and a TCP proxy all
//! reach one engine).
//!
//! An engine that embeds mx knows the worker ids it follows the control plane as, and the
//! process incarnation each registered with. It answers them, with the incarnation hidden behind
//! [`incarnation_digest`] (an incarnation is what lets a registration take over a connected
//! worker id, so it never leaves the process in the clear):
//!
//! - mx's own engine routes (`mx worker`, the Python and C pullers' `serve`): `GET
//!   {base}/mx/identity` answering [`wire::IdentityResponse`], one entry.
//! - a vLLM server with mx as its weight-transfer backend: vLLM's dev-mode route `POST
//!   {base}/collective_rpc` with `{"method": "mx_engine_identity"}`, which calls the method the
//!   mx plugin adds to vLLM's workers on every tensor-parallel rank and answers `{"results":
//!   [entry, ...]}`, one entry per rank.
//!
//! An engine that does not embed mx (SGLang's own server, a Dynamo worker's system routes) has
//! no such answer: [`Proof::NotOffered`] says why, and the caller decides whether an address is
//! enough.

use serde::{Deserialize, Serialize};

/// One worker an engine says it serves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineIdentity {
    /// The worker id it follows the control plane as.
    pub worker_id: String,
    /// The inference instance that worker registered in.
    pub instance: String,
    /// [`incarnation_digest`] of the incarnation that worker's process registered with.
    pub incarnation_digest: String,
}

/// What an engine answered to the identity question.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Proof {
    /// The workers it serves (a tensor-parallel engine: one per rank).
    Proven(Vec<EngineIdentity>),
    /// The engine has no identity route (it does not embed mx): why, in words.
    NotOffered(String),
}

/// The identity an engine shows for a process incarnation: the first 16 bytes of BLAKE3's
/// key derivation over the incarnation's 8 little-endian bytes, in lowercase hex (32
/// characters). One-way, so an answer does not hand out the incarnation that lets a
/// registration take over the worker id.
pub fn incarnation_digest(incarnation: u64) -> String {
    let key = blake3::derive_key("mx engine identity v1", &incarnation.to_le_bytes());
    key[..16].iter().map(|b| format!("{b:02x}")).collect()
}

/// The identity route's wire values.
pub mod wire {
    use serde::{Deserialize, Serialize};

    use super::EngineIdentity;

    /// The route mx's own engine routes answer it on (`GET`).
    pub const MX_ROUTE: &str = "mx/identity";

    /// The method the mx vLLM plugin adds to vLLM's workers, called through `collective_rpc`.
    pub const VLLM_METHOD: &str = "mx_engine_identity";

    /// `GET /mx/identity`: the workers this engine serves.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct IdentityResponse {
        /// One per worker id the engine follows the control plane as.
        pub engines: Vec<EngineIdentity>,
    }

    /// `POST /collective_rpc` body.
    #[derive(Debug, Clone, Serialize)]
    pub struct CollectiveRpcRequest<'a> {
        /// The worker method.
        pub method: &'a str,
    }

    /// `POST /collective_rpc` answer: one result per vLLM worker (`null` for a worker whose
    /// weight-transfer backend is not mx's).
    #[derive(Debug, Clone, Deserialize)]
    pub struct CollectiveRpcResponse {
        /// Each worker's return value.
        pub results: Vec<Option<EngineIdentity>>,
    }
}

/// Reads `GET {base}/mx/identity` (mx's own routes): [`Proof::NotOffered`] on 404 or 405.
pub(crate) async fn mx_route(
    http: &reqwest::Client,
    base: &str,
    timeout: std::time::Duration,
) -> Result<Proof, crate::Error> {
    let url = format!("{}/{}", base.trim_end_matches('/'), wire::MX_ROUTE);
    let (status, raw) = crate::send(&url, http.get(&url), timeout).await?;
    match status {
        200 => {
            let r: wire::IdentityResponse =
                serde_json::from_str(&raw).map_err(|e| crate::Error::BadResponse {
                    url: url.clone(),
                    reason: format!("{e}: {}", crate::snippet(&raw)),
                })?;
            Ok(Proof::Proven(r.engines))
        }
        404 | 405 => Ok(Proof::NotOffered(format!(
            "{url} answered HTTP {status}: the engine does not embed mx"
        ))),
        _ => Err(crate::Error::Status {
            url,
            status,
            body: crate::snippet(&raw),
        }),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)] // reason: tests fail loudly on purpose
mod tests {
    use super::*;

    #[test]
    fn the_digest_is_stable_one_way_and_distinguishes_incarnations() {
        let a = incarnation_digest(0x1234_5678_9abc_def0);
        assert_eq!(a.len(), 32);
        assert!(a
            .bytes()
            .all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase()));
        assert_eq!(a, incarnation_digest(0x1234_5678_9abc_def0));
        assert_ne!(a, incarnation_digest(0x1234_5678_9abc_def1));
        assert!(!a.contains("123456789abcdef0"));
    }

    #[test]
    fn identities_are_read_strictly() {
        let ok: wire::IdentityResponse = serde_json::from_str(
            r#"{"engines":[{"worker_id":"w0","instance":"i0","incarnation_digest":"ab"}]}"#,
        )
        .unwrap();
        assert_eq!(ok.engines[0].worker_id, "w0");
        let extra = serde_json::from_str::<EngineIdentity>(
            r#"{"worker_id":"w0","instance":"i0","incarnation_digest":"ab","x":1}"#,
        );
        assert!(extra.unwrap_err().to_string().contains("unknown field"));
        let r: wire::CollectiveRpcResponse = serde_json::from_str(
            r#"{"results":[null,{"worker_id":"i-tp1","instance":"i","incarnation_digest":"cd"}]}"#,
        )
        .unwrap();
        assert_eq!(r.results.len(), 2);
        assert!(r.results[0].is_none());
    }
}
