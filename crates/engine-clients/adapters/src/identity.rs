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
    let missing = "the engine does not embed mx";
    Ok(
        match read_answer::<wire::IdentityResponse>(&url, status, &raw, missing, None)? {
            Ok(r) => Proof::Proven(r.engines),
            Err(proof) => proof,
        },
    )
}

/// Reads an identity route's answer, the one place its HTTP status is judged: 200 is parsed
/// strictly as `T`; 404 and 405 (no such route) are [`Proof::NotOffered`] because `missing`;
/// a 500 whose body contains `unimplemented.0` is [`Proof::NotOffered`] because
/// `unimplemented.1` (a route that exists but whose method the engine lacks); anything else is
/// an error.
///
/// # Errors
/// [`crate::Error::Status`] for another status, [`crate::Error::BadResponse`] for a 200 whose
/// body is not a `T`.
pub(crate) fn read_answer<T: serde::de::DeserializeOwned>(
    url: &str,
    status: u16,
    raw: &str,
    missing: &str,
    unimplemented: Option<(&str, &str)>,
) -> Result<Result<T, Proof>, crate::Error> {
    let not_offered = |why: &str| Ok(Err(Proof::NotOffered(format!("{url}: {why}"))));
    match (status, unimplemented) {
        (200, _) => serde_json::from_str(raw)
            .map(Ok)
            .map_err(|e| crate::Error::BadResponse {
                url: url.to_string(),
                reason: format!("{e}: {}", crate::snippet(raw)),
            }),
        (404 | 405, _) => not_offered(&format!("HTTP {status}: {missing}")),
        (500, Some((needle, why))) if raw.contains(needle) => not_offered(why),
        _ => Err(crate::Error::Status {
            url: url.to_string(),
            status,
            body: crate::snippet(raw),
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
    fn one_reader_judges_every_identity_routes_status() {
        type R = Result<Result<wire::IdentityResponse, Proof>, crate::Error>;
        let read = |status: u16, raw: &str| -> R {
            read_answer(
                "http://e/x",
                status,
                raw,
                "gone",
                Some(("not implemented", "no method")),
            )
        };
        let body = r#"{"engines":[{"worker_id":"w","instance":"i","incarnation_digest":"ab"}]}"#;
        assert_eq!(read(200, body).unwrap().unwrap().engines[0].worker_id, "w");
        assert!(matches!(
            read(200, "{}"),
            Err(crate::Error::BadResponse { .. })
        ));
        for status in [404, 405] {
            assert_eq!(
                read(status, "").unwrap().unwrap_err(),
                Proof::NotOffered(format!("http://e/x: HTTP {status}: gone"))
            );
        }
        assert_eq!(
            read(500, "method not implemented").unwrap().unwrap_err(),
            Proof::NotOffered("http://e/x: no method".into())
        );
        for (status, raw) in [(500, "boom"), (503, "not implemented"), (401, "")] {
            assert!(
                matches!(read(status, raw), Err(crate::Error::Status { status: s, .. }) if s == status),
                "{status}"
            );
        }
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
